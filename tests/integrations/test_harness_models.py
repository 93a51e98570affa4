"""The harness on real models: native presets and patched Hugging Face families pass; unpatched families
either leak, with the leak traced to a mixer, or have their raise reported."""

import pytest

from hybrid_pack.integrations.transformers.tiny import tiny_model
from hybrid_pack.modeling import from_preset
from hybrid_pack.testing import check_isolation
from tests.support.torch_path import pure_torch_transformers

LAYOUT = [1, 21, 2, 17]


@pytest.mark.parametrize("preset", ["qwen3-next-tiny", "bamba-tiny"])
def test_native_presets_pass_every_adversarial_layout(preset):
    report = check_isolation(from_preset(preset, vocab_size=256), max_tokens=300)
    assert report.ok, str(report)
    assert all(d.gradient_leak == 0.0 for d in report.documents)


@pytest.mark.parametrize("family, mixer", [("mamba2", "backbone.layers.0.mixer"), ("jamba", "model.layers.0.mamba"),
                                           ("lfm2", "model.layers.0.conv"),
                                           ("qwen3_next", "model.layers.0.linear_attn")])
def test_unpatched_leak_is_found_and_traced_to_the_mixer(family, mixer):
    model = tiny_model(family)
    with pure_torch_transformers(model):
        report = check_isolation(model, lengths=LAYOUT, grads=False)
    assert not report.ok and report.error is None
    assert report.first_leaking_module == mixer, str(report)


def test_unpatched_raise_is_reported():
    report = check_isolation(tiny_model("bamba"), lengths=LAYOUT, grads=False)
    assert not report.ok and report.error and "Error" in report.error
    assert str(report).startswith("ERROR") and report.error in str(report)   # an error, never a LEAK verdict
