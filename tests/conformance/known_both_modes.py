"""Tests of transformers' ``ModelTesterMixin`` that fail on hybrid_pack's tiny models WITH AND WITHOUT
``patch_model``, with the reason: the conformance tier expects exactly these to fail (strict ``xfail``, in
both modes), so one that starts passing, or starts failing in one mode only, fails the tier.

Kept for the transformers release the tier runs against (:data:`RELEASE`); on another release, re-derive it
with ``python scripts/conformance_table.py --raw`` (which lists every both-mode failure and its first error
line). Entries are ``test name -> {family or "*": reason}``.
"""

from __future__ import annotations

__all__ = ["RELEASE", "KNOWN", "reason_for"]

RELEASE = "5.24.0"

ALL = "*"

_HYBRID_ATTENTIONS = ("the mixin expects one attention map per layer; a hybrid model returns one per softmax-"
                      "attention layer only (transformers' own test of each hybrid family overrides this test)")
_ROTARY_DIM_2 = ("tiny config: head_dim 8 x partial_rotary_factor 0.25 gives a rotary dim of 2, and dynamic NTK "
                 "scaling divides by (dim - 2) in transformers' rope utils")
# The families whose tiny config has 3 or 4 layers, not all of them attention layers (falcon_h1: 2 layers, each
# with attention beside its SSM; mamba2: 2 layers, no attention).
_MULTI_LAYER = ("qwen3_next", "qwen3_5", "bamba", "nemotron_h", "granitemoehybrid", "zamba2", "lfm2", "jamba")
_NO_MOE_LAYER = "tiny config: nemotron_h's layers are mamba / attention / mlp, no 'moe' layer"

KNOWN: dict[str, dict[str, str]] = {
    "test_num_layers_is_small": dict.fromkeys(
        _MULTI_LAYER, "tiny config: 3 or 4 layers (a linear mixer on both sides of an attention layer); the mixin's "
                      "guard on test cost asks for at most 2"),
    "test_attention_outputs": dict.fromkeys(_MULTI_LAYER, _HYBRID_ATTENTIONS),
    "test_model_rope_scaling_frequencies": {"qwen3_next": _ROTARY_DIM_2, "qwen3_5": _ROTARY_DIM_2},
    "test_model_rope_scaling_from_config_1_dynamic": {"qwen3_next": _ROTARY_DIM_2, "qwen3_5": _ROTARY_DIM_2},
    **{f"test_eager_matches_batched_and_grouped_inference_{case}": {
        "nemotron_h": f"{_NO_MOE_LAYER}: the experts implementations the test mocks are never called",
    } for case in ("0_fp16", "1_fp32", "2_bf16")},
    "test_keep_in_fp32_modules_exist": {
        "nemotron_h": f"{_NO_MOE_LAYER}: the class's _keep_in_fp32_modules_strict names MoE router modules absent here",
    },
    "test_output_router_logits_from_config": {
        "nemotron_h": f"{_NO_MOE_LAYER}: config.output_router_logits has no router to report",
    },
    "test_reverse_loading_mapping": {
        "nemotron_h": f"{_NO_MOE_LAYER}: the class's checkpoint conversion mapping renames no key of this model",
    },
    "test_tp_plan_matches_params": {
        "nemotron_h": f"{_NO_MOE_LAYER}: the class's tensor-parallel plan names expert weights absent here",
    },
    "test_inputs_embeds_matches_input_ids": {
        "falcon_h1": "tiny config: embedding_multiplier 2.0; FalconH1Model applies it to embed_tokens(input_ids) "
                     "only, not to inputs_embeds passed in",
    },
    "test_bc_cache_name_forward": {
        "mamba2": "the mixin calls cache.get_seq_length(), which transformers' cache refuses when it holds only "
                  "linear-attention (SSM) layers, as a pure Mamba2 model's does",
    },
}


def reason_for(family: str, test: str) -> str | None:
    """Why ``test`` fails on ``family`` in both modes, or None if it is not expected to fail."""
    entry = KNOWN.get(test)
    if entry is None:
        return None
    return entry.get(family, entry.get(ALL))
