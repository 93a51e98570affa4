"""Softmax attention for Hugging Face models through :func:`hybrid_pack.ops.varlen_attention`.

The patched model's ``config._attn_implementation`` names a function registered with
``transformers.AttentionInterface`` (and a mask function with ``AttentionMaskInterface``). Inside a
packed call both use the current boundaries: no mask is built and every token attends only within
its document. Outside one, both hand over to the implementation the model had before (``sdpa``,
``eager``, a flash kernel, ...), so ordinary batches run exactly as before patching.
"""

from __future__ import annotations

import sys
from typing import Any

import torch

from hybrid_pack.errors import UnsupportedModelError
from hybrid_pack.integrations.transformers.context import current_boundaries
from hybrid_pack.integrations.transformers.entry import explicit_keys_in, stray_keys_error
from hybrid_pack.ops import varlen_attention

__all__ = ["packed_attention_name", "fallback_of"]

PREFIX = "hybrid_pack"
# Registered names must not contain "sdpa", "flash" or "flex": transformers reads those substrings.
_ALIASES = {"sdpa": "sdp", "flash_attention": "fa", "flex_attention": "flx"}
_FALLBACK_BY_NAME: dict[str, str] = {}


def fallback_of(name: str) -> str | None:
    """The implementation a registered packed-attention ``name`` falls back to (None if not ours)."""
    return _FALLBACK_BY_NAME.get(name)


def _eager_attention(module: torch.nn.Module) -> Any:
    """The model family's own ``eager_attention_forward`` (the ``eager`` implementation is not registered)."""
    family = sys.modules[type(module).__module__]
    return family.eager_attention_forward


def _original_attention(module: torch.nn.Module, fallback: str) -> Any:
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    if fallback == "eager":
        return _eager_attention(module)
    return ALL_ATTENTION_FUNCTIONS.get_interface(fallback, _eager_attention(module))


def _packed_attention(fallback: str) -> Any:
    def attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                  attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                  **kwargs: Any) -> tuple[torch.Tensor, None]:
        """``query [B, H, T, D]``, ``key/value [B, Hkv, T, D]`` -> ``([B, T, H, D], None)``, as transformers expects."""
        boundaries = current_boundaries()
        if boundaries is None:
            stray = explicit_keys_in(kwargs)
            if stray:
                raise stray_keys_error(type(module).__name__, stray)
            return _original_attention(module, fallback)(module, query, key, value, attention_mask, dropout=dropout,
                                                         scaling=scaling, **kwargs)
        layer = type(module).__name__
        if dropout:
            raise UnsupportedModelError(f"{layer}: attention dropout {dropout} is not supported on packed rows; "
                                        "set config.attention_dropout=0.0")
        for name in ("sliding_window", "softcap"):
            if kwargs.get(name) is not None:
                raise UnsupportedModelError(f"{layer}: {name}={kwargs[name]!r} is not supported on packed rows")
        if not getattr(module, "is_causal", True):
            raise UnsupportedModelError(f"{layer}: only causal attention is supported on packed rows")
        out = varlen_attention(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), boundaries,
                               causal=True, softmax_scale=scaling)
        return out, None

    return torch.compiler.disable(attention)  # boundaries are Python-level state: never traced


def _packed_mask(fallback: str) -> Any:
    def mask(**kwargs: Any) -> Any:
        """No mask inside a packed call (the boundaries replace it); the original mask otherwise."""
        from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

        if current_boundaries() is not None or fallback not in ALL_MASK_ATTENTION_FUNCTIONS:
            return None
        return ALL_MASK_ATTENTION_FUNCTIONS[fallback](**kwargs)

    return torch.compiler.disable(mask)


def packed_attention_name(fallback: str) -> str:
    """Register (once) the packed attention falling back to ``fallback`` and return its name."""
    from transformers import AttentionInterface, AttentionMaskInterface

    alias = fallback
    for original, short in _ALIASES.items():
        alias = alias.replace(original, short)
    name = f"{PREFIX}({alias})"
    if name not in _FALLBACK_BY_NAME:
        AttentionInterface.register(name, _packed_attention(fallback))
        AttentionMaskInterface.register(name, _packed_mask(fallback))
        _FALLBACK_BY_NAME[name] = fallback
    return name
