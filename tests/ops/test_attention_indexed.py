"""Indexed (DSA-style) attention on packed rows: pools, top-k and attention never reach another document.

The oracle is a per-query loop over one document alone, as transformers' Qwen4Exp indexer computes it: the
query's visible keys cut into pools from the document's first token, pooled indexer keys scored with
``relu(q k)`` summed over heads, the top pools' tokens (ties, which relu makes common, to the earlier pool) plus the
incomplete tail, then softmax attention over exactly those keys. The packed pipeline
(:mod:`hybrid_pack.ops.attention.indexed`) on a packed row must equal that oracle run on every document alone,
forward and backward (float64, 1e-10).
"""

from __future__ import annotations

import pytest
import torch

from hybrid_pack import PackedBoundaries
from hybrid_pack.errors import InputError
from hybrid_pack.ops.attention.indexed import document_pools, document_topk, indexed_attention, visible_tail
from tests import kit

TOL = 1e-10
HEADS, KV_HEADS, DIM, VALUE_DIM = 4, 2, 8, 6
INDEX_HEADS, INDEX_DIM = 2, 4
LAYOUTS = kit.named(
    kit.Layout("one_token_docs", (1, 1, 1)),
    kit.Layout("shorter_than_a_pool", (2, 3, 1, 2)),
    kit.Layout("long_next_to_short", (1, 23, 2, 17, 3)),
    kit.Layout("trailing_padding", (9, 4, 11), num_pad_tokens=5),
    kit.Layout("single_doc", (29,)),
)


def inputs(total: int, seed: int) -> dict[str, torch.Tensor]:
    """Attention q, k, v (a value dim unlike the key's, as MLA has) and the indexer's query and key features."""
    generator = torch.Generator().manual_seed(seed)

    def draw(*shape: int) -> torch.Tensor:
        return torch.randn(1, total, *shape, generator=generator, dtype=torch.float64).requires_grad_()

    return {"q": draw(HEADS, DIM), "k": draw(KV_HEADS, DIM), "v": draw(KV_HEADS, VALUE_DIM),
            "index_q": draw(INDEX_HEADS, INDEX_DIM), "index_k": draw(INDEX_DIM)}


def packed_pipeline(x: dict[str, torch.Tensor], boundaries: PackedBoundaries, pool: int, top: int) -> torch.Tensor:
    """Pools per document, pooled keys, scores, top pools per query within its document, tail, attention."""
    pools = document_pools(boundaries, pool)                                       # [P, pool]
    pooled = x["index_k"][0][pools].mean(dim=1)                                    # [P, Di]
    scores = torch.relu(torch.einsum("thd,pd->thp", x["index_q"][0], pooled)).sum(dim=1)[None]
    chosen = document_topk(scores.detach(), pools[:, -1], boundaries, top)         # [1, T, k]
    tokens = torch.where(chosen[..., None] >= 0, pools[chosen.clamp(min=0)], -1).flatten(2)
    selected = torch.cat([tokens, visible_tail(boundaries, pool)], dim=-1)
    return indexed_attention(x["q"], x["k"], x["v"], selected, boundaries, softmax_scale=0.4)


def oracle_document(x: dict[str, torch.Tensor], pool: int, top: int) -> torch.Tensor:
    """One document alone, query by query, as transformers' Qwen4ExpTextQSAIndexer selects (then dense softmax)."""
    length = x["q"].shape[1]
    group = HEADS // KV_HEADS
    keys, values = (x[name][0].repeat_interleave(group, dim=1) for name in ("k", "v"))
    outputs = []
    for query in range(length):
        visible = torch.arange(query + 1)
        complete = len(visible) // pool
        selected = visible[complete * pool:]
        if complete:
            blocks = visible[:complete * pool].view(complete, pool)
            pooled = x["index_k"][0][blocks].mean(dim=1)
            score = torch.relu(x["index_q"][0, query] @ pooled.T).sum(dim=0)
            best = score.sort(descending=True, stable=True).indices[:top]  # ties: the earlier pool
            selected = torch.cat([blocks[best].flatten(), selected])
        logits = torch.einsum("hd,shd->hs", x["q"][0, query], keys[selected]) * 0.4
        outputs.append(torch.einsum("hs,shd->hd", logits.softmax(dim=-1), values[selected]))
    return torch.stack(outputs)[None]


def oracle(x: dict[str, torch.Tensor], boundaries: PackedBoundaries, pool: int, top: int) -> torch.Tensor:
    pieces = [oracle_document({name: t[:, span] for name, t in x.items()}, pool, top)
              for span in kit.segment_spans(boundaries)]
    return torch.cat(pieces, dim=1)


@pytest.mark.parametrize(("pool", "top"), [(1, 3), (3, 2), (4, 1), (2, 50)])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_packed_equals_each_document_alone(layout: str, pool: int, top: int) -> None:
    boundaries = LAYOUTS[layout].boundaries()
    x = inputs(boundaries.total_tokens, seed=pool * 10 + top)
    got = packed_pipeline(x, boundaries, pool, top)
    want = oracle(x, boundaries, pool, top)
    kit.assert_close(got, want, "output", tol=TOL)
    weight = torch.randn(got.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    names = ("q", "k", "v", "index_q", "index_k")
    got_grads = torch.autograd.grad((got * weight).sum(), [x[n] for n in names], allow_unused=True)
    want_grads = torch.autograd.grad((want * weight).sum(), [x[n] for n in names], allow_unused=True)
    for name, grad, expected in zip(names, got_grads, want_grads, strict=True):
        if name.startswith("index"):  # the selection is discrete: no gradient reaches the indexer through it
            assert grad is None and expected is None
        else:
            kit.assert_close(grad, expected, f"d{name}", tol=TOL)


@pytest.mark.parametrize("layout", ["long_next_to_short", "trailing_padding"])
def test_tied_scores_select_the_same_keys_packed_as_alone(layout: str) -> None:
    """Every score ties (relu of negative products): each query takes its document's earliest pools."""
    boundaries = LAYOUTS[layout].boundaries()
    x = inputs(boundaries.total_tokens, seed=5)
    with torch.no_grad():
        x["index_k"].copy_(x["index_k"].abs())
        x["index_q"].copy_(-x["index_q"].abs())
    kit.assert_close(packed_pipeline(x, boundaries, 2, 3), oracle(x, boundaries, 2, 3), "output", tol=TOL)


def test_top_k_never_selects_another_documents_keys() -> None:
    """Other documents' keys and later keys score highest: every query still selects only its own earlier keys."""
    boundaries = LAYOUTS["long_next_to_short"].boundaries()
    total = boundaries.total_tokens
    segment = boundaries.seq_idx[0].long()
    position = torch.arange(total)
    own = (segment[:, None] == segment[None, :]) & (position[None, :] <= position[:, None])
    scores = torch.where(own, torch.rand(total, total, dtype=torch.float64), 100.0)[None]
    chosen = document_topk(scores, position, boundaries, 5)[0]
    for query in range(total):
        picked = chosen[query][chosen[query] >= 0]
        visible = own[query].nonzero().flatten()
        assert len(picked) == min(5, len(visible))
        assert set(picked.tolist()) <= set(visible.tolist()), f"query {query} picked {picked.tolist()}"
        assert (chosen[query][len(picked):] == -1).all()


def test_top_k_of_a_document_is_the_same_packed_as_alone_when_its_keys_score_minus_infinity() -> None:
    """An indexer that masks a key with -inf: the query still ranks it above every other document's key (masked
    -inf too), so it selects the same keys packed as alone (it picked another document's and dropped them)."""
    own = torch.tensor([[float("-inf"), 1.0, 0.5]] * 3)
    alone = document_topk(own[None], torch.arange(3), PackedBoundaries.from_lengths([3]), 2)[0]
    scores = torch.zeros(1, 6, 6)
    scores[0, 3:, 3:] = own
    packed = document_topk(scores, torch.arange(6), PackedBoundaries.from_lengths([3, 3]), 2)[0, 3:]
    assert torch.where(packed >= 0, packed - 3, packed).tolist() == alone.tolist() == [[0, -1], [1, 0], [1, 2]]


def test_pools_and_tails_start_at_every_document() -> None:
    boundaries = kit.Layout("x", (5, 2, 7), num_pad_tokens=3).boundaries()
    assert document_pools(boundaries, 3).tolist() == [[0, 1, 2], [7, 8, 9], [10, 11, 12], [14, 15, 16]]
    tail = visible_tail(boundaries, 3)[0]
    assert tail[:7].tolist() == [[0, -1], [0, 1], [-1, -1], [3, -1], [3, 4], [5, -1], [5, 6]]
    assert tail[14:].tolist() == [[14, -1], [14, 15], [-1, -1]]


def test_selections_outside_the_document_are_not_attended() -> None:
    boundaries = LAYOUTS["trailing_padding"].boundaries()
    x = inputs(boundaries.total_tokens, seed=3)
    position = torch.arange(boundaries.total_tokens)
    own = torch.stack([position, (position - 1).clamp(min=0)], dim=-1)[None]     # itself and the token before
    foreign = torch.cat([own, (position[None, :, None] + 7) % boundaries.total_tokens], dim=-1)  # + a far token
    first = torch.as_tensor(boundaries.starts)[boundaries.seq_idx[0].long()]
    own = own.masked_fill(own < first[None, :, None], -1)
    past_the_row = torch.full_like(position, boundaries.total_tokens + 2)[None, :, None]
    foreign = torch.cat([foreign, past_the_row, -past_the_row], dim=-1)                  # + indices outside the row
    want = indexed_attention(x["q"], x["k"], x["v"], own, boundaries)
    got = indexed_attention(x["q"], x["k"], x["v"], foreign, boundaries)
    kit.assert_close(got, want, "output", tol=TOL)
    leak = torch.autograd.grad(got[:, :9].sum(), x["k"])[0][:, 9:]
    assert leak.abs().max() == 0, "a query of document 0 reached another document's keys"


def test_a_query_with_no_selection_gets_zeros_and_finite_gradients() -> None:
    boundaries = PackedBoundaries.from_lengths([4])
    x = inputs(4, seed=4)
    indices = torch.tensor([[[-1, -1], [0, -1], [-1, -1], [1, 3]]])
    out = indexed_attention(x["q"], x["k"], x["v"], indices, boundaries)
    assert out[0, 0].abs().max() == 0 and out[0, 2].abs().max() == 0
    grads = torch.autograd.grad(out.sum(), [x["q"], x["k"], x["v"]])
    assert all(torch.isfinite(g).all() for g in grads)


@pytest.mark.parametrize(("call", "match"), [
    (lambda b, x: document_pools(b, 0), "^size: expected a positive int"),
    (lambda b, x: document_topk(torch.zeros(1, 5, 3), torch.arange(3), b, 0), "^k: expected a positive int"),
    (lambda b, x: document_topk(torch.zeros(1, 4, 3), torch.arange(3), b, 1), r"^scores: expected \[1, 5,"),
    (lambda b, x: document_topk(torch.zeros(1, 5, 3), torch.arange(2), b, 1), r"^candidate_last: expected \[3\]"),
    (lambda b, x: indexed_attention(x["q"], x["k"], x["v"], torch.zeros(1, 5, 2), b), "^indices: expected int"),
    (lambda b, x: indexed_attention(x["q3"], x["k"], x["v"], torch.zeros(1, 5, 2, dtype=torch.long), b),
     "^k: 2 key/value heads must divide q's 3 heads"),
    (lambda b, x: indexed_attention(x["q"], x["k"], x["v"][:, :, :1], torch.zeros(1, 5, 2, dtype=torch.long), b),
     "^v: 1 heads must equal k's 2"),
])
def test_bad_input_is_refused(call, match: str) -> None:
    boundaries = PackedBoundaries.from_lengths([2, 3])
    x = inputs(5, seed=0)
    x["q3"] = torch.zeros(1, 5, 3, DIM, dtype=torch.float64)
    with pytest.raises(InputError, match=match):
        call(boundaries, x)
