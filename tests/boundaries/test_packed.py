"""PackedBoundaries: every constructor agrees, conversions round-trip, bad input names its field."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hybrid_pack import PackedBoundaries
from hybrid_pack.testing import Layout


def test_from_lengths_builds_every_form():
    b = PackedBoundaries.from_lengths([3, 1, 2])
    assert b.cu_seqlens.tolist() == [0, 3, 4, 6] and b.cu_seqlens.dtype == torch.int32
    assert b.seq_idx.tolist() == [[0, 0, 0, 1, 2, 2]] and b.seq_idx.dtype == torch.int32
    assert b.position_ids.tolist() == [[0, 1, 2, 0, 0, 1]] and b.position_ids.dtype == torch.int64
    assert b.max_seqlen == 3 and type(b.max_seqlen) is int
    assert (b.num_docs, b.total_tokens, b.lengths, b.num_pad_tokens) == (3, 6, [3, 1, 2], 0)
    assert b.starts == [0, 3, 4]


def test_padding_segment_is_last_and_not_a_document():
    b = PackedBoundaries.from_lengths([2, 5, 4], num_pad_tokens=4)
    assert b.num_docs == 2 and b.num_segments == 3 and b.lengths == [2, 5]
    assert b.cu_seqlens.tolist() == [0, 2, 7, 11] and b.total_tokens == 11
    assert b.max_seqlen == 5


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(1, 40), min_size=1, max_size=30), st.booleans())
def test_every_constructor_agrees(lengths, pad):
    num_pad = lengths[-1] if pad else 0
    b = PackedBoundaries.from_lengths(lengths, num_pad_tokens=num_pad)
    documents = lengths[:-1] if pad else lengths
    for other in (PackedBoundaries.from_document_lengths(documents, num_pad_tokens=num_pad),
                  Layout("drawn", tuple(documents), num_pad_tokens=num_pad).boundaries(),
                  PackedBoundaries.from_cu_seqlens(b.cu_seqlens, num_pad_tokens=num_pad),
                  PackedBoundaries.from_seq_idx(b.seq_idx, num_pad_tokens=num_pad),
                  PackedBoundaries.from_position_ids(b.position_ids, num_pad_tokens=num_pad),
                  PackedBoundaries.from_batch({**b.hf_kwargs(), "num_pad_tokens": num_pad})):
        assert other.segment_lengths == b.segment_lengths and other.num_pad_tokens == num_pad
        for field in ("cu_seqlens", "seq_idx", "position_ids"):
            assert torch.equal(getattr(other, field), getattr(b, field))
    assert b.max_seqlen == max(lengths)


def test_from_batch_prefers_cu_seqlens_and_checks_agreement():
    b = PackedBoundaries.from_lengths([2, 3])
    batch = {**b.hf_kwargs(), "input_ids": torch.zeros(1, 5, dtype=torch.long)}
    assert PackedBoundaries.from_batch(batch).segment_lengths == (2, 3)
    wrong = dict(batch, seq_idx=torch.tensor([[0, 0, 0, 1, 1]], dtype=torch.int32))
    with pytest.raises(ValueError, match="seq_idx"):
        PackedBoundaries.from_batch(wrong)
    with pytest.raises(ValueError, match="max_length_q"):
        PackedBoundaries.from_batch(dict(batch, max_length_q=9))
    with pytest.raises(ValueError, match="input_ids"):
        PackedBoundaries.from_batch(dict(batch, input_ids=torch.zeros(1, 6, dtype=torch.long)))
    only_pos = {"position_ids": b.position_ids}
    assert PackedBoundaries.from_batch(only_pos).segment_lengths == (2, 3)
    with pytest.raises(ValueError, match="cu_seq_lens_q"):
        PackedBoundaries.from_batch({"input_ids": torch.zeros(1, 3)})
    # without host_boundaries, dtypes were not checked: float positions truncated to the right ints passed, and a
    # list of the right values was called "disagree"
    with pytest.raises(ValueError, match="position_ids: expected a torch.int64 tensor .* got torch.float32"):
        PackedBoundaries.from_batch(dict(batch, position_ids=b.position_ids + 0.4))
    with pytest.raises(ValueError, match="seq_idx: expected a torch.int32 tensor .* got list"):
        PackedBoundaries.from_batch(dict(batch, seq_idx=b.seq_idx.tolist()))
    with pytest.raises(ValueError, match="batch: expected the collated batch .* got list"):
        PackedBoundaries.from_batch([{"input_ids": [1, 2]}])


def test_to_keeps_max_seqlen_an_int():
    b = PackedBoundaries.from_lengths([4, 1]).to("cpu")
    assert type(b.max_seqlen) is int and b.device.type == "cpu"


def test_hf_kwargs_names():
    kw = PackedBoundaries.from_lengths([1, 2]).hf_kwargs()
    assert set(kw) == {"cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "seq_idx", "position_ids"}
    assert kw["max_length_q"] == kw["max_length_k"] == 2


@pytest.mark.parametrize("make, field", [
    (lambda: PackedBoundaries.from_lengths([2, 0, 1]), "lengths"),
    (lambda: PackedBoundaries.from_lengths([]), "lengths"),
    (lambda: PackedBoundaries.from_lengths([2.5]), "lengths"),
    (lambda: PackedBoundaries.from_lengths([2, 3], num_pad_tokens=2), "num_pad_tokens"),
    (lambda: PackedBoundaries.from_cu_seqlens(torch.tensor([0, 3, 2], dtype=torch.int32)), "cu_seqlens"),
    (lambda: PackedBoundaries.from_cu_seqlens(torch.tensor([0, 3, 3], dtype=torch.int32)), "cu_seqlens"),
    (lambda: PackedBoundaries.from_cu_seqlens(torch.tensor([1, 3], dtype=torch.int32)), "cu_seqlens"),
    (lambda: PackedBoundaries.from_cu_seqlens(torch.tensor([0.0, 3.0])), "cu_seqlens"),
    (lambda: PackedBoundaries.from_cu_seqlens(torch.tensor([[0, 3]])), "cu_seqlens"),
    (lambda: PackedBoundaries.from_seq_idx(torch.tensor([[0, 0, 1, 0]])), "seq_idx"),
    (lambda: PackedBoundaries.from_seq_idx(torch.tensor([[0, 1, 1, 3]])), "seq_idx"),
    (lambda: PackedBoundaries.from_seq_idx(torch.tensor([[1, 1]])), "seq_idx"),
    (lambda: PackedBoundaries.from_seq_idx(torch.zeros(2, 3, dtype=torch.int32)), "seq_idx"),
    (lambda: PackedBoundaries.from_position_ids(torch.tensor([[0, 1, 3]])), "position_ids"),
    (lambda: PackedBoundaries.from_position_ids(torch.tensor([[1, 2, 3]])), "position_ids"),
    (lambda: PackedBoundaries.from_position_ids(torch.tensor([[0.0, 1.0]])), "position_ids"),
    # fla's chunk index of chunk_size 0 was an empty tensor (5 tokens in no chunk), kept on the object
    (lambda: PackedBoundaries.from_lengths([3, 2]).kernel_chunk_index(0), "chunk_size: expected a positive int"),
    (lambda: PackedBoundaries.from_lengths([3, 2]).kernel_chunk_index(2.5), "chunk_size"),
    (lambda: PackedBoundaries.from_lengths([3, 2]).chunk_layout(True), "chunk_size"),
    # a float count was blamed on the lengths; a bool was taken as 1
    (lambda: PackedBoundaries.from_document_lengths([1, 2], num_pad_tokens=2.5), "num_pad_tokens: expected an int"),
    (lambda: PackedBoundaries.from_document_lengths([1, 2], num_pad_tokens=True), "num_pad_tokens: expected an int"),
    (lambda: PackedBoundaries.from_lengths([1, 2], device="gpu0"), "device: expected cpu, cuda"),
    (lambda: PackedBoundaries.from_cu_seqlens(torch.tensor([0, 2**31 - 1, 2**31])), "cu_seqlens: expected a total"),
])
def test_malformed_input_names_the_field(make, field):
    with pytest.raises(ValueError, match=field):
        make()


def test_direct_construction_checks_dtypes_and_shapes():
    b = PackedBoundaries.from_lengths([2, 2])
    with pytest.raises(ValueError, match="cu_seqlens"):
        PackedBoundaries(b.cu_seqlens.long(), b.seq_idx, b.position_ids, 2, (2, 2))
    with pytest.raises(ValueError, match="seq_idx"):
        PackedBoundaries(b.cu_seqlens, b.seq_idx[:, :3], b.position_ids, 2, (2, 2))
    with pytest.raises(ValueError, match="max_seqlen"):
        PackedBoundaries(b.cu_seqlens, b.seq_idx, b.position_ids, torch.tensor(2), (2, 2))


def test_numpy_and_list_inputs():
    assert PackedBoundaries.from_cu_seqlens(np.array([0, 2, 5])).segment_lengths == (2, 3)
    assert PackedBoundaries.from_seq_idx([0, 0, 1]).segment_lengths == (2, 1)


def test_a_view_first_built_in_inference_mode_serves_training_calls_after_it():
    """The layouts the ops derive are kept on the boundaries: one built inside ``torch.inference_mode`` (an
    evaluation) must not be an inference tensor that a later training call cannot save for its backward."""
    from hybrid_pack.ops import gated_delta_rule, varlen_attention

    boundaries = PackedBoundaries.from_lengths([5, 1, 9])
    q = torch.randn(1, 15, 2, 4, dtype=torch.float64, requires_grad=True)
    g, beta = -torch.rand(1, 15, 2, dtype=torch.float64), torch.rand(1, 15, 2, dtype=torch.float64)
    with torch.inference_mode():
        varlen_attention(q, q, q, boundaries)
        gated_delta_rule(q, q, q, g, beta, boundaries)
    attention = varlen_attention(q, q, q, boundaries)
    delta, _ = gated_delta_rule(q, q, q, g, beta, boundaries)
    (attention.sum() + delta.sum()).backward()
    assert torch.isfinite(q.grad).all()

    from hybrid_pack.boundaries.sharded import ShardedBoundaries

    shard = ShardedBoundaries.from_row(PackedBoundaries.from_lengths([5, 7, 4]), group=None, rank=1, world_size=2)
    with torch.inference_mode():
        positions = shard.document_positions               # a view of the split, first built in an evaluation
    assert not positions.is_inference()
