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

import inspect
import warnings
from typing import Any

import torch

from hybrid_pack.errors import UnsupportedModelError
from hybrid_pack.integrations.transformers.attention import mark_attention, wrap_every_attention
from hybrid_pack.integrations.transformers.entry import (
    entry_modules,
    forward_slot,
    hand_off,
    handed_off,
    install_entry,
    mark_weightless,
    receives_hand_offs,
)
from hybrid_pack.integrations.transformers.experts import experts_modules, refuse_varying_experts
from hybrid_pack.integrations.transformers.families import (
    FAMILIES,
    INDEXED_ATTENTION,
    Family,
    PackedForward,
    WholeCall,
    family_of,
)
from hybrid_pack.integrations.transformers.glm5_next import refuse_unselected_tail
from hybrid_pack.integrations.transformers.keys import explicit_keys_in, stray_keys_error
from hybrid_pack.integrations.transformers.mask import skip_masks_of_packed_calls
from hybrid_pack.schema import BOUNDARIES

__all__ = ["patch_model", "is_patched", "FAMILIES", "TESTED_TRANSFORMERS"]

TESTED_TRANSFORMERS = ((5, 20), (5, 25))  # [lower, upper) of the transformers versions tested
_FAMILY_FLAG = "_hybrid_pack_family"


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


class PackedMixerForward:
    """The ``forward`` of a patched mixer: ``packed_forward`` on calls that carry ``boundaries`` (or were handed
    them, :func:`.entry.hand_off`), the class's own ``forward`` otherwise. Set on the module instance; it holds the
    module and the packed forward (a module-level function or a ``functools.partial`` of one), so ``pickle``,
    ``torch.save(model)`` and ``copy.deepcopy`` keep the mixer patched. Its signature is the class's ``forward``.

    The collator's packed keys reaching the mixer without ``boundaries`` mean they bypassed every entry
    (:mod:`.entry`): the original forward would run the row as one document, so the call is refused instead.
    """

    def __init__(self, module: torch.nn.Module, packed_forward: PackedForward | WholeCall) -> None:
        self.module, self.packed_forward = module, packed_forward

    @property
    def __signature__(self) -> inspect.Signature:
        return inspect.signature(type(self.module).forward.__get__(self.module))

    @property
    def __name__(self) -> str:
        return "forward"

    def __call__(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        module = self.module
        boundaries = kwargs.pop(BOUNDARIES, None)
        if boundaries is None:
            boundaries = handed_off(module)
        if boundaries is not None:
            hooked = [(child, child.__dict__["_hf_hook"]) for child in module._modules.values()
                      if child is not None and child.__dict__.get("_hf_hook") is not None]   # (no __getattr__)
            if not hooked:
                return self._packed(boundaries, args, kwargs)
            # accelerate offloading: the packed forward reads some children's weights without calling them (a
            # conv's, dt_proj's), so the children's hooks are fired around it, as transformers'
            # force_accelerate_hooks does for the children its kernel paths read (here every child: the children
            # the packed forward calls load their weights again, once more per call under offloading)
            for child, hook in hooked:
                hook.pre_forward(child)
            try:
                return self._packed(boundaries, args, kwargs)
            finally:
                for child, hook in reversed(hooked):
                    hook.post_forward(child, None)
        stray = explicit_keys_in(kwargs)
        if stray:
            raise stray_keys_error(type(module).__name__, stray)
        return type(module).forward(module, *args, **kwargs)

    def _packed(self, boundaries: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if isinstance(self.packed_forward, WholeCall):
            return self.packed_forward.forward(self.module, boundaries, *args, **kwargs)
        return self.packed_forward(self.module, args[0] if args else kwargs["hidden_states"], boundaries)


def _patch_mixer(module: torch.nn.Module, packed_forward: PackedForward | WholeCall) -> None:
    """Route ``module``'s forward to ``packed_forward`` on packed calls (:class:`PackedMixerForward`), once; under
    an accelerate hook (offloading, ``device_map``) as the forward the hook wraps (``_old_forward``)."""
    slot = forward_slot(module)
    if not isinstance(module.__dict__.get(slot), PackedMixerForward):
        setattr(module, slot, PackedMixerForward(module, packed_forward))
    receives_hand_offs(module)


def _attention_modules(modules: list[torch.nn.Module]) -> list[torch.nn.Module]:
    """The softmax-attention layers (the modules that call transformers' attention interface)."""
    return [m for m in modules if type(m).__name__.endswith("Attention") and hasattr(m, "is_causal")]


def _refuse_unserved_settings(model: torch.nn.Module, attention: list[torch.nn.Module]) -> None:
    """Settings the family accepts but packed attention cannot serve exactly, refused before any call."""
    for module in attention:
        layer = type(module).__name__
        dropout = getattr(module, "attention_dropout", 0.0) or 0.0
        if dropout:
            raise UnsupportedModelError(f"config.attention_dropout: {dropout} is not supported on packed rows "
                                        f"({layer}); set config.attention_dropout=0.0 before patch_model")
        for setting in ("softcap",):
            if getattr(module, setting, None) is not None:
                raise UnsupportedModelError(f"config.{setting}: {getattr(module, setting)!r} ({layer}) is not "
                                            "supported on packed rows; patch a model without it")
        if not module.is_causal:
            raise UnsupportedModelError(f"{layer}.is_causal: only causal attention is supported on packed rows")
        if hasattr(getattr(module, "indexer", None), "index_kpool_always_select_tail"):
            refuse_unselected_tail(module.indexer)


def patch_model(model: torch.nn.Module) -> torch.nn.Module:
    """Make a Hugging Face hybrid causal LM keep the documents of a packed batch apart, on any device.

    After patching, a docs/api.md §3 batch (``input_ids [1, T]`` plus ``cu_seq_lens_q/k``, ``max_length_q/k``,
    ``seq_idx``, ``position_ids``, optional ``num_pad_tokens``; or restarting ``position_ids`` alone) runs
    every mixer and attention layer through :mod:`hybrid_pack.ops`, so no document sees another one,
    forward or backward, whether it enters through ``model(**batch)``, the backbone
    (``model.base_model(**batch)``, as TRL's fused LM head calls it) or a decoder layer. Calls without
    boundary keys run exactly as before, and nothing else changes (docs/api.md §6a): the forward signatures,
    ``config._attn_implementation`` and ``set_attn_implementation``, ``output_attentions``, generation and
    caches, gradient checkpointing, saving and loading, PEFT and ``torch.compile(fullgraph=True)``.

    Packed calls refuse ``attention_mask``, a cache and ``use_cache=True`` (an ``InputError`` naming the
    fix), and run with ``use_cache=False``. Patching twice changes nothing.

    Args:
        model: a supported model (see :data:`FAMILIES`), typically an ``...ForCausalLM``, or a PEFT /
            ``torch.compile`` module around one. Patched in place.

    Returns:
        ``model``.

    Raises:
        UnsupportedModelError: unsupported family, one whose layers were not found, a sequence-classification
            head (one prediction per row), or a setting of its config that packed rows cannot serve exactly
            (named).
    """
    target = _unwrapped(model)
    if type(target).__name__.endswith("ForSequenceClassification"):
        raise UnsupportedModelError(f"model: {type(target).__name__} pools each row into one prediction, and a "
                                    "packed row holds several documents; classify padded batches with the "
                                    "unpatched model (token-level heads such as ...ForCausalLM are served)")
    family = family_of(target)
    modules = _served_modules(target, family)
    if not is_patched(target):
        _check_transformers_version()
        _patch_family(target, family, modules)
    served = {id(m) for m in modules}
    for entry in entry_modules(target):
        if id(entry) in served:
            install_entry(entry)
    setattr(target, _FAMILY_FLAG, family.name)
    return model


def _served_modules(model: torch.nn.Module, family: Family) -> list[torch.nn.Module]:
    """``model``'s modules outside any sub-model of another kind (a multimodal model's vision tower: its own
    ``cu_seqlens`` keep each image apart, and packed text boundaries mean nothing to it)."""
    from transformers import PreTrainedModel

    foreign = [m for m in model.modules() if isinstance(m, PreTrainedModel)
               and getattr(m.config, "model_type", None) not in family.model_types]
    excluded = {id(sub) for m in foreign for sub in m.modules()}
    return [m for m in model.modules() if id(m) not in excluded]


def _patch_family(model: torch.nn.Module, family: Family, modules: list[torch.nn.Module]) -> None:
    layers = [(m, family.layers[type(m).__name__]) for m in modules if type(m).__name__ in family.layers]
    attention = [m for m in _attention_modules(modules) if type(m).__name__ not in family.layers]
    if not layers and not attention:
        raise UnsupportedModelError(f"model: no {' / '.join(family.layers)} or attention module found in this "
                                    f"{family.name} model; this transformers version may have renamed them (see "
                                    "docs/transformers.md for the tested versions)")
    _refuse_unserved_settings(model, _attention_modules(modules))
    for module, layer in layers:
        _patch_mixer(module, layer.forward)
        if layer.kind is INDEXED_ATTENTION:
            mark_weightless(module)
    for module in modules:
        child = family.hand_offs.get(type(module).__name__)
        if child is not None:
            hand_off(module, child)
    wrap_every_attention()
    skip_masks_of_packed_calls(model)
    for module in attention:
        mark_attention(module, window_from_config=family.window_from_config)
    for module in experts_modules(modules):
        module.register_forward_pre_hook(refuse_varying_experts)
