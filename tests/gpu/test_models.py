"""Models and training on CUDA: every preset and every Hugging Face family isolated, a 20-step packed
training run, and a training step under ``torch.cuda.set_sync_debug_mode("error")`` (no host syncs)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from hybrid_pack import PackedBoundaries, PackingCollator
from hybrid_pack.integrations.transformers.tiny import TINY_CONFIGS, tiny_model
from hybrid_pack.modeling import from_preset, list_presets
from hybrid_pack.testing import check_isolation
from hybrid_pack.training import TrainConfig, train


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("preset", list_presets())
def test_preset_is_isolated_on_cuda(preset: str, dtype: torch.dtype, cuda: torch.device) -> None:
    model = from_preset(preset).to(cuda, dtype)
    report = check_isolation(model, max_tokens=512)
    assert report.ok, str(report)


@pytest.mark.parametrize("family", sorted(TINY_CONFIGS))
def test_patched_hugging_face_family_is_isolated_on_cuda(family: str, cuda: torch.device) -> None:
    from hybrid_pack.integrations.transformers import patch_model

    report = check_isolation(patch_model(tiny_model(family).to(cuda)))
    assert report.ok, str(report)


def test_twenty_packed_training_steps_on_cuda(tmp_path: Path) -> None:
    metrics = train(TrainConfig(model="qwen3-next-tiny", out=str(tmp_path), device="cuda", dtype="bfloat16",
                                max_examples=400, capacity=2048, max_steps=20, isolation_check=True, progress=False))
    assert metrics["steps"] == 20 and metrics["isolation_ok"]
    losses = metrics["losses"]
    assert all(torch.isfinite(torch.tensor(losses))) and losses[-1] < losses[0]


@pytest.mark.parametrize("preset", ["qwen3-next-tiny", "bamba-tiny"])
def test_a_training_step_makes_no_host_sync(preset: str, cuda: torch.device) -> None:
    torch.manual_seed(0)
    model = from_preset(preset).to(cuda)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    features = [{"input_ids": torch.randint(0, model.config.vocab_size, (n,)).tolist()} for n in (1, 63, 65, 700, 9)]
    batch = PackingCollator()(features)
    boundaries = PackedBoundaries.from_batch(batch)

    def step() -> None:
        ids, labels = (batch[k].to(cuda, non_blocking=True) for k in ("input_ids", "labels"))
        loss = model(input_ids=ids, labels=labels, boundaries=boundaries.to(cuda)).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    with torch.autocast("cuda", dtype=torch.bfloat16):
        step()  # first use: kernels are checked and index views built (both may sync, once)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
