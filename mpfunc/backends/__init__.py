"""Where a step runs: the planner that groups leaves into kernel calls, the native CPU pass
(csrc/), the XLA computations."""
