"""Softmax attention of a packed call: chosen by the call, never by a renamed implementation.

A patched model keeps its ``config._attn_implementation`` (``sdpa``, a flash kernel, flex, ``eager``).
Each implementation registered in transformers' ``AttentionInterface`` is wrapped once
(:func:`wrap_attention`): a call that carries ``boundaries`` (put there by a patched entry, :mod:`.entry`)
from a patched model's attention module runs :func:`hybrid_pack.ops.varlen_attention`, every token
attending only within its document and no mask read; any other call runs the wrapped implementation
unchanged, so unpatched models and unpacked calls are exactly as before. ``eager`` is the family's own
``eager_attention_forward`` (not in the registry): it is wrapped in the family's module, and a packed call
runs it with a per-document causal mask built from the boundaries, so it returns the attention weights.
"""

from __future__ import annotations

import sys
from typing import Any

import torch

from hybrid_pack.errors import UnsupportedModelError
from hybrid_pack.integrations.transformers.entry import explicit_keys_in, stray_keys_error
from hybrid_pack.ops import varlen_attention
from hybrid_pack.parallel.boundaries import ShardedBoundaries
from hybrid_pack.schema import BOUNDARIES

__all__ = ["mark_attention", "wrap_attention", "wrap_every_attention", "wrap_eager_attention", "document_causal_mask"]

_ATTENTION_FLAG = "_hybrid_pack_attention"
_ORIGINAL = "_hybrid_pack_wraps"
EAGER = "eager"


def mark_attention(module: torch.nn.Module) -> None:
    """Let ``module`` (an attention layer of a patched model) take the packed path of every implementation."""
    wrap_eager_attention(module)
    setattr(module, _ATTENTION_FLAG, True)


def document_causal_mask(boundaries: Any, dtype: torch.dtype) -> torch.Tensor:
    """Additive mask ``[1, 1, T, T]``: 0 where a token may attend (same document, not later), dtype's min elsewhere."""
    if isinstance(boundaries, ShardedBoundaries):
        raise UnsupportedModelError("config._attn_implementation: 'eager' masks whole documents, and a context-"
                                    "parallel shard holds pieces of them; call model.set_attn_implementation('sdpa') "
                                    "(every other implementation runs hybrid_pack's context-parallel attention)")
    seq_idx = boundaries.seq_idx[0]
    allowed = (seq_idx[:, None] == seq_idx[None, :]).tril()
    return torch.zeros(allowed.shape, dtype=dtype, device=seq_idx.device).masked_fill(
        ~allowed, torch.finfo(dtype).min)[None, None]


def _packed_eager(original: Any) -> Any:
    def eager_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                                attention_mask: torch.Tensor | None, *args: Any, **kwargs: Any) -> Any:
        boundaries = kwargs.get(BOUNDARIES)
        if boundaries is not None and getattr(module, _ATTENTION_FLAG, False):
            attention_mask = document_causal_mask(boundaries, query.dtype)
        return original(module, query, key, value, attention_mask, *args, **kwargs)

    eager_attention_forward.__doc__ = original.__doc__
    setattr(eager_attention_forward, _ORIGINAL, original)
    return eager_attention_forward


def wrap_eager_attention(module: torch.nn.Module) -> None:
    """Wrap the ``eager_attention_forward`` of the family ``module`` comes from (once)."""
    family = sys.modules[type(module).__module__]
    original = getattr(family, "eager_attention_forward", None)
    if original is None:
        raise UnsupportedModelError(f"{type(module).__name__}: no eager_attention_forward in {family.__name__}; "
                                    "this transformers version may have moved it")
    if not hasattr(original, _ORIGINAL):
        family.eager_attention_forward = _packed_eager(original)


def _packed(original: Any) -> Any:
    def attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                  attention_mask: torch.Tensor | None, *args: Any, **kwargs: Any) -> Any:
        """``query [B, H, T, D]``, ``key/value [B, Hkv, T, D]`` -> ``([B, T, H, D], None)``, as transformers expects."""
        boundaries = kwargs.get(BOUNDARIES)
        if boundaries is None or not getattr(module, _ATTENTION_FLAG, False):
            stray = explicit_keys_in(kwargs) if getattr(module, _ATTENTION_FLAG, False) else []
            if stray:
                raise stray_keys_error(type(module).__name__, stray)
            return original(module, query, key, value, attention_mask, *args, **kwargs)
        scaling = kwargs.get("scaling", args[1] if len(args) > 1 else None)
        out = varlen_attention(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), boundaries,
                               causal=True, softmax_scale=scaling)
        return out, None

    attention.__name__ = getattr(original, "__name__", "attention")
    attention.__doc__ = getattr(original, "__doc__", None)
    setattr(attention, _ORIGINAL, original)
    return attention


def wrap_attention(name: str) -> None:
    """Wrap the registered attention implementation ``name`` once (``eager`` is served by the model itself)."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    if name is None or name == EAGER or name.startswith("paged"):
        return
    if name not in ALL_ATTENTION_FUNCTIONS:
        raise UnsupportedModelError(f"config._attn_implementation: {name!r} is not registered in transformers' "
                                    "AttentionInterface")
    function = ALL_ATTENTION_FUNCTIONS[name]
    if not hasattr(function, _ORIGINAL):
        ALL_ATTENTION_FUNCTIONS.register(name, _packed(function))


def wrap_every_attention() -> None:
    """Wrap every implementation registered now (a later ``set_attn_implementation`` finds it wrapped)."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    for name in list(ALL_ATTENTION_FUNCTIONS.valid_keys()):
        wrap_attention(name)
