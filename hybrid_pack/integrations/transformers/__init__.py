"""Packed (padding-free) training for Hugging Face hybrid models: :func:`patch_model`.

Example::

    model = AutoModelForCausalLM.from_pretrained("ibm-ai-platform/Bamba-9B-v2")
    model = patch_model(model)
    batch = PackingCollator()(features)          # input_ids [1, T], cu_seq_lens_q/k, seq_idx, ...
    loss = model(**batch).loss                   # no document sees another one
"""

from __future__ import annotations

import functools
import inspect
import types
import warnings
from typing import Any

import torch

from hybrid_pack.boundaries import PackedBoundaries
from hybrid_pack.integrations.transformers.attention import fallback_of, packed_attention_name
from hybrid_pack.integrations.transformers.context import carry_boundaries, current_boundaries, packed_row
from hybrid_pack.integrations.transformers.families import FAMILIES, Family, PackedForward, family_of

__all__ = ["patch_model", "is_patched", "FAMILIES", "TESTED_TRANSFORMERS"]

TESTED_TRANSFORMERS = ((5, 20), (5, 24))  # [lower, upper) of the transformers versions tested
BOUNDARY_KEYS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "seq_idx", "num_pad_tokens")
CACHE_KEYS = ("past_key_values", "cache_params")


def _check_transformers_version() -> None:
    import transformers

    major, minor = (int(p) for p in transformers.__version__.split(".")[:2])
    (lo_major, lo_minor), (hi_major, hi_minor) = TESTED_TRANSFORMERS
    if not (lo_major, lo_minor) <= (major, minor) < (hi_major, hi_minor):
        warnings.warn(f"hybrid_pack.patch_model is tested with transformers >={lo_major}.{lo_minor},"
                      f"<{hi_major}.{hi_minor}; found {transformers.__version__}. Run "
                      "hybrid_pack.testing.check_isolation(model) on the patched model before training.",
                      stacklevel=3)


def is_patched(model: torch.nn.Module) -> bool:
    """Whether :func:`patch_model` has been applied to ``model``."""
    return getattr(model, "_hybrid_pack_family", None) is not None


def _patch_mixer(module: torch.nn.Module, packed_forward: PackedForward) -> None:
    """Route ``module``'s forward to ``packed_forward`` inside a packed call; keep the original otherwise."""
    original = module.forward

    @functools.wraps(original)
    def forward(self: torch.nn.Module, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        boundaries = current_boundaries()
        if boundaries is None:
            return original(hidden_states, *args, **kwargs)
        return packed_forward(self, hidden_states, boundaries)

    module.forward = types.MethodType(forward, module)


def _packed_boundaries(model: torch.nn.Module, kwargs: dict[str, Any]) -> PackedBoundaries | None:
    """The boundaries of a packed call, or None for an ordinary one (no boundary key, no restarting positions).

    A ready :class:`PackedBoundaries` may come as ``boundaries=`` (as native models take it); it is popped.
    """
    given = kwargs.pop("boundaries", None)
    position_ids = kwargs.get("position_ids")
    packed = given is not None or any(kwargs.get(key) is not None for key in BOUNDARY_KEYS)
    if not packed and position_ids is not None and kwargs.get("attention_mask") is None and position_ids.dim() == 2 \
            and position_ids.shape[0] == 1 and not any(kwargs.get(key) is not None for key in CACHE_KEYS):
        packed = bool((position_ids[0, 1:] == 0).any())  # restarting positions: a flattened batch
    if not packed:
        return None
    tokens = kwargs.get("input_ids") if kwargs.get("input_ids") is not None else kwargs.get("inputs_embeds")
    if tokens is not None and tokens.shape[0] != 1:
        raise ValueError(f"input_ids: a packed batch is one row [1, T]; got batch size {tokens.shape[0]} with "
                         "boundary keys (flatten the batch with hybrid_pack.PackingCollator)")
    if kwargs.get("attention_mask") is not None:
        raise ValueError("attention_mask: not allowed with packed boundary keys (cu_seq_lens_q / seq_idx / "
                         "position_ids already separate the documents); drop attention_mask from the batch")
    for key in CACHE_KEYS:
        if kwargs.get(key) is not None:
            raise ValueError(f"{key}: a KV / state cache cannot be used with a packed batch; packed rows are for "
                             "training and scoring; generate from unpacked inputs")
    if kwargs.get("use_cache"):
        raise ValueError("use_cache: must be False (or unset) with a packed batch; a cache would mix documents")
    boundaries = given if given is not None else PackedBoundaries.from_batch(kwargs)
    device = tokens.device if tokens is not None else boundaries.device
    return boundaries.to(device) if boundaries.device != device else boundaries


def _wrap_forward(model: torch.nn.Module) -> None:
    original = model.forward
    takes_position_ids = "position_ids" in inspect.signature(original).parameters

    @functools.wraps(original)
    def forward(self: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
        if args:
            kwargs = {**inspect.signature(original).bind_partial(*args).arguments, **kwargs}
        boundaries = _packed_boundaries(self, kwargs)
        if boundaries is None:
            with packed_row(None):
                return original(**kwargs)
        for key in BOUNDARY_KEYS + ("position_ids", "attention_mask"):
            kwargs.pop(key, None)
        kwargs["use_cache"] = False
        if takes_position_ids:
            kwargs["position_ids"] = boundaries.position_ids
        if self.is_gradient_checkpointing:
            for module in self.modules():
                if getattr(module, "_gradient_checkpointing_func", None) is not None:
                    module._gradient_checkpointing_func = carry_boundaries(module._gradient_checkpointing_func)
        with packed_row(boundaries):
            return original(**kwargs)

    model.forward = types.MethodType(forward, model)


def _use_packed_attention(model: torch.nn.Module) -> None:
    current = model.config._attn_implementation
    if current is None or fallback_of(current) is not None:
        return
    model.set_attn_implementation(packed_attention_name(current))
    if model.config._attn_implementation != packed_attention_name(current):
        raise ValueError(f"model: {type(model).__name__} did not accept the packed attention implementation "
                         f"(config._attn_implementation is still {model.config._attn_implementation!r})")


def patch_model(model: torch.nn.Module) -> torch.nn.Module:
    """Make a Hugging Face hybrid causal LM keep the documents of a packed batch apart, on any device.

    After patching, ``model(**batch)`` with a SPEC §3 batch (``input_ids [1, T]`` plus ``cu_seq_lens_q/k``,
    ``max_length_q/k``, ``seq_idx``, ``position_ids``, optional ``num_pad_tokens``; or restarting
    ``position_ids`` alone) runs every mixer and attention layer through :mod:`hybrid_pack.ops`, so no
    document sees another one, forward or backward. Calls without boundary keys run exactly as before.

    Packed calls refuse ``attention_mask``, a cache and ``use_cache=True`` (ValueError naming the fix),
    and run with ``use_cache=False``. Gradient checkpointing is supported.

    Args:
        model: a supported model (see :data:`FAMILIES`), typically an ``...ForCausalLM``. Patched in place.

    Returns:
        ``model``.

    Raises:
        ValueError: unsupported family, or a supported one whose mixers were not found.
    """
    family = family_of(model)
    if is_patched(model):
        return model
    _check_transformers_version()
    _patch_family(model, family)
    _use_packed_attention(model)
    _wrap_forward(model)
    model._hybrid_pack_family = family.name
    return model


def _patch_family(model: torch.nn.Module, family: Family) -> None:
    mixers = [(m, family.mixers[type(m).__name__]) for m in model.modules() if type(m).__name__ in family.mixers]
    if not mixers:
        raise ValueError(f"model: no {' / '.join(family.mixers)} module found in this {family.name} model; "
                         "this transformers version may have renamed it (see docs/transformers.md for the tested "
                         "versions)")
    for module, packed_forward in mixers:
        _patch_mixer(module, packed_forward)
