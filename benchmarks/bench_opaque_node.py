"""A compiled forward and backward of one op through its opaque node (``hybrid_pack::<op>``): the path a kernel with
no static form takes in a compiled graph (docs/compile.md).

    python benchmarks/bench_opaque_node.py [--ops conv gated_delta ssd] [--tokens 4096] [--documents 16] [--steps 5]
        [--label after] [--out benchmarks/results/opaque_node.json]

On a CPU no kernel runs, so the op's per-document pure-torch backend stands in for one: it is registered as a CPU
"kernel" with no static form (priority above every other backend) and is counted. Each op is compiled (inductor,
``fullgraph=True``) on one static row of ``--tokens`` tokens and ``--documents`` documents of the op's typical CPU
signature in float32; a step is the forward and the backward of one random projection of the outputs. Reported per
op: the median step (ms) over ``--steps`` steps after the first (compiling) one, the same step eagerly (the op on
the plain boundaries), and how many times the backend ran in the forward and in the backward of one step.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

import hybrid_pack.ops as ops
from hybrid_pack import backends
from hybrid_pack.boundaries import PackedBoundaries, StaticBoundaries
from hybrid_pack.ops.dispatch.registry import contract_of, reference_of

RESULTS = Path(__file__).parent / "results"
PUBLIC = {"attention": ops.varlen_attention, "conv": ops.causal_conv1d, "gated_delta": ops.gated_delta_rule,
          "ssd": ops.mamba2_ssd}
STAND_IN = "stand_in_kernel"


def _leaves(arguments: dict[str, Any]) -> dict[str, Any]:
    return {name: value.detach().requires_grad_(value.is_floating_point()) if isinstance(value, torch.Tensor)
            else value for name, value in arguments.items()}


def _median_ms(step: Callable[[], None], steps: int) -> float:
    times = []
    for _ in range(steps):
        began = time.perf_counter()
        step()
        times.append((time.perf_counter() - began) * 1e3)
    return statistics.median(times)


def measure(op: str, tokens: int, documents: int, steps: int) -> dict[str, Any]:
    contract = contract_of(op)
    lengths = [tokens // documents] * (documents - 1)
    lengths.append(tokens - sum(lengths))
    plain = PackedBoundaries.from_lengths(lengths)
    static = StaticBoundaries.from_boundaries(plain, documents + 2)
    case = contract.make_case(contract.default_signature(torch.float32, "cpu"), plain, torch.Generator().manual_seed(0))
    calls: list[int] = []
    reference = reference_of(op).fn

    def stand_in(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        return reference(*args, **kwargs)

    def public(*args: Any, **kwargs: Any) -> Any:
        return PUBLIC[op](*args, backend=STAND_IN, **kwargs)

    def forward(fn: Callable[..., Any], boundaries: Any) -> torch.Tensor:
        tokens, states = contract.outputs(case.call(fn, boundaries, _leaves(case.arguments)))
        return sum((t.float() * 1e-3).sum() for t in tokens + states)

    backends.register(op, STAND_IN, stand_in, priority=1000, devices=("cpu",), dtypes=(torch.float32,))
    try:
        forward(public, plain).backward()  # the single process's self-check
        torch._dynamo.reset()
        compiled = torch.compile(public, fullgraph=True)
        forward(compiled, static).backward()  # compiles
        calls.clear()
        loss = forward(compiled, static)
        forward_calls = len(calls)
        loss.backward()
        backward_calls = len(calls) - forward_calls
        compiled_ms = _median_ms(lambda: forward(compiled, static).backward(), steps)
        eager_ms = _median_ms(lambda: forward(public, plain).backward(), steps)
    finally:
        backends.unregister(op, STAND_IN)
    return {"op": op, "tokens": tokens, "documents": documents, "compiled_step_ms": round(compiled_ms, 2),
            "eager_step_ms": round(eager_ms, 2), "compiled_over_eager": round(compiled_ms / eager_ms, 3),
            "backend_calls_forward": forward_calls, "backend_calls_backward": backward_calls}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ops", nargs="+", default=["conv", "gated_delta", "ssd"], choices=sorted(PUBLIC))
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--documents", type=int, default=16)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--label", default="now")
    parser.add_argument("--out", type=Path, default=RESULTS / "opaque_node.json")
    args = parser.parse_args()
    rows = []
    for op in args.ops:
        rows.append(measure(op, args.tokens, args.documents, args.steps))
        print(json.dumps(rows[-1]), flush=True)
    record = {"label": args.label, "machine": platform.processor() or platform.machine(),
              "threads": torch.get_num_threads(), "torch": torch.__version__, "rows": rows}
    existing = json.loads(args.out.read_text()) if args.out.exists() else []
    args.out.write_text(json.dumps([r for r in existing if r.get("label") != args.label] + [record], indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
