"""Benchmarks for mpfunc; run them as modules, e.g. ``python -m bench.seed``."""
