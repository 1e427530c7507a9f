"""Support code for the tests: comparisons, strategies, bad-input tables, launchers."""
