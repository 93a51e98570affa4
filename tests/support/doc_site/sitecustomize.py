"""Loaded by the docs' programs (tests/test_docs.py puts this folder on PYTHONPATH): transformers' families run
their kernels on the torch originals, as a GPU machine would run the kernels (tests/support/torch_path.py)."""

from tests.support.torch_path import switch_on_import

switch_on_import()
