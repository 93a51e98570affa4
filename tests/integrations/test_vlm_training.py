"""Training vision-language models on packed rows: ``PackedTrainer`` and TRL's ``SFTTrainer`` (through
``PackedSFTTrainer``) on a patched tiny Qwen3.5 VLM, images and text-only samples in one row with M-RoPE positions.

One training step each: the trainer's loss is the sum of every sample's token losses run alone (unpacked, unpatched
model) over the count the trainer divides by (the row's targets ``labels[..., 1:] != -100``: Qwen3.5-VL takes no
``num_items_in_batch``), and the gradients of every parameter, the vision tower's included, are the same samples'
summed gradients alone.
"""

from __future__ import annotations

import itertools
import warnings
from collections.abc import Iterator, Mapping
from typing import Any

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from hybrid_pack import PackingCollator
from hybrid_pack.integrations.transformers import patch_model
from hybrid_pack.integrations.transformers.tiny import tiny_vlm_model
from hybrid_pack.mrope import mrope_position_ids
from hybrid_pack.testing.multimodal import vision_sample
from tests.support.torch_path import pure_torch_transformers

FAMILY = "qwen3_5"
SEGMENTS = [
    [("text", 3), ("image", (1, 4, 4)), ("text", 5)],
    [("text", 9)],                                                             # text only
    [("text", 2), ("image", (1, 4, 8)), ("text", 4), ("image", (1, 8, 4)), ("text", 1)],
    [("text", 2), ("image", (1, 4, 4)), ("text", 1)],                           # 1 text token after the image
]


@pytest.fixture(autouse=True)
def _quiet() -> Iterator[None]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def _model() -> torch.nn.Module:
    """The tiny VLM with weights large enough (std 0.2) that a leak between samples would show."""
    model = tiny_vlm_model(FAMILY)
    torch.manual_seed(1)
    with torch.no_grad():
        for parameter in model.parameters():
            if parameter.dim() > 1:
                parameter.normal_(0, 0.2)
    return model


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


def _alone(samples: list[Mapping[str, Any]]) -> tuple[float, int, dict[str, torch.Tensor]]:
    """``(sum of every sample's token losses, target count, gradients of loss_sum / count)``: each sample run
    alone through the unpatched model (its own positions, computed by the model), summed cross-entropy of
    ``logits[:-1]`` against ``labels[1:]``."""
    model = _model().train()
    count = sum(int((torch.as_tensor(s.get("labels", s["input_ids"]))[1:] != -100).sum()) for s in samples)
    total = 0.0
    with pure_torch_transformers(type(model.model.language_model)):
        for sample in samples:
            inputs = {k: torch.as_tensor(v)[None] if k in ("input_ids", "mm_token_type_ids") else torch.as_tensor(v)
                      for k, v in sample.items() if k not in ("labels", "attention_mask")}
            labels = torch.as_tensor(sample.get("labels", sample["input_ids"]))
            logits = model(**inputs).logits[0]
            loss = torch.nn.functional.cross_entropy(logits[:-1], labels[1:], ignore_index=-100, reduction="sum")
            (loss / count).backward()
            total += loss.item()
    return total, count, _grads(model)


def _step(trainer: Any, batch: dict[str, Any]) -> tuple[float, int]:
    """One training step of ``trainer`` on ``batch``: ``(its loss, the target count it divides by)``. Qwen3.5-VL
    declares ``accepts_loss_kwargs = False``, so ``Trainer`` counts no ``num_items_in_batch``: the loss is the mean
    over the row's targets (``labels[..., 1:] != -100``), divided by the accumulation steps (1; ``train()`` sets
    it)."""
    _, num_items = trainer.get_batch_samples(iter([batch]), 1, trainer.args.device)
    assert num_items is None and not trainer.model_accepts_loss_kwargs
    trainer.current_gradient_accumulation_steps = 1
    loss = trainer.training_step(trainer.model, batch, num_items)
    return loss.item(), int((batch["labels"][..., 1:] != -100).sum())


def _assert_same_step(loss: float, model: torch.nn.Module, targets: int,
                      alone: tuple[float, int, dict[str, torch.Tensor]]) -> None:
    total, count, grads = alone
    assert targets == count
    assert loss == pytest.approx(total / count, rel=1e-5)
    packed = _grads(model)
    assert packed.keys() == grads.keys()
    for name, grad in packed.items():
        assert torch.isfinite(grad).all(), name
        scale = float(grads[name].abs().max())
        assert float((grad - grads[name]).abs().max()) <= 1e-4 * scale, name   # float32 sums over 70 tokens
    visual = {name: g for name, g in packed.items() if name.startswith("model.visual.")}
    assert visual and all(g.abs().sum() > 0 for g in visual.values()), "the vision tower got no gradient"


def test_packed_trainer_step_on_images_equals_samples_alone(tmp_path) -> None:
    from transformers import TrainingArguments

    from hybrid_pack.integrations.transformers.trainer import PackedTrainer

    model = patch_model(_model())
    samples = [vision_sample(model.config, segments, torch.Generator().manual_seed(i))
               for i, segments in enumerate(SEGMENTS)]
    samples[1] = {"input_ids": samples[1]["input_ids"]}                       # a sample without any vision key
    lengths = [len(s["input_ids"]) for s in samples]
    args = TrainingArguments(str(tmp_path), max_steps=1, report_to=[], use_cpu=True, save_strategy="no",
                             disable_tqdm=True)
    collator = PackingCollator(position_ids_fn=mrope_position_ids(model), pad_to_multiple_of=16)
    trainer = PackedTrainer(model=model, args=args, train_dataset=samples, lengths=lengths, capacity=sum(lengths) + 8,
                            collator=collator)
    batch = next(iter(trainer.get_train_dataloader()))
    assert batch["position_ids"].shape == (3, 1, batch["input_ids"].shape[1]) and batch["num_pad_tokens"] > 0
    assert batch["pixel_values"].shape[0] == int(batch["image_grid_thw"].prod(dim=1).sum())
    loss, targets = _step(trainer, batch)
    order = _row_order(batch, samples)
    _assert_same_step(loss, model, targets, _alone([samples[i] for i in order]))


def test_packed_trainer_takes_the_models_positions(tmp_path) -> None:
    """Without a collator, ``PackedTrainer`` numbers an M-RoPE model's samples with its ``get_rope_index``; a
    collator with 1-D positions is refused on the first row that has images (the loss would be silently wrong)."""
    from transformers import TrainingArguments

    from hybrid_pack.errors import InputError
    from hybrid_pack.integrations.transformers.trainer import PackedTrainer
    from hybrid_pack.mrope import MRopePositions

    model = patch_model(_model())
    samples = [vision_sample(model.config, segments, torch.Generator().manual_seed(i))
               for i, segments in enumerate(SEGMENTS[:2])]
    lengths = [len(s["input_ids"]) for s in samples]
    args = TrainingArguments(str(tmp_path), max_steps=1, report_to=[], use_cpu=True, save_strategy="no",
                             disable_tqdm=True)
    trainer = PackedTrainer(model=model, args=args, train_dataset=samples, lengths=lengths, capacity=sum(lengths))
    assert isinstance(trainer.packing_collator.position_ids_fn, MRopePositions)
    trainer = PackedTrainer(model=model, args=args, train_dataset=samples, lengths=lengths, capacity=sum(lengths),
                            collator=PackingCollator())
    batch = next(iter(trainer.get_train_dataloader()))
    with pytest.raises(InputError, match=r"position_ids: 1-D positions for a row with images"):
        trainer.training_step(trainer.model, batch)


def _row_order(batch: Mapping[str, Any], samples: list[Mapping[str, Any]]) -> list[int]:
    """Which sample each document of the packed row is (the sampler orders them by its plan)."""
    cu = batch["cu_seq_lens_q"].tolist()
    ids = batch["input_ids"][0]
    order = []
    for start, end in itertools.pairwise(cu):
        match = [i for i, s in enumerate(samples) if torch.equal(torch.as_tensor(s["input_ids"]), ids[start:end])]
        if match:
            order.append(match[0])
    assert sorted(order) == list(range(len(samples)))
    return order


def _image(height: int, width: int, seed: int) -> Any:
    import numpy as np
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    return Image.fromarray(pixels)


def _vision_dataset() -> Any:
    """Chats with one image, none, two images of other shapes, one; answers of one to six words."""
    from datasets import Dataset

    def chat(images: int, question: str, answer: str) -> list[dict[str, Any]]:
        content = [{"type": "image"}] * images + [{"type": "text", "text": question}]
        reply = [{"type": "text", "text": answer}]
        return [{"role": "user", "content": content}, {"role": "assistant", "content": reply}]

    return Dataset.from_dict({
        "images": [[_image(16, 16, 0)], [], [_image(16, 32, 1), _image(32, 16, 2)], [_image(16, 16, 3)]],
        "messages": [chat(1, "w5 w6 w7", "w8 w9"), chat(0, "w10 w11 w12 w13", "w14 w15 w16 w17 w18 w19"),
                     chat(2, "w20", "w21"), chat(1, "w22 w23", "w24 w25 w26")],
    })


@pytest.mark.parametrize("assistant_only_loss", [False, True])
def test_trl_sft_step_on_images_equals_samples_alone(tmp_path, assistant_only_loss: bool) -> None:
    pytest.importorskip("trl")
    from trl import SFTConfig
    from trl.trainer.sft_trainer import DataCollatorForVisionLanguageModeling

    from hybrid_pack.integrations.transformers.tiny_processor import tiny_vlm_processor
    from hybrid_pack.integrations.trl import PackedSFTTrainer
    from hybrid_pack.integrations.trl_vlm import VisionLanguagePackingCollator

    dataset = _vision_dataset()
    args = SFTConfig(str(tmp_path), per_device_train_batch_size=len(dataset), max_steps=1, use_cpu=True,
                     report_to=[], save_strategy="no", disable_tqdm=True, assistant_only_loss=assistant_only_loss)
    assert not args.packing and not args.padding_free and args.gradient_checkpointing   # TRL's defaults, kept
    model = _model()
    trainer = PackedSFTTrainer(model=model, args=args, train_dataset=dataset, processing_class=tiny_vlm_processor())
    assert isinstance(trainer.data_collator, VisionLanguagePackingCollator)
    batch = next(iter(trainer.get_train_dataloader()))
    total = batch["input_ids"].shape[1]
    assert batch["position_ids"].shape == (3, 1, total) and batch["cu_seq_lens_q"].numel() == len(dataset) + 1
    assert sorted(batch["image_grid_thw"].tolist()) == [[1, 4, 4], [1, 4, 4], [1, 4, 8], [1, 8, 4]]  # any order
    loss, targets = _step(trainer, batch)
    assert trainer._metrics["train"]["num_tokens"] == [total]    # TRL's count of M-RoPE rows, corrected
    # TRL's own collator on each example alone: what TRL feeds the model for one example
    alone = DataCollatorForVisionLanguageModeling(tiny_vlm_processor(), max_length=args.max_length,
                                                  assistant_only_loss=assistant_only_loss)
    samples = [{k: v[0] if k in ("input_ids", "labels", "attention_mask", "mm_token_type_ids") else v
                for k, v in alone([dict(example)]).items()} for example in dataset]
    _assert_same_step(loss, model, targets, _alone(samples))


def test_trl_sft_trains_on_images(tmp_path) -> None:
    """``train()`` as a user calls it: two optimizer steps on packed image rows, the losses logged and finite, the
    vision tower updated, then the harness on the trainer's own packed row."""
    pytest.importorskip("trl")
    from trl import SFTConfig

    from hybrid_pack.integrations.transformers.tiny_processor import tiny_vlm_processor
    from hybrid_pack.integrations.trl import PackedSFTTrainer
    from hybrid_pack.testing import check_isolation

    dataset = _vision_dataset()
    args = SFTConfig(str(tmp_path), per_device_train_batch_size=2, max_steps=2, logging_steps=1, use_cpu=True,
                     report_to=[], save_strategy="no", disable_tqdm=True)
    model = _model()
    before = {name: p.detach().clone() for name, p in model.model.visual.named_parameters()}
    trainer = PackedSFTTrainer(model=model, args=args, train_dataset=dataset, processing_class=tiny_vlm_processor())
    trainer.train()
    logs = [log for log in trainer.state.log_history if "loss" in log]
    assert trainer.state.global_step == 2 and len(logs) == 2
    assert all(torch.isfinite(torch.tensor(log["loss"])) and log["num_tokens"] > 2 for log in logs)
    assert all(log["tokens_per_second"] > 0 for log in logs)
    assert any(not torch.equal(p, before[name]) for name, p in model.model.visual.named_parameters())
    report = check_isolation(trainer)     # the trained model on its packed image row, each document alone
    assert report.ok, str(report)


def test_trl_sft_refusals(tmp_path) -> None:
    pytest.importorskip("trl")
    from trl import SFTConfig

    from hybrid_pack.errors import InputError
    from hybrid_pack.integrations.transformers.tiny_processor import tiny_vlm_processor
    from hybrid_pack.integrations.trl import PackedSFTTrainer

    dataset = _vision_dataset()
    args = SFTConfig(str(tmp_path), per_device_train_batch_size=2, max_steps=1, use_cpu=True, report_to=[],
                     save_strategy="no")
    model = _model()
    with pytest.raises(InputError, match="position_ids_fn=mrope_position_ids"):   # 1-D positions: wrong with images
        PackedSFTTrainer(model=model, args=args, train_dataset=dataset, processing_class=tiny_vlm_processor(),
                         data_collator=PackingCollator())
    with pytest.raises(InputError, match="capacity: TRL turns a vision dataset's images into pixels"):
        PackedSFTTrainer(model=model, args=args, train_dataset=dataset, processing_class=tiny_vlm_processor(),
                         capacity=256)
    chosen = PackingCollator(position_ids_fn=mrope_position_ids(model), pad_to_multiple_of=32)
    trainer = PackedSFTTrainer(model=model, args=args, train_dataset=dataset, processing_class=tiny_vlm_processor(),
                               data_collator=chosen)
    batch = next(iter(trainer.get_train_dataloader()))
    assert trainer.data_collator.collator is chosen and batch["input_ids"].shape[1] % 32 == 0
