"""The ``model_tester`` the conformance tier gives transformers' ``ModelTesterMixin``, one per family.

transformers' own per-family testers (``tests/models/<family>/test_modeling_<family>.py``) and their base,
``tests/causal_lm_tester.py``, are not in the release's source distribution (see :mod:`.hf_release`), so
:class:`FamilyTester` is ``CausalLMModelTester`` reduced to what the mixin reads, over the family's tiny config
(:func:`conformance_config`).

The tier's families (:data:`CONFORMANCE_FAMILIES`): every key of ``TINY_CONFIGS`` (a causal LM) and every key of
``TINY_VLM_CONFIGS`` that has no causal-LM config (GLM-5-Next: transformers has only its vision-language
``...ForConditionalGeneration``), run as that model on text-only inputs.
"""

from __future__ import annotations

import unittest
from collections.abc import Callable
from typing import Any

import torch
from transformers import MODEL_FOR_CAUSAL_LM_MAPPING, MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING

from hybrid_pack.integrations.transformers.tiny import TINY_CONFIGS, TINY_VLM_CONFIGS
from tests.conformance import hf_release

__all__ = ["CONFORMANCE_FAMILIES", "FamilyTester", "common", "conformance_config", "language_model_class"]

common = hf_release.load()

CONFORMANCE_FAMILIES: dict[str, Callable[[], Any]] = TINY_CONFIGS | {
    family: build for family, build in TINY_VLM_CONFIGS.items() if family not in TINY_CONFIGS}
"""The tier's families and their tiny config builders: causal-LM configs first, vision-language ones only for the
families that have no causal-LM config."""


def conformance_config(family: str) -> Any:
    """The tiny config the tier runs ``family`` (a key of :data:`CONFORMANCE_FAMILIES`) on."""
    return CONFORMANCE_FAMILIES[family]()


def language_model_class(config: Any) -> type:
    """The language-model class of ``config``: its causal LM, else its vision-language model (run text-only)."""
    if type(config) in MODEL_FOR_CAUSAL_LM_MAPPING:
        return MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]
    return MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING[type(config)]


class FamilyTester:
    """What ``ModelTesterMixin`` reads of its ``model_tester``: transformers' ``CausalLMModelTester`` defaults
    (batch 13, sequence 7, ``ids_tensor`` ids, a ``torch.tril`` attention mask: row ``i`` holds ``min(i + 1, 7)``
    real tokens, then right padding) over one family's tiny config (its text config's sizes for a vision-language
    one; the ids stay below the text vocabulary, so text-only)."""

    batch_size = 13
    seq_length = 7
    is_training = True
    num_labels = 3
    num_choices = 4
    type_sequence_label_size = 2

    def __init__(self, parent: unittest.TestCase | None, family: str) -> None:
        text = conformance_config(family).get_text_config()
        self.parent, self.family = parent, family
        self.vocab_size, self.hidden_size = text.vocab_size, text.hidden_size
        self.num_hidden_layers = text.num_hidden_layers
        self.num_attention_heads = getattr(text, "num_attention_heads", None)

    def get_config(self):
        config = conformance_config(self.family)
        if hasattr(config.get_text_config(), "max_position_embeddings"):
            # CausalLMModelTester's value: the RoPE tests run a sequence of 1.5 times this length.
            config.get_text_config().max_position_embeddings = 512
        return config

    def prepare_config_and_inputs(self) -> tuple:
        """``(config, input_ids int64 [13, 7], attention_mask int64 [13, 7])``."""
        input_ids = common.ids_tensor([self.batch_size, self.seq_length], self.vocab_size)
        attention_mask = torch.tril(torch.ones_like(input_ids))
        return self.get_config(), input_ids, attention_mask

    def prepare_config_and_inputs_for_common(self) -> tuple:
        """``(config, {"input_ids", "attention_mask"})``: the inputs every mixin test starts from."""
        config, input_ids, attention_mask = self.prepare_config_and_inputs()
        return config, {"input_ids": input_ids, "attention_mask": attention_mask}
