"""The model presets: names, layer patterns, overrides."""

from __future__ import annotations

import pytest

from hybrid_pack.modeling import from_preset, list_presets
from hybrid_pack.modeling.presets import preset_config


def test_presets() -> None:
    assert {"qwen3-next-tiny", "bamba-tiny", "qwen3-next-small", "bamba-small"} <= set(list_presets())
    assert preset_config("qwen3-next-small").layer_pattern == "GGGA" * 2
    assert set(preset_config("bamba-small").layer_pattern) == {"M", "A"}
    assert preset_config("bamba-tiny", hidden_size=96).hidden_size == 96
    with pytest.raises(ValueError, match="^name: unknown preset"):
        preset_config("qwen3-next-huge")
    model = from_preset("qwen3-next-tiny", vocab_size=512)
    assert model.num_parameters() > model.num_parameters(exclude_embeddings=True) > 0
