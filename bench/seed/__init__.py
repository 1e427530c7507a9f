"""The seed benchmark; run it with ``python -m bench.seed`` (see ``bench/seed/__main__.py``)."""
