"""PackingCollator on vision-language samples (docs/api.md §3b), with M-RoPE positions from the model's own code.

The reference positions are the ones the unpatched tiny Qwen3.5 VLM hands its language model when it runs each
sample alone (captured by a hook), so the packed row's ``position_ids`` are proven equal to the model's own.
"""

from __future__ import annotations

import pickle

import pytest
import torch

pytest.importorskip("transformers")

from hybrid_pack import PackingCollator, plan_packs
from hybrid_pack.errors import InputError, UnsupportedModelError
from hybrid_pack.integrations.transformers.tiny import tiny_model, tiny_vlm_model
from hybrid_pack.mrope import MRopePositions, mrope_position_ids
from hybrid_pack.packing import PackedBatchSampler, SlicedDataset, pack_stream
from hybrid_pack.packing.slicing import slice_example
from hybrid_pack.testing.multimodal import vision_sample

FAMILIES = ["qwen3_5", "qwen3_5_moe"]


@pytest.fixture(scope="module", params=FAMILIES)
def model(request: pytest.FixtureRequest) -> torch.nn.Module:
    return tiny_vlm_model(request.param)


def _sample(config, segments: list[tuple[str, object]], seed: int) -> dict:
    """A processor-like sample (:func:`hybrid_pack.testing.multimodal.vision_sample`)."""
    return vision_sample(config, segments, torch.Generator().manual_seed(seed))


def _samples(config) -> list[dict]:
    """An image document, a text-only one (no multimodal key at all), a wider image between text, a video."""
    return [
        _sample(config, [("text", 3), ("image", (1, 4, 4)), ("text", 5)], seed=0),
        {"input_ids": torch.randint(3, 100, (9,))},
        _sample(config, [("text", 2), ("image", (1, 4, 8)), ("text", 4), ("image", (1, 8, 4)), ("text", 1)], seed=1),
        _sample(config, [("text", 2), ("video", (2, 4, 4)), ("text", 3)], seed=2),
    ]


class _Captured(Exception):
    """Raised by the hook below once the language model's positions are seen (the rest of the forward is moot)."""


def _alone_positions(model: torch.nn.Module, sample: dict) -> torch.Tensor:
    """int64 ``[3, 1, L]``: the positions the unpatched model gives its language model for ``sample`` alone."""
    seen = {}

    def hook(module, args, kwargs):
        seen["position_ids"] = kwargs.get("position_ids")
        raise _Captured

    handle = model.model.language_model.register_forward_pre_hook(hook, with_kwargs=True)
    try:
        with torch.no_grad(), pytest.raises(_Captured):
            model(**{key: value[None] if key in ("input_ids", "mm_token_type_ids") else value
                     for key, value in sample.items()})
    finally:
        handle.remove()
    length = sample["input_ids"].shape[0]
    if seen["position_ids"] is None:  # text only: the language model numbers it 0..L-1 on every row
        return torch.arange(length).expand(3, 1, length)
    return seen["position_ids"]


def test_positions_equal_each_sample_alone(model: torch.nn.Module) -> None:
    samples = _samples(model.config)
    collator = PackingCollator(position_ids_fn=mrope_position_ids(model), pad_to_multiple_of=16)
    batch = collator(samples)
    lengths = [s["input_ids"].shape[0] for s in samples]
    total, num_pad = batch["input_ids"].shape[1], batch["num_pad_tokens"]
    assert total == sum(lengths) + num_pad and num_pad > 0
    positions = batch["position_ids"]
    assert positions.shape == (3, 1, total) and positions.dtype == torch.int64
    offset = 0
    for sample, n in zip(samples, lengths, strict=True):
        alone = _alone_positions(model, sample)
        assert torch.equal(positions[:, :, offset:offset + n], alone)
        offset += n
    assert torch.equal(positions[:, 0, offset:], torch.arange(num_pad).expand(3, num_pad))
    # M-RoPE really differs from 1-D positions here (the test would catch restarting aranges)
    assert not torch.equal(positions[0, :, :lengths[0]], positions[1, :, :lengths[0]])

    assert batch["cu_seq_lens_q"].tolist() == [0, *torch.tensor(lengths).cumsum(0).tolist(), total]
    types = batch["mm_token_type_ids"]
    assert types.shape == (1, total) and types.dtype == torch.int64
    expected_types = torch.cat([s.get("mm_token_type_ids", torch.zeros(n, dtype=torch.int64))
                                for s, n in zip(samples, lengths, strict=True)])
    assert torch.equal(types[0, :offset], expected_types) and not types[0, offset:].any()
    images = [s for s in samples if "pixel_values" in s]
    assert torch.equal(batch["pixel_values"], torch.cat([s["pixel_values"] for s in images]))
    assert torch.equal(batch["image_grid_thw"], torch.cat([s["image_grid_thw"] for s in images]))
    assert torch.equal(batch["pixel_values_videos"], samples[3]["pixel_values_videos"])
    assert torch.equal(batch["video_grid_thw"], samples[3]["video_grid_thw"])


def test_position_rule_matches_get_rope_index_and_pickles(model: torch.nn.Module) -> None:
    rule = mrope_position_ids(model)
    restored = pickle.loads(pickle.dumps(rule))
    assert isinstance(restored, MRopePositions)
    assert not any(isinstance(v, torch.nn.Module) for v in vars(restored).values())
    for sample in _samples(model.config):
        if "mm_token_type_ids" not in sample:
            continue
        ids, types = sample["input_ids"][None], sample["mm_token_type_ids"][None]
        want, _ = model.model.get_rope_index(ids, types, sample.get("image_grid_thw"), sample.get("video_grid_thw"))
        got = restored(ids, types, sample.get("image_grid_thw"), sample.get("video_grid_thw"))
        assert torch.equal(got, want)
    collator = pickle.loads(pickle.dumps(PackingCollator(position_ids_fn=rule)))
    assert collator(_samples(model.config))["position_ids"].shape[0] == 3


def test_text_only_samples_keep_text_batch() -> None:
    docs = [{"input_ids": [5, 6, 7]}, {"input_ids": [8, 9]}]
    batch = PackingCollator()(docs)
    assert not {"mm_token_type_ids", "pixel_values", "image_grid_thw"} & set(batch)
    assert batch["position_ids"].tolist() == [[0, 1, 2, 0, 1]]
    rule = mrope_position_ids(tiny_vlm_model("qwen3_5"))
    batch = PackingCollator(position_ids_fn=rule, pack_length=8)(docs)
    assert batch["position_ids"].tolist() == [[[0, 1, 2, 0, 1, 0, 1, 2]]] * 3
    assert "mm_token_type_ids" not in batch
    none_keys = dict.fromkeys(("mm_token_type_ids", "pixel_values", "image_grid_thw"))  # datasets' missing columns
    batch = PackingCollator(return_tensors="np")([{**docs[0], **none_keys}, docs[1]])
    assert not {"mm_token_type_ids", "pixel_values", "image_grid_thw"} & set(batch)


def test_static_form_fixes_shapes_with_images(model: torch.nn.Module) -> None:
    samples = _samples(model.config)
    collator = PackingCollator(position_ids_fn=mrope_position_ids(model), pack_length=96, max_documents=4)
    first, second = collator(samples[:3]), collator([samples[3], samples[1], samples[2]])
    for batch in (first, second):
        assert batch["input_ids"].shape == (1, 96) and batch["position_ids"].shape == (3, 1, 96)
        assert batch["cu_seq_lens_q"].shape == (6,) and batch["max_length_q"] == 96
        assert batch["mm_token_type_ids"].shape == (1, 96)
    assert first["pixel_values"].shape[0] != second["pixel_values"].shape[0]  # the pixel rows vary, by design
    assert torch.equal(first["position_ids"], PackingCollator(position_ids_fn=mrope_position_ids(model),
                                                              pack_length=96)(samples[:3])["position_ids"])
    with pytest.raises(InputError, match="max_documents"):
        PackingCollator(position_ids_fn=mrope_position_ids(model), pack_length=96, max_documents=1)(samples[:2])


@pytest.mark.parametrize(("edit", "match"), [
    (lambda s: s.pop("image_grid_thw"), r"features\[0\]\.image_grid_thw: missing, while the sample has pixel_values"),
    (lambda s: s.pop("pixel_values"), r"features\[0\]\.pixel_values: missing, while the sample has image_grid_thw"),
    (lambda s: s.update(pixel_values=s["pixel_values"][:-1]), r"features\[0\]\.pixel_values: expected 16 rows"),
    (lambda s: s.update(image_grid_thw=torch.tensor([1, 4, 4])), r"features\[0\]\.image_grid_thw: expected integer"),
    (lambda s: s.pop("mm_token_type_ids"), r"features\[0\]\.mm_token_type_ids: missing"),
    (lambda s: s["mm_token_type_ids"].fill_(0), r"mm_token_type_ids: marks no image token"),
    (lambda s: s["mm_token_type_ids"].__setitem__(0, 3), r"expected 0 \(text\), 1 \(image\) or 2 \(video\)"),
    (lambda s: s["mm_token_type_ids"].__setitem__(5, 0), r"one run of image tokens per image"),
    (lambda s: s["mm_token_type_ids"].__setitem__(-1, 2), r"marks video tokens \(2\) but the sample has no"),
    (lambda s: s.update(pixel_values=torch.zeros(16, 5)), r"features\[2\]\.pixel_values: expected 5 values per"),
])
def test_invalid_samples_are_refused(model: torch.nn.Module, edit, match: str) -> None:
    samples = _samples(model.config)
    edit(samples[0])
    with pytest.raises(InputError, match=match):
        PackingCollator(position_ids_fn=mrope_position_ids(model))(samples)


def test_placeholder_count_must_match_the_grid(model: torch.nn.Module) -> None:
    sample = _sample(model.config, [("text", 2), ("image", (1, 4, 4)), ("text", 2)], seed=3)
    sample["image_grid_thw"] = torch.tensor([[1, 4, 8]])
    sample["pixel_values"] = torch.zeros(32, sample["pixel_values"].shape[1])
    with pytest.raises(InputError, match=r"mm_token_type_ids: 4 tokens of type 1, while image_grid_thw"):
        PackingCollator(position_ids_fn=mrope_position_ids(model))([sample])


def test_multimodal_keys_are_not_extra_keys_and_rule_needs_mrope() -> None:
    with pytest.raises(InputError, match="extra_token_keys"):
        PackingCollator(extra_token_keys=("mm_token_type_ids",))
    with pytest.raises(InputError, match="position_ids_fn: expected a callable"):
        PackingCollator(position_ids_fn=3)
    with pytest.raises(UnsupportedModelError, match="no get_rope_index"):
        mrope_position_ids(tiny_model("qwen3_5"))


def test_overflow_never_cuts_an_image(model: torch.nn.Module) -> None:
    samples = _samples(model.config)
    lengths = [s["input_ids"].shape[0] for s in samples]  # placeholders included: what plans count
    capacity = lengths[2] - 1  # the wider image document does not fit; the others do
    assert max(lengths[:2] + lengths[3:]) <= capacity
    with pytest.raises(InputError, match="cannot be cut"):
        slice_example(samples[2], 0, capacity)
    whole = slice_example(samples[2], 0, lengths[2])  # the whole example is no cut
    assert whole.keys() == samples[2].keys() and all(torch.equal(whole[k], v) for k, v in samples[2].items())
    assert len(slice_example(samples[1], 0, 4)["input_ids"]) == 4  # text is cut as before

    sampler = PackedBatchSampler(lengths, capacity, overflow="truncate", shuffle=False)
    dataset = SlicedDataset(samples)
    items = [item for batch in sampler for item in batch]
    assert (2, 0, capacity) in items  # the plan truncates it: fetching that piece is refused
    with pytest.raises(InputError, match="overflow: a multimodal example"):
        dataset[(2, 0, capacity)]

    plan = plan_packs(lengths, capacity, overflow="drop")
    assert plan.num_dropped == 1 and 2 not in plan.example_index.tolist()
    collator = PackingCollator(position_ids_fn=mrope_position_ids(model), pack_length=capacity)
    for pack in plan.packs():
        batch = collator([samples[i] for i, _, _ in pack])
        assert batch["input_ids"].shape == (1, capacity)

    stream = pack_stream(iter(samples), capacity, overflow="drop")
    packs = list(stream)
    assert stream.report.num_dropped == 1 and sum(len(p) for p in packs) == 3
    with pytest.raises(InputError, match="cannot be cut"):
        list(pack_stream(iter(samples), capacity, overflow="split"))
