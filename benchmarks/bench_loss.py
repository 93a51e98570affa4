"""Peak memory and time of the LM loss, forward + backward: full logits + packed_loss against the chunked op.

    python benchmarks/bench_loss.py [--device cpu|cuda] [--dtype float32] [--vocab 151680] [--hidden 256]
        [--full-tokens 1024 2048 4096] [--chunked-tokens 4096 32768] [--backends torch]

Each case runs in a fresh subprocess: the hidden states ``[1, T, H]`` and the head's weight ``[V, H]`` are made
(and touched), then one forward + backward of the loss is measured. Peak memory is what the loss adds above that
point: on CPU the rise of the process's peak resident set (``ru_maxrss``; torch's CPU allocator returns freed
blocks, and the peak is the operating system's high-water mark, so nothing allocated in between is missed); on
CUDA ``torch.cuda.max_memory_allocated``. It includes the gradients of hidden and weight, which both paths make.

``full_logits``: ``lm_head(hidden)``, then :func:`hybrid_pack.packed_loss` (today's path before issue 27).
``chunked``: :func:`hybrid_pack.ops.linear_cross_entropy` forced to each of ``--backends``.
The full-logits baseline does not fit at T = 32,768 on a small machine; its figure there is computed from the
measured per-token slope (a least-squares line through the measured T) and labelled so in the results.
Hidden size barely matters for the logits' memory; the hidden size is kept small so the CPU run takes minutes.
Writes benchmarks/results/loss_memory[_<device>].json.
"""

from __future__ import annotations

import argparse
import json
import platform
import resource
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from hybrid_pack import packed_loss
from hybrid_pack.ops import linear_cross_entropy
from hybrid_pack.ops.linear_cross_entropy.op import DEFAULT_CHUNK_SIZE

RESULTS = Path(__file__).parent / "results"
TARGET_TOKENS = 32_768
MIB = 2 ** 20


def _peak_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def _loss(method: str, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    if method == "full_logits":
        return packed_loss(F.linear(hidden, weight), targets, shifted=True)
    return linear_cross_entropy(hidden, weight, targets, backend=method.removeprefix("chunked_"))


def run_case(method: str, tokens: int, vocab: int, hidden_size: int, dtype: torch.dtype, device: torch.device
             ) -> dict[str, Any]:
    """One forward + backward in this process: peak bytes above the inputs, and seconds."""
    torch.manual_seed(0)
    warm = [torch.randn(1, 64, hidden_size, device=device, dtype=dtype, requires_grad=True),
            torch.randn(vocab // 64, hidden_size, device=device, dtype=dtype, requires_grad=True)]
    _loss(method, *warm, torch.randint(0, vocab // 64, (1, 64), device=device)).backward()  # loads kernels
    # made in place, no temporaries: the peak so far is what the process holds now
    hidden = torch.randn(1, tokens, hidden_size, device=device, dtype=dtype).requires_grad_()
    weight = torch.randn(vocab, hidden_size, device=device, dtype=dtype).mul_(hidden_size ** -0.5).requires_grad_()
    targets = torch.randint(0, vocab, (1, tokens), device=device)
    targets[:, -1] = -100
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    before = _peak_bytes(device)
    began = time.perf_counter()
    loss = _loss(method, hidden, weight, targets)
    loss.backward()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    seconds = time.perf_counter() - began
    return {"method": method, "tokens": tokens, "peak_bytes": _peak_bytes(device) - before, "seconds": seconds,
            "loss": loss.item()}


def _in_subprocess(method: str, tokens: int, args: argparse.Namespace) -> dict[str, Any]:
    command = [sys.executable, __file__, "--case", method, str(tokens), "--device", args.device, "--dtype",
               args.dtype, "--vocab", str(args.vocab), "--hidden", str(args.hidden)]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        return {"method": method, "tokens": tokens, "error": done.stderr.strip().splitlines()[-1:]}
    result = json.loads(done.stdout.strip().splitlines()[-1])
    print(f"{method:>14} T={tokens:>6}: {result['peak_bytes'] / MIB:9.0f} MiB  {result['seconds']:7.2f} s", flush=True)
    return result


def _slope(points: list[dict[str, Any]]) -> tuple[float, float]:
    """Least-squares ``peak = a + b * T`` through the measured points: (a, b) in bytes and bytes per token."""
    xs, ys = [p["tokens"] for p in points], [p["peak_bytes"] for p in points]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    return my - b * mx, b


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--vocab", type=int, default=151_680)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--full-tokens", type=int, nargs="*", default=[1024, 2048, 4096])
    parser.add_argument("--chunked-tokens", type=int, nargs="*", default=[4096, TARGET_TOKENS])
    parser.add_argument("--backends", nargs="*", default=["torch"])
    parser.add_argument("--case", nargs=2, metavar=("METHOD", "TOKENS"), help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    if args.case:
        print(json.dumps(run_case(args.case[0], int(args.case[1]), args.vocab, args.hidden, dtype, device)))
        return

    full = [_in_subprocess("full_logits", t, args) for t in args.full_tokens]
    chunked = {name: [_in_subprocess(f"chunked_{name}", t, args) for t in args.chunked_tokens]
               for name in args.backends}
    measured = [p for p in full if "error" not in p]
    intercept, per_token = _slope(measured) if len(measured) >= 2 else (float("nan"), float("nan"))
    at_target = {name: next((p for p in points if p["tokens"] == TARGET_TOKENS and "error" not in p), None)
                 for name, points in chunked.items()}
    full_at_target = intercept + per_token * TARGET_TOKENS
    summary = {
        "full_logits_at_32768_bytes_computed": full_at_target,
        "full_logits_at_32768_note": ("computed, not measured: the least-squares line through the full-logits "
                                      f"points at T = {[p['tokens'] for p in measured]}"),
        "full_logits_bytes_per_token_measured": per_token,
        **{f"chunked_{name}_at_32768_bytes_measured": None if p is None else p["peak_bytes"]
           for name, p in at_target.items()},
        **{f"chunked_{name}_at_32768_seconds": None if p is None else p["seconds"] for name, p in at_target.items()},
    }
    result = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or
              platform.machine(), "threads": torch.get_num_threads(), "torch": torch.__version__,
              "dtype": args.dtype, "vocab": args.vocab, "hidden": args.hidden, "chunk_size": DEFAULT_CHUNK_SIZE,
              "measure": "CUDA max_memory_allocated" if device.type == "cuda" else
              "rise of ru_maxrss in a fresh subprocess per case",
              "full_logits": full, "chunked": chunked, "summary": summary}
    out = args.out or RESULTS / ("loss_memory.json" if device.type == "cpu" else f"loss_memory_{device.type}.json")
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"full logits at T={TARGET_TOKENS} (computed from {per_token / MIB * 1024:.1f} KiB/token): "
          f"{full_at_target / 2 ** 30:.1f} GiB; chunked: " + ", ".join(
              f"{name} {p['peak_bytes'] / 2 ** 30:.2f} GiB in {p['seconds']:.1f} s" for name, p in at_target.items()
              if p is not None) + f"  -> {out}")


if __name__ == "__main__":
    main()
