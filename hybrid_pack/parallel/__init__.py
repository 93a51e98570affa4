"""Parallelism applied to a model: FSDP2 sharding (``fsdp.py``)."""
