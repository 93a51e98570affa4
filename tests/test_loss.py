"""packed_loss equals the loss of the same documents batched with padding, values and gradients."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from hybrid_pack import PackedBoundaries, PackingCollator, packed_loss
from hybrid_pack.errors import InputError
from hybrid_pack.loss import token_logprobs
from hybrid_pack.parallel import ShardedBoundaries
from tests.kit import assert_close

VOCAB = 37
TOL = 1e-6  # float32 losses and gradients


def _documents(seed: int, lengths: list[int]) -> list[dict[str, torch.Tensor]]:
    """Documents with some labels masked (-100), like prompts in SFT data."""
    g = torch.Generator().manual_seed(seed)
    docs = []
    for n in lengths:
        ids = torch.randint(0, VOCAB, (n,), generator=g)
        labels = ids.clone()
        labels[torch.rand(n, generator=g) < 0.3] = -100
        docs.append({"input_ids": ids, "labels": labels})
    return docs


class TinyLM(torch.nn.Module):
    """Logits depend on the current token only, so packed and padded rows give identical logits."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(VOCAB, 16)
        self.head = torch.nn.Linear(16, VOCAB)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.embed(input_ids)))


def _padded_loss(model: TinyLM, docs: list[dict[str, torch.Tensor]], reduction: str) -> torch.Tensor:
    """Reference: one padded row per document, the usual shift-by-one cross-entropy per row."""
    width = max(len(d["input_ids"]) for d in docs)
    ids = torch.zeros(len(docs), width, dtype=torch.long)
    labels = torch.full((len(docs), width), -100, dtype=torch.long)
    for row, d in enumerate(docs):
        ids[row, :len(d["input_ids"])] = d["input_ids"]
        labels[row, :len(d["labels"])] = d["labels"]
    logits = model(ids)[:, :-1]
    targets = labels[:, 1:]
    per_token = F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1), reduction="none").view_as(targets)
    valid = targets != -100
    if reduction == "token":
        return per_token[valid].sum() / valid.sum()
    rows = valid.sum(1) > 0
    return ((per_token * valid).sum(1)[rows] / valid.sum(1)[rows]).mean()


PARAMETERS = ("embed.weight", "head.weight", "head.bias")


def _grads(model: TinyLM, loss: torch.Tensor) -> list[torch.Tensor]:
    return list(torch.autograd.grad(loss, list(model.parameters())))


@pytest.mark.parametrize("reduction", ["token", "sequence"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_packed_equals_padded(reduction: str, seed: int) -> None:
    docs = _documents(seed, [7, 1, 12, 3, 9, 2])
    model = TinyLM()
    batch = PackingCollator()(docs)
    boundaries = PackedBoundaries.from_batch(batch)
    packed = packed_loss(model(batch["input_ids"]), batch["labels"], boundaries=boundaries, reduction=reduction)
    padded = _padded_loss(model, docs, reduction)
    assert_close(packed, padded, "loss", tol=TOL)
    for name, a, b in zip(PARAMETERS, _grads(model, packed), _grads(model, padded)):
        assert_close(a, b, f"d{name}", tol=TOL)


@pytest.mark.parametrize("reduction", ["token", "sequence"])
def test_gradient_accumulation_with_num_items_in_batch(reduction: str) -> None:
    docs = _documents(3, [5, 8, 2, 11, 4, 6, 3])
    micro_batches = [docs[:3], docs[3:5], docs[5:]]
    collator = PackingCollator(pad_to_multiple_of=8)
    batches = [collator(mb) for mb in micro_batches]
    if reduction == "token":
        num_items = sum(int((b["labels"][:, 1:] != -100).sum()) for b in batches)
    else:
        num_items = sum(int((d["labels"][1:] != -100).any()) for d in docs)
    model = TinyLM()
    accumulated = sum(
        packed_loss(model(b["input_ids"]), b["labels"], boundaries=PackedBoundaries.from_batch(b),
                    reduction=reduction, num_items_in_batch=num_items)
        for b in batches)
    padded = _padded_loss(model, docs, reduction)
    assert_close(accumulated, padded, "loss", tol=TOL)
    for name, a, b in zip(PARAMETERS, _grads(model, accumulated), _grads(model, padded)):
        assert_close(a, b, f"d{name}", tol=TOL)


def test_tensor_num_items_in_batch_matches_int() -> None:
    docs = _documents(4, [6, 9])
    batch = PackingCollator()(docs)
    logits = TinyLM()(batch["input_ids"])
    as_int = packed_loss(logits, batch["labels"], num_items_in_batch=11)
    as_tensor = packed_loss(logits, batch["labels"], num_items_in_batch=torch.tensor(11))
    assert_close(as_int, as_tensor, "loss", tol=TOL)


def test_collator_labels_never_predict_across_documents() -> None:
    """The collator masks every document's first label, so boundaries change nothing; raw labels need them."""
    docs = [{"input_ids": d["input_ids"]} for d in _documents(5, [4, 6, 5])]
    batch = PackingCollator()(docs)
    boundaries = PackedBoundaries.from_batch(batch)
    starts = boundaries.cu_seqlens[:-1].long()
    assert (batch["labels"][0, starts] == -100).all()

    model = TinyLM()
    logits = model(batch["input_ids"])
    with_bounds = packed_loss(logits, batch["labels"], boundaries=boundaries)
    assert_close(packed_loss(logits, batch["labels"]), with_bounds, "loss without boundaries", tol=TOL)
    assert_close(with_bounds, _padded_loss(model, [{**d, "labels": d["input_ids"]} for d in docs], "token"), "loss",
                 tol=TOL)

    raw = batch["input_ids"]
    assert_close(packed_loss(logits, raw, boundaries=boundaries), with_bounds, "loss of raw labels", tol=TOL)
    assert not torch.allclose(packed_loss(logits, raw), with_bounds)


def test_padding_segment_and_single_token_documents_are_excluded_from_sequence_mean() -> None:
    docs = _documents(6, [1, 5, 1, 7])
    batch = PackingCollator(pack_length=32)(docs)
    boundaries = PackedBoundaries.from_batch(batch)
    model = TinyLM()
    packed = packed_loss(model(batch["input_ids"]), batch["labels"], boundaries=boundaries, reduction="sequence")
    assert_close(packed, _padded_loss(model, docs[1::2], "sequence"), "loss", tol=TOL)


def test_bf16_logits_accumulate_in_fp32() -> None:
    docs = _documents(7, [300, 200, 500])
    batch = PackingCollator()(docs)
    logits = (TinyLM()(batch["input_ids"]).detach() * 4).bfloat16()
    loss = packed_loss(logits, batch["labels"])
    assert loss.dtype == torch.float32
    exact = packed_loss(logits.double(), batch["labels"])
    assert_close(loss.double(), exact, "loss", tol=5e-7)


def test_no_targets_gives_zero_loss_and_gradient() -> None:
    model = TinyLM()
    ids = torch.randint(0, VOCAB, (1, 5))
    loss = packed_loss(model(ids), torch.full((1, 5), -100))
    assert loss.item() == 0.0
    assert all((g == 0).all() for g in _grads(model, loss))


def test_token_logprobs_are_aligned_with_tokens() -> None:
    docs = _documents(8, [4, 3])
    batch = PackingCollator()(docs)
    logits = TinyLM()(batch["input_ids"]).detach()
    logprobs, mask = token_logprobs(logits, batch["labels"], boundaries=PackedBoundaries.from_batch(batch))
    labels = batch["labels"][0]
    for t in range(1, labels.shape[0]):
        if labels[t] != -100:
            expected = torch.log_softmax(logits[0, t - 1], -1)[labels[t]]
            assert_close(logprobs[0, t], expected, f"logprob of token {t}", tol=TOL)
            assert mask[0, t]
        else:
            assert logprobs[0, t] == 0 and not mask[0, t]
    assert not mask[0, 0] and not mask[0, 4]


def test_bad_inputs_raise() -> None:
    logits = torch.zeros(1, 4, VOCAB)
    labels = torch.zeros(1, 4, dtype=torch.long)
    with pytest.raises(ValueError, match="reduction"):
        packed_loss(logits, labels, reduction="mean")
    with pytest.raises(ValueError, match="boundaries"):
        packed_loss(logits, labels, reduction="sequence")
    with pytest.raises(ValueError, match="labels"):
        packed_loss(logits, labels[:, :3])
    with pytest.raises(ValueError, match="labels"):
        packed_loss(logits, labels.float())
    with pytest.raises(ValueError, match="boundaries"):
        packed_loss(logits, labels, boundaries=PackedBoundaries.from_lengths([2, 3]))
    with pytest.raises(ValueError, match="num_items_in_batch"):
        packed_loss(logits, labels, num_items_in_batch=0)


def test_unshifted_labels_on_a_context_parallel_shard_raise() -> None:
    row = PackedBoundaries.from_document_lengths([3, 5])
    shard = ShardedBoundaries.from_row(row, group=None, rank=0, world_size=2)
    logits, labels = torch.randn(1, 4, 7), torch.randint(0, 7, (1, 4))
    with pytest.raises(InputError, match="shift_labels"):
        packed_loss(logits, labels, boundaries=shard)
    with pytest.raises(InputError, match="^num_items_in_batch: a context-parallel shard's loss"):
        packed_loss(logits, labels, boundaries=shard, shifted=True)  # would divide by the shard's own count
    assert torch.isfinite(packed_loss(logits, labels, boundaries=shard, shifted=True, num_items_in_batch=6))
