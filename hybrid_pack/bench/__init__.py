"""Benchmarks behind ``hybrid-pack bench``: what document boundaries cost each backend, on rows at real sizes (the
adapter overhead over each library's own kernel is ``benchmarks/bench_kernels.py``'s)."""
