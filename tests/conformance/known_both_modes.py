"""Tests of transformers' ``ModelTesterMixin`` that fail on hybrid_pack's tiny models WITH AND WITHOUT
``patch_model``, each with how it fails: the exception type, a pattern of its message, and why.

The conformance tier marks exactly these ``xfail(strict=True, raises=<type>)`` in both modes and checks the
message: a listed test that starts passing, fails with another exception type, or fails with a message the
pattern does not match (a new failure, patched-only or not, behind the same assertion type) fails the tier.

Two entries follow from a family's tiny config (:func:`structural`): the mixin's guard on layer count and its
one-attention-map-per-layer check, pinned to the config's numbers. The rest are listed per family in
:data:`KNOWN`. Kept for the transformers release the tier runs against (:data:`RELEASE`); on another release,
re-derive them with ``python scripts/conformance_table.py`` (it lists every both-mode failure with its type and
first error line).
"""

from __future__ import annotations

import contextlib
import functools
import re
import unittest
from dataclasses import dataclass

import pytest
from huggingface_hub.errors import StrictDataclassClassValidationError

from tests.conformance.family_tester import conformance_config

__all__ = ["RELEASE", "LISTED_OTHERWISE", "Expected", "KNOWN", "attention_layers", "expected_failure",
           "expecting_failure", "reason_for", "structural"]

RELEASE = "5.24.0"
# How the failure of a listed test that its entry does not describe reads (scripts/conformance_table.py finds it).
LISTED_OTHERWISE = "is listed in known_both_modes.py as failing with"


@dataclass(frozen=True)
class Expected:
    """How a test fails in both modes: ``raises`` (the exception type), ``match`` (a regular expression
    searched in ``str(exception)``, as ``pytest.raises(match=...)``) and ``reason`` (why)."""

    raises: type[BaseException]
    match: str
    reason: str

    def matches(self, error: BaseException) -> bool:
        return isinstance(error, self.raises) and re.search(self.match, str(error)) is not None


_ROTARY_DIM_2 = Expected(
    ZeroDivisionError, r"^division by zero$",
    "tiny config: head_dim 8 x partial_rotary_factor 0.25 gives a rotary dim of 2, and dynamic NTK scaling divides "
    "by (dim - 2) in transformers' rope utils")
_NO_MOE_LAYER = "tiny config: nemotron_h's layers are mamba / attention / mlp, no 'moe' layer"
_LIGHTNING_STATE = ("MiniMax's lightning (linear) attention layers return their key-value state as the layer's "
                    "attentions")

_HALF_PRECISION_EXPERTS = Expected(
    AssertionError, r"^Tensor-likes are not close!\n",
    "tiny MoE in half precision: the batched / grouped experts differ from eager beyond the test's tolerance (the "
    "float32 case passes)")
_SSM_ONLY_CACHE = Expected(
    ValueError, r"^`get_seq_length` can only be called on Attention layers, and the current Cache seem to only "
                r"contain LinearAttention layers\.$",
    "the mixin calls cache.get_seq_length(), which transformers' cache refuses when it holds only linear-attention "
    "(SSM) layers, as a pure SSM model's does")
_QSA_INDEXER = Expected(
    AssertionError, r"^False is not true : model\.layers\.1\.self_attn\.indexer\.\w+\.weight in Qwen4ExpForCausalLM "
                    r"has no gradient!$",
    "Qwen4-Exp's QSA indexer picks the attended keys by top-k: its weights get no gradient from the loss, and the "
    "mixin asks every parameter for one")
_HALF_CASES = ("0_fp16", "2_bf16")

# (tests, families, how they fail).
_ENTRIES: tuple[tuple[tuple[str, ...], tuple[str, ...], Expected], ...] = (
    (("test_model_rope_scaling_frequencies", "test_model_rope_scaling_from_config_1_dynamic"),
     ("qwen3_next", "qwen3_5", "qwen3_5_moe"), _ROTARY_DIM_2),
    (tuple(f"test_eager_matches_batched_and_grouped_inference_{case}" for case in ("0_fp16", "1_fp32", "2_bf16")),
     ("nemotron_h",), Expected(
        AssertionError, r"^Expected 'mock' to have been called\.$",
        f"{_NO_MOE_LAYER}: the experts implementations the test mocks are never called")),
    (("test_keep_in_fp32_modules_exist",), ("nemotron_h",), Expected(
        # The two names come from a set: in either order.
        AssertionError, r"^False is not true : \[(('gate\.weight'|'e_score_correction_bias')(, )?){2}\] were "
                        r"specified in the `_keep_in_fp32_modules_strict` list, but are not part of the modules in "
                        r"NemotronHModel$",
        f"{_NO_MOE_LAYER}: the class's _keep_in_fp32_modules_strict names MoE router modules absent here")),
    (("test_output_router_logits_from_config",), ("nemotron_h",), Expected(
        AssertionError, r"^\(\) is not true : `config\.output_router_logits=True` was ignored$",
        f"{_NO_MOE_LAYER}: config.output_router_logits has no router to report")),
    (("test_reverse_loading_mapping",), ("nemotron_h",), Expected(
        AssertionError, r"^\[.*\] == \[.*\] : No key mapping was performed!$",
        f"{_NO_MOE_LAYER}: the class's checkpoint conversion mapping renames no key of this model")),
    (("test_tp_plan_matches_params",), ("nemotron_h",), Expected(
        AssertionError, r"^False is not true : The following entries of the TP-plan are not valid: "
                        r"\{('layers\.\*\.mixer\.experts(\.up_proj|\.down_proj)?'(, )?){3}\}$",
        f"{_NO_MOE_LAYER}: the class's tensor-parallel plan names expert weights absent here")),
    (("test_inputs_embeds_matches_input_ids",), ("falcon_h1",), Expected(
        # Every element differs: the multiplier scales every embedding (a partial mismatch is another failure).
        AssertionError, r"^Tensor-likes are not close!\n\nMismatched elements: (\d+) / \1 \(100\.0%\)\n",
        "tiny config: embedding_multiplier 2.0; FalconH1Model applies it to embed_tokens(input_ids) only, not to "
        "inputs_embeds passed in")),
    (("test_attention_outputs",), ("minimax",), Expected(
        AssertionError, r"^Lists differ: \[4, 8, 8\] != \[4, 7, 7\]",
        f"{_LIGHTNING_STATE} [heads 4, head_dim 8, head_dim 8], where the mixin expects a map [heads, query 7, "
        f"key 7]")),
    (("test_retain_grad_hidden_states_attentions",), ("minimax",), Expected(
        AssertionError, r"^unexpectedly None$",
        f"{_LIGHTNING_STATE}, and the logits' first element does not depend on it: its .grad stays None")),
    (tuple(f"test_eager_matches_batched_and_grouped_inference_{case}" for case in _HALF_CASES),
     ("minimax", "kimi_linear", "bailing_hybrid"), _HALF_PRECISION_EXPERTS),
    (("test_eager_matches_sdpa_inference_16_bf16_pad_left_sdpa_kernels",), ("lara_mini",), Expected(
        ValueError, r"^mean relative difference for hidden_states: \S+, torch atol = \S+, torch rtol = 0\.01$",
        "bfloat16 with left padding: the tiny model's eager and SDPA hidden states differ beyond the test's bf16 "
        "tolerance (the float32 and float16 cases pass)")),
    (("test_bc_cache_name_forward",), ("mamba2", "mamba", "falcon_mamba"), _SSM_ONLY_CACHE),
    (("test_reverse_loading_mapping",), ("bailing_hybrid",), Expected(
        AssertionError, r"^False is not true : `\^model\\\.word_embeddings\\\.` in `WeightRenaming\(source_patterns="
                        r"\['\^model\\\\\.word_embeddings\\\\\.'\], target_patterns=\['model\.embed_tokens\.'\]\)` did "
                        r"not match any of the source keys\.",
        "the class's checkpoint conversion mapping renames `model.word_embeddings.`, a key the saved model does not "
        "have (it saves model.embed_tokens)")),
    (("test_hidden_states_output",), ("qwen4_exp",), Expected(
        AssertionError, r"^Lists differ: \[7, 64\] != \[7, 32\]",
        "Qwen4-Exp's hyper-connections (tiny config: hc_count 2) keep 2 residual streams: its hidden states are "
        "[seq 7, 2 x hidden 32], where the mixin expects [seq 7, hidden 32]")),
    (("test_model_forward_default_config_values",), ("qwen4_exp",), Expected(
        StrictDataclassClassValidationError,
        r"^Class validation error for validator 'validate_architecture':\n.*eos_token_id must be set when Qwen4-Exp "
        r"PLE layers are enabled\.",
        "the mixin rebuilds the config from the class defaults, without eos_token_id, which Qwen4ExpTextConfig "
        "requires with PLE layers (tiny config: ple_layer_ids [1, 3])")),
    (("test_training_gradient_checkpointing", "test_training_gradient_checkpointing_use_reentrant_false",
      "test_training_gradient_checkpointing_use_reentrant_true"), ("qwen4_exp",), _QSA_INDEXER),
)


def _known() -> dict[str, dict[str, Expected]]:
    known: dict[str, dict[str, Expected]] = {}
    for tests, families, expected in _ENTRIES:
        for test in tests:
            for family in families:
                if family in known.setdefault(test, {}):
                    raise ValueError(f"known_both_modes.py: {test} is listed twice for {family}")
                known[test][family] = expected
    return known


KNOWN: dict[str, dict[str, Expected]] = _known()


# The `config.layer_types` kinds whose layers return an attention map (zamba2 / falcon_h1 "hybrid": attention
# beside the SSM).
ATTENTION_KINDS = ("full_attention", "sliding_attention", "indexed_attention", "attention", "hybrid")


def attention_layers(config) -> int:
    """How many of ``config``'s layers return an attention map (``config.layer_types`` kinds in
    :data:`ATTENTION_KINDS`); a config without ``layer_types`` counts every layer if it has attention heads."""
    kinds = getattr(config, "layer_types", None)
    if kinds is None:
        return config.num_hidden_layers if getattr(config, "num_attention_heads", None) else 0
    return sum(kind in ATTENTION_KINDS for kind in kinds)


@functools.cache
def structural(family: str) -> dict[str, Expected]:
    """The both-mode failures that follow from ``family``'s tiny config: more than 2 layers (the mixin's guard on
    test cost), and attention maps from some layers only (the mixin expects one per layer)."""
    config = conformance_config(family).get_text_config()
    layers, maps = config.num_hidden_layers, attention_layers(config)
    expected = {}
    if layers > 2:
        expected["test_num_layers_is_small"] = Expected(
            AssertionError, rf"^assert {layers} <= 2\b",
            f"tiny config: {layers} layers, to hold every layer kind of the family; the mixin's guard on test cost "
            f"asks for at most 2")
    if maps and maps != layers:
        expected["test_attention_outputs"] = Expected(
            AssertionError, rf"^{maps} != {layers}$",
            f"the mixin expects one attention map per layer ({layers}); a hybrid model returns one per softmax-"
            f"attention layer ({maps}); transformers' own test of each hybrid family overrides this test")
    return expected


def expected_failure(family: str, test: str) -> Expected | None:
    """How ``test`` fails on ``family`` in both modes, or None if it is not expected to fail."""
    listed = KNOWN.get(test, {}).get(family)
    return listed if listed is not None else structural(family).get(test)


def reason_for(family: str, test: str) -> str | None:
    """Why ``test`` fails on ``family`` in both modes, or None if it is not expected to fail."""
    expected = expected_failure(family, test)
    return None if expected is None else expected.reason


def expecting_failure(test, family: str, expected: Expected, *, mark: bool):
    """``test`` (a mixin method shared by every class) wrapped for one family's class: a failure that ``expected``
    does not describe (another exception type, or a message ``expected.match`` does not find) becomes
    ``pytest.fail`` naming both, which no xfail mark accepts. With ``mark``: ``xfail(strict=True,
    raises=expected.raises)``. Its ``self.subTest`` blocks are plain blocks: pytest reports a failing subtest apart
    from its test, where the xfail mark does not reach; here the first failure fails the test itself."""

    @functools.wraps(test)
    def wrapper(self, *args, **kwargs):
        self.subTest = lambda *_, **__: contextlib.nullcontext()
        try:
            return test(self, *args, **kwargs)
        except unittest.SkipTest:
            raise
        except Exception as error:
            if not expected.matches(error):
                pytest.fail(f"{family}: {test.__name__} {LISTED_OTHERWISE} {expected.raises.__name__} matching "
                            f"{expected.match!r} ({expected.reason}); it failed with {type(error).__name__}: {error}",
                            pytrace=False)
            raise

    if mark:
        wrapper.pytestmark = [*getattr(test, "pytestmark", []),
                              pytest.mark.xfail(reason=expected.reason, strict=True, raises=expected.raises)]
    return wrapper
