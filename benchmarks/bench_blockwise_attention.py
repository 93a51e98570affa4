"""Blockwise lower-right causal attention against the dense-mask SDPA call it replaces in ``ops/attention/cp.py``.

    .venv/bin/python benchmarks/bench_blockwise_attention.py

The shape is a continuing document's under context parallelism: ``Tq = T/2`` local queries over
``Tk = T`` keys (the earlier half from other ranks), causal with the diagonal bottom right. Defaults:
T in (4096, 16384), H=4, Hkv=2, D=32, float32 on CPU, 1 thread, block 512.

For each variant, in a fresh process: forward + backward of ``sum(out * weight)``; the best CPU time of
``--repeats`` runs after a warm-up (CPU time, not wall time: the machine may be shared); the bytes saved
for backward (a ``saved_tensors_hooks`` pack hook summing ``numel * element_size``); the largest tensor
any torch op returned (a dispatch mode; it does not see a kernel's internal buffers); and the growth of
the process's peak resident memory over the first forward + backward (``ru_maxrss``, after the inputs
exist). Both variants' outputs and gradients are checked against each other first. Writes
``benchmarks/results/blockwise_attention.json`` and prints a markdown table.
"""

from __future__ import annotations

import argparse
import json
import platform
import resource
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hybrid_pack.ops.attention.blockwise import lower_right_causal_attention

RESULTS = Path(__file__).resolve().parent / "results" / "blockwise_attention.json"
VARIANTS = ("blockwise", "dense_mask_sdpa")


def attention(variant: str, num_queries: int, num_keys: int, block: int
              ) -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]:
    """``[Tq, H, D]`` queries over ``[Tk, Hkv, D]`` keys -> ``[Tq, H, D]``, causal bottom right, by ``variant``."""
    if variant == "blockwise":
        return lambda q, k, v: lower_right_causal_attention(q, k, v, scale=q.shape[-1] ** -0.5, block=block)
    mask = causal_lower_right(num_queries, num_keys)  # built here: not inside a dispatch mode

    def dense_mask_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """What ops/attention/cp.py runs today for the continuing document."""
        out = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None],
                                             v.transpose(0, 1)[None], attn_mask=mask, scale=q.shape[-1] ** -0.5,
                                             enable_gqa=q.shape[1] != k.shape[1])
        return out[0].transpose(0, 1)

    return dense_mask_sdpa


def make_inputs(tokens: int, heads: int, kv_heads: int, dim: int, seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {"q": torch.randn(tokens // 2, heads, dim, generator=gen),
            "k": torch.randn(tokens, kv_heads, dim, generator=gen),
            "v": torch.randn(tokens, kv_heads, dim, generator=gen),
            "weight": torch.randn(tokens // 2, heads, dim, generator=gen)}


class LargestTensor(TorchDispatchMode):
    """Records the bytes of the largest tensor any op returns."""

    def __init__(self) -> None:
        super().__init__()
        self.bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(tensor, torch.Tensor):
                self.bytes = max(self.bytes, tensor.numel() * tensor.element_size())
        return out


def resident_bytes() -> int:
    """This process's resident memory now (Linux)."""
    return int(Path("/proc/self/statm").read_text().split()[1]) * resource.getpagesize()


def measure(variant: str, tokens: int, heads: int, kv_heads: int, dim: int, block: int, repeats: int,
            seed: int) -> dict[str, float | int]:
    """One variant in this process: peak memory of the first run, then timings and the counters."""
    inputs = make_inputs(tokens, heads, kv_heads, dim, seed)
    weight = inputs.pop("weight")
    fn = attention(variant, tokens // 2, tokens, block)

    def run() -> tuple[torch.Tensor, ...]:
        leaves = [x.detach().requires_grad_() for x in inputs.values()]
        out = fn(*leaves)
        (out * weight).sum().backward()
        return out.detach(), *(x.grad for x in leaves)

    before = resident_bytes()
    run()
    peak_growth = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before
    best = float("inf")
    for _ in range(repeats):
        start = time.process_time()
        run()
        best = min(best, time.process_time() - start)
    saved = 0

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        nonlocal saved
        saved += tensor.numel() * tensor.element_size()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor), LargestTensor() as largest:
        run()
    return {"fwd_bwd_cpu_s": best, "saved_bytes": saved, "largest_tensor_bytes": largest.bytes,
            "peak_rss_growth_bytes": peak_growth}


def check_agreement(tokens: int, heads: int, kv_heads: int, dim: int, block: int, seed: int) -> float:
    """The largest difference between the variants' outputs and gradients (on a quarter-size row)."""
    inputs = make_inputs(tokens // 4, heads, kv_heads, dim, seed)
    weight = inputs.pop("weight")
    results = []
    for variant in VARIANTS:
        leaves = [x.detach().requires_grad_() for x in inputs.values()]
        out = attention(variant, tokens // 8, tokens // 4, block)(*leaves)
        (out * weight).sum().backward()
        results.append([out.detach(), *(x.grad for x in leaves)])
    return max((a - b).abs().max().item() for a, b in zip(*results))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[4096, 16384], help="T (Tk = T, Tq = T/2)")
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--dim", type=int, default=32)
    parser.add_argument("--block", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--one", choices=VARIANTS, help=argparse.SUPPRESS)  # internal: measure one variant
    args = parser.parse_args()
    torch.set_num_threads(1)
    shape = (args.heads, args.kv_heads, args.dim, args.block)
    if args.one:
        print(json.dumps(measure(args.one, args.tokens[0], *shape, args.repeats, args.seed)))
        return
    rows = []
    for tokens in args.tokens:
        error = check_agreement(tokens, *shape, args.seed)
        assert error < 1e-4, f"T={tokens}: the variants differ by {error}"
        row = {"T": tokens, "Tq": tokens // 2, "Tk": tokens, "max_abs_difference": error}
        for variant in VARIANTS:
            command = [sys.executable, __file__, "--one", variant, "--tokens", str(tokens), "--heads",
                       str(args.heads), "--kv-heads", str(args.kv_heads), "--dim", str(args.dim), "--block",
                       str(args.block), "--repeats", str(args.repeats), "--seed", str(args.seed)]
            done = subprocess.run(command, check=True, capture_output=True, text=True)
            row[variant] = json.loads(done.stdout.splitlines()[-1])
        rows.append(row)
    result = {
        "what": "forward + backward, Tq = T/2 queries over Tk = T keys, causal lower right; blockwise online "
                "softmax vs SDPA with causal_lower_right (dense mask, what ops/attention/cp.py runs today)",
        "heads": args.heads, "kv_heads": args.kv_heads, "head_dim": args.dim, "block": args.block,
        "dtype": "float32", "threads": 1, "repeats": args.repeats, "time": "best process CPU time (s)",
        "torch": torch.__version__, "machine": platform.machine(), "processor": platform.processor(),
        "rows": rows,
    }
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=2) + "\n")
    mib = 2 ** 20
    print("| T | variant | fwd+bwd CPU s | saved MiB | largest tensor MiB | peak RSS growth MiB |")
    print("|---|---|---|---|---|---|")
    for row in rows:
        for variant in VARIANTS:
            m = row[variant]
            print(f"| {row['T']} | {variant} | {m['fwd_bwd_cpu_s']:.2f} | {m['saved_bytes'] / mib:.1f} | "
                  f"{m['largest_tensor_bytes'] / mib:.1f} | {m['peak_rss_growth_bytes'] / mib:.1f} |")


if __name__ == "__main__":
    main()
