"""Named model presets: JSON :class:`HybridConfig` files shipped as the ``hybrid_pack.presets`` package.

The files live in the repository's top-level ``models/`` folder (``models/<name>.json``), which
installs as ``hybrid_pack.presets``; see docs/models.md for the table of presets.
"""

from __future__ import annotations

import json
from importlib import resources
from importlib.resources.abc import Traversable
from pathlib import Path
from typing import Any

from hybrid_pack.errors import InputError
from hybrid_pack.modeling.config import HybridConfig
from hybrid_pack.modeling.model import HybridForCausalLM

__all__ = ["list_presets", "preset_config", "from_preset"]

PRESET_PACKAGE = "hybrid_pack.presets"


def _preset_dir() -> Traversable:
    """The installed ``hybrid_pack.presets`` package (the repository's ``models/`` folder)."""
    return resources.files(PRESET_PACKAGE)


def list_presets() -> list[str]:
    """Names of the bundled presets, sorted (``"bamba-tiny"``, ``"qwen3-next-tiny"``, ...)."""
    files = _preset_dir().iterdir()
    return sorted(f.name.removesuffix(".json") for f in files if f.name.endswith(".json"))


def preset_config(name: str, **overrides: Any) -> HybridConfig:
    """The :class:`HybridConfig` of preset ``name`` (or of a JSON file path), with fields overridden.

    Raises:
        ValueError: unknown preset (the message lists them) or an invalid override.
    """
    path = Path(name)
    if path.suffix == ".json" and path.is_file():
        data = json.loads(path.read_text())
    else:
        names = list_presets()
        if name not in names:
            raise InputError(f"name: unknown preset {name!r}; presets are {names} (or pass a path to a .json config)")
        data = json.loads(_preset_dir().joinpath(f"{name}.json").read_text())
    return HybridConfig.from_dict({**data, **overrides})


def from_preset(name: str, **overrides: Any) -> HybridForCausalLM:
    """A freshly initialised model of preset ``name``, e.g. ``from_preset("bamba-tiny", vocab_size=4096)``."""
    return HybridForCausalLM(preset_config(name, **overrides))
