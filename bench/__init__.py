"""Benchmarks for mpfunc, one package each; run them as modules, e.g. ``python -m bench.seed``.

Each benchmark folder (``seed``, ``transforms``, ``convergence``, ``dp_scaling``) holds its
entry point (``__main__``), its ``worker`` and its ``report``; what they share lives in
``bench.common``, and no benchmark imports another. Results go outside the repository
unless ``--out`` says otherwise; the committed ones in ``bench/results/<benchmark>`` are
refreshed on purpose with ``--out bench/results/<benchmark>``.
"""
