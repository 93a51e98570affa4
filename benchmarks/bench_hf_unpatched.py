"""What a packed batch does to each Hugging Face hybrid family, before and after ``patch_model``.

The batch is the one transformers recommends for padding-free training
(``DataCollatorWithFlattening(return_flash_attn_kwargs=True, return_seq_idx=True)``: ``input_ids [1, T]``,
``cu_seq_lens_q/k``, ``max_length_q/k``, ``seq_idx``, restarting ``position_ids``), on tiny random models
(float32, CPU). For each family it records whether the unpatched model raises (and what) or leaks
(``check_isolation``: largest leak and the first leaking module), both as installed here and with
transformers' own torch functions for the convolution and the delta rule called directly (no kernel
dispatch, so no "can't keep packed sequences apart" guard: what the layer itself does with a packed
row); then the patched model's isolation figures and its largest difference from the unpatched model
on one document.

    python benchmarks/bench_hf_unpatched.py        # writes benchmarks/results/hf_families.{json,md}
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import platform
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # tests.support: the unpacked reference
import transformers

from hybrid_pack.boundaries import PackedBoundaries
from hybrid_pack.integrations.transformers import patch_model
from hybrid_pack.integrations.transformers.families import FAMILIES
from hybrid_pack.integrations.transformers.tiny import CHUNK, VOCAB, tiny_model
from hybrid_pack.testing import check_isolation
from tests.support.torch_path import pure_torch_transformers

RESULTS = Path(__file__).parent / "results"
LENGTHS = [1, 3 * CHUNK + 5, 2, 4, CHUNK - 1, CHUNK]  # one-token docs, one > 3 chunks, conv edges
NUM_PAD = 7
KERNEL_PACKAGES = ("fla", "causal_conv1d", "mamba_ssm", "flash_attn")


def _family_key(model_type: str) -> str:
    return {"qwen3_5_text": "qwen3_5"}.get(model_type, model_type)


def _verdict(report: Any) -> dict[str, Any]:
    if report.error is not None:
        return {"outcome": "raises", "error": report.error.splitlines()[0][:200]}
    leaking = next((layout.first_leaking_module for layout in report.layouts if layout.first_leaking_module), None)
    return {"outcome": "isolated" if report.ok else "leaks", "max_leak": report.max_leak,
            "first_leaking_module": leaking}


def measure(family: str, seed: int) -> dict[str, Any]:
    kwargs = {"lengths": LENGTHS, "num_pad_tokens": NUM_PAD, "grads": True, "atol": 1e-5, "seed": seed}
    unpatched = tiny_model(family, seed)
    as_installed = _verdict(check_isolation(unpatched, **kwargs))
    with pure_torch_transformers(unpatched):
        pure_torch = _verdict(check_isolation(unpatched, **kwargs))
    patched = patch_model(tiny_model(family, seed))
    start = time.perf_counter()
    report = check_isolation(patched, **kwargs)
    check_seconds = time.perf_counter() - start
    ids = torch.randint(0, VOCAB, (1, 2 * CHUNK + 3), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad(), pure_torch_transformers(unpatched):
        expected = unpatched(input_ids=ids).logits
        got = patched(input_ids=ids, **PackedBoundaries.from_lengths([ids.shape[1]]).hf_kwargs()).logits
    return {
        "family": family,
        "model": type(patched).__name__,
        "unpatched_as_installed": as_installed,
        "unpatched_pure_torch": pure_torch,
        "patched": {**_verdict(report), "max_diff_vs_unpatched_one_doc": (got - expected).abs().max().item(),
                    "isolation_check_seconds": round(check_seconds, 2)},
    }


def _cell(verdict: dict[str, Any]) -> str:
    if verdict["outcome"] == "raises":
        return f"raises `{verdict['error'][:90]}`"
    if verdict["outcome"] == "leaks":
        return f"leaks {verdict['max_leak']:.2g} (first: `{verdict['first_leaking_module']}`)"
    return f"isolated (max leak {verdict['max_leak']:.1e})"


def markdown(rows: list[dict[str, Any]], meta: dict[str, Any]) -> str:
    lines = [
        f"transformers {meta['transformers']}, torch {meta['torch']}, {meta['device']}; kernel packages installed "
        f"here (not necessarily usable on CPU): {', '.join(meta['kernel_packages']) or 'none'}. Layout: documents "
        f"{LENGTHS} + {NUM_PAD} padding tokens, chunk size {CHUNK}, float32, gradients checked.",
        "",
        "| family | unpatched (as installed) | unpatched (torch conv / delta rule, no guard) | patched | "
        "patched vs unpatched, one doc |",
        "|---|---|---|---|---|",
    ]
    for row in rows:
        lines.append(f"| {row['family']} | {_cell(row['unpatched_as_installed'])} | "
                     f"{_cell(row['unpatched_pure_torch'])} | {_cell(row['patched'])} | "
                     f"{row['patched']['max_diff_vs_unpatched_one_doc']:.1e} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--families", nargs="*", default=[_family_key(f.model_types[0]) for f in FAMILIES])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    meta = {"transformers": transformers.__version__, "torch": torch.__version__, "device": "cpu",
            "machine": platform.machine(),
            "kernel_packages": [p for p in KERNEL_PACKAGES if importlib.util.find_spec(p) is not None]}
    rows = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for family in args.families:
            rows.append(measure(family, args.seed))
            print(f"{family}: {_cell(rows[-1]['unpatched_pure_torch'])} -> {_cell(rows[-1]['patched'])}", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "hf_families.json").write_text(json.dumps({"meta": meta, "layout": {"lengths": LENGTHS,
                                                           "num_pad_tokens": NUM_PAD}, "rows": rows}, indent=2))
    (args.out / "hf_families.md").write_text(markdown(rows, meta))
    print(markdown(rows, meta))


if __name__ == "__main__":
    main()
