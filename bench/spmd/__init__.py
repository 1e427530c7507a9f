"""The XLA SPMD scaling benchmark; run it with ``python -m bench.spmd``."""
