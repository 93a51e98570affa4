"""transformers' own common tests, imported from the INSTALLED release's source distribution (docs/api.md §6a).

Where they come from: ``scripts/fetch_transformers_tests.sh VENV`` (run by ``make test``'s set-up, the
``$(VENV)/.test`` target) downloads ``transformers==<installed version>``'s sdist from PyPI
(``pip download --no-deps --no-binary :all:``) and keeps its ``tests/`` folder in
``VENV/transformers-tests/<version>/tests``: fetched once per version, never copied into this repository.
``HYBRID_PACK_TRANSFORMERS_TESTS`` names another root for that cache (``<root>/<version>/tests``).

How they are imported: that folder becomes the package :data:`PACKAGE` (a namespace put on ``sys.modules``
with the folder as its ``__path__``), so the relative imports of ``test_modeling_common.py`` resolve inside it.

What the sdist lacks, and what this harness puts in its place. The sdist ships only the top-level files of
``tests/`` (``test_modeling_common.py``, ``test_configuration_common.py``, ``test_pipeline_mixin.py``, ...):
no ``tests/models``, ``tests/utils``, ``tests/generation``, ``tests/exporters``, ``tests/causal_lm_tester.py``.
``test_modeling_common.py`` imports two of the missing modules at its top; :func:`load` provides them:

- ``PACKAGE.generation.test_utils`` with ``GenerationTesterMixin``: an EMPTY class. transformers' generation
  tests (``generate()`` over every decoding mode) are therefore not run by this tier. ``ModelTesterMixin``
  uses the name twice: ``test_generation_tester_mixin_inheritance`` checks that a generative model's test
  class inherits it (ours do), and ``test_bc_cache_name_forward`` compares the two caches with
  ``self._check_caches_are_equal`` only ``if hasattr(self, ...)``: with the empty mixin that comparison is
  skipped and the rest of the test runs. Generation and caches on patched models are tested in
  ``tests/integrations`` instead.
- ``PACKAGE.exporters.test_export`` with ``ExportTesterMixin``: an EMPTY class (``ModelTesterMixin``'s base).
  Its ``torch.export`` tests are therefore not run by this tier (``torch.compile`` tests of the mixin are).

Not run, because they need more of the missing files: the config tester (``test_configuration_common.py``
imports ``tests/utils/test_configuration_utils.py``; it checks config classes, which ``patch_model`` never
touches) and the pipeline tester (``test_pipeline_mixin.py`` needs ``tests/pipelines`` and
``tests/utils/tiny_model_summary.json`` and models on the Hugging Face Hub).
"""

from __future__ import annotations

import importlib
import os
import sys
import types
from pathlib import Path

import transformers

__all__ = ["CACHE_ENV", "PACKAGE", "cache_dir", "load"]

CACHE_ENV = "HYBRID_PACK_TRANSFORMERS_TESTS"
PACKAGE = "hf_release_tests"


def cache_dir() -> Path:
    """The cached ``tests/`` folder of the installed transformers release."""
    root = os.environ.get(CACHE_ENV) or Path(sys.prefix) / "transformers-tests"
    return Path(root) / transformers.__version__ / "tests"


def _module(name: str, **attributes: object) -> types.ModuleType:
    module = types.ModuleType(name)
    module.__dict__.update(attributes)
    sys.modules[name] = module
    return module


def load() -> types.ModuleType:
    """``test_modeling_common`` of the installed release, with the two provided modules in place.

    Raises:
        FileNotFoundError: the release's tests are not cached (the message gives the command that fetches them).
    """
    tests = cache_dir()
    if not (tests / "test_modeling_common.py").is_file():
        raise FileNotFoundError(
            f"{tests}: transformers {transformers.__version__}'s own tests are not cached; fetch them with "
            f"`bash scripts/fetch_transformers_tests.sh {sys.prefix}` (make test's set-up runs it)")
    if PACKAGE not in sys.modules:
        _module(PACKAGE, __path__=[str(tests)], __file__=str(tests / "__init__.py"), __package__=PACKAGE)
        for folder, file, mixin in (("generation", "test_utils", "GenerationTesterMixin"),
                                    ("exporters", "test_export", "ExportTesterMixin")):
            _module(f"{PACKAGE}.{folder}", __path__=[], __package__=f"{PACKAGE}.{folder}")
            name = f"{PACKAGE}.{folder}.{file}"
            _module(name, __package__=f"{PACKAGE}.{folder}", **{mixin: type(mixin, (), {"__module__": name})})
    return importlib.import_module(f"{PACKAGE}.test_modeling_common")
