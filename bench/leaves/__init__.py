"""python -m bench.leaves: setup and step cost of many small leaves, per pair."""
