"""Every hybrid family, patched by what its layers are (SPEC §6b).

A family is a table entry: its ``config.model_type`` values and, for each of its module classes that carries
information across tokens, a :class:`Layer`: the layer :class:`Kind` (which §4 ops it runs on) and its packed
forward. A plain packed forward takes ``(module, hidden_states [1, T, hidden], boundaries)`` and returns the
module's output with every document on its own; a :class:`WholeCall` one takes the module's whole call.
Softmax attention (full, sliding-window, MLA) needs no entry: every attention module that calls transformers'
attention interface is served through it (:mod:`.attention`). Families whose layers are not all known kinds
are refused by name (:data:`REFUSED`), the missing kind named.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch

from hybrid_pack.boundaries import PackedBoundaries
from hybrid_pack.errors import UnsupportedModelError
from hybrid_pack.integrations.transformers.gated_deltanet import (
    gated_deltanet_forward,
    olmo_hybrid_output,
    olmo_hybrid_projections,
    qwen3_5_projections,
    qwen3_next_projections,
)
from hybrid_pack.integrations.transformers.glm5_next import indexed_mla_forward
from hybrid_pack.integrations.transformers.kda import bailing_hybrid_output_gate, kda_forward, kimi_linear_output_gate
from hybrid_pack.integrations.transformers.lightning import lightning_attention_forward
from hybrid_pack.integrations.transformers.mamba1 import mamba1_forward, zamba_mamba_forward
from hybrid_pack.integrations.transformers.mamba2 import falcon_h1_gated_norm, falcon_h1_in_proj, mamba2_forward
from hybrid_pack.integrations.transformers.qsa import qsa_attention_forward
from hybrid_pack.integrations.transformers.qwen4_exp import ple_call
from hybrid_pack.integrations.transformers.short_conv import short_conv_forward

__all__ = ["Kind", "Layer", "WholeCall", "Family", "FAMILIES", "REFUSED", "ATTENTION", "family_of", "PackedForward"]

PackedForward = Callable[[torch.nn.Module, torch.Tensor, PackedBoundaries], torch.Tensor]


@dataclass(frozen=True)
class Kind:
    """A layer kind: what it carries across tokens, the §4 ops (``hybrid_pack.ops``) its packed forward runs, and
    whether it serves a context-parallel shard (``ShardedBoundaries``) or refuses it by name."""

    name: str
    ops: tuple[str, ...]
    context_parallel: bool = True


ATTENTION = Kind("softmax attention (full, sliding window, MLA)", ("varlen_attention",))
GATED_DELTANET = Kind("Gated DeltaNet", ("causal_conv1d", "gated_delta_rule"))
KIMI_DELTA_ATTENTION = Kind("Kimi Delta Attention", ("causal_conv1d", "kda"))
MAMBA2 = Kind("Mamba-2", ("causal_conv1d", "mamba2_ssd"))
MAMBA1 = Kind("Mamba-1", ("causal_conv1d", "selective_scan"))
SHORT_CONV = Kind("gated short convolution", ("causal_conv1d",))
DECAY_LINEAR_ATTENTION = Kind("lightning (decay linear) attention", ("decay_linear_attention",))
INDEXED_ATTENTION = Kind("indexed (DSA-style) sparse attention", ("indexed_attention",), context_parallel=False)
NGRAM_EMBEDDING = Kind("per-layer hashed n-gram embedding with a dilated convolution", (), context_parallel=False)


@dataclass(frozen=True)
class WholeCall:
    """A packed forward that needs the layer's whole call, not only its hidden states:
    ``forward(module, boundaries, *args, **kwargs)`` returns what the module's own forward returns."""

    forward: Callable[..., Any]


@dataclass(frozen=True)
class Layer:
    """A module class's layer kind and its packed forward (a module-level function or ``functools.partial`` of one,
    so a patched model pickles)."""

    kind: Kind
    forward: PackedForward | WholeCall


@dataclass(frozen=True)
class Family:
    """One model family: its display name, its ``config.model_type`` values (text and multimodal), its layers
    ``{module class name: Layer}``, and ``hand_offs``: ``{module class: child attribute}`` where the module's
    forward does not pass its keywords (``boundaries``) on to that child, so the patch hands them over
    (:func:`.entry.hand_off`); ``window_from_config``: its attention layers apply ``config.sliding_window``, which
    they do not hold themselves."""

    name: str
    model_types: tuple[str, ...]
    layers: Mapping[str, Layer]
    hand_offs: Mapping[str, str] = field(default_factory=dict)
    window_from_config: bool = False

    @property
    def kinds(self) -> tuple[Kind, ...]:
        """The family's layer kinds, softmax attention last (every family here has it or is attention-free)."""
        return tuple(dict.fromkeys(layer.kind for layer in self.layers.values()))


_QWEN3_5_GDN = Layer(GATED_DELTANET, partial(gated_deltanet_forward, projections=qwen3_5_projections))
_MAMBA2 = Layer(MAMBA2, mamba2_forward)
_SHORT_CONV = Layer(SHORT_CONV, short_conv_forward)
_KIMI_KDA = Layer(KIMI_DELTA_ATTENTION, partial(kda_forward, output_gate=kimi_linear_output_gate))

FAMILIES: tuple[Family, ...] = (
    Family("Qwen3-Next", ("qwen3_next",),
           {"Qwen3NextGatedDeltaNet": Layer(GATED_DELTANET, partial(gated_deltanet_forward,
                                                                    projections=qwen3_next_projections))}),
    Family("Qwen3.5", ("qwen3_5_text", "qwen3_5"), {"Qwen3_5GatedDeltaNet": _QWEN3_5_GDN}),
    Family("Qwen3.5-MoE", ("qwen3_5_moe_text", "qwen3_5_moe"), {"Qwen3_5MoeGatedDeltaNet": _QWEN3_5_GDN}),
    Family("LaraMini", ("lara_mini",), {"LaraMiniGatedDeltaNet": _QWEN3_5_GDN}),
    Family("OLMo-Hybrid", ("olmo_hybrid",),
           {"OlmoHybridGatedDeltaNet": Layer(GATED_DELTANET, partial(
               gated_deltanet_forward, projections=olmo_hybrid_projections, output=olmo_hybrid_output))}),
    Family("Kimi-Linear", ("kimi_linear",), {"KimiLinearDeltaAttention": _KIMI_KDA}),
    Family("Bailing-Hybrid", ("bailing_hybrid",),
           {"BailingHybridDeltaAttention": Layer(KIMI_DELTA_ATTENTION, partial(
               kda_forward, output_gate=bailing_hybrid_output_gate))}),
    Family("MiniMax", ("minimax",),
           {"MiniMaxLightningAttention": Layer(DECAY_LINEAR_ATTENTION, lightning_attention_forward)},
           window_from_config=True),
    Family("Bamba", ("bamba",), {"BambaMixer": _MAMBA2}),
    Family("Nemotron-H", ("nemotron_h",), {"NemotronHMamba2Mixer": _MAMBA2}),
    Family("Falcon-H1", ("falcon_h1",),
           {"FalconH1Mixer": Layer(MAMBA2, partial(mamba2_forward, in_proj=falcon_h1_in_proj,
                                                   gated_norm=falcon_h1_gated_norm))}),
    Family("GraniteMoeHybrid", ("granitemoehybrid",), {"GraniteMoeHybridMambaLayer": _MAMBA2}),
    Family("Zamba2", ("zamba2",), {"Zamba2MambaMixer": _MAMBA2}),
    Family("Mamba2", ("mamba2",), {"Mamba2Mixer": _MAMBA2}, hand_offs={"Mamba2ForCausalLM": "backbone"}),
    Family("Lfm2", ("lfm2",), {"Lfm2ShortConv": _SHORT_CONV}),
    Family("Lfm2-MoE", ("lfm2_moe",), {"Lfm2MoeShortConv": _SHORT_CONV}),
    Family("Lfm3", ("lfm3",), {"Lfm3ShortConv": _SHORT_CONV}),
    Family("Jamba", ("jamba",), {"JambaMambaMixer": Layer(MAMBA1, partial(mamba1_forward, normed=True))},
           hand_offs={"JambaMambaDecoderLayer": "mamba"}),
    Family("Mamba", ("mamba",), {"MambaMixer": Layer(MAMBA1, mamba1_forward)},
           hand_offs={"MambaForCausalLM": "backbone", "MambaModel": "layers", "MambaBlock": "mixer"}),
    Family("FalconMamba", ("falcon_mamba",), {"FalconMambaMixer": Layer(MAMBA1, partial(mamba1_forward, normed=True))},
           hand_offs={"FalconMambaForCausalLM": "backbone", "FalconMambaModel": "layers",
                      "FalconMambaBlock": "mixer"}),
    Family("Zamba", ("zamba",), {"ZambaMambaMixer": Layer(MAMBA1, zamba_mamba_forward)}),
    Family("GLM-5-Next", ("glm5_next_text", "glm5_next"),
           {"Glm5NextTextLinearAttention": _KIMI_KDA,
            "Glm5NextTextAttention": Layer(INDEXED_ATTENTION, WholeCall(indexed_mla_forward))}),
    Family("Qwen4-Exp", ("qwen4_exp_text",),
           {"Qwen4ExpTextGatedDeltaNet": _QWEN3_5_GDN,
            "Qwen4ExpTextAttention": Layer(INDEXED_ATTENTION, WholeCall(qsa_attention_forward)),
            "Qwen4ExpTextPLELayer": Layer(NGRAM_EMBEDDING, WholeCall(ple_call))},
           hand_offs={"Qwen4ExpTextDecoderLayer": "ple"}),
)

REFUSED: Mapping[str, str] = {
    "qwen4_exp": "Qwen4ExpForConditionalGeneration (multimodal, M-RoPE positions) is not served on packed rows; "
                 "load the text model with Qwen4ExpForCausalLM",
    "recurrent_gemma": "RecurrentGemma's RG-LRU recurrence (RecurrentGemmaRecurrentBlock) is a layer kind with no "
                       "packed op here",
    "xlstm": "xLSTM's mLSTM recurrence (xLSTMBlock's mLSTM layer) is a layer kind with no packed op here",
    "rwkv": "RWKV-4's WKV recurrence (RwkvSelfAttention) and token shift are layer kinds with no packed op here",
    "inkling_text": "Inkling's short convolutions over q/k/v (InklingShortConvolution) and relative logits are "
                    "layer kinds with no packed op here",
    "inkling_mm_model": "Inkling's short convolutions over q/k/v (InklingShortConvolution) and relative logits are "
                        "layer kinds with no packed op here",
    "inkling2_text": "Inkling2's short and dynamic short convolutions (Inkling2ShortConvolution, "
                     "Inkling2DynamicShortConvolution) and relative position bias are layer kinds with no packed op "
                     "here",
    "inkling2": "Inkling2's short and dynamic short convolutions (Inkling2ShortConvolution, "
                "Inkling2DynamicShortConvolution) and relative position bias are layer kinds with no packed op "
                "here",
    "inkling2_loop_text": "Inkling2-Loop's short and dynamic short convolutions (Inkling2LoopShortConvolution, "
                          "Inkling2LoopDynamicShortConvolution) and relative position bias are layer kinds with no "
                          "packed op here",
    "inkling2_loop": "Inkling2-Loop's short and dynamic short convolutions (Inkling2LoopShortConvolution, "
                     "Inkling2LoopDynamicShortConvolution) and relative position bias are layer kinds with no packed "
                     "op here",
    "deepseek_v4": "DeepSeek-V4's compressed attention (DeepseekV4HCACompressor, DeepseekV4CSACompressor: keys "
                   "pooled across tokens) and its indexer (DeepseekV4Indexer) are layer kinds with no packed op here",
    "minimax_m3_vl_text": "MiniMax-M3's indexed sparse attention (MiniMaxM3VLIndexer) is a layer kind with no packed "
                          "op here",
    "minimax_m3_vl": "MiniMax-M3's indexed sparse attention (MiniMaxM3VLIndexer) is a layer kind with no packed op "
                     "here",
    "zaya": "ZAYA's convolved attention (ZayaCCAProjection: convolutions over q/k inside attention) is a layer kind "
            "with no packed op here",
}
"""Hybrid families of transformers that :func:`family_of` refuses, with the missing layer kind."""


def family_of(model: torch.nn.Module) -> Family:
    """The :class:`Family` of ``model`` (read from ``model.config.model_type``); UnsupportedModelError if none."""
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    for family in FAMILIES:
        if model_type in family.model_types:
            return family
    supported = ", ".join(f"{f.name} ({'/'.join(f.model_types)})" for f in FAMILIES)
    missing = REFUSED.get(model_type) or _around_a_served_language_model(model)
    raise UnsupportedModelError(f"model: {type(model).__name__} (model_type={model_type!r}) is not a supported "
                                f"hybrid family{'; ' + missing if missing else ''}. Supported: {supported}")


def _around_a_served_language_model(model: torch.nn.Module) -> str:
    """Why a multimodal model whose language model is a served family is refused ("" for any other model)."""
    config = getattr(model, "config", None)
    get_text_config = getattr(config, "get_text_config", None)
    try:
        text = get_text_config() if callable(get_text_config) else None
    except ValueError:  # several text configs (an encoder-decoder): no one language model
        return ""
    family = next((f for f in FAMILIES if getattr(text, "model_type", None) in f.model_types), None)
    if family is None or text is config:
        return ""
    return (f"its language model is {family.name} ({text.model_type}), served, but its image / audio inputs are not "
            "the packed multimodal batches hybrid_pack builds (docs/api.md §3b: Qwen-style pixel_values with "
            "image_grid_thw); train the language model on text rows (loaded alone, AutoModelForCausalLM)")

