"""The 4-bit moment design study (issue 22, item 1): ``python -m bench.q4_design`` (moments on
the side of an fp32 run) and ``python -m bench.q4_design.loss`` (candidates in the loop)."""
