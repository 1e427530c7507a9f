"""Code every benchmark shares; no benchmark imports another benchmark's package.

Light modules, safe in the parents that only drive workers (they never import torch):

- ``procs``: worker processes forked from a preloaded server and driven over a pipe;
- ``meta``: the metadata block every result JSON carries, and where output goes;
- ``report``: the report header, number formatting and the plotting backend;
- ``model_config``: the size of the shared transformer-like model, and its parameter count;
- ``peers``: other libraries' memory-saving AdamW by name (each library imported by ``make``).

Modules that import torch, for workers and in-process benchmarks:

- ``device``: the ``Device`` helper (sync, XLA counters, peak-memory gauge) and a
  thread-count context;
- ``model``: the shared transformer-like model (``bench.seed`` and ``bench.dp_scaling``);
- ``memory``: bytes held between steps, and a step's measured peak with activations apart.
"""
