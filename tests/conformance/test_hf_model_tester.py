"""The conformance tier (docs/api.md §6a): transformers' own ``ModelTesterMixin`` (``tests/test_modeling_common.py``
of the installed release's source distribution, see :mod:`tests.conformance.hf_release`) over every
supported family, unpatched and patched. The contract: every test that passes unpatched passes patched.

Per family of :data:`~tests.conformance.family_tester.CONFORMANCE_FAMILIES` (every supported family;
``test_packed_rows.py`` checks that each one in ``FAMILIES`` has a tiny config) two ``unittest`` classes,
``TestHF<Family>Unpatched`` and ``TestHF<Family>Patched``, each with ``all_model_classes = (backbone, language
model)`` of the family's tiny config (the backbone of qwen3_5 is ``Qwen3_5TextModel``; a family with only a
vision-language config, GLM-5-Next, would run ``Glm5NextModel`` and ``Glm5NextForConditionalGeneration`` on text;
it is a counted skip for now, see :data:`NOT_RUN`).
The model tester is :class:`tests.conformance.family_tester.FamilyTester` (transformers' own per-family testers
are not in the sdist). A family whose classes cannot be built (its tiny config, model classes or expected
failures raise) gets instead one failing ``test_family_builds`` per mode, naming it and the error.

Both modes run the families' code on transformers' own torch functions (``pure_torch_transformers``): the
kernel packages the test venv installs for the Triton-interpreter tier need a GPU otherwise.

Patched: every model of the family that a test builds goes through ``patch_model`` once, as a user would
patch it: a model built directly (``model_class(config)``, ``_from_config``) right after its constructor
(the outermost ``post_init``; a backbone built inside a causal LM is patched with it), and one loaded with
``from_pretrained`` after it is loaded. ``type(model)`` stays the real class.

Expected failures: the tests of :mod:`tests.conformance.known_both_modes` fail in both modes as recorded there
(exception type, message pattern, reason), and are marked ``xfail(strict=True, raises=<type>)`` in both; a
message the pattern does not find fails the test. ``HYBRID_PACK_CONFORMANCE_RAW=1`` drops those marks
(``scripts/conformance_table.py`` runs that way to report real outcomes).
"""

from __future__ import annotations

import contextlib
import os
import sys
import unittest
import zlib
from collections.abc import Iterator
from unittest import mock

import pytest

pytest.importorskip("transformers")
pytest.importorskip("parameterized")

from transformers import MODEL_MAPPING, PreTrainedModel, set_seed

from hybrid_pack.integrations.transformers import patch_model
from tests.conformance import hf_release
from tests.conformance.family_tester import (
    CONFORMANCE_FAMILIES,
    FamilyTester,
    common,
    conformance_config,
    language_model_class,
)
from tests.conformance.known_both_modes import attention_layers, expected_failure, expecting_failure
from tests.support.torch_path import pure_torch_transformers

pytestmark = pytest.mark.conformance

RAW_ENV = "HYBRID_PACK_CONFORMANCE_RAW"

GenerationTesterMixin = sys.modules[f"{hf_release.PACKAGE}.generation.test_utils"].GenerationTesterMixin


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


def _test_class(family: str, patched: bool) -> type:
    config = conformance_config(family)
    config_class = type(config)
    model_classes = (MODEL_MAPPING[config_class], language_model_class(config))

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

    name = _class_name(family, patched)
    attributes = {"all_model_classes": model_classes, "has_attentions": attention_layers(config.get_text_config()) > 0,
                  "family": family, "patched": patched, "setUp": setUp, "__module__": __name__, "__qualname__": name}
    cls = type(name, (common.ModelTesterMixin, GenerationTesterMixin, unittest.TestCase), attributes)
    raw = bool(os.environ.get(RAW_ENV))
    for test in [attr for attr in dir(cls) if attr.startswith("test_")]:
        expected = expected_failure(family, test)
        if expected is not None:
            setattr(cls, test, expecting_failure(getattr(cls, test), family, expected, mark=not raw))
    return cls


def _class_name(family: str, patched: bool) -> str:
    return "TestHF" + "".join(part.title() for part in family.split("_")) + ("Patched" if patched else "Unpatched")


def _unbuildable_class(family: str, patched: bool, error: Exception) -> type:
    """A class with one failing test, standing for a family whose test class could not be built (its tiny config,
    its model classes or its expected failures raised): the tier reports the family instead of failing to collect."""
    message = (f"{family}: the conformance tier could not build this family's test class: "
               f"{type(error).__name__}: {error}")

    def test_family_builds(self) -> None:
        pytest.fail(message, pytrace=False)

    name = _class_name(family, patched)
    return type(name, (unittest.TestCase,), {"test_family_builds": test_family_builds, "__module__": __name__,
                                              "__qualname__": name})


# Families whose mixin classes are a counted skip, with why (the packed-row check still runs them).
NOT_RUN: dict[str, str] = {
    "glm5_next": (
        "GLM-5-Next has only a vision-language model in transformers (Glm5NextForConditionalGeneration); the mixin "
        "on it, text-only, fails 18 tests in BOTH modes (its image/video-feature tests need pixel inputs "
        "FamilyTester does not make, attention/hidden-state counts of a 4-layer hybrid, half-precision experts) and "
        "none patched-only (transformers 5.24 run); they are not yet listed in known_both_modes.py"),
}


def _not_run_class(family: str, patched: bool, reason: str) -> type:
    """A class with one skipped test, standing for a family the mixin does not run on (:data:`NOT_RUN`)."""

    def test_family_runs_the_mixin(self) -> None:
        pytest.skip(f"{family}: {reason}")

    name = _class_name(family, patched)
    return type(name, (unittest.TestCase,), {"test_family_runs_the_mixin": test_family_runs_the_mixin,
                                              "__module__": __name__, "__qualname__": name})


for _family in CONFORMANCE_FAMILIES:
    for _patched in (False, True):
        if _family in NOT_RUN:
            _cls = _not_run_class(_family, _patched, NOT_RUN[_family])
            globals()[_cls.__name__] = _cls
            continue
        try:
            _cls = _test_class(_family, _patched)
        except Exception as _error:  # any failure of a family's set-up is reported as that family's test failure
            _cls = _unbuildable_class(_family, _patched, _error)
        globals()[_cls.__name__] = _cls
del _family, _patched, _cls
