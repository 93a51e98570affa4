"""Benchmarks behind ``hybrid-pack bench``: kernels (boundary cost, adapter overhead) on rows at real sizes."""
