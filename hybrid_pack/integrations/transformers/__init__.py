"""Packed (padding-free) training for Hugging Face hybrid models: :func:`patch_model`.

Example::

    model = AutoModelForCausalLM.from_pretrained("ibm-ai-platform/Bamba-9B-v2")
    model = patch_model(model)
    batch = PackingCollator()(features)          # input_ids [1, T], cu_seq_lens_q/k, seq_idx, ...
    loss = model(**batch).loss                   # no document sees another one

The patch holds on every call path (top-level forward, backbone, a decoder layer), in any order with
trainers and wrappers that replace the top-level forward (TRL's fused LM head), PEFT and
``torch.compile``: see :mod:`.entry`.
"""

from __future__ import annotations

import functools
import types
import warnings
from typing import Any

import torch

from hybrid_pack.errors import UnsupportedModelError
from hybrid_pack.integrations.transformers.attention import fallback_of, packed_attention_name
from hybrid_pack.integrations.transformers.context import current_boundaries, packed_row
from hybrid_pack.integrations.transformers.entry import (
    entry_modules,
    explicit_keys_in,
    rebound,
    stray_keys_error,
    wrap_entry,
)
from hybrid_pack.integrations.transformers.families import FAMILIES, Family, PackedForward, family_of

__all__ = ["patch_model", "is_patched", "packed_row", "FAMILIES", "TESTED_TRANSFORMERS"]

TESTED_TRANSFORMERS = ((5, 20), (5, 25))  # [lower, upper) of the transformers versions tested
_FAMILY_FLAG = "_hybrid_pack_family"
_MIXER_FLAG = "_hybrid_pack_mixer"


def _check_transformers_version() -> None:
    import transformers

    major, minor = (int(p) for p in transformers.__version__.split(".")[:2])
    (lo_major, lo_minor), (hi_major, hi_minor) = TESTED_TRANSFORMERS
    if not (lo_major, lo_minor) <= (major, minor) < (hi_major, hi_minor):
        warnings.warn(f"hybrid_pack.patch_model is tested with transformers >={lo_major}.{lo_minor},"
                      f"<{hi_major}.{hi_minor}; found {transformers.__version__}. Run "
                      "hybrid_pack.testing.check_isolation(model) on the patched model before training.",
                      stacklevel=3)


def _unwrapped(model: torch.nn.Module) -> torch.nn.Module:
    """The Hugging Face model inside a PEFT model (``get_base_model()``) or a ``torch.compile`` module."""
    while True:
        if callable(getattr(model, "get_base_model", None)) and model.get_base_model() is not model:
            model = model.get_base_model()
        elif isinstance(getattr(model, "_orig_mod", None), torch.nn.Module):
            model = model._orig_mod
        else:
            return model


def is_patched(model: torch.nn.Module) -> bool:
    """Whether :func:`patch_model` has been applied to ``model`` (or to the model a PEFT / compiled module wraps)."""
    return getattr(_unwrapped(model), _FAMILY_FLAG, None) is not None


def _patch_mixer(module: torch.nn.Module, packed_forward: PackedForward) -> None:
    """Route ``module``'s forward to ``packed_forward`` inside a packed call; keep the original otherwise.

    Outside a packed call, packed keys reaching the mixer mean they bypassed every entry (:mod:`.entry`):
    the original forward would run the row as one document, so the call is refused instead.
    """
    if getattr(module, _MIXER_FLAG, False):
        return
    original = module.forward

    @functools.wraps(original)
    def forward(self: torch.nn.Module, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        boundaries = current_boundaries()
        if boundaries is not None:
            return packed_forward(self, hidden_states, boundaries)
        stray = explicit_keys_in(kwargs)
        if stray:
            raise stray_keys_error(type(self).__name__, stray)
        return rebound(original, self)(hidden_states, *args, **kwargs)

    # Never traced by torch.compile: the boundaries are Python-level state, and the packed ops would be
    # recompiled for every layout; the layers around the mixer compile as usual.
    module.forward = types.MethodType(torch.compiler.disable(forward), module)
    setattr(module, _MIXER_FLAG, True)


def _use_packed_attention(model: torch.nn.Module) -> None:
    current = model.config._attn_implementation
    if current is None or fallback_of(current) is not None:
        return
    model.set_attn_implementation(packed_attention_name(current))
    if model.config._attn_implementation != packed_attention_name(current):
        raise UnsupportedModelError(f"model: {type(model).__name__} did not accept the packed attention "
                                    f"implementation (config._attn_implementation is still "
                                    f"{model.config._attn_implementation!r})")


def patch_model(model: torch.nn.Module) -> torch.nn.Module:
    """Make a Hugging Face hybrid causal LM keep the documents of a packed batch apart, on any device.

    After patching, a docs/api.md §3 batch (``input_ids [1, T]`` plus ``cu_seq_lens_q/k``, ``max_length_q/k``,
    ``seq_idx``, ``position_ids``, optional ``num_pad_tokens``; or restarting ``position_ids`` alone) runs
    every mixer and attention layer through :mod:`hybrid_pack.ops`, so no document sees another one,
    forward or backward, whether it enters through ``model(**batch)``, the backbone
    (``model.base_model(**batch)``, as TRL's fused LM head calls it) or a decoder layer. Calls without
    boundary keys run exactly as before.

    Packed calls refuse ``attention_mask``, a cache and ``use_cache=True`` (an ``InputError`` naming the
    fix), and run with ``use_cache=False``. Gradient checkpointing, PEFT and ``torch.compile`` are
    supported, applied before or after patching; so is patching before or after a trainer replaces
    ``model.forward``. Patching twice changes nothing.

    Args:
        model: a supported model (see :data:`FAMILIES`), typically an ``...ForCausalLM``, or a PEFT /
            ``torch.compile`` module around one. Patched in place.

    Returns:
        ``model``.

    Raises:
        UnsupportedModelError: unsupported family, or a supported one whose mixers were not found.
    """
    target = _unwrapped(model)
    family = family_of(target)
    if not is_patched(target):
        _check_transformers_version()
        _patch_family(target, family)
        _use_packed_attention(target)
    for entry in entry_modules(target):
        wrap_entry(entry)
    setattr(target, _FAMILY_FLAG, family.name)
    return model


def _patch_family(model: torch.nn.Module, family: Family) -> None:
    mixers = [(m, family.mixers[type(m).__name__]) for m in model.modules() if type(m).__name__ in family.mixers]
    if not mixers:
        raise UnsupportedModelError(f"model: no {' / '.join(family.mixers)} module found in this {family.name} "
                                    "model; this transformers version may have renamed it (see "
                                    "docs/transformers.md for the tested versions)")
    for module, packed_forward in mixers:
        _patch_mixer(module, packed_forward)
