"""Integrations with other libraries (Hugging Face transformers: :mod:`hybrid_pack.integrations.transformers`)."""
