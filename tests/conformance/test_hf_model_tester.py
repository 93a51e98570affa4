"""The conformance tier (docs/api.md §6a): transformers' own ``ModelTesterMixin`` (``tests/test_modeling_common.py``
of the installed release's source distribution, see :mod:`tests.conformance.hf_release`) over every
supported family, unpatched and patched. The contract: every test that passes unpatched passes patched.

Per family two ``unittest`` classes, ``TestHF<Family>Unpatched`` and ``TestHF<Family>Patched``, each with
``all_model_classes = (backbone, causal LM)`` of the family's tiny config
(``hybrid_pack.integrations.transformers.tiny.tiny_config``; the backbone of qwen3_5 is ``Qwen3_5TextModel``).
The model tester (:class:`FamilyTester`) is transformers' ``CausalLMModelTester`` reduced to what the mixin
reads (that file is not in the sdist): ``batch_size`` 13, ``seq_length`` 7, ``ids_tensor`` ids and a
``torch.tril`` attention mask (rows right-padded), on the tiny config instead of a tester-built one, with
the tester's ``max_position_embeddings=512`` (the RoPE tests run 1.5 times that many positions).

Both modes run the families' code on transformers' own torch functions (``pure_torch_transformers``): the
kernel packages the test venv installs for the Triton-interpreter tier need a GPU otherwise.

Patched: every model of the family that a test builds goes through ``patch_model`` once, as a user would
patch it: a model built directly (``model_class(config)``, ``_from_config``) right after its constructor
(the outermost ``post_init``; a backbone built inside a causal LM is patched with it), and one loaded with
``from_pretrained`` after it is loaded. ``type(model)`` stays the real class.

Expected failures: the tests listed in :mod:`tests.conformance.known_both_modes` fail in both modes for the
reason given there, and are marked strict ``xfail`` in both. ``HYBRID_PACK_CONFORMANCE_RAW=1`` drops those
marks (``scripts/conformance_table.py`` runs that way to report real outcomes).
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys
import unittest
import zlib
from collections.abc import Iterator
from unittest import mock

import pytest

pytest.importorskip("transformers")
pytest.importorskip("parameterized")

import torch
from transformers import MODEL_FOR_CAUSAL_LM_MAPPING, MODEL_MAPPING, PreTrainedModel, set_seed

from hybrid_pack.integrations.transformers import patch_model
from hybrid_pack.integrations.transformers.tiny import TINY_CONFIGS, pure_torch_transformers, tiny_config
from tests.conformance import hf_release
from tests.conformance.known_both_modes import reason_for

pytestmark = pytest.mark.conformance

RAW_ENV = "HYBRID_PACK_CONFORMANCE_RAW"

common = hf_release.load()
GenerationTesterMixin = sys.modules[f"{hf_release.PACKAGE}.generation.test_utils"].GenerationTesterMixin


class FamilyTester:
    """What ``ModelTesterMixin`` reads of its ``model_tester``: transformers' ``CausalLMModelTester`` defaults
    (batch 13, sequence 7, ``torch.tril`` mask) over one family's tiny config."""

    batch_size = 13
    seq_length = 7
    is_training = True
    num_labels = 3
    num_choices = 4
    type_sequence_label_size = 2

    def __init__(self, parent: unittest.TestCase, family: str) -> None:
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
        input_ids = common.ids_tensor([self.batch_size, self.seq_length], self.vocab_size)
        attention_mask = torch.tril(torch.ones_like(input_ids))
        return self.get_config(), input_ids, attention_mask

    def prepare_config_and_inputs_for_common(self) -> tuple:
        config, input_ids, attention_mask = self.prepare_config_and_inputs()
        return config, {"input_ids": input_ids, "attention_mask": attention_mask}


def _inside_another_model(model: PreTrainedModel) -> bool:
    """Whether ``model`` is being built inside the constructor of another model (a backbone in a causal LM)."""
    frame = sys._getframe(2)
    while frame is not None:
        if frame.f_code.co_name == "__init__":
            owner = frame.f_locals.get("self")
            if owner is not model and isinstance(owner, PreTrainedModel):
                return True
        frame = frame.f_back
    return False


@contextlib.contextmanager
def patching_every_model(config_class: type) -> Iterator[None]:
    """Within: every model whose config is a ``config_class`` goes through ``patch_model`` once it is built
    (the outermost ``post_init``) or, when loaded with ``from_pretrained``, once it is loaded."""
    post_init = PreTrainedModel.post_init
    from_pretrained = PreTrainedModel.from_pretrained.__func__
    loading = [0]

    def ours(model: object) -> bool:
        return isinstance(model, PreTrainedModel) and isinstance(model.config, config_class)

    def patched_post_init(self: PreTrainedModel, *args, **kwargs):
        result = post_init(self, *args, **kwargs)
        if not loading[0] and ours(self) and not _inside_another_model(self):
            patch_model(self)
        return result

    def patched_from_pretrained(cls: type, *args, **kwargs):
        loading[0] += 1
        try:
            result = from_pretrained(cls, *args, **kwargs)
        finally:
            loading[0] -= 1
        model = result[0] if isinstance(result, tuple) else result
        if not loading[0] and ours(model):
            patch_model(model)
        return result

    with mock.patch.object(PreTrainedModel, "post_init", patched_post_init), \
            mock.patch.object(PreTrainedModel, "from_pretrained", classmethod(patched_from_pretrained)):
        yield


def _expected_failure(test, reason: str):
    """``test`` (a mixin method shared by every class) wrapped for one class, marked strict xfail. Its
    ``self.subTest`` blocks are plain blocks: pytest reports a failing subtest apart from its test, where the
    xfail mark does not reach; here the first failure fails the test itself."""

    @functools.wraps(test)
    def wrapper(self, *args, **kwargs):
        self.subTest = lambda *_, **__: contextlib.nullcontext()
        return test(self, *args, **kwargs)

    wrapper.pytestmark = [*getattr(test, "pytestmark", []), pytest.mark.xfail(reason=reason, strict=True)]
    return wrapper


def _test_class(family: str, patched: bool) -> type:
    config_class = type(tiny_config(family))
    model_classes = (MODEL_MAPPING[config_class], MODEL_FOR_CAUSAL_LM_MAPPING[config_class])

    def setUp(self) -> None:
        seed = zlib.crc32(self._testMethodName.encode())              # the same data in both modes
        set_seed(seed)
        common.global_rng.seed(seed)
        self.model_tester = FamilyTester(self, family)
        stack = contextlib.ExitStack()
        self.addCleanup(stack.close)
        stack.enter_context(pure_torch_transformers(model_classes[0]))
        if patched:
            stack.enter_context(patching_every_model(config_class))

    name = "TestHF" + "".join(part.title() for part in family.split("_")) + ("Patched" if patched else "Unpatched")
    attributes = {"all_model_classes": model_classes, "has_attentions": family != "mamba2", "family": family,
                  "patched": patched, "setUp": setUp, "__module__": __name__, "__qualname__": name}
    cls = type(name, (common.ModelTesterMixin, GenerationTesterMixin, unittest.TestCase), attributes)
    if not os.environ.get(RAW_ENV):
        for test in [attr for attr in dir(cls) if attr.startswith("test_")]:
            reason = reason_for(family, test)
            if reason is not None:
                setattr(cls, test, _expected_failure(getattr(cls, test), reason))
    return cls


for _family in TINY_CONFIGS:
    for _patched in (False, True):
        _cls = _test_class(_family, _patched)
        globals()[_cls.__name__] = _cls
del _family, _patched, _cls
