"""Packed vs padded training steps of the patched tiny Qwen3.5 vision-language model on mixed image / text samples.

    .venv/bin/python benchmarks/bench_multimodal_packing.py          # about 2 minutes on 2 loaded CPU cores

The dataset is generated, nothing is downloaded: the first ``--samples`` GSM8K train questions (bundled), each
word mapped to a text id of the tiny vocabulary by a CRC32 hash, and two samples in three with one random image
before the question, its grid drawn from ``GRIDS`` (4 to 36 image tokens after the 2 x 2 merge), laid out as the
Qwen3.5 processor lays it (``vision_start``, the image tokens, ``vision_end``), pixels from a seeded generator.

- packed: ``plan_packs(lengths, capacity)`` then ``PackingCollator(pack_length=capacity, max_documents=M,
  position_ids_fn=mrope_position_ids(model))``: static rows ``[1, capacity]`` with per-document M-RoPE positions.
- padded: batches of ``--batch-size`` samples in dataset order, right-padded to the longest with an
  ``attention_mask`` (the model computes its own M-RoPE positions), labels -100 on padding; run under
  ``pure_torch_transformers`` (transformers' own torch delta rule and conv, as the tests' unpacked reference:
  on CPU the installed flash-linear-attention kernels cannot run).

A step is one forward and backward (``loss.backward()``) of one batch; the figure is the median of ``--repeats``
passes over all batches, divided by the number of samples. Real-token fraction = real tokens / tokens the model
ran. Writes ``benchmarks/results/multimodal_packing.json``.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
import warnings
import zlib
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hybrid_pack import PackingCollator, plan_packs
from hybrid_pack.data import load_gsm8k
from hybrid_pack.integrations.transformers import patch_model
from hybrid_pack.integrations.transformers.tiny import VISION_TOKENS, tiny_vlm_model
from hybrid_pack.mrope import mrope_position_ids
from tests.support.torch_path import pure_torch_transformers

RESULTS = Path(__file__).resolve().parent / "results" / "multimodal_packing.json"
GRIDS = [(1, 4, 4), (1, 8, 8), (1, 8, 12), (1, 12, 12)]
"""(t, h, w) patch grids of the generated images: 4, 16, 24 and 36 image tokens."""
TEXT_VOCAB = min(VISION_TOKENS.values())


def mixed_samples(config: Any, count: int, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    """``count`` processor-style samples: GSM8K question words as ids, two in three with one image first."""
    vision = config.vision_config
    merge = vision.spatial_merge_size
    patch = vision.in_channels * vision.temporal_patch_size * vision.patch_size ** 2
    generator = torch.Generator().manual_seed(seed)
    samples = []
    for i, row in enumerate(load_gsm8k("train")[:count]):
        text = [3 + zlib.crc32(word.encode()) % (TEXT_VOCAB - 3) for word in row["question"].split()]
        if i % 3 == 2:
            samples.append({"input_ids": torch.tensor(text)})
            continue
        grid = GRIDS[int(torch.randint(len(GRIDS), (1,), generator=generator))]
        image = [config.vision_start_token_id] + [config.image_token_id] * (grid[0] * grid[1] * grid[2] // merge**2)
        image.append(config.vision_end_token_id)
        types = [0] + [1] * (len(image) - 2) + [0] + [0] * len(text)
        samples.append({"input_ids": torch.tensor(image + text), "mm_token_type_ids": torch.tensor(types),
                        "image_grid_thw": torch.tensor([grid]),
                        "pixel_values": torch.randn(grid[0] * grid[1] * grid[2], patch, generator=generator)})
    return samples


def padded_batch(samples: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Right-padded ``[B, max L]`` batch with ``attention_mask``; pixels and grids concatenated in order."""
    width = max(s["input_ids"].shape[0] for s in samples)
    ids = torch.zeros(len(samples), width, dtype=torch.int64)
    types, mask = torch.zeros_like(ids), torch.zeros_like(ids)
    labels = torch.full_like(ids, -100)
    for row, sample in enumerate(samples):
        n = sample["input_ids"].shape[0]
        ids[row, :n] = labels[row, :n] = sample["input_ids"]
        mask[row, :n] = 1
        if "mm_token_type_ids" in sample:
            types[row, :n] = sample["mm_token_type_ids"]
    batch = {"input_ids": ids, "attention_mask": mask, "labels": labels, "mm_token_type_ids": types}
    images = [s for s in samples if "pixel_values" in s]
    if images:
        batch["pixel_values"] = torch.cat([s["pixel_values"] for s in images])
        batch["image_grid_thw"] = torch.cat([s["image_grid_thw"] for s in images])
    return batch


def time_steps(model: torch.nn.Module, batches: list[dict[str, Any]], repeats: int) -> float:
    """Median seconds of one pass (forward + backward of every batch), after one warm-up pass."""
    passes = []
    for repeat in range(repeats + 1):
        start = time.perf_counter()
        for batch in batches:
            model(**batch).loss.backward()
            model.zero_grad(set_to_none=True)
        if repeat:
            passes.append(time.perf_counter() - start)
    return statistics.median(passes)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--samples", type=int, default=64)
    parser.add_argument("--capacity", type=int, default=256, help="packed row length")
    parser.add_argument("--batch-size", type=int, default=4, help="samples per padded batch")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    warnings.simplefilter("ignore")

    model = patch_model(tiny_vlm_model("qwen3_5")).train()
    samples = mixed_samples(model.config, args.samples)
    lengths = [s["input_ids"].shape[0] for s in samples]
    plan = plan_packs(lengths, args.capacity)
    max_documents = int(plan.pack_num_documents.max())
    collator = PackingCollator(pack_length=args.capacity, max_documents=max_documents,
                               position_ids_fn=mrope_position_ids(model))
    packed = [collator([samples[i] for i, _, _ in pack]) for pack in plan.packs()]
    padded = [padded_batch(samples[i:i + args.batch_size]) for i in range(0, len(samples), args.batch_size)]
    real = sum(lengths)
    ran = {"packed": sum(b["input_ids"].numel() for b in packed), "padded": sum(b["input_ids"].numel() for b in padded)}
    seconds = {"packed": time_steps(model, packed, args.repeats)}
    with pure_torch_transformers(type(model.model.language_model)):  # the unpacked call's CPU path (no Triton)
        seconds["padded"] = time_steps(model, padded, args.repeats)
    rows = {mode: {"batches": len(packed if mode == "packed" else padded), "tokens_run": ran[mode],
                   "real_token_fraction": round(real / ran[mode], 4),
                   "step_ms_per_sample": round(1e3 * seconds[mode] / len(samples), 3),
                   "pass_seconds": round(seconds[mode], 3)} for mode in ("packed", "padded")}
    result = {
        "command": "python benchmarks/bench_multimodal_packing.py " + " ".join(sys.argv[1:]),
        "model": "patched tiny Qwen3_5ForConditionalGeneration (hidden 32, layers GDN/attention/GDN, vision depth 2)",
        "samples": len(samples), "images": sum("pixel_values" in s for s in samples), "real_tokens": real,
        "sample_lengths": {"min": min(lengths), "max": max(lengths)}, "capacity": args.capacity,
        "max_documents": max_documents, "padded_batch_size": args.batch_size, "repeats": args.repeats,
        "packed": rows["packed"], "padded": rows["padded"],
        "padded_over_packed_time": round(seconds["padded"] / seconds["packed"], 3),
        "machine": {"platform": platform.platform(), "torch": torch.__version__, "threads": torch.get_num_threads()},
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print("| mode | batches | tokens run | real-token fraction | step ms per sample |")
    print("|---|---:|---:|---:|---:|")
    for mode, row in rows.items():
        print(f"| {mode} | {row['batches']} | {row['tokens_run']:,} | {row['real_token_fraction']:.3f} | "
              f"{row['step_ms_per_sample']:.2f} |")


if __name__ == "__main__":
    main()
