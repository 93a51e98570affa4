"""Static multimodal batches (docs/api.md §3b, §9) under ``torch.compile``: the patched tiny Qwen3.5 VLM.

``PackingCollator(pack_length=L, max_documents=M, position_ids_fn=mrope_position_ids(model))`` fixes the row, the
boundary keys and the M-RoPE ``position_ids`` ``[3, 1, L]``; the pixels and grids change rows with the images.
The compiled model gives eager's loss and gradients on every static multimodal batch. After dynamo's
automatic-dynamic recompile on the second batch, a batch with a new image-token count compiles at most one more
graph (transformers' vision-dependent frame: its placeholder mask reads the count on the host). StaticBoundaries
reads the documents' positions from cu_seq_lens_q / seq_idx (the M-RoPE position_ids are not them). The vision
tower runs eager (docs/multimodal.md, "Static shapes and compile").
"""

from __future__ import annotations

import itertools
import warnings
from collections.abc import Iterator

import pytest
import torch
import torch._dynamo

pytest.importorskip("transformers")

from hybrid_pack import PackingCollator
from hybrid_pack.boundaries.static import StaticBoundaries
from hybrid_pack.integrations.transformers import patch_model
from hybrid_pack.integrations.transformers.tiny import VISION_TOKENS, tiny_vlm_model
from hybrid_pack.mrope import mrope_position_ids

L, M = 96, 4
TEXT_VOCAB = min(VISION_TOKENS.values())
# (image grid or None for a text-only document, text tokens) per document; the grid sets differ batch to batch
LAYOUTS = [[((1, 4, 4), 5), (None, 9), ((1, 4, 8), 4)],
           [((1, 8, 4), 3), ((1, 8, 8), 2)],
           [(None, 1), ((1, 4, 4), 2), ((1, 4, 4), 3), (None, 10)],
           [((1, 8, 8), 2), ((1, 4, 4), 3), (None, 5)]]


@pytest.fixture(autouse=True)
def _quiet() -> Iterator[None]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def _document(config, grid: tuple[int, int, int] | None, text: int, seed: int) -> dict[str, torch.Tensor]:
    """A processor-like sample: ``text`` tokens, then (with ``grid``) vision_start, the image tokens, vision_end."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, TEXT_VOCAB, (text,), generator=gen).tolist()
    if grid is None:
        return {"input_ids": torch.tensor(ids)}
    vision = config.vision_config
    count = grid[0] * grid[1] * grid[2] // vision.spatial_merge_size ** 2
    ids += [config.vision_start_token_id] + [config.image_token_id] * count + [config.vision_end_token_id]
    patch = vision.in_channels * vision.temporal_patch_size * vision.patch_size ** 2
    return {"input_ids": torch.tensor(ids), "mm_token_type_ids": torch.tensor([0] * (text + 1) + [1] * count + [0]),
            "image_grid_thw": torch.tensor([grid]),
            "pixel_values": torch.randn(grid[0] * grid[1] * grid[2], patch, generator=gen)}


def _model() -> torch.nn.Module:
    model = tiny_vlm_model("qwen3_5")
    torch.manual_seed(1)
    with torch.no_grad():
        for parameter in model.model.language_model.parameters():
            if parameter.dim() > 1:
                parameter.normal_(0, 0.2)
    return patch_model(model).train()


def _batches(model: torch.nn.Module) -> list[dict]:
    collator = PackingCollator(pack_length=L, max_documents=M, position_ids_fn=mrope_position_ids(model))
    return [collator([_document(model.config, grid, text, seed=10 * b + i) for i, (grid, text) in enumerate(layout)])
            for b, layout in enumerate(LAYOUTS)]


def _step(model: torch.nn.Module, call, batch: dict) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    loss = call(**batch).loss
    loss.backward()
    return loss.detach(), {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


def test_static_boundaries_read_a_static_mrope_batch() -> None:
    model = _model()
    batch = _batches(model)[0]
    assert batch["input_ids"].shape == (1, L) and batch["position_ids"].shape == (3, 1, L)
    boundaries = StaticBoundaries.from_batch(batch)
    positions = PackingCollator(pack_length=L, max_documents=M)([{"input_ids": ids} for ids in (
        batch["input_ids"][0, int(a):int(b)] for a, b in zip(batch["cu_seq_lens_q"][:-1], batch["cu_seq_lens_q"][1:])
        if b > a)])["position_ids"]
    assert torch.equal(boundaries.document_positions, positions)


@pytest.mark.slow
def test_compiled_model_equals_eager_on_static_multimodal_batches() -> None:
    """Loss (fp32 1e-5) and every gradient (vision tower included; 1e-4 of each tensor's largest entry) of the compiled
    model equal eager's on static batches whose image grids differ; the vision tower runs eager
    (``torch.compiler.disable``); a later batch compiles at most one new graph."""
    model = _model()
    batches = _batches(model)
    assert len({tuple(b["pixel_values"].shape) for b in batches}) == len(batches)  # the pixel rows vary
    assert {(tuple(b["input_ids"].shape), tuple(b["cu_seq_lens_q"].shape), b["max_length_q"]) for b in batches} \
        == {((1, L), (M + 2,), L)}
    eager = [_step(model, model, batch) for batch in batches]
    model.model.visual.forward = torch.compiler.disable(model.model.visual.forward)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    compiled = torch.compile(model, backend="aot_eager")
    graphs = []
    for batch, (loss, grads) in zip(batches, eager, strict=True):
        got_loss, got_grads = _step(model, compiled, batch)
        graphs.append(torch._dynamo.utils.counters["stats"]["unique_graphs"])
        torch.testing.assert_close(got_loss, loss, rtol=1e-5, atol=1e-5)
        assert got_grads.keys() == grads.keys() and any(name.startswith("model.visual") for name in grads)
        for name, grad in grads.items():   # float32: compiled and eager round differently, within 5e-5 of the largest
            torch.testing.assert_close(got_grads[name], grad, rtol=0, atol=1e-4 * float(grad.abs().max()), msg=name)
    new_graphs = [after - before for before, after in itertools.pairwise(graphs[1:])]
    assert all(count <= 1 for count in new_graphs), f"graphs after each batch: {graphs}"
