"""The data-parallel scaling benchmark; run it with ``python -m bench.dp_scaling``."""
