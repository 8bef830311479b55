"""Benchmarks of shared-prefix joint replay against naive and packed-tree-mask training.

``python -m benchmarks.run`` (CPU, writes benchmarks/results/cpu.*) and
``python -m benchmarks.gpu`` (one CUDA GPU, bf16). The library never imports this package.
"""
