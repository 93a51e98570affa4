"""Supported Hugging Face hybrid families: which mixer classes each one has and their packed forwards.

A packed forward takes ``(mixer, hidden_states [1, T, hidden], boundaries)`` and returns the mixer's
output ``[1, T, hidden]`` computed with every document on its own. Softmax attention needs no entry:
it is handled for every family through the attention interface (:mod:`.attention`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from functools import partial

import torch

from hybrid_pack.boundaries import PackedBoundaries
from hybrid_pack.errors import UnsupportedModelError
from hybrid_pack.integrations.transformers.gated_deltanet import (
    gated_deltanet_forward,
    qwen3_5_projections,
    qwen3_next_projections,
)
from hybrid_pack.integrations.transformers.jamba import jamba_mamba_forward
from hybrid_pack.integrations.transformers.mamba2 import falcon_h1_gated_norm, falcon_h1_in_proj, mamba2_forward
from hybrid_pack.integrations.transformers.short_conv import short_conv_forward

__all__ = ["Family", "FAMILIES", "family_of", "PackedForward"]

PackedForward = Callable[[torch.nn.Module, torch.Tensor, PackedBoundaries], torch.Tensor]


@dataclass(frozen=True)
class Family:
    """One model family: its display name, its ``config.model_type`` values, its mixers' packed forwards, and
    ``hand_offs``: ``{module class: child attribute}`` where the module's forward does not pass its keywords
    (``boundaries``) on to that child, so the patch hands them over (:func:`.entry.hand_off`)."""

    name: str
    model_types: tuple[str, ...]
    mixers: Mapping[str, PackedForward]
    hand_offs: Mapping[str, str] = field(default_factory=dict)


FAMILIES: tuple[Family, ...] = (
    Family("Qwen3-Next", ("qwen3_next",),
           {"Qwen3NextGatedDeltaNet": partial(gated_deltanet_forward, projections=qwen3_next_projections)}),
    Family("Qwen3.5", ("qwen3_5_text",),
           {"Qwen3_5GatedDeltaNet": partial(gated_deltanet_forward, projections=qwen3_5_projections)}),
    Family("Bamba", ("bamba",), {"BambaMixer": mamba2_forward}),
    Family("Nemotron-H", ("nemotron_h",), {"NemotronHMamba2Mixer": mamba2_forward}),
    Family("Falcon-H1", ("falcon_h1",),
           {"FalconH1Mixer": partial(mamba2_forward, in_proj=falcon_h1_in_proj, gated_norm=falcon_h1_gated_norm)}),
    Family("GraniteMoeHybrid", ("granitemoehybrid",), {"GraniteMoeHybridMambaLayer": mamba2_forward}),
    Family("Zamba2", ("zamba2",), {"Zamba2MambaMixer": mamba2_forward}),
    Family("Lfm2", ("lfm2",), {"Lfm2ShortConv": short_conv_forward}),
    Family("Mamba2", ("mamba2",), {"Mamba2Mixer": mamba2_forward}, hand_offs={"Mamba2ForCausalLM": "backbone"}),
    Family("Jamba", ("jamba",), {"JambaMambaMixer": jamba_mamba_forward},
           hand_offs={"JambaMambaDecoderLayer": "mamba"}),
)

_UNSUPPORTED_HINTS = {
    "qwen3_5": "Qwen3_5ForConditionalGeneration (multimodal, M-RoPE positions) is not supported; "
               "load the text model with Qwen3_5ForCausalLM",
}


def family_of(model: torch.nn.Module) -> Family:
    """The :class:`Family` of ``model`` (read from ``model.config.model_type``); UnsupportedModelError if none."""
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    for family in FAMILIES:
        if model_type in family.model_types:
            return family
    supported = ", ".join(f"{f.name} ({'/'.join(f.model_types)})" for f in FAMILIES)
    hint = _UNSUPPORTED_HINTS.get(model_type, "")
    raise UnsupportedModelError(f"model: {type(model).__name__} (model_type={model_type!r}) is not a supported "
                                f"hybrid family{'; ' + hint if hint else ''}. Supported: {supported}")
