"""The ``model_tester`` the conformance tier gives transformers' ``ModelTesterMixin``, one per family.

transformers' own per-family testers (``tests/models/<family>/test_modeling_<family>.py``) and their base,
``tests/causal_lm_tester.py``, are not in the release's source distribution (see :mod:`.hf_release`), so
:class:`FamilyTester` is ``CausalLMModelTester`` reduced to what the mixin reads, over the family's tiny config
(:func:`hybrid_pack.integrations.transformers.tiny.tiny_config`).
"""

from __future__ import annotations

import unittest

import torch

from hybrid_pack.integrations.transformers.tiny import tiny_config
from tests.conformance import hf_release

__all__ = ["FamilyTester", "common"]

common = hf_release.load()


class FamilyTester:
    """What ``ModelTesterMixin`` reads of its ``model_tester``: transformers' ``CausalLMModelTester`` defaults
    (batch 13, sequence 7, ``ids_tensor`` ids, a ``torch.tril`` attention mask: row ``i`` holds ``min(i + 1, 7)``
    real tokens, then right padding) over one family's tiny config."""

    batch_size = 13
    seq_length = 7
    is_training = True
    num_labels = 3
    num_choices = 4
    type_sequence_label_size = 2

    def __init__(self, parent: unittest.TestCase | None, family: str) -> None:
        config = tiny_config(family)
        self.parent, self.family = parent, family
        self.vocab_size, self.hidden_size = config.vocab_size, config.hidden_size
        self.num_hidden_layers = config.num_hidden_layers
        self.num_attention_heads = getattr(config, "num_attention_heads", None)

    def get_config(self):
        config = tiny_config(self.family)
        if hasattr(config, "max_position_embeddings"):
            # CausalLMModelTester's value: the RoPE tests run a sequence of 1.5 times this length.
            config.max_position_embeddings = 512
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
