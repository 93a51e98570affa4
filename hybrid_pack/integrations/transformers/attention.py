"""Softmax attention of a packed call: chosen by the call, never by a renamed implementation.

A patched model keeps its ``config._attn_implementation`` (``sdpa``, a flash kernel, flex, ``eager``).
Each implementation registered in transformers' ``AttentionInterface`` is registered again once, through
its public ``register``, wrapped in :class:`PackedAttention`: a call that carries ``boundaries`` (put there
by a patched entry, :mod:`.entry`) from a patched model's attention module runs
:func:`hybrid_pack.ops.varlen_attention`, every token attending only within its document (and within the
layer's ``sliding_window``) and no mask read; any other call runs the wrapped implementation with the same
arguments, so unpatched models and unpacked calls compute exactly what they did before. ``eager`` is the
family's own ``eager_attention_forward`` (not in the registry): a patched attention module gets a forward
pre-hook (:class:`_EagerDocumentMask`) that hands it the per-document causal mask on packed calls, so it
returns the attention weights. Nothing is stored per call.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch

from hybrid_pack.boundaries.sharded import ShardedBoundaries
from hybrid_pack.errors import UnsupportedModelError
from hybrid_pack.integrations.transformers.keys import explicit_keys_in, stray_keys_error
from hybrid_pack.ops import varlen_attention
from hybrid_pack.schema import ATTENTION_MASK, BOUNDARIES

__all__ = ["mark_attention", "is_packed_attention", "wrap_attention", "wrap_every_attention", "PackedAttention",
           "document_causal_mask"]

_ATTENTION_FLAG = "_hybrid_pack_attention"
EAGER = "eager"
_HIDDEN_STATES = "hidden_states"


def is_packed_attention(module: torch.nn.Module) -> bool:
    """Whether ``module`` is an attention layer of a patched model (:func:`mark_attention`)."""
    return getattr(module, _ATTENTION_FLAG, False)


def mark_attention(module: torch.nn.Module, *, window_from_config: bool = False) -> None:
    """Let ``module`` (an attention layer of a patched model) take the packed path of every implementation;
    ``window_from_config``: its sliding window is ``config.sliding_window`` (not an attribute of its own)."""
    if is_packed_attention(module):
        return
    module.register_forward_pre_hook(_EagerDocumentMask(window_from_config), with_kwargs=True)
    setattr(module, _ATTENTION_FLAG, True)


def document_causal_mask(boundaries: Any, dtype: torch.dtype, window: int | None = None) -> torch.Tensor:
    """Additive mask ``[1, 1, T, T]``: 0 where a token may attend (same document, not later, fewer than ``window``
    tokens back when given), dtype's min elsewhere."""
    if isinstance(boundaries, ShardedBoundaries):
        raise UnsupportedModelError("config._attn_implementation: 'eager' masks whole documents, and a context-"
                                    "parallel shard holds pieces of them; call model.set_attn_implementation('sdpa') "
                                    "(every other implementation runs hybrid_pack's context-parallel attention)")
    seq_idx = boundaries.seq_idx[0]
    allowed = (seq_idx[:, None] == seq_idx[None, :]).tril()
    if window is not None:
        allowed = allowed.triu(1 - window)
    return torch.zeros(allowed.shape, dtype=dtype, device=seq_idx.device).masked_fill(
        ~allowed, torch.finfo(dtype).min)[None, None]


class _EagerDocumentMask:
    """Forward pre-hook of a patched attention module, on a packed call: under the ``eager`` implementation the
    ``attention_mask`` it receives becomes the per-document causal mask, so the family's own eager attention runs
    on it and returns its weights; under any other, that implementation is made sure to be wrapped
    (:func:`wrap_attention`: a model loaded in a fresh process, or an implementation registered again after
    patching, and a call entering at a decoder layer). A class, so a patched model pickles; it holds nothing per
    call."""

    window_from_config = False  # the class's: a hook pickled before the attribute existed reads it

    def __init__(self, window_from_config: bool = False) -> None:
        self.window_from_config = window_from_config

    def __call__(self, module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        boundaries = kwargs.get(BOUNDARIES)
        if boundaries is None:
            return None
        implementation = getattr(getattr(module, "config", None), "_attn_implementation", EAGER)
        if implementation != EAGER:
            if not torch.compiler.is_compiling():  # a trace runs what an eager call (or patch_model) wrapped
                wrap_attention(implementation)
            return None
        hidden = args[0] if args else kwargs[_HIDDEN_STATES]
        holder = module.config if self.window_from_config and not hasattr(module, "sliding_window") else module
        mask = document_causal_mask(boundaries, hidden.dtype, getattr(holder, "sliding_window", None))
        positional = list(inspect.signature(type(module).forward).parameters)[1:len(args) + 1]
        if ATTENTION_MASK in positional:
            args = tuple(mask if name == ATTENTION_MASK else arg for name, arg in zip(positional, args))
            return args, kwargs
        return args, {**kwargs, ATTENTION_MASK: mask}


class PackedAttention:
    """An attention implementation of transformers' ``AttentionInterface``, serving packed calls of patched models:
    ``query [B, H, T, D]``, ``key/value [B, Hkv, T, D]`` -> ``([B, T, H, D], None)``, as transformers expects.
    Any other call runs ``original`` with the same arguments. Picklable; holds nothing per call."""

    def __init__(self, original: Any) -> None:
        self.original = original
        self.__name__ = getattr(original, "__name__", "attention")
        self.__doc__ = getattr(original, "__doc__", None)

    def __call__(self, module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 attention_mask: torch.Tensor | None, *args: Any, **kwargs: Any) -> Any:
        boundaries = kwargs.get(BOUNDARIES)
        if boundaries is None or not is_packed_attention(module):
            stray = explicit_keys_in(kwargs) if is_packed_attention(module) else []
            if stray:
                raise stray_keys_error(type(module).__name__, stray)
            return self.original(module, query, key, value, attention_mask, *args, **kwargs)
        scaling = kwargs.get("scaling", args[1] if len(args) > 1 else None)
        window = kwargs.get("sliding_window", getattr(module, "sliding_window", None))
        extra = {} if window is None else {"window": window}
        value_dim, query_dim = value.shape[-1], query.shape[-1]
        if scaling is None:
            scaling = query_dim ** -0.5   # the query's own head dim, whatever the padding below
        # MLA: one head dim for all three; zero columns added to V give zero outputs (sliced off below), added to
        # Q and K they leave every score q.k as it was
        if value_dim < query_dim:
            value = torch.nn.functional.pad(value, (0, query_dim - value_dim))
        elif value_dim > query_dim:
            query, key = (torch.nn.functional.pad(t, (0, value_dim - query_dim)) for t in (query, key))
        out = varlen_attention(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), boundaries,
                               causal=True, softmax_scale=scaling, **extra)
        return out[..., :value_dim], None


def wrap_attention(name: str | None) -> None:
    """Register the attention implementation ``name`` wrapped in :class:`PackedAttention`, once (``eager`` is
    served by the model itself)."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    if name is None or name == EAGER or name.startswith("paged"):
        return
    if name not in ALL_ATTENTION_FUNCTIONS:
        raise UnsupportedModelError(f"config._attn_implementation: {name!r} is not registered in transformers' "
                                    "AttentionInterface")
    function = ALL_ATTENTION_FUNCTIONS[name]
    if not isinstance(function, PackedAttention):
        ALL_ATTENTION_FUNCTIONS.register(name, PackedAttention(function))


def wrap_every_attention() -> None:
    """Wrap every implementation registered now (a later ``set_attn_implementation`` finds it wrapped)."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    for name in list(ALL_ATTENTION_FUNCTIONS.valid_keys()):
        wrap_attention(name)
