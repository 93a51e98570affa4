"""HybridConfig: JSON round trips (config and model), every malformed field named."""

from __future__ import annotations

import pytest
import torch

from hybrid_pack.modeling import HybridConfig, HybridForCausalLM
from hybrid_pack.modeling.presets import preset_config


def test_config_json_round_trip(tmp_path) -> None:
    config = preset_config("qwen3-next-tiny-moe", layer_pattern=["gdn", "mamba2", "attn", "gdn"])
    assert config.layer_pattern == "GMAG" and config.num_layers == 4
    config.save(tmp_path)
    loaded = HybridConfig.load(tmp_path / "config.json")
    assert loaded == config and loaded.to_dict() == config.to_dict()

    model = HybridForCausalLM(config)
    model.save_pretrained(tmp_path / "model")
    again = HybridForCausalLM.from_pretrained(tmp_path / "model")
    assert again.config == config
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), again.state_dict().values(), strict=True))


@pytest.mark.parametrize(("field", "overrides"), [
    ("hidden_size", {"hidden_size": 0}),
    ("hidden_size", {"hidden_size": 64.0}),
    ("layer_pattern", {"layer_pattern": "GGXA"}),
    ("layer_pattern", {"layer_pattern": ["gdn", "lstm"]}),
    ("layer_pattern", {"layer_pattern": ""}),
    ("num_key_value_heads", {"num_attention_heads": 4, "num_key_value_heads": 3}),
    ("head_dim", {"head_dim": 31}),
    ("gdn_num_v_heads", {"gdn_num_k_heads": 2, "gdn_num_v_heads": 3}),
    ("mamba_num_groups", {"layer_pattern": "MA", "mamba_num_heads": 4, "mamba_num_groups": 3}),
    ("num_experts_per_tok", {"num_experts": 2, "num_experts_per_tok": 3}),
    ("tie_word_embeddings", {"tie_word_embeddings": "yes"}),
    ("hiden_size", {"hiden_size": 64}),
    ("rms_norm_eps", {"rms_norm_eps": float("nan")}),  # accepted before: every loss NaN
    ("initializer_range", {"initializer_range": float("inf")}),
])
def test_bad_config_names_the_field(field: str, overrides: dict) -> None:
    with pytest.raises(ValueError, match=f"^{field}:"):
        HybridConfig.from_dict({**HybridConfig().to_dict(), **overrides})
