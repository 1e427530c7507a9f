"""torch.compile of an mpfunc training step; run with ``python -m bench.compile``."""
