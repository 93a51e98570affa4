"""hybrid_pack.modeling: packed rows give every document exactly what it gets alone.

Each layout puts adversarial documents side by side (one-token documents, documents just under,
at and over the op chunk size 64, a long document next to short ones), runs the packed row and
each document alone in float32, and compares logits and gradients.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from hybrid_pack import PackedBoundaries, PackingCollator
from hybrid_pack.modeling import HybridConfig, HybridForCausalLM, VocabRemap, from_preset, list_presets
from hybrid_pack.modeling.presets import preset_config

TINY_PRESETS = ["qwen3-next-tiny", "bamba-tiny", "qwen3-next-tiny-moe"]
VOCAB = 512
LAYOUTS = {
    "adversarial": [1, 64, 1, 65, 63, 130, 2, 1],
    "long_next_to_short": [3, 200, 1],
}
ATOL = 1e-5



def tiny_model(name: str, seed: int = 0, **overrides: object) -> HybridForCausalLM:
    torch.manual_seed(seed)
    return from_preset(name, vocab_size=VOCAB, **overrides).float()


def random_docs(lengths: list[int], seed: int = 1) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (n,), generator=gen) for n in lengths]


def packed_row(docs: list[torch.Tensor]) -> tuple[torch.Tensor, PackedBoundaries]:
    return torch.cat(docs).view(1, -1), PackedBoundaries.from_lengths([len(d) for d in docs])


def summed_next_token_loss(logits: torch.Tensor, ids: torch.Tensor, starts: list[int]) -> torch.Tensor:
    """Sum of next-token CE with no target at any document start (what the collator's labels give)."""
    labels = ids.clone()
    labels[:, starts] = -100
    return F.cross_entropy(logits[0, :-1], labels[0, 1:], ignore_index=-100, reduction="sum")


@pytest.mark.parametrize("name", TINY_PRESETS)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("train", [False, True], ids=["eval", "train"])
def test_packed_logits_equal_each_document_alone(name: str, layout: str, train: bool) -> None:
    model = tiny_model(name).train(train)
    docs = random_docs(LAYOUTS[layout])
    ids, boundaries = packed_row(docs)
    with torch.no_grad():
        packed = model(ids, **boundaries.hf_kwargs()).logits
        for doc, start in zip(docs, boundaries.starts, strict=True):
            alone = model(doc.view(1, -1)).logits
            torch.testing.assert_close(packed[:, start:start + len(doc)], alone, atol=ATOL, rtol=0)


@pytest.mark.parametrize("name", TINY_PRESETS)
def test_packed_gradients_equal_sum_of_document_gradients(name: str) -> None:
    model = tiny_model(name).double().train()
    docs = random_docs(LAYOUTS["adversarial"], seed=2)
    ids, boundaries = packed_row(docs)
    loss = summed_next_token_loss(model(ids, **boundaries.hf_kwargs()).logits, ids, boundaries.starts)
    packed_grads = torch.autograd.grad(loss, list(model.parameters()))

    model.zero_grad()
    for doc in docs:
        doc_ids = doc.view(1, -1)
        summed_next_token_loss(model(doc_ids).logits, doc_ids, [0]).backward()
    for (param_name, param), packed_grad in zip(model.named_parameters(), packed_grads, strict=True):
        expected = param.grad if param.grad is not None else torch.zeros_like(param)
        torch.testing.assert_close(packed_grad, expected, atol=1e-10, rtol=1e-8,
                                   msg=lambda m, name=param_name: f"{name}: {m}")


@pytest.mark.parametrize("name", ["qwen3-next-tiny", "bamba-tiny"])
def test_collator_batch_with_padding_segment(name: str) -> None:
    model = tiny_model(name).eval()
    docs = random_docs([5, 64, 1, 33], seed=3)
    features = [{"input_ids": d.tolist(), "response_mask": [1] * len(d)} for d in docs]
    batch = PackingCollator(pad_to_multiple_of=64)(features)
    assert batch["num_pad_tokens"] == 25 and "response_mask" in batch

    out = model(**batch)
    assert out.logits.shape == (1, 128, VOCAB)
    with torch.no_grad():
        total, count = torch.zeros(()), 0
        for doc, start in zip(docs, PackedBoundaries.from_batch(batch).starts[:-1], strict=True):
            alone = model(doc.view(1, -1), labels=doc.view(1, -1))
            torch.testing.assert_close(out.logits[:, start:start + len(doc)], alone.logits, atol=ATOL, rtol=0)
            if len(doc) > 1:
                total, count = total + alone.loss * (len(doc) - 1), count + len(doc) - 1
    torch.testing.assert_close(out.loss, total / count, atol=1e-6, rtol=1e-5)
    out.loss.backward()
    assert all(p.grad is not None and p.grad.isfinite().all() for p in model.parameters())
    assert out["loss"] is out.loss and out[1] is out.logits


def test_a_leaking_mixer_is_caught() -> None:
    """The comparison above can fail: a Gated DeltaNet that sees the row as one document leaks."""
    model = tiny_model("qwen3-next-tiny").eval()
    mixer = model.model.layers[0].mixer
    original = mixer.forward
    mixer.forward = lambda h, b: original(h, PackedBoundaries.from_lengths([b.total_tokens]))
    docs = random_docs([40, 40], seed=4)
    ids, boundaries = packed_row(docs)
    with torch.no_grad():
        packed = model(ids, **boundaries.hf_kwargs()).logits
        alone = model(docs[1].view(1, -1)).logits
    assert (packed[:, 40:] - alone).abs().max() > 100 * ATOL


def test_inputs_embeds_and_unpacked_rows() -> None:
    model = tiny_model("bamba-tiny").eval()
    docs = random_docs([16, 16], seed=5)
    rows = torch.stack(docs)
    with torch.no_grad():
        by_rows = model(rows).logits
        by_embeds = model(inputs_embeds=model.model.embed_tokens(rows)).logits
        ids, boundaries = packed_row(docs)
        packed = model(ids, boundaries=boundaries).logits
    assert by_rows.shape == (2, 16, VOCAB)
    torch.testing.assert_close(by_embeds, by_rows, atol=0, rtol=0)
    torch.testing.assert_close(packed.view(2, 16, VOCAB), by_rows, atol=ATOL, rtol=0)


def test_bad_forward_arguments_raise() -> None:
    model = tiny_model("qwen3-next-tiny")
    ids, boundaries = packed_row(random_docs([3, 4]))
    with pytest.raises(ValueError, match="^attention_mask"):
        model(ids, attention_mask=torch.ones_like(ids))
    with pytest.raises(ValueError, match="^input_ids"):
        model(ids.view(7, 1), seq_idx=boundaries.seq_idx)
    with pytest.raises(ValueError, match="^boundaries"):
        model(ids[:, :5], boundaries=boundaries)
    with pytest.raises(ValueError, match="^cu_seqlens"):
        model(ids, cu_seqlens=boundaries.cu_seqlens)
    with pytest.raises(ValueError, match="^cu_seq_lens_k"):
        model(ids, cu_seq_lens_k=boundaries.cu_seqlens)


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
])
def test_bad_config_names_the_field(field: str, overrides: dict) -> None:
    with pytest.raises(ValueError, match=f"^{field}:"):
        HybridConfig.from_dict({**HybridConfig().to_dict(), **overrides})


def test_presets() -> None:
    assert {"qwen3-next-tiny", "bamba-tiny", "qwen3-next-small", "bamba-small"} <= set(list_presets())
    assert preset_config("qwen3-next-small").layer_pattern == "GGGA" * 2
    assert set(preset_config("bamba-small").layer_pattern) == {"M", "A"}
    assert preset_config("bamba-tiny", hidden_size=96).hidden_size == 96
    with pytest.raises(ValueError, match="^name: unknown preset"):
        preset_config("qwen3-next-huge")
    model = tiny_model("qwen3-next-tiny")
    assert model.num_parameters() > model.num_parameters(exclude_embeddings=True) > 0


def test_vocab_remap() -> None:
    remap = VocabRemap.from_corpus([[7, 7, 7, 3, 3, 151000], [3, 9]], size=3)
    assert remap.size == 3 and remap.kept_ids.tolist() == [3, 7]
    assert remap.encode([3, 7, 9, 151000, 200000, -100]) == [1, 2, 0, 0, 0, -100]
    ids = torch.tensor([[7, 3, 12]])
    assert torch.equal(remap.decode(remap.encode(ids), unk_token_id=99), torch.tensor([[7, 3, 99]]))
    example = remap.encode_example({"input_ids": [7, 9], "labels": [-100, 3], "prompt": "x"})
    assert example == {"input_ids": [2, 0], "labels": [-100, 1], "prompt": "x"}
    with pytest.raises(ValueError, match="^ids"):
        remap.decode([3], unk_token_id=0)
