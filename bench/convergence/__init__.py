"""The convergence study; run it with ``python -m bench.convergence``."""
