"""HybridForCausalLM: packed rows give every document exactly what it gets alone.

Each layout puts adversarial documents side by side (one-token documents, documents just under,
at and over the op chunk size 64, a long document next to short ones), runs the packed row and
each document alone in float32, and compares logits and gradients.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from hybrid_pack import PackedBoundaries, PackingCollator
from hybrid_pack.errors import InputError
from hybrid_pack.modeling import HybridForCausalLM, from_preset
from tests import kit
from tests.kit import MODEL_LAYOUTS as LAYOUTS

TINY_PRESETS = ["qwen3-next-tiny", "bamba-tiny", "qwen3-next-tiny-moe"]
VOCAB = 512
LOGITS_TOL = 2.5e-6  # float32 logits below 3 in magnitude: within 1e-5


def tiny_model(name: str, seed: int = 0, **overrides: object) -> HybridForCausalLM:
    torch.manual_seed(seed)
    return from_preset(name, vocab_size=VOCAB, **overrides).float()


def random_docs(lengths: tuple[int, ...], seed: int = 1) -> list[torch.Tensor]:
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
    docs = random_docs(LAYOUTS[layout].lengths)
    ids, boundaries = packed_row(docs)
    with torch.no_grad():
        packed = model(ids, **boundaries.hf_kwargs()).logits
        for doc, start in zip(docs, boundaries.starts, strict=True):
            alone = model(doc.view(1, -1)).logits
            kit.assert_close(packed[:, start:start + len(doc)], alone, f"logits of document at {start}", tol=LOGITS_TOL)


@pytest.mark.parametrize("name", TINY_PRESETS)
def test_packed_gradients_equal_sum_of_document_gradients(name: str) -> None:
    model = tiny_model(name).double().train()
    docs = random_docs(LAYOUTS["adversarial"].lengths, seed=2)
    ids, boundaries = packed_row(docs)
    loss = summed_next_token_loss(model(ids, **boundaries.hf_kwargs()).logits, ids, boundaries.starts)
    packed_grads = torch.autograd.grad(loss, list(model.parameters()))

    model.zero_grad()
    for doc in docs:
        doc_ids = doc.view(1, -1)
        summed_next_token_loss(model(doc_ids).logits, doc_ids, [0]).backward()
    for (param_name, param), packed_grad in zip(model.named_parameters(), packed_grads, strict=True):
        expected = param.grad if param.grad is not None else torch.zeros_like(param)
        kit.assert_close(packed_grad, expected, param_name, tol=1e-10)


@pytest.mark.parametrize("name", ["qwen3-next-tiny", "bamba-tiny"])
def test_collator_batch_with_padding_segment(name: str) -> None:
    model = tiny_model(name).eval()
    docs = random_docs((5, 64, 1, 33), seed=3)
    features = [{"input_ids": d.tolist(), "response_mask": [1] * len(d)} for d in docs]
    batch = PackingCollator(pad_to_multiple_of=64)(features)
    assert batch["num_pad_tokens"] == 25 and "response_mask" in batch

    out = model(**batch)
    assert out.logits.shape == (1, 128, VOCAB)
    with torch.no_grad():
        total, count = torch.zeros(()), 0
        for doc, start in zip(docs, PackedBoundaries.from_batch(batch).starts[:-1], strict=True):
            alone = model(doc.view(1, -1), labels=doc.view(1, -1))
            kit.assert_close(out.logits[:, start:start + len(doc)], alone.logits, f"logits of document at {start}",
                             tol=LOGITS_TOL)
            if len(doc) > 1:
                total, count = total + alone.loss * (len(doc) - 1), count + len(doc) - 1
    kit.assert_close(out.loss, total / count, "loss", tol=1e-6)
    out.loss.backward()
    assert all(p.grad is not None and p.grad.isfinite().all() for p in model.parameters())
    assert out["loss"] is out.loss and out[1] is out.logits


def test_a_leaking_mixer_is_caught() -> None:
    """The comparison above can fail: a Gated DeltaNet that sees the row as one document leaks."""
    model = tiny_model("qwen3-next-tiny").eval()
    mixer = model.model.layers[0].mixer
    original = mixer.forward
    mixer.forward = lambda h, b: original(h, PackedBoundaries.from_lengths([b.total_tokens]))
    docs = random_docs((40, 40), seed=4)
    ids, boundaries = packed_row(docs)
    with torch.no_grad():
        packed = model(ids, **boundaries.hf_kwargs()).logits
        alone = model(docs[1].view(1, -1)).logits
    assert (packed[:, 40:] - alone).abs().max() > 1e-3


def test_inputs_embeds_and_unpacked_rows() -> None:
    model = tiny_model("bamba-tiny").eval()
    docs = random_docs((16, 16), seed=5)
    rows = torch.stack(docs)
    with torch.no_grad():
        by_rows = model(rows).logits
        by_embeds = model(inputs_embeds=model.model.embed_tokens(rows)).logits
        ids, boundaries = packed_row(docs)
        packed = model(ids, boundaries=boundaries).logits
    assert by_rows.shape == (2, 16, VOCAB)
    assert torch.equal(by_embeds, by_rows)
    kit.assert_close(packed.view(2, 16, VOCAB), by_rows, "logits", tol=LOGITS_TOL)


def test_bad_forward_arguments_raise() -> None:
    model = tiny_model("qwen3-next-tiny")
    ids, boundaries = packed_row(random_docs((3, 4)))
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
    rows = torch.arange(12).view(2, 6)  # two documents as rows: labels [6, 2] were read row-major, silently
    with pytest.raises(ValueError, match=r"^labels: expected the input's shape \[B, T\] = \[2, 6\]"):
        model(rows, labels=rows.T)
    with pytest.raises(ValueError, match="^shift_labels"):
        model(ids, shift_labels=ids.view(-1))



def test_logits_read_later_are_those_of_the_forward_pass() -> None:
    """With labels, the logits are built on first read: read after the autocast block they came back float32
    (5e-3 off what the forward gave without labels), and read after an optimizer step they used the new head."""
    model = tiny_model("qwen3-next-tiny")
    features = [{"input_ids": d.tolist()} for d in random_docs((5, 9, 3))]
    batch = PackingCollator()(features)
    unlabelled = {k: v for k, v in batch.items() if k != "labels"}
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected = model(**unlabelled).logits
        out = model(**batch)
    assert out.computed_logits is None and expected.dtype == torch.bfloat16
    torch.testing.assert_close(out.logits, expected, rtol=0, atol=0)

    out = model(**batch)
    out.loss.backward()
    torch.optim.SGD(model.parameters(), lr=1.0).step()
    with pytest.raises(InputError, match="logits: the LM head's weight changed in place"):
        _ = out.logits
    assert model(**batch).logits.shape == expected.shape  # a new forward pass reads them again

    with torch.inference_mode():  # read outside it, they raised (inference tensors saved for backward)
        out = model(**batch)
    assert not out.logits.requires_grad and out.logits.is_inference()
    with torch.no_grad():
        out = model(**batch)
    assert not out.logits.requires_grad  # read outside no_grad, they took a gradient the forward never had
    out = model(**batch)
    with torch.no_grad():
        first = out.logits  # a first read under no_grad kept logits without their gradient
    assert first.requires_grad
