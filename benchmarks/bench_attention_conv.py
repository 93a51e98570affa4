"""Pure-torch varlen attention and causal conv vs their naive alternatives: forward + backward on a packed row.

    .venv/bin/python benchmarks/bench_attention_conv.py

defaults: T=4096 with 8 and with 64 documents; attention H=4, D=64, causal; conv D=512, W=4, silu;
float32, 1 thread.

Attention is compared with one SDPA call over the whole row under a dense ``[T, T]`` block-diagonal
causal mask, and with one SDPA call per document. The conv is compared with the per-token test
reference and with one ``F.conv1d`` per document. Every variant is checked against the op's output
before it is timed. Writes ``benchmarks/results/attention_conv.json`` and prints markdown tables for
docs/benchmarks.md. Each timing is the best process CPU time of ``--repeats`` runs after a warm-up
(CPU time, not wall time: the machine may be shared).
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hybrid_pack import PackedBoundaries
from hybrid_pack.ops import causal_conv1d, varlen_attention
from tests.ops.reference.conv import causal_conv1d_ref

RESULTS = Path(__file__).resolve().parent / "results" / "attention_conv.json"


def document_lengths(total: int, num_docs: int, rng: np.random.Generator) -> list[int]:
    """``num_docs`` positive lengths summing to ``total``, cut at distinct random points."""
    cuts = np.sort(rng.choice(np.arange(1, total), size=num_docs - 1, replace=False))
    return np.diff(np.concatenate([[0], cuts, [total]])).tolist()


def time_fwd_bwd(fn: Callable[..., torch.Tensor], inputs: dict[str, torch.Tensor], repeats: int,
                 expected: torch.Tensor) -> float:
    """Best CPU time (s, this process) of forward + backward of ``sum(out * weight)``, after one warm-up run.

    CPU time rather than wall time: on a shared machine it does not count time spent waiting for a core.
    """
    weight = torch.randn_like(expected)
    best = float("inf")
    for run in range(repeats + 1):
        leaves = {name: x.detach().requires_grad_() for name, x in inputs.items()}
        start = time.process_time()
        out = fn(**leaves)
        (out * weight).sum().backward()
        if run:
            best = min(best, time.process_time() - start)
        else:
            torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-4)
    return best


def bench_attention(boundaries: PackedBoundaries, heads: int, dim: int, repeats: int, seed: int
                    ) -> dict[str, float]:
    gen = torch.Generator().manual_seed(seed)
    total = boundaries.total_tokens
    inputs = {name: torch.randn(1, total, heads, dim, generator=gen) for name in ("q", "k", "v")}
    seq = boundaries.seq_idx[0]
    block_causal = (seq[:, None] == seq[None, :]).tril()

    def packed(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return varlen_attention(q, k, v, boundaries, backend="torch")

    def dense_mask(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                             attn_mask=block_causal)
        return out.transpose(1, 2)

    def per_document(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        outs = [F.scaled_dot_product_attention(*(t[:, s:s + n].transpose(1, 2) for t in (q, k, v)), is_causal=True)
                for s, n in zip(boundaries.starts, boundaries.segment_lengths)]
        return torch.cat(outs, dim=2).transpose(1, 2)

    with torch.no_grad():
        expected = packed(**inputs)
    return {
        "dense [T, T] mask, one SDPA call": time_fwd_bwd(dense_mask, inputs, repeats, expected),
        "one SDPA call per document": time_fwd_bwd(per_document, inputs, repeats, expected),
        "hybrid_pack varlen_attention(backend='torch')": time_fwd_bwd(packed, inputs, repeats, expected),
    }


def bench_conv(boundaries: PackedBoundaries, channels: int, width: int, repeats: int, reference_repeats: int,
               seed: int) -> dict[str, float]:
    gen = torch.Generator().manual_seed(seed)
    total = boundaries.total_tokens
    inputs = {"x": torch.randn(1, total, channels, generator=gen),
              "weight": torch.randn(channels, width, generator=gen) / width,
              "bias": torch.randn(channels, generator=gen)}

    def packed(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        return causal_conv1d(x, weight, bias, boundaries, activation="silu", backend="torch")

    def reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        return causal_conv1d_ref(x, weight, bias, boundaries, activation="silu")

    def per_document(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        channels_first = x.transpose(1, 2)
        outs = [F.conv1d(channels_first[..., s:s + n], weight.unsqueeze(1), bias, padding=width - 1,
                         groups=channels)[..., :n]
                for s, n in zip(boundaries.starts, boundaries.segment_lengths)]
        return F.silu(torch.cat(outs, dim=-1)).transpose(1, 2)

    with torch.no_grad():
        expected = packed(**inputs)
    return {
        "per-token reference (tests/ops/reference/conv.py, float64)": time_fwd_bwd(reference, inputs, reference_repeats,
                                                                              expected),
        "one F.conv1d per document": time_fwd_bwd(per_document, inputs, repeats, expected),
        "hybrid_pack causal_conv1d(backend='torch')": time_fwd_bwd(packed, inputs, repeats, expected),
    }


ATTENTION_BASELINE = "dense [T, T] mask, one SDPA call"
CONV_BASELINE = "per-token reference (tests/ops/reference/conv.py, float64)"


def table(title: str, tokens: int, rows: dict[str, float], baseline: str) -> str:
    lines = [title, "", "| implementation | fwd+bwd CPU ms | tokens per CPU second | speedup vs baseline |",
             "|---|---:|---:|---:|"]
    for name, seconds in rows.items():
        label = f"{name} (baseline)" if name == baseline else name
        lines.append(f"| {label} | {seconds * 1e3:.1f} | {tokens / seconds:,.0f} | {rows[baseline] / seconds:.1f}x |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--docs", type=int, nargs="+", default=[8, 64], help="one run per document count")
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--channels", type=int, default=512)
    parser.add_argument("--width", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--reference-repeats", type=int, default=1)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()

    torch.set_num_threads(args.threads)
    runs = []
    for num_docs in args.docs:
        lengths = document_lengths(args.tokens, num_docs, np.random.default_rng(args.seed))
        boundaries = PackedBoundaries.from_lengths(lengths)
        attention = bench_attention(boundaries, args.heads, args.head_dim, args.repeats, args.seed)
        conv = bench_conv(boundaries, args.channels, args.width, args.repeats, args.reference_repeats, args.seed)
        runs.append({"docs": num_docs, "lengths": lengths,
                     "attention_cpu_seconds": attention,
                     "attention_tokens_per_cpu_second": {k: args.tokens / s for k, s in attention.items()},
                     "conv_cpu_seconds": conv,
                     "conv_tokens_per_cpu_second": {k: args.tokens / s for k, s in conv.items()}})
        print(f"T={args.tokens}, {num_docs} documents (longest {max(lengths)}), float32, {args.threads} thread(s), "
              f"best CPU time of {args.repeats}\n")
        print(table(f"Attention, causal, H={args.heads}, D={args.head_dim}", args.tokens, attention,
                    ATTENTION_BASELINE))
        print()
        print(table(f"Causal conv, D={args.channels}, W={args.width}, silu", args.tokens, conv, CONV_BASELINE))
        print()

    result = {
        "benchmark": "varlen_attention (causal) and causal_conv1d (silu) forward+backward, CPU float32",
        "command": "python benchmarks/bench_attention_conv.py " + " ".join(sys.argv[1:]),
        "timing": "best process CPU time of forward+backward after one warm-up run",
        "tokens": args.tokens, "heads": args.heads, "head_dim": args.head_dim, "channels": args.channels,
        "width": args.width, "threads": args.threads, "repeats": args.repeats,
        "torch": torch.__version__, "machine": platform.processor() or platform.machine(),
        "attention_baseline": ATTENTION_BASELINE, "conv_baseline": CONV_BASELINE,
        "runs": runs,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
