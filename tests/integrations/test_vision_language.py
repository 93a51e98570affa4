"""patch_model on the vision-language classes (``Qwen3_5ForConditionalGeneration``,
``Qwen3_5MoeForConditionalGeneration``): how every Qwen3.5 checkpoint loads, served on text-only packed rows.

The language model's Gated DeltaNet, conv and attention layers get the boundaries, positions restart per
document; the vision tower is left as it is; a packed row that carries images is refused by name.
"""

from __future__ import annotations

import pickle
import warnings
from collections.abc import Iterator

import pytest
import torch

pytest.importorskip("transformers")

from hybrid_pack import PackingCollator
from hybrid_pack.errors import InputError
from hybrid_pack.integrations.transformers import is_patched, patch_model
from hybrid_pack.integrations.transformers.tiny import (
    TINY_VLM_CONFIGS,
    VISION_TOKENS,
    tiny_vlm_model,
)
from hybrid_pack.mrope import mrope_position_ids
from hybrid_pack.testing import check_isolation
from hybrid_pack.testing.multimodal import vision_sample
from tests.kit import widened
from tests.support.torch_path import pure_torch_transformers

FAMILIES = sorted(TINY_VLM_CONFIGS)
LENGTHS = [7, 13, 5]
TEXT_VOCAB = min(VISION_TOKENS.values())   # text documents draw no vision token
FAMILIES = [f for f in FAMILIES if f.startswith("qwen3_5")]


@pytest.fixture(autouse=True)
def _quiet() -> Iterator[None]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def _high_init(family: str) -> torch.nn.Module:
    """The tiny vision-language model with its language model's weights drawn at std 0.2 (fp32)."""
    model = tiny_vlm_model(family)
    widened(model.model.language_model)
    return model


@pytest.mark.parametrize("family", FAMILIES)
def test_text_rows_are_isolated(family: str) -> None:
    model = patch_model(_high_init(family))
    report = check_isolation(model, lengths=[1, 21, 2, 4], num_pad_tokens=3, grads=True, atol=1e-5,
                             vocab_size=TEXT_VOCAB)
    assert report.ok, str(report)
    assert is_patched(pickle.loads(pickle.dumps(model)))


@pytest.mark.parametrize("family", FAMILIES)
def test_unpatched_model_leaks_or_raises(family: str) -> None:
    model = _high_init(family)
    with pure_torch_transformers(type(model.model.language_model)):
        report = check_isolation(model, lengths=LENGTHS, grads=False, per_layer=False, atol=1e-5,
                                 vocab_size=TEXT_VOCAB)
    assert report.error is not None or not report.ok, str(report)


@pytest.mark.parametrize("family", FAMILIES)
def test_each_document_equals_the_unpatched_model_alone(family: str) -> None:
    """The collator's batch and restarting ``position_ids`` alone: each document's logits are the unpatched
    model's logits for that document (its own M-RoPE positions computed by the model)."""
    reference, model = _high_init(family), patch_model(_high_init(family))
    documents = [torch.randint(3, TEXT_VOCAB, (n,), generator=torch.Generator().manual_seed(n)).tolist()
                 for n in LENGTHS]
    batch = PackingCollator()([{"input_ids": d} for d in documents])
    starts = [0, *torch.tensor(LENGTHS).cumsum(0).tolist()]
    with torch.no_grad(), pure_torch_transformers(type(reference.model.language_model)):
        collated = model(**{k: v for k, v in batch.items() if k != "labels"}).logits
        by_positions = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"]).logits
        for i, document in enumerate(documents):
            alone = reference(input_ids=torch.tensor([document])).logits
            for packed in (collated, by_positions):
                torch.testing.assert_close(packed[:, starts[i]:starts[i + 1]], alone, rtol=1e-5, atol=1e-5)


def test_the_vision_tower_is_left_as_it_is() -> None:
    model = patch_model(tiny_vlm_model("qwen3_5"))
    vision = model.model.visual
    assert all(not module._forward_pre_hooks for module in vision.modules())
    assert all("forward" not in module.__dict__ for module in vision.modules())


# --- packed rows with images and videos (SPEC §3b) ----------------------------------------------------------------

def _sample(config: object, segments: list[tuple[str, object]], seed: int) -> dict[str, torch.Tensor]:
    return vision_sample(config, segments, torch.Generator().manual_seed(seed))


def _samples(config: object, *, video: bool) -> list[dict[str, torch.Tensor]]:
    """An image document, a text-only one, a wider image between text (and a video document)."""
    samples = [_sample(config, [("text", 3), ("image", (1, 4, 4)), ("text", 5)], seed=0),
               _sample(config, [("text", 9)], seed=1),
               _sample(config, [("text", 2), ("image", (1, 4, 8)), ("text", 4)], seed=2)]
    if video:
        samples.append(_sample(config, [("text", 2), ("video", (2, 4, 4)), ("text", 3)], seed=3))
    return samples


def _alone(sample: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """One sample as the unpatched model takes it: ``input_ids`` / ``mm_token_type_ids`` as ``[1, L]``."""
    return {key: value[None] if key in ("input_ids", "mm_token_type_ids") else value for key, value in sample.items()}


def _gradients(model: torch.nn.Module, logits: torch.Tensor, weight: torch.Tensor) -> dict[str, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    (logits * weight).sum().backward()
    return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


def _assert_close_per_tensor(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], tol: float,
                             what: str) -> None:
    """Every gradient of ``expected`` within ``tol`` of that tensor's largest entry; a gradient only ``got`` has
    (the vision tower, reached by other samples' images) exactly zero."""
    assert expected.keys() <= got.keys(), what
    for name, grad in got.items():
        if name not in expected:
            assert not grad.any(), f"{name} ({what}): a gradient from another sample's images"
            continue
        scale = float(expected[name].abs().max()) or 1.0
        torch.testing.assert_close(grad, expected[name], rtol=0, atol=tol * scale, msg=f"{name} ({what})")


def _assert_each_sample_equals_it_alone(family: str, samples: list[dict[str, torch.Tensor]]) -> None:
    """For each sample: its logits in the packed row equal the unpatched model's on the sample alone; every
    parameter gradient (vision tower included) of its share of the row equals the gradient of the sample packed alone,
    and, within the float32 steps transformers' own Gated DeltaNet and vision code keep, the unpatched model's."""
    reference, model = _high_init(family), patch_model(_high_init(family))
    collator = PackingCollator(position_ids_fn=mrope_position_ids(model))
    batch = {key: value for key, value in collator(samples).items() if key != "labels"}
    lengths = [len(sample["input_ids"]) for sample in samples]
    starts = [0, *torch.tensor(lengths).cumsum(0).tolist()]
    with pure_torch_transformers(type(reference.model.language_model)):
        for i, sample in enumerate(samples):
            alone_logits = reference(**_alone(sample)).logits
            weight = torch.randn(alone_logits.shape, generator=torch.Generator().manual_seed(i))
            packed_logits = model(**batch).logits[:, starts[i]:starts[i + 1]]
            scale = float(alone_logits.abs().max())   # logits reach 1e1 at init 0.2: 1e-5 of that
            torch.testing.assert_close(packed_logits, alone_logits, rtol=1e-5, atol=1e-5 * scale)
            packed = _gradients(model, packed_logits, weight)
            own_row = {key: value for key, value in collator([sample]).items() if key != "labels"}
            _assert_close_per_tensor(packed, _gradients(model, model(**own_row).logits, weight), 1e-4,
                                     f"sample {i} packed alone")
            alone = _gradients(reference, alone_logits, weight)
            assert any(name.startswith("model.visual") for name in alone) == ("pixel_values" in sample or
                                                                              "pixel_values_videos" in sample)
            # transformers' delta rule and vision tower keep float32 steps (their gradients differ from the packed
            # op's by up to 2e-3 of a tensor's largest entry even in float64); a leak is O(1) at init 0.2.
            _assert_close_per_tensor(packed, alone, 5e-3, f"sample {i} through the unpatched model")


@pytest.mark.parametrize("family", FAMILIES)
def test_images_text_and_video_packed_equal_each_sample_alone(family: str) -> None:
    """Logits and every parameter's gradient (vision tower included) of each sample's share of a packed row equal
    that sample alone through the unpatched model: images, a text-only document, a wider image, a video."""
    config = TINY_VLM_CONFIGS[family]()
    _assert_each_sample_equals_it_alone(family, _samples(config, video=False))
    _assert_each_sample_equals_it_alone(family, _samples(config, video=True))


def test_a_row_too_short_moves_or_drops_image_samples_whole() -> None:
    """A row length that forces overflow decisions: samples that do not fit a row go to the next one whole, a sample
    longer than the row is dropped and counted (never cut through its image), and each row's samples equal each
    sample alone."""
    from hybrid_pack import plan_packs

    config = TINY_VLM_CONFIGS["qwen3_5"]()
    samples = _samples(config, video=True)
    lengths = [len(sample["input_ids"]) for sample in samples]
    capacity = sorted(lengths)[-2] + 1            # the longest sample (the video one) does not fit
    plan = plan_packs(lengths, capacity, overflow="drop")
    longest = lengths.index(max(lengths))
    assert plan.num_dropped == 1 and plan.tokens_kept == sum(lengths) - lengths[longest]
    packs = [plan.pack_examples(p).tolist() for p in range(len(plan.pack_tokens))]
    assert len(packs) > 1 and sorted(i for pack in packs for i in pack) == sorted(set(range(len(samples))) - {longest})
    for pack in packs:
        _assert_each_sample_equals_it_alone("qwen3_5", [samples[i] for i in pack])


def test_the_vision_tower_keeps_each_image_apart() -> None:
    """The vision tower already separates images through its own ``cu_seqlens`` (from the grids): the features of
    three images encoded together equal each image encoded alone."""
    model = tiny_vlm_model("qwen3_5")
    config = model.config
    sample = _sample(config, [("image", (1, 4, 4)), ("image", (1, 8, 4)), ("image", (1, 4, 8))], seed=5)
    pixels, grids = sample["pixel_values"], sample["image_grid_thw"]
    rows = grids.prod(dim=1).tolist()
    with torch.no_grad():
        together = torch.cat(model.model.get_image_features(pixels, grids).pooler_output)
        alone = torch.cat([model.model.get_image_features(p, g[None]).pooler_output[0]
                           for p, g in zip(pixels.split(rows), grids)])
    torch.testing.assert_close(together, alone, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("positions", ["2-D", "none"])
def test_an_image_row_without_its_mrope_positions_is_refused(positions: str) -> None:
    """A packed row with images collated without ``position_ids_fn`` (2-D restarting positions, or none) would
    number the vision tokens as text: the patched model refuses it, naming the fix."""
    config = TINY_VLM_CONFIGS["qwen3_5"]()
    model = patch_model(_high_init("qwen3_5"))
    batch = {key: value for key, value in PackingCollator()(_samples(config, video=False)).items() if key != "labels"}
    assert batch["position_ids"].dim() == 2
    if positions == "none":
        del batch["position_ids"]
    with pytest.raises(InputError, match=r"position_ids: .*\(\[3, 1, T\]\).*position_ids_fn=mrope_position_ids"):
        model(**batch)
