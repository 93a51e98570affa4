"""patch_model on every supported Hugging Face hybrid family (tiny random models, float32, CPU).

For each family: the patched model keeps the documents of a packed row apart, forward and backward
(one-token documents, a document longer than the chunk size, a trailing padding segment); a packed
row of one document gives the unpatched model's logits; ordinary padded batches are untouched; and
the unpatched model raises or leaks on the same packed batch, so the patch is what makes it safe.
"""

from __future__ import annotations

import inspect
import re
import warnings
from collections.abc import Iterator
from copy import deepcopy

import pytest
import torch

pytest.importorskip("transformers")

from hybrid_pack.boundaries import PackedBoundaries
from hybrid_pack.integrations.transformers import patch_model
from hybrid_pack.integrations.transformers.tiny import (
    CHUNK,
    TINY_CONFIGS,
    VOCAB,
    tiny_config,
    tiny_model,
)
from hybrid_pack.testing import check_isolation
from tests.support.torch_path import pure_torch_transformers

FAMILIES = sorted(TINY_CONFIGS)
# One-token documents, one longer than the chunk size (16), conv-width edges, a trailing padding segment.
LENGTHS = [1, CHUNK + 5, 2, 4]
NUM_PAD = 3


@pytest.fixture(autouse=True)
def _quiet() -> Iterator[None]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def _ids(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, VOCAB, shape, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("family", FAMILIES)
def test_patched_model_is_isolated(family: str) -> None:
    model = patch_model(tiny_model(family))
    report = check_isolation(model, lengths=LENGTHS, num_pad_tokens=NUM_PAD, grads=True, atol=1e-5)
    assert report.ok, str(report)


@pytest.mark.parametrize("family", FAMILIES)
def test_patched_matches_unpatched(family: str) -> None:
    reference, model = tiny_model(family), patch_model(tiny_model(family))
    ids = _ids(1, 2 * CHUNK + 3)
    padded = _ids(2, 13, seed=1)
    mask = torch.ones(2, 13, dtype=torch.long)
    mask[1, :4] = 0
    with torch.no_grad(), pure_torch_transformers(reference):
        expected = reference(input_ids=ids).logits
        packed = model(input_ids=ids, **PackedBoundaries.from_lengths([ids.shape[1]]).hf_kwargs()).logits
        ordinary = model(input_ids=ids).logits
        padded_expected = reference(input_ids=padded, attention_mask=mask).logits
        padded_patched = model(input_ids=padded, attention_mask=mask).logits
    # float32 round-off of two algorithms (transformers' and the packed ops'); MoE routers add up to 1.1e-5
    torch.testing.assert_close(packed, expected, rtol=1e-5, atol=2e-5)
    torch.testing.assert_close(ordinary, expected, rtol=0, atol=0)
    torch.testing.assert_close(padded_patched, padded_expected, rtol=0, atol=0)


@pytest.mark.parametrize("family", FAMILIES)
def test_unpatched_model_raises_or_leaks(family: str) -> None:
    report = check_isolation(tiny_model(family), lengths=LENGTHS, num_pad_tokens=NUM_PAD, grads=False,
                             per_layer=False, atol=1e-5)
    assert report.error is not None or not report.ok, str(report)


@pytest.mark.parametrize("family", FAMILIES)
def test_restarting_position_ids_alone_mark_a_packed_row(family: str) -> None:
    """The collator's keys and restarting ``position_ids`` alone give the same packed call (families whose
    forward takes ``position_ids``; the Mamba-1 / Mamba-2-only models take none)."""
    model = patch_model(tiny_model(family))
    if "position_ids" not in inspect.signature(model.forward).parameters:
        pytest.skip(f"{type(model).__name__}.forward takes no position_ids")
    boundaries = PackedBoundaries.from_lengths(LENGTHS)
    ids = _ids(1, boundaries.total_tokens)
    with torch.no_grad():
        full = model(input_ids=ids, **boundaries.hf_kwargs()).logits
        positions_only = model(input_ids=ids, position_ids=boundaries.position_ids).logits
    torch.testing.assert_close(positions_only, full, rtol=0, atol=0)


def test_gradient_checkpointing_keeps_documents_apart() -> None:
    model = patch_model(tiny_model("qwen3_next"))
    boundaries = PackedBoundaries.from_lengths(LENGTHS)
    embeds = model.get_input_embeddings()(_ids(1, boundaries.total_tokens)).detach()

    def grad_of_first_doc(checkpointing: bool) -> torch.Tensor:
        if checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.train()
        x = embeds.clone().requires_grad_(True)
        model(inputs_embeds=x, **boundaries.hf_kwargs()).logits[0, : sum(LENGTHS[:2])].sum().backward()
        return x.grad

    plain = grad_of_first_doc(False)
    checkpointed = grad_of_first_doc(True)
    assert checkpointed[0, sum(LENGTHS[:2]):].abs().max() == 0
    torch.testing.assert_close(checkpointed, plain, rtol=1e-5, atol=1e-6)


def test_bad_packed_calls_raise() -> None:
    model = patch_model(tiny_model("lfm2"))
    boundaries = PackedBoundaries.from_lengths([3, 4])
    ids = _ids(1, 7)
    with pytest.raises(ValueError, match="attention_mask"):
        model(input_ids=ids, attention_mask=torch.ones_like(ids), **boundaries.hf_kwargs())
    with pytest.raises(ValueError, match="batch size 2"):
        model(input_ids=_ids(2, 7), **boundaries.hf_kwargs())
    with pytest.raises(ValueError, match="use_cache"):
        model(input_ids=ids, use_cache=True, **boundaries.hf_kwargs())
    with pytest.raises(ValueError, match="cu_seq_lens_k"):
        model(input_ids=ids, **{**boundaries.hf_kwargs(), "cu_seq_lens_k": torch.tensor([0, 2, 7], dtype=torch.int32)})


def test_unsupported_model_is_refused() -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    llama = LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=1))
    with pytest.raises(ValueError, match="not a supported hybrid family.*Qwen3-Next.*Jamba"):
        patch_model(llama)


def test_patch_is_idempotent() -> None:
    model = patch_model(tiny_model("mamba2"))
    hooks = {name: len(m._forward_pre_hooks) for name, m in model.named_modules()}
    mixer_forward = model.backbone.layers[0].mixer.forward
    assert patch_model(model) is model
    assert {name: len(m._forward_pre_hooks) for name, m in model.named_modules()} == hooks
    assert model.backbone.layers[0].mixer.forward is mixer_forward


def test_a_copy_of_a_patched_model_runs_its_own_weights() -> None:
    """The patched forwards are bound to their module, so a deep copy (a reference model, an EMA) is its own."""
    model = patch_model(tiny_model("bamba"))
    copy = deepcopy(model)
    with torch.no_grad():
        for p in copy.parameters():
            p.add_(0.1)
    batch = PackedBoundaries.from_lengths(LENGTHS).hf_kwargs()
    ids = _ids(1, sum(LENGTHS))
    with torch.no_grad(), pure_torch_transformers(copy):
        assert (copy(input_ids=ids, **batch).logits - model(input_ids=ids, **batch).logits).abs().max() > 1e-3
        torch.testing.assert_close(copy(input_ids=ids).logits, copy.base_model(input_ids=ids).last_hidden_state
                                   @ copy.lm_head.weight.T, rtol=1e-5, atol=1e-5)


def test_patch_model_does_not_warn_on_the_installed_transformers() -> None:
    """The installed transformers (the current release) is inside the tested range the hf extra pins."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        patch_model(tiny_model("lfm2"))
    assert not [w for w in caught if "patch_model is tested with transformers" in str(w.message)]


@pytest.mark.parametrize("key", ["past_key_values", "cache"])
def test_a_cache_is_refused_on_a_packed_call(key: str) -> None:
    """transformers 5.24 renamed ``past_key_values`` / ``cache_params`` to ``cache``: every name is refused."""
    from transformers import DynamicCache

    model = patch_model(tiny_model("qwen3_next"))
    cache = DynamicCache(config=model.config)
    with pytest.raises(ValueError, match=f"{key}: a KV / state cache cannot be used with a packed batch"):
        model(input_ids=_ids(1, 7), **{key: cache}, **PackedBoundaries.from_lengths([3, 4]).hf_kwargs())


def test_docs_family_table_is_the_code() -> None:
    from pathlib import Path

    from hybrid_pack.integrations.transformers.family_table import BEGIN, END, markdown_family_table

    text = (Path(__file__).parents[2] / "docs" / "transformers.md").read_text()
    documented = text[text.index(BEGIN):text.index(END) + len(END)]
    assert documented == markdown_family_table(), \
        "regenerate it: python -m hybrid_pack.integrations.transformers.family_table"


@pytest.mark.parametrize("model_type", ["recurrent_gemma", "rwkv", "xlstm", "zaya"])
def test_a_refused_family_names_its_missing_layer_kind(model_type: str) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM

    from hybrid_pack.errors import UnsupportedModelError
    from hybrid_pack.integrations.transformers.families import REFUSED

    config = AutoConfig.for_model(model_type, vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2,
                                  num_attention_heads=2, num_key_value_heads=1, intermediate_size=64)
    with pytest.raises(UnsupportedModelError, match=REFUSED[model_type].split(" (")[0]):
        patch_model(AutoModelForCausalLM.from_config(config))


@pytest.mark.parametrize(("model_type", "language_model"), [("lfm2_vl", "Lfm2 (lfm2)"), ("lfm3_vl", "Lfm3 (lfm3)")])
def test_a_multimodal_model_around_a_served_language_model_is_refused_naming_it(model_type: str,
                                                                                language_model: str) -> None:
    """Its images come in another form than the packed batches: refused before any call, the fix named."""
    from transformers import AutoConfig, AutoModelForImageTextToText

    from hybrid_pack.errors import UnsupportedModelError

    config = AutoConfig.for_model(model_type, text_config=tiny_config(model_type.removesuffix("_vl")).to_dict())
    for name, value in {"hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1,
                        "num_attention_heads": 2}.items():
        setattr(config.vision_config, name, value)
    model = AutoModelForImageTextToText.from_config(config)
    with pytest.raises(UnsupportedModelError, match=rf"language model is {re.escape(language_model)}, served, "
                                                    r"but its image / audio inputs .*AutoModelForCausalLM"):
        patch_model(model)


@pytest.mark.parametrize("model", [torch.nn.Linear(2, 2), "musicgen"], ids=["no config", "two text configs"])
def test_a_model_of_no_family_is_refused_as_unsupported(model: object) -> None:
    from hybrid_pack.errors import UnsupportedModelError

    if model == "musicgen":
        from transformers import AutoConfig

        model = torch.nn.Module()
        model.config = AutoConfig.for_model("musicgen")
    with pytest.raises(UnsupportedModelError, match="is not a supported hybrid family"):
        patch_model(model)
