"""The cost of batch-invariant packing (docs/rl.md, "On-policy numerics"): one packed forward + backward of a static
row, inside :func:`hybrid_pack.batch_invariant` against the default packed path.

Models: the native ``bamba-tiny`` preset and the patched tiny Hugging Face Qwen3.5 (pure-torch mixers, as on CPU).
The row: the 8 sequences of tests/test_batch_invariant.py (1 to 60 tokens, 183 in all) in one static row of 256
tokens (``PackingCollator(pack_length=256, max_documents=8)``). Each figure is the median of ``--repeats`` timed
steps after two warm-up steps::

    python benchmarks/bench_batch_invariant.py [--repeats 15] [--threads 2] [--out ...]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # tests.support: the unpacked reference

import hybrid_pack
from hybrid_pack.collate import PackingCollator
from hybrid_pack.loss import packed_loss

LENGTHS = (1, 7, 60, 23, 2, 41, 16, 33)
ROW = 256


def _models() -> dict[str, tuple[torch.nn.Module, contextlib.AbstractContextManager[None]]]:
    from hybrid_pack.integrations.transformers import patch_model
    from hybrid_pack.integrations.transformers.tiny import tiny_model
    from hybrid_pack.modeling import from_preset
    from tests.support.torch_path import pure_torch_transformers

    torch.manual_seed(0)
    bamba = from_preset("bamba-tiny", vocab_size=512).train()
    qwen = patch_model(tiny_model("qwen3_5")).train()
    return {"bamba-tiny (preset)": (bamba, contextlib.nullcontext()),
            "qwen3_5 (patched HF, tiny)": (qwen, pure_torch_transformers(qwen))}


def _step(model: torch.nn.Module, batch: dict, invariant: bool) -> float:
    model.zero_grad(set_to_none=True)
    began = time.perf_counter()
    with hybrid_pack.batch_invariant() if invariant else contextlib.nullcontext():
        logits = model(**{k: v for k, v in batch.items() if k != "labels"}).logits
        packed_loss(logits, batch["labels"]).backward()
    return time.perf_counter() - began


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--threads", type=int, default=2, help="torch threads (1 is steadier on a shared machine)")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "batch_invariant.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    generator = torch.Generator().manual_seed(0)
    results = []
    for name, (model, context) in _models().items():
        vocab = model.config.vocab_size
        docs = [{"input_ids": torch.randint(3, vocab, (n,), generator=generator).tolist()} for n in LENGTHS]
        batch = PackingCollator(pack_length=ROW, max_documents=len(LENGTHS))(docs)
        with context:
            for invariant in (False, True):
                for _ in range(2):
                    _step(model, batch, invariant)
            # interleaved, so drift on a shared machine hits both alike
            runs: dict[bool, list[float]] = {False: [], True: []}
            for _ in range(args.repeats):
                for invariant in (False, True):
                    runs[invariant].append(_step(model, batch, invariant))
            times = {key: statistics.median(value) for key, value in runs.items()}
        row = {"model": name, "row_tokens": ROW, "documents": len(LENGTHS), "real_tokens": sum(LENGTHS),
               "default_ms": 1e3 * times[False], "batch_invariant_ms": 1e3 * times[True],
               "ratio": times[True] / times[False], "repeats": args.repeats}
        results.append(row)
        print(f"{name}: default {row['default_ms']:.1f} ms, batch_invariant {row['batch_invariant_ms']:.1f} ms, "
              f"{row['ratio']:.2f}x")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"device": "cpu", "threads": torch.get_num_threads(),
                                    "machine": platform.processor() or platform.machine(),
                                    "torch": torch.__version__, "results": results}, indent=2) + "\n")


if __name__ == "__main__":
    main()
