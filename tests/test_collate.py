"""PackingCollator: values against transformers' DataCollatorWithFlattening and a per-token
reference, the padding segment, packs, extra keys, and every malformed input."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hybrid_pack import PackedBoundaries, PackingCollator
from hybrid_pack.schema import HOST_BOUNDARIES, IGNORE_INDEX

BOUNDARY_KEYS = ("input_ids", "labels", "position_ids", "seq_idx", "cu_seq_lens_q", "cu_seq_lens_k")
EXTRA_KEYS = ("response_mask", "tool_mask", "advantages", "old_logprobs")


def make_features(lengths: list[int], *, seed: int = 0, labels: bool = True, extras: bool = False) -> list[dict]:
    """Chat-like examples as Python lists: a masked prompt third, then trained response tokens."""
    rng = np.random.default_rng(seed)
    features = []
    for n in lengths:
        ids = rng.integers(0, 151_000, n)
        prompt = np.arange(n) < n // 3
        feature = {"input_ids": ids.tolist()}
        if labels:
            feature["labels"] = np.where(prompt, IGNORE_INDEX, ids).tolist()
        if extras:
            feature["response_mask"] = (~prompt).astype(int).tolist()
            feature["tool_mask"] = (rng.random(n) < 0.1).astype(int).tolist()
            feature["advantages"] = [float(rng.standard_normal())] * n
            feature["old_logprobs"] = (-rng.random(n)).tolist()
        features.append(feature)
    return features


def as_tensors(features: list[dict]) -> list[dict]:
    return [{key: torch.tensor(value) for key, value in feature.items()} for feature in features]


def reference_batch(features: list[dict], *, separator_id: int = IGNORE_INDEX, num_pad: int = 0,
                    pad_token_id: int = 0) -> dict:
    """The collator's output written token by token, for comparison."""
    ids, labels, positions, seq_idx, cu = [], [], [], [], [0]
    for doc, feature in enumerate(features):
        source = feature.get("labels", feature["input_ids"])
        for t, token in enumerate(feature["input_ids"]):
            ids.append(int(token))
            labels.append(separator_id if t == 0 else int(source[t]))
            positions.append(t)
            seq_idx.append(doc)
        cu.append(len(ids))
    if num_pad:
        ids += [pad_token_id] * num_pad
        labels += [separator_id] * num_pad
        positions += list(range(num_pad))
        seq_idx += [len(features)] * num_pad
        cu.append(len(ids))
    segments = np.diff(cu)
    return {"input_ids": [ids], "labels": [labels], "position_ids": [positions], "seq_idx": [seq_idx],
            "cu_seq_lens_q": cu, "cu_seq_lens_k": cu, "max_length_q": int(segments.max()),
            "max_length_k": int(segments.max())}


def assert_matches_reference(batch: dict, reference: dict) -> None:
    for key in BOUNDARY_KEYS:
        assert batch[key].tolist() == reference[key], key
    assert batch["max_length_q"] == batch["max_length_k"] == reference["max_length_q"]
    assert type(batch["max_length_q"]) is int


# ------------------------------------------------------------------ against transformers
@pytest.mark.parametrize("with_labels", [False, True])
def test_matches_transformers_flattening_collator(with_labels: bool) -> None:
    from transformers import DataCollatorWithFlattening

    features = make_features([178, 74, 400, 1, 2, 546, 93], labels=with_labels)
    ours = PackingCollator()(features)
    theirs = DataCollatorWithFlattening(return_flash_attn_kwargs=True, return_seq_idx=True)(features)
    assert set(theirs) == set(ours) - {HOST_BOUNDARIES}   # the host entry: tests/test_host_reads.py
    for key, value in theirs.items():
        if isinstance(value, torch.Tensor):
            # Same dtypes on purpose: int64 ids / labels / positions, int32 seq_idx and cu_seq_lens.
            assert ours[key].dtype == value.dtype, key
            assert ours[key].shape == value.shape, key
            assert torch.equal(ours[key], value), key
        else:
            assert type(ours[key]) is type(value) is int
            assert ours[key] == value, key


def test_no_attention_mask_and_shared_cu_seq_lens() -> None:
    batch = PackingCollator()(make_features([5, 7]))
    assert "attention_mask" not in batch
    assert torch.equal(batch["cu_seq_lens_q"], batch["cu_seq_lens_k"])
    assert "num_pad_tokens" not in batch


# ------------------------------------------------------------------ keys the collator does not emit
@pytest.mark.parametrize("kind", ["list", "tensor"])
def test_attention_mask_of_ones_is_accepted_and_dropped(kind: str) -> None:
    features = make_features([5, 7])
    masked = [{**f, "attention_mask": [1] * len(f["input_ids"])} for f in features]
    if kind == "tensor":
        masked = as_tensors(masked)
    batch, expected = PackingCollator()(masked), PackingCollator()(features)
    assert "attention_mask" not in batch
    assert_matches_reference(batch, reference_batch(features))
    assert all(torch.equal(batch[key], expected[key]) for key in BOUNDARY_KEYS)


def test_attention_mask_with_zeros_raises_naming_the_example() -> None:
    features = [{**f, "attention_mask": [1] * len(f["input_ids"])} for f in make_features([5, 7, 4])]
    features[1]["attention_mask"][-2:] = [0, 0]
    with pytest.raises(ValueError, match=r"features\[1\]\.attention_mask: expected all ones .* unpadded"):
        PackingCollator()(features)


@pytest.mark.parametrize("key", ["loss_weight", "text", "position_ids"])
def test_unknown_key_raises_naming_it_and_extra_token_keys(key: str) -> None:
    features = make_features([3, 4])
    features[1][key] = [1, 1, 1, 1]
    with pytest.raises(ValueError, match=rf"features\[1\]\.{key}: not a key this collator takes.*extra_token_keys="):
        PackingCollator()(features)


def test_unknown_key_passes_once_named_in_extra_token_keys() -> None:
    features = [{**f, "loss_weight": [0.5] * len(f["input_ids"])} for f in make_features([3, 4])]
    batch = PackingCollator(extra_token_keys=("loss_weight",))(features)
    assert batch["loss_weight"].tolist() == [[0.5] * 7]


# ------------------------------------------------------------------ input kinds
@pytest.mark.parametrize("kind", ["tensor", "numpy", "tuple", "mixed", "int32"])
def test_input_kinds_agree_with_lists(kind: str) -> None:
    features = make_features([9, 31, 4], extras=True)
    expected = PackingCollator(pad_to_multiple_of=16)(features)
    if kind == "tensor":
        converted = as_tensors(features)
    elif kind == "numpy":
        converted = [{k: np.asarray(v) for k, v in f.items()} for f in features]
    elif kind == "tuple":
        converted = [{k: tuple(v) for k, v in f.items()} for f in features]
    elif kind == "mixed":
        converted = [as_tensors([f])[0] if i % 2 else f for i, f in enumerate(features)]
    else:
        converted = [{k: torch.tensor(v, dtype=torch.int32 if isinstance(v[0], int) else torch.float64)
                      for k, v in f.items()} for f in features]
    got = PackingCollator(pad_to_multiple_of=16)(converted)
    assert set(got) == set(expected)
    for key, value in expected.items():
        if isinstance(value, torch.Tensor):
            assert got[key].dtype == value.dtype, key
            assert torch.equal(got[key], value), key
        else:
            assert got[key] == value, key


@pytest.mark.parametrize("kind", ["list", "tensor", "numpy"])
def test_inputs_are_left_unchanged(kind: str) -> None:
    features = make_features([6, 1, 9], extras=True)
    if kind == "tensor":
        features = as_tensors(features)
    elif kind == "numpy":
        features = [{k: np.asarray(v) for k, v in f.items()} for f in features]
    before = copy.deepcopy(features)
    for options in ({}, {"pad_to_multiple_of": 8}):
        batch = PackingCollator(separator_id=-7, **options)(features)
        assert batch["labels"][0, 0] == -7
    for feature, saved in zip(features, before):
        for key, value in feature.items():
            assert torch.equal(torch.as_tensor(value), torch.as_tensor(saved[key])), key


def test_integer_lists_beyond_a_byte_keep_their_values() -> None:
    features = [{"input_ids": [1, 2, 3], "tool_mask": [0, 1, 1], "sample_index": [True, False, True]},
                {"input_ids": [4, 5], "tool_mask": [255, 256], "sample_index": [-1, 2**40]}]
    batch = PackingCollator(extra_token_keys=("tool_mask", "sample_index"))(features)
    assert batch["tool_mask"][0].tolist() == [0, 1, 1, 255, 256]
    assert batch["sample_index"][0].tolist() == [1, 0, 1, -1, 2**40]
    assert batch["sample_index"].dtype == torch.int64


def test_packs_are_flattened_in_order() -> None:
    features = make_features([3, 8, 2, 6, 1], extras=True)
    packs = [features[:2], features[2:3], features[3:]]
    flat = PackingCollator(pad_to_multiple_of=8)(features)
    packed = PackingCollator(pad_to_multiple_of=8)(packs)
    assert set(flat) == set(packed)
    for key, value in flat.items():
        assert torch.equal(packed[key], value) if isinstance(value, torch.Tensor) else packed[key] == value


def test_user_labels_are_kept_and_first_tokens_separated() -> None:
    features = make_features([10, 12])
    batch = PackingCollator(separator_id=-7)(features)
    labels = batch["labels"][0].tolist()
    assert labels[0] == -7 and labels[10] == -7
    assert labels[1:10] == features[0]["labels"][1:]
    assert labels[11:] == features[1]["labels"][1:]
    assert labels.count(IGNORE_INDEX) == (10 // 3 - 1) + (12 // 3 - 1)  # masked prompts, first tokens now -7


# ------------------------------------------------------------------ padding
@pytest.mark.parametrize(("options", "total"), [({"pad_to_multiple_of": 64}, 64), ({"pack_length": 100}, 100),
                                                ({"pad_to_multiple_of": 16, "pack_length": 96}, 96)])
def test_one_trailing_padding_segment(options: dict, total: int) -> None:
    features = make_features([20, 5, 17], extras=True)
    batch = PackingCollator(pad_token_id=151643, **options)(features)
    num_pad = total - 42
    assert batch["num_pad_tokens"] == num_pad and type(batch["num_pad_tokens"]) is int
    assert batch["cu_seq_lens_q"].tolist() == [0, 20, 25, 42, total]
    assert batch["seq_idx"][0, 42:].tolist() == [3] * num_pad
    assert batch["position_ids"][0, 42:].tolist() == list(range(num_pad))
    assert batch["input_ids"][0, 42:].tolist() == [151643] * num_pad
    assert batch["labels"][0, 42:].tolist() == [IGNORE_INDEX] * num_pad
    for key in EXTRA_KEYS:
        assert batch[key].shape == (1, total)
        assert not batch[key][0, 42:].any(), key
    assert batch["max_length_q"] == max(20, num_pad)
    assert_matches_reference(batch, reference_batch(features, num_pad=num_pad, pad_token_id=151643))

    boundaries = PackedBoundaries.from_batch(batch)
    assert boundaries.num_pad_tokens == num_pad
    assert boundaries.num_docs == 3 and boundaries.lengths == [20, 5, 17]
    assert boundaries.max_seqlen == batch["max_length_q"]


def test_no_padding_segment_when_already_aligned() -> None:
    batch = PackingCollator(pad_to_multiple_of=8)(make_features([3, 5]))
    assert "num_pad_tokens" not in batch
    assert batch["cu_seq_lens_q"].tolist() == [0, 3, 8]
    batch = PackingCollator(pack_length=8)(make_features([3, 5]))
    assert "num_pad_tokens" not in batch and batch["input_ids"].shape == (1, 8)


def test_pack_length_too_small_names_the_field() -> None:
    with pytest.raises(ValueError, match=r"pack_length.*12 tokens.*pack_length=10.*plan_packs"):
        PackingCollator(pack_length=10)(make_features([6, 6]))


# ------------------------------------------------------------------ extra keys
def test_extra_key_dtypes_and_values() -> None:
    features = make_features([4, 3], extras=True)
    features[0]["advantages"] = [1, 1, 1, 1]  # ints still give float32
    batch = PackingCollator()(features)
    assert batch["advantages"].dtype == torch.float32
    assert batch["advantages"][0].tolist()[:4] == [1.0] * 4
    assert batch["old_logprobs"].dtype == torch.float32
    np.testing.assert_allclose(batch["old_logprobs"][0, 4:].numpy(), features[1]["old_logprobs"], rtol=1e-6)
    for key in ("response_mask", "tool_mask"):
        assert batch[key].dtype == torch.int64
        assert batch[key][0].tolist() == features[0][key] + features[1][key]


def test_custom_extra_keys_follow_their_input_type() -> None:
    features = [{"input_ids": [1, 2], "weights": [0.5, 1.0], "sample_index": [0, 0]},
                {"input_ids": [3], "weights": [2.0], "sample_index": [1]}]
    batch = PackingCollator(extra_token_keys=("weights", "sample_index"), pad_to_multiple_of=4)(features)
    assert batch["weights"].dtype == torch.float32 and batch["weights"][0].tolist() == [0.5, 1.0, 2.0, 0.0]
    assert batch["sample_index"].dtype == torch.int64 and batch["sample_index"][0].tolist() == [0, 0, 1, 0]
    with pytest.raises(ValueError, match=r"features\[0\]\.advantages: not a key this collator takes"):
        PackingCollator(extra_token_keys=())(make_features([2], extras=True))


def test_tensors_that_require_grad_come_out_detached() -> None:
    features = as_tensors(make_features([3, 2], extras=True))
    for feature in features:
        feature["old_logprobs"].requires_grad_(True)
    batch = PackingCollator()(features)
    assert not batch["old_logprobs"].requires_grad


def test_works_as_a_dataloader_collate_fn() -> None:
    features = make_features([5, 9, 2, 7])
    loader = torch.utils.data.DataLoader(features, batch_size=2, collate_fn=PackingCollator())
    batches = list(loader)
    assert [b["cu_seq_lens_q"].tolist() for b in batches] == [[0, 5, 14], [0, 2, 9]]


# ------------------------------------------------------------------ property test
@settings(max_examples=60, deadline=None)
@given(lengths=st.lists(st.integers(1, 40), min_size=1, max_size=12),
       pad_to=st.one_of(st.none(), st.integers(1, 32)), with_labels=st.booleans(),
       kind=st.sampled_from(["list", "tensor", "numpy"]), seed=st.integers(0, 2**16))
def test_property_random_lengths(lengths: list[int], pad_to: int | None, with_labels: bool, kind: str,
                                 seed: int) -> None:
    features = make_features(lengths, seed=seed, labels=with_labels, extras=True)
    if kind == "tensor":
        inputs = as_tensors(features)
    elif kind == "numpy":
        inputs = [{k: np.asarray(v) for k, v in f.items()} for f in features]
    else:
        inputs = features
    batch = PackingCollator(pad_to_multiple_of=pad_to)(inputs)
    total = sum(lengths)
    num_pad = -total % pad_to if pad_to else 0
    assert batch.get("num_pad_tokens", 0) == num_pad
    assert_matches_reference(batch, reference_batch(features, num_pad=num_pad))
    assert batch["input_ids"].shape == (1, total + num_pad)
    assert batch["seq_idx"].dtype == torch.int32 and batch["cu_seq_lens_q"].dtype == torch.int32
    for key in EXTRA_KEYS:
        flat = np.concatenate([np.asarray(f[key], dtype=np.float64) for f in features] + [np.zeros(num_pad)])
        np.testing.assert_allclose(batch[key][0].numpy(), flat, rtol=1e-6, err_msg=key)
    boundaries = PackedBoundaries.from_batch(batch)
    assert boundaries.lengths == lengths and boundaries.num_pad_tokens == num_pad
    expected = PackedBoundaries.from_document_lengths(lengths, num_pad_tokens=num_pad)
    for key, field in (("position_ids", "position_ids"), ("seq_idx", "seq_idx"), ("cu_seq_lens_q", "cu_seqlens")):
        assert batch[key].dtype == getattr(expected, field).dtype, key
        assert torch.equal(batch[key], getattr(expected, field)), key


# ------------------------------------------------------------------ malformed input
def _features(**changes) -> list[dict]:
    features = make_features([3, 4], extras=True)
    for key, value in changes.items():
        index, field = key.split("__")
        if value is None:
            del features[int(index[1:])][field]
        else:
            features[int(index[1:])][field] = value
    return features


MALFORMED = {
    "empty list": ([], r"features: expected at least one example"),
    "dict of lists": ({"input_ids": [[1, 2]]}, r"features: expected a list of examples.*split a dict of lists"),
    "string": ("abc", r"features: expected a list"),
    "missing input_ids": ([{"labels": [1, 2]}], r"features\[0\]: expected an 'input_ids' key"),
    "empty document": (_features(f1__input_ids=[]), r"features\[1\]\.input_ids: expected at least one token"),
    "empty tensor document": ([{"input_ids": torch.tensor([], dtype=torch.long)}], r"features\[0\]\.input_ids"),
    "labels length": (_features(f1__labels=[1, 2]), r"features\[1\]\.labels: expected 4 values .* got 2"),
    "extra length": (_features(f0__advantages=[0.5]), r"features\[0\]\.advantages: expected 3 values"),
    "extra in some": (_features(f1__tool_mask=None), r"features\[1\]\.tool_mask: missing, while features\[0\]"),
    "labels in some": (_features(f0__labels=None), r"features\[0\]\.labels: missing, while features\[1\]"),
    "2-D tensor": ([{"input_ids": torch.ones(1, 5, dtype=torch.long)}], r"features\[0\]\.input_ids: expected a 1-D"),
    "2-D extra": (_features(f0__response_mask=torch.ones(3, 1, dtype=torch.long)),
                  r"features\[0\]\.response_mask: expected a 1-D"),
    "nested list": ([{"input_ids": [[1, 2, 3]]}], r"features\[0\]\.input_ids: expected a flat list"),
    "negative id": (_features(f1__input_ids=[4, -3, 5, 6]), r"features\[1\]\.input_ids: expected token ids >= 0; "
                    r"got -3 at token 1"),
    "negative tensor id": ([{"input_ids": torch.tensor([-1, 2])}], r"features\[0\]\.input_ids: expected token ids"),
    "uint64 id above int64": ([{"input_ids": [1]}, {"input_ids": np.array([3, 2**64 - 1], dtype=np.uint64)}],
                              r"features\[1\]\.input_ids: expected token ids >= 0; got -1 at token 1 \(unsigned"),
    "float tensor ids": ([{"input_ids": torch.ones(3)}], r"features\[0\]\.input_ids: expected values that cast"),
    "float numpy ids": ([{"input_ids": [1, 2]}, {"input_ids": np.ones(3)}],
                        r"features\[1\]\.input_ids: expected values that cast"),
    "float numpy ids only": ([{"input_ids": np.ones(3)}], r"features\[0\]\.input_ids: expected values that cast"),
    "float tensor labels": ([{"input_ids": torch.ones(2, dtype=torch.long), "labels": torch.ones(2)}],
                            r"features\[0\]\.labels: expected values that cast"),
    "0-d tensor": ([{"input_ids": torch.tensor(3)}], r"features\[0\]\.input_ids: expected a 1-D"),
    "float in id list": ([{"input_ids": [1, 2.5]}], r"features\[0\]\.input_ids: expected integers"),
    "string ids": ([{"input_ids": "hello"}], r"features\[0\]\.input_ids: expected a list or a 1-D"),
    "float mask in int key": (_features(f1__tool_mask=[0, 1, 0.5, 0]), r"features\[1\]\.tool_mask: expected integers"),
    "empty pack": ([[{"input_ids": [1]}], []], r"features\[1\]: expected a pack with at least one example"),
    "examples then packs": ([{"input_ids": [1]}, [{"input_ids": [2]}]], r"features\[1\]: expected a dict"),
    "packs then examples": ([[{"input_ids": [1]}], {"input_ids": [2]}], r"features\[1\]: expected a pack"),
    "non-dict in pack": ([[{"input_ids": [1]}, [3]]], r"features\[0\]\[1\]: expected a dict"),
}


@pytest.mark.parametrize("case", list(MALFORMED))
def test_malformed_features_raise_naming_the_field(case: str) -> None:
    features, message = MALFORMED[case]
    with pytest.raises(ValueError, match=message):
        PackingCollator()(features)


@pytest.mark.parametrize(("options", "message"), [
    ({"pad_to_multiple_of": 0}, r"pad_to_multiple_of: expected a positive int"),
    ({"pack_length": 2.5}, r"pack_length: expected a positive int"),
    ({"pad_to_multiple_of": 64, "pack_length": 100}, r"pack_length: expected a multiple of pad_to_multiple_of=64"),
    ({"separator_id": None}, r"separator_id: expected an int"),
    ({"pad_token_id": 1.0}, r"pad_token_id: expected an int"),
    ({"extra_token_keys": "advantages"}, r"extra_token_keys: expected a sequence of key names"),
    ({"extra_token_keys": ("labels", "seq_idx")}, r"extra_token_keys: \['labels', 'seq_idx'\] are built"),
])
def test_bad_options_raise_naming_the_field(options: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        PackingCollator(**options)
