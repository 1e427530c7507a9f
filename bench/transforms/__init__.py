"""The transform microbenchmarks; run them with ``python -m bench.transforms``."""
