"""The static form of the collator (docs/api.md §9): the same shapes and Python values for every batch of one
``(pack_length, max_documents)``, and boundaries that read back as the same documents without the padding."""

from __future__ import annotations

import pytest
import torch

from hybrid_pack import PackedBoundaries, PackingCollator
from hybrid_pack.boundaries.host import StaticHostBoundaries
from hybrid_pack.errors import BoundaryError, InputError
from hybrid_pack.schema import CU_SEQ_LENS_K, CU_SEQ_LENS_Q, HOST_BOUNDARIES, NUM_PAD_TOKENS

PACK_LENGTH, MAX_DOCUMENTS = 32, 5
LAYOUTS = [(32,), (10, 22), (1, 2, 3), (4, 4, 4, 4, 16), (3, 3, 3, 3, 3), (1,)]


def _documents(lengths: tuple[int, ...]) -> list[dict[str, list[int]]]:
    return [{"input_ids": [d + 1] * n, "response_mask": [1] * n} for d, n in enumerate(lengths)]


def test_every_batch_has_the_same_shapes_and_python_values() -> None:
    collator = PackingCollator(pack_length=PACK_LENGTH, max_documents=MAX_DOCUMENTS)
    batches = [collator(_documents(lengths)) for lengths in LAYOUTS]
    first = batches[0]
    for batch in batches:
        assert batch.keys() == first.keys()
        for key, value in batch.items():
            if isinstance(value, StaticHostBoundaries):   # host tensors: values change, shapes do not
                value, first_value = (value.cu_seqlens, value.num_pad_tokens), (first[key].cu_seqlens,
                                                                                first[key].num_pad_tokens)
                assert [(t.shape, t.dtype, t.device) for t in value] == [(t.shape, t.dtype, t.device)
                                                                        for t in first_value], key
            elif isinstance(value, torch.Tensor):
                assert (value.shape, value.dtype) == (first[key].shape, first[key].dtype), key
            else:
                assert value == first[key], f"{key}: a Python value that changes between batches"
    assert first[CU_SEQ_LENS_Q].shape == (MAX_DOCUMENTS + 2,) and first[CU_SEQ_LENS_Q].dtype == torch.int32
    assert first["max_length_q"] == first["max_length_k"] == PACK_LENGTH
    assert first["seq_idx"].shape == first["input_ids"].shape == (1, PACK_LENGTH)


@pytest.mark.parametrize("lengths", LAYOUTS)
def test_static_batch_reads_back_as_the_same_documents(lengths: tuple[int, ...]) -> None:
    documents = _documents(lengths)
    static = PackingCollator(pack_length=PACK_LENGTH, max_documents=MAX_DOCUMENTS)(documents)
    plain = PackingCollator(pack_length=PACK_LENGTH)(documents)
    cu_seqlens = static[CU_SEQ_LENS_Q].tolist()
    assert static[CU_SEQ_LENS_K] is static[CU_SEQ_LENS_Q]
    used = len(plain[CU_SEQ_LENS_Q])
    assert cu_seqlens[:used] == plain[CU_SEQ_LENS_Q].tolist()
    assert cu_seqlens[used:] == [PACK_LENGTH] * (len(cu_seqlens) - used), "unused slots repeat L, at the end"
    host = static[HOST_BOUNDARIES]   # §9, §9b: the same values on the host, as tensors (a graph input, no constant)
    assert isinstance(host, StaticHostBoundaries) and host.cu_seqlens is not static[CU_SEQ_LENS_Q]
    assert host.cu_seqlens.tolist() == cu_seqlens and int(host.num_pad_tokens) == int(static[NUM_PAD_TOKENS])
    assert host.lengths() == plain[HOST_BOUNDARIES]
    for key in plain.keys() - {CU_SEQ_LENS_Q, CU_SEQ_LENS_K, "max_length_q", "max_length_k", NUM_PAD_TOKENS,
                               HOST_BOUNDARIES}:
        assert torch.equal(static[key], plain[key]), key
    assert int(static[NUM_PAD_TOKENS]) == plain.get(NUM_PAD_TOKENS, 0)
    without_host = {key: value for key, value in static.items() if key != HOST_BOUNDARIES}
    expected = PackedBoundaries.from_batch(plain)
    for read in (PackedBoundaries.from_batch(static), PackedBoundaries.from_batch(without_host)):
        assert (read.segment_lengths, read.num_pad_tokens, read.max_seqlen) == (
            expected.segment_lengths, expected.num_pad_tokens, expected.max_seqlen)
        assert all(torch.equal(getattr(read, name), getattr(expected, name))
                   for name in ("cu_seqlens", "seq_idx", "position_ids"))


def test_a_static_host_entry_of_other_slots_or_values_raises_naming_it() -> None:
    batch = PackingCollator(pack_length=PACK_LENGTH, max_documents=MAX_DOCUMENTS)(_documents((10, 22)))
    other = PackingCollator(pack_length=PACK_LENGTH, max_documents=1)(_documents((32,)))
    with pytest.raises(BoundaryError, match=f"{CU_SEQ_LENS_Q}: expected shape \\[7\\].*{HOST_BOUNDARIES}"):
        PackedBoundaries.from_batch({**other, HOST_BOUNDARIES: batch[HOST_BOUNDARIES]})
    with pytest.raises(BoundaryError, match=f"{HOST_BOUNDARIES}.cu_seqlens: expected a .*CPU"):
        StaticHostBoundaries(batch[CU_SEQ_LENS_Q].to(torch.int64), batch[HOST_BOUNDARIES].num_pad_tokens)
    shifted = StaticHostBoundaries(batch[CU_SEQ_LENS_Q] + 1, batch[HOST_BOUNDARIES].num_pad_tokens)
    with pytest.raises(BoundaryError, match=f"{HOST_BOUNDARIES}.cu_seqlens: expected \\[0, ..., T\\]"):
        PackedBoundaries.from_batch({**batch, HOST_BOUNDARIES: shifted})


def test_too_many_documents_raise_naming_max_documents() -> None:
    collator = PackingCollator(pack_length=PACK_LENGTH, max_documents=MAX_DOCUMENTS)
    with pytest.raises(InputError, match="max_documents=5"):
        collator(_documents((1,) * (MAX_DOCUMENTS + 1)))


@pytest.mark.parametrize("options", [{"max_documents": 4}, {"max_documents": 0, "pack_length": 8},
                                     {"max_documents": 2.0, "pack_length": 8}])
def test_max_documents_needs_a_positive_int_and_pack_length(options: dict) -> None:
    with pytest.raises(InputError, match="max_documents"):
        PackingCollator(**options)


def test_zero_length_segments_only_at_the_end() -> None:
    batch = {CU_SEQ_LENS_Q: torch.tensor([0, 3, 3, 8], dtype=torch.int32)}
    with pytest.raises(ValueError, match="cu_seqlens"):
        PackedBoundaries.from_batch(batch)
