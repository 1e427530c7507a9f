"""python -m bench.pairs: every (strategy, state format) pair beside the peers."""
