"""PackingCollator as a drop-in for transformers' DataCollatorWithFlattening (docs/api.md §3): the same keyword
arguments with the same meaning, and key by key the same output (keys, values, dtypes, types), "pt" and
"np"; the settings that would drop the boundaries refused with the reason."""

from __future__ import annotations

import copy
from collections.abc import Callable

import numpy as np
import pytest
import torch

from hybrid_pack import PackedBoundaries, PackingCollator
from hybrid_pack.errors import InputError
from hybrid_pack.schema import HOST_BOUNDARIES, IGNORE_INDEX, NUM_PAD_TOKENS, POSITION_IDS, RESPONSE_MASK

transformers = pytest.importorskip("transformers")
DataCollatorWithFlattening = transformers.DataCollatorWithFlattening

# The only way to have transformers emit every boundary key; PackingCollator's defaults.
BOUNDARY_FLAGS = {"return_flash_attn_kwargs": True, "return_seq_idx": True}


def _ids(lengths: list[int], seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 50_000, n).tolist() for n in lengths]


def _with_labels(ids: list[list[int]]) -> list[dict]:
    """Chat-like: the first third of every example masked, as tokenize_chats does."""
    return [{"input_ids": x, "labels": [IGNORE_INDEX if t < len(x) // 3 else v for t, v in enumerate(x)]}
            for x in ids]


FEATURE_SETS: dict[str, Callable[[], list[dict]]] = {
    "lists, no labels": lambda: [{"input_ids": x} for x in _ids([7, 3, 12], 0)],
    "lists, labels": lambda: _with_labels(_ids([9, 4, 15, 2], 1)),
    "one-token documents": lambda: [{"input_ids": x} for x in _ids([1, 1, 5, 1], 2)],
    "one-token documents, labels": lambda: _with_labels(_ids([1, 6, 1], 3)),
    "a single document": lambda: _with_labels(_ids([11], 4)),
    "tensors": lambda: [{k: torch.tensor(v) for k, v in f.items()} for f in _with_labels(_ids([5, 8, 3], 5))],
    "int32 tensors": lambda: [{k: torch.tensor(v, dtype=torch.int32) for k, v in f.items()}
                              for f in _with_labels(_ids([4, 9], 6))],
    "numpy arrays": lambda: [{k: np.asarray(v) for k, v in f.items()} for f in _with_labels(_ids([6, 2, 10], 7))],
    "numpy int32, no labels": lambda: [{"input_ids": np.asarray(x, dtype=np.int32)} for x in _ids([3, 7], 8)],
    "lists, tensors and arrays mixed": lambda: [
        {"input_ids": [4, 5, 6], "labels": [4, 5, 6]},
        {"input_ids": torch.tensor([7, 8]), "labels": torch.tensor([IGNORE_INDEX, 8])},
        {"input_ids": np.array([9, 10, 11, 12]), "labels": np.array([9, 10, 11, 12])},
    ],
}


def assert_same_batch(ours: dict, theirs: dict) -> None:
    """Key by key: the same keys in the same order, and per key the same type, dtype, shape and values; ours with
    ``host_boundaries`` besides (the segment lengths on the host, docs/api.md §9b: tests/test_host_reads.py)."""
    if HOST_BOUNDARIES in ours:
        lengths = tuple(np.diff(np.asarray(ours["cu_seq_lens_q"])).tolist())
        assert ours[HOST_BOUNDARIES].segment_lengths == lengths
        ours = {key: value for key, value in ours.items() if key != HOST_BOUNDARIES}
    assert list(ours) == list(theirs)
    for key, want in theirs.items():
        got = ours[key]
        assert type(got) is type(want), (key, type(got), type(want))
        if isinstance(want, (torch.Tensor, np.ndarray)):
            assert got.dtype == want.dtype, (key, got.dtype, want.dtype)
            assert tuple(got.shape) == tuple(want.shape), (key, got.shape, want.shape)
            assert got.tolist() == want.tolist(), key
        else:
            assert got == want, key


# ------------------------------------------------------------------ (a) the same output, key by key
@pytest.mark.parametrize("return_tensors", ["pt", "np"])
@pytest.mark.parametrize("name", list(FEATURE_SETS))
def test_same_batch_as_transformers(name: str, return_tensors: str) -> None:
    features = FEATURE_SETS[name]()
    before = copy.deepcopy(features)
    ours = PackingCollator(**BOUNDARY_FLAGS, return_tensors=return_tensors)(features)
    theirs = DataCollatorWithFlattening(**BOUNDARY_FLAGS, return_tensors=return_tensors)(features)
    assert_same_batch(ours, theirs)
    for old, new in zip(before, features):  # neither collator writes into the examples
        assert {k: np.asarray(v).tolist() for k, v in old.items()} == {k: np.asarray(v).tolist()
                                                                       for k, v in new.items()}


@pytest.mark.parametrize("return_tensors", ["pt", "np"])
def test_return_tensors_at_call_overrides_the_constructor(return_tensors: str) -> None:
    features = FEATURE_SETS["lists, labels"]()
    other = "np" if return_tensors == "pt" else "pt"
    ours = PackingCollator(return_tensors=other)
    theirs = DataCollatorWithFlattening(**BOUNDARY_FLAGS, return_tensors=other)
    assert_same_batch(ours(features, return_tensors=return_tensors), theirs(features, return_tensors=return_tensors))
    assert_same_batch(ours(features), theirs(features))  # for that call only
    assert isinstance(ours(features)["input_ids"], torch.Tensor if other == "pt" else np.ndarray)


@pytest.mark.parametrize("return_tensors", ["pt", "np"])
def test_return_position_ids_false_leaves_position_ids_out(return_tensors: str) -> None:
    features = FEATURE_SETS["lists, labels"]()
    kwargs = {"return_position_ids": False, "return_tensors": return_tensors}
    ours = PackingCollator(**kwargs)(features)
    assert_same_batch(ours, DataCollatorWithFlattening(**BOUNDARY_FLAGS, **kwargs)(features))
    assert POSITION_IDS not in ours
    # The other keys still carry the boundaries: the same documents as with position_ids.
    full = PackingCollator()(features)
    assert PackedBoundaries.from_batch(ours).segment_lengths == PackedBoundaries.from_batch(full).segment_lengths


def test_a_model_needs_no_position_ids() -> None:
    from hybrid_pack.modeling import from_preset

    torch.manual_seed(0)
    model = from_preset("bamba-tiny", vocab_size=64)
    features = [{"input_ids": [5, 17, 9, 30]}, {"input_ids": [3, 3]}, {"input_ids": [8, 1, 44, 2, 6]}]
    with torch.no_grad():
        full = model(**PackingCollator()(features))
        without = model(**PackingCollator(return_position_ids=False)(features))
    assert torch.equal(full.logits, without.logits) and torch.equal(full.loss, without.loss)


@pytest.mark.parametrize("position_ids_start", [0, np.int64(0)])
def test_explicit_defaults_of_transformers_are_accepted(position_ids_start: int) -> None:
    features = FEATURE_SETS["lists, labels"]()
    kwargs = {"return_position_ids": True, "separator_id": IGNORE_INDEX, "position_ids_start": position_ids_start,
              "return_tensors": "pt", **BOUNDARY_FLAGS}
    assert_same_batch(PackingCollator(**kwargs)(features), DataCollatorWithFlattening(**kwargs)(features))


def test_keys_added_beyond_transformers() -> None:
    """Two keys transformers never emits, each only when asked for: ``num_pad_tokens`` with padding, and the
    extra per-token keys the examples carry (transformers drops those)."""
    features = FEATURE_SETS["lists, labels"]()   # 30 tokens
    theirs = DataCollatorWithFlattening(**BOUNDARY_FLAGS)(features)
    assert_same_batch(PackingCollator(pad_to_multiple_of=10)(features), theirs)   # no padding needed: no key added

    padded = PackingCollator(pad_to_multiple_of=16)(features)
    assert [key for key in padded if key != HOST_BOUNDARIES] == [*theirs, NUM_PAD_TOKENS]
    assert padded[NUM_PAD_TOKENS] == 2
    for key in ("input_ids", "labels", "position_ids", "seq_idx"):
        assert padded[key][:, :30].tolist() == theirs[key].tolist(), key
    assert padded["cu_seq_lens_q"].tolist() == [*theirs["cu_seq_lens_q"].tolist(), 32]

    with_mask = [{**f, RESPONSE_MASK: [1] * len(f["input_ids"])} for f in features]
    ours = PackingCollator()(with_mask)
    assert [key for key in ours if key != HOST_BOUNDARIES] == [*theirs, RESPONSE_MASK]
    assert ours[RESPONSE_MASK].shape == (1, 30)
    assert_same_batch({key: ours[key] for key in theirs}, DataCollatorWithFlattening(**BOUNDARY_FLAGS)(with_mask))


def test_numpy_batches_are_read_by_the_boundaries() -> None:
    features = FEATURE_SETS["lists, labels"]()
    for collator in (PackingCollator(return_tensors="np"), PackingCollator(return_tensors="np", pad_to_multiple_of=16),
                     PackingCollator(return_tensors="np", pack_length=64, max_documents=8)):
        as_np, as_pt = collator(features), collator(features, return_tensors="pt")
        assert PackedBoundaries.from_batch(as_np).segment_lengths == PackedBoundaries.from_batch(as_pt).segment_lengths
    static = PackingCollator(return_tensors="np", pack_length=64, max_documents=8)(features)
    assert isinstance(static[NUM_PAD_TOKENS], np.ndarray) and static[NUM_PAD_TOKENS].dtype == np.int64


# ------------------------------------------------------------------ (b) refusals
@pytest.mark.parametrize("flag", ["return_flash_attn_kwargs", "return_seq_idx"])
def test_a_flag_that_drops_boundaries_is_refused(flag: str) -> None:
    keys = ("cu_seq_lens_q, cu_seq_lens_k, max_length_q, max_length_k" if flag == "return_flash_attn_kwargs"
            else "seq_idx")
    message = (rf"{flag}: expected True; got False\. A hybrid model needs {keys} to keep the packed documents "
               rf"apart: .* remove {flag}=False")
    with pytest.raises(InputError, match=message):
        PackingCollator(**{flag: False})
    collator = PackingCollator()
    setattr(collator, flag, False)  # transformers reads the attributes at call time: so are they checked
    with pytest.raises(InputError, match=message):
        collator([{"input_ids": [1, 2]}])
    with pytest.raises(InputError, match=rf"{flag}: expected True; got 1"):
        PackingCollator(**{flag: 1})


@pytest.mark.parametrize("value", ["tf", "jax", "PT", None, 1])
def test_other_return_tensors_are_refused(value: object) -> None:
    message = rf"return_tensors: expected 'pt' \(torch tensors\) or 'np' \(NumPy arrays\); got {value!r}"
    with pytest.raises(InputError, match=message):
        PackingCollator(return_tensors=value)  # type: ignore[arg-type]
    if value is not None:  # None at call time means the constructor's
        with pytest.raises(InputError, match=message):
            PackingCollator()([{"input_ids": [1, 2]}], return_tensors=value)  # type: ignore[arg-type]
        with pytest.raises(ValueError):  # transformers refuses them too (at call time)
            DataCollatorWithFlattening(**BOUNDARY_FLAGS)([{"input_ids": [1, 2]}], return_tensors=value)


@pytest.mark.parametrize("start", [1, 2])
def test_a_position_offset_is_refused(start: int) -> None:
    with pytest.raises(InputError, match=rf"position_ids_start: expected 0; got {start}\. position_ids restart at 0 "
                                         r"in every document: PackedBoundaries\.from_batch reads them so"):
        PackingCollator(position_ids_start=start)


def test_no_position_ids_in_the_static_form_is_refused() -> None:
    with pytest.raises(InputError, match=r"return_position_ids: expected True with max_documents=4 \(the static "
                                         r"form\): a compiled packed forward reads cu_seq_lens_q, seq_idx and "
                                         r"position_ids"):
        PackingCollator(pack_length=64, max_documents=4, return_position_ids=False)
    with pytest.raises(InputError, match=r"return_position_ids: expected True or False; got 'no'"):
        PackingCollator(return_position_ids="no")  # type: ignore[arg-type]


def test_stricter_than_transformers_where_documented() -> None:
    """Inputs transformers takes silently and PackingCollator refuses (docs/collator.md): nothing is dropped."""
    cases = {
        r"features\[1\]\.input_ids: expected at least one token": [{"input_ids": [1, 2]}, {"input_ids": []}],
        r"features\[0\]\.text: not a key this collator takes": [{"input_ids": [1, 2], "text": "hi"}],
        # transformers reads labels from the first example only: the second example's labels are ignored
        r"features\[0\]\.labels: missing, while features\[1\] has it": [{"input_ids": [3]},
                                                                        {"input_ids": [1, 2], "labels": [-100, 2]}],
    }
    for message, features in cases.items():
        DataCollatorWithFlattening(**BOUNDARY_FLAGS)(features)
        with pytest.raises(InputError, match=message):
            PackingCollator()(features)


# ------------------------------------------------------------------ (c) separator_id at call time
@pytest.mark.parametrize("return_tensors", ["pt", "np"])
def test_separator_id_at_call_time_is_for_that_call_only(return_tensors: str) -> None:
    features = FEATURE_SETS["one-token documents, labels"]()
    ours = PackingCollator(separator_id=-1, return_tensors=return_tensors)
    theirs = DataCollatorWithFlattening(separator_id=-1, return_tensors=return_tensors, **BOUNDARY_FLAGS)
    assert_same_batch(ours(features, separator_id=-7), theirs(features, separator_id=-7))
    assert_same_batch(ours(features), theirs(features))
    assert ours(features, separator_id=-7)["labels"].tolist()[0][0] == -7
    assert ours(features)["labels"].tolist()[0][0] == -1 and ours.separator_id == -1


def test_separator_id_at_call_time_also_labels_the_padding() -> None:
    batch = PackingCollator(pad_to_multiple_of=8)([{"input_ids": [1, 2, 3]}], separator_id=-5)
    assert batch["labels"].tolist() == [[-5, 2, 3, -5, -5, -5, -5, -5]]


@pytest.mark.parametrize("value", [1.5, "x", True])
def test_separator_id_at_call_time_must_be_an_int(value: object) -> None:
    with pytest.raises(InputError, match=rf"separator_id: expected an int; got {value!r}"):
        PackingCollator()([{"input_ids": [1, 2]}], separator_id=value)  # type: ignore[arg-type]
