"""The harness and the guard on vision-language models (docs/api.md §3b, §7, §7a): packed rows of image, video and
text documents, each against itself alone with its own pixel values, grids and M-RoPE positions.

Both tiny Qwen3.5 vision-language classes, patched, at initializer 0.2 in float32, judged at 1e-5; a planted leak
(one Gated DeltaNet layer running the whole row as one document) is caught on the multimodal layouts by the
harness, on the user's own batch and by the guard in a real training step; the unpatched model raises or leaks.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Iterator

import pytest
import torch

pytest.importorskip("transformers")

from hybrid_pack import PackedBoundaries, PackingCollator
from hybrid_pack.errors import BoundaryError, IsolationError, UnsupportedModelError
from hybrid_pack.integrations.transformers import patch_model
from hybrid_pack.integrations.transformers.tiny import tiny_model, tiny_vlm_model
from hybrid_pack.isolation.vision import document_vision_inputs
from hybrid_pack.mrope import mrope_position_ids
from hybrid_pack.testing import PackingGuard, check_isolation
from hybrid_pack.testing.multimodal import VisionLayout, text_vocab_size, vision_layouts, vision_samples
from tests.kit import widened
from tests.support.torch_path import pure_torch_transformers

FAMILIES = ["qwen3_5", "qwen3_5_moe"]
ATOL = 1e-5
VISION_LAYOUTS = {"images at the row start", "an image document across the middle",
                  "a text-only document between two image documents"}


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


def _whole_row(packed_forward, mixer, hidden_states, boundaries):
    """A planted leak: the mixer's packed forward run on the whole row as one document (no boundaries)."""
    return packed_forward(mixer, hidden_states, PackedBoundaries.from_lengths([hidden_states.shape[1]],
                                                                              device=hidden_states.device))


def _plant_leak(model: torch.nn.Module) -> str:
    """Give the first Gated DeltaNet layer no boundaries; returns its module name."""
    name, mixer = next((n, m) for n, m in model.named_modules() if n.endswith("linear_attn"))
    mixer.forward.packed_forward = functools.partial(_whole_row, mixer.forward.packed_forward)
    return name


def _batch(model: torch.nn.Module, seed: int = 0) -> tuple[list[dict], dict]:
    """The samples of every vision layout of ``model``, and their packed batch (labels included)."""
    generator = torch.Generator().manual_seed(seed)
    documents = [d for layout in vision_layouts(model.config) for d in layout.documents]
    samples = vision_samples(model.config, VisionLayout("all", tuple(documents)), generator)
    return samples, PackingCollator(position_ids_fn=mrope_position_ids(model), pad_to_multiple_of=8)(samples)


@pytest.fixture(scope="module", params=FAMILIES)
def family(request: pytest.FixtureRequest) -> str:
    return request.param


def test_patched_model_is_isolated_on_vision_layouts(family: str) -> None:
    report = check_isolation(patch_model(_high_init(family)), lengths=[1, 6], atol=ATOL)
    assert report.ok, str(report)
    assert {layout.name for layout in report.layouts} == {"given lengths"} | VISION_LAYOUTS
    for layout in report.layouts:
        assert all(d.perturbation_leak <= ATOL and d.gradient_leak == 0 for d in layout.documents), str(report)
    middle = next(layout for layout in report.layouts if layout.name == "an image document across the middle")
    assert max(middle.lengths) > 64 and middle.num_pad_tokens > 0     # crosses a 64-token chunk; padding


def test_planted_leak_is_caught_on_vision_layouts(family: str) -> None:
    model = patch_model(_high_init(family))
    leaking = _plant_leak(model)
    report = check_isolation(model, lengths=[4], atol=ATOL)   # one text document: only vision layouts can leak
    assert not report.ok and report.error is None, str(report)
    by_name = {layout.name: layout for layout in report.layouts}
    assert by_name["given lengths"].ok
    for name in VISION_LAYOUTS:
        layout = by_name[name]
        assert not layout.ok and layout.first_leaking_module == leaking, str(report)
        assert max(d.alone_diff for d in layout.documents) > 1e-2
        assert max(d.gradient_leak for d in layout.documents) > 0


def test_unpatched_model_raises_or_leaks(family: str) -> None:
    model = _high_init(family)
    with pure_torch_transformers(type(model.model.language_model)):
        report = check_isolation(model, lengths=[3], grads=False, per_layer=False, atol=ATOL, multimodal=True)
    assert report.error is not None or not all(
        layout.ok for layout in report.layouts if layout.name in VISION_LAYOUTS), str(report)


def test_users_own_documents_and_batch(family: str) -> None:
    """documents= takes processor-style samples; batch= a packed multimodal batch (the training-step path)."""
    model = patch_model(_high_init(family))
    samples, batch = _batch(model)
    by_documents = check_isolation(model, documents=samples, atol=ATOL)
    assert by_documents.ok and [layout.name for layout in by_documents.layouts] == ["given documents"], \
        str(by_documents)
    assert by_documents.layouts[0].lengths == [s["input_ids"].shape[0] for s in samples]
    by_batch = check_isolation(model, batch=batch, atol=ATOL)
    assert by_batch.ok and len(by_batch.layouts[0].documents) == len(samples), str(by_batch)
    assert all(d.gradient_leak == 0 for d in by_batch.layouts[0].documents)

    _plant_leak(model)
    assert not check_isolation(model, documents=samples, atol=ATOL, per_layer=False).ok
    assert not check_isolation(model, batch=batch, atol=ATOL, per_layer=False).ok


def test_each_document_gets_its_own_vision_inputs() -> None:
    model = tiny_vlm_model("qwen3_5")
    samples, batch = _batch(model)
    rule = mrope_position_ids(model)
    start = 0
    for sample in samples:
        length = sample["input_ids"].shape[0]
        alone = PackingCollator(position_ids_fn=rule)([sample])
        got = document_vision_inputs(batch, start, length)
        assert torch.equal(got["position_ids"], alone["position_ids"])
        own = {k for k in ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw") if k in sample}
        assert set(got) - {"position_ids"} == own
        for key in own:
            assert torch.equal(got[key], sample[key])
        start += length
    image = next(i for i, s in enumerate(samples) if "image_grid_thw" in s and s["image_grid_thw"][0].prod() > 4)
    first = sum(s["input_ids"].shape[0] for s in samples[:image])
    with pytest.raises(BoundaryError, match="image_grid_thw"):      # a cut through the image's placeholders
        document_vision_inputs(batch, first, int((samples[image]["mm_token_type_ids"] == 1).nonzero()[0]) + 1)


def test_vision_layouts_need_a_vision_model() -> None:
    with pytest.raises(UnsupportedModelError, match="multimodal"):
        check_isolation(tiny_model("qwen3_5"), lengths=[3], multimodal=True)
    config = tiny_vlm_model("qwen3_5").config
    assert text_vocab_size(config) == min(config.image_token_id, config.video_token_id,
                                          config.vision_start_token_id, config.vision_end_token_id)


def test_guard_checks_a_multimodal_training_step(family: str) -> None:
    """The guard on a real training step (forward, loss, backward) of a packed multimodal batch: every document it
    runs alone carries its own pixels, grids and positions; the planted leak raises."""
    model = patch_model(_high_init(family)).train()
    samples, batch = _batch(model)
    guard = PackingGuard(model, every=1, documents=len(samples), atol=ATOL).attach()
    model(**batch).loss.backward()
    record = guard.records[-1]
    assert record.ok and sorted(record.documents) == list(range(len(samples))), record
    _plant_leak(model)
    with pytest.raises(IsolationError, match="differs from the same document run alone"):
        model(**batch).loss.backward()
    guard.detach()


def test_guard_callback_in_a_trainer(family: str, tmp_path) -> None:
    """PackingGuardCallback in a Hugging Face Trainer fed by the multimodal collator: the check of its first step
    passes; with the planted leak, training stops on it."""
    from transformers import Trainer, TrainingArguments

    from hybrid_pack.integrations.transformers.guard import PackingGuardCallback

    model = patch_model(_high_init(family))
    samples, _ = _batch(model)
    collator = PackingCollator(position_ids_fn=mrope_position_ids(model))

    def trainer(callback: PackingGuardCallback) -> Trainer:
        args = TrainingArguments(str(tmp_path), max_steps=1, per_device_train_batch_size=len(samples),
                                 use_cpu=True, report_to=[], save_strategy="no", remove_unused_columns=False)
        return Trainer(model=model, args=args, train_dataset=samples, data_collator=collator, callbacks=[callback])

    callback = PackingGuardCallback(every=1, documents=len(samples), atol=ATOL)
    trainer(callback).train()
    assert [r.ok for r in callback.guard.records] == [True], callback.guard.records
    _plant_leak(model)
    with pytest.raises(IsolationError):
        trainer(PackingGuardCallback(every=1, atol=ATOL)).train()
