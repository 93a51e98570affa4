"""One rank of tests/parallel/test_cp_attention_ring.py (launched by torchrun, gloo): context-parallel attention
through the ring passes and the partial forms, sharded against unsharded.

For every attention backend usable here, both layouts, with and without a sliding window, on the adversarial
context-parallel row and the context-parallel proofs' rows: rank r's output and the gradients of q, k and v,
gathered over the group, equal the unsharded op's (float64, 1e-10), and one segment's output has exactly zero
gradient with respect to every other segment's tokens. Rank 0 writes ``{case: verdict}`` as JSON to
``sys.argv[1]``.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as dist

from hybrid_pack import PackedBoundaries, backends
from hybrid_pack.boundaries.sharded import LAYOUTS
from hybrid_pack.distributed import end_process_group
from hybrid_pack.isolation import adversarial_cp_row
from hybrid_pack.ops import varlen_attention
from hybrid_pack.parallel import ShardedBoundaries
from tests.kit import assert_close
from tests.workers.dist_context_parallel import op_layouts
from tests.workers.gathered import gather_tokens
from tests.workers.launch import exit_without_finalizing, run_cases, write_on_rank0

TOL = 1e-10
HEADS, KV_HEADS, DIM, SCALE = 4, 2, 8, 0.3
WINDOWS = (None, 5)


def rows(world: int) -> dict[str, PackedBoundaries]:
    """The adversarial context-parallel row, the context-parallel proofs' rows, and one document over the row."""
    out = {"adversarial_cp_row": adversarial_cp_row(world)}
    out.update({layout.name: layout.boundaries() for layout in op_layouts(world)})
    out["one_document"] = PackedBoundaries.from_lengths([world * 40])
    return out


def check(row: PackedBoundaries, cp_layout: str, backend: str, window: int | None, rank: int, world: int) -> None:
    """Outputs, q/k/v gradients and zero cross-segment gradients, sharded vs unsharded."""
    generator = torch.Generator().manual_seed(0)
    total = row.total_tokens
    q, k, v = (torch.randn(1, total, heads, DIM, generator=generator, dtype=torch.float64).requires_grad_()
               for heads in (HEADS, KV_HEADS, KV_HEADS))
    weight = torch.randn(1, total, HEADS, DIM, generator=generator, dtype=torch.float64)

    def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, boundaries: object) -> torch.Tensor:
        return varlen_attention(q, k, v, boundaries, softmax_scale=SCALE, window=window, backend=backend)

    expected = attention(q, k, v, row)
    expected_grads = torch.autograd.grad((expected * weight).sum(), (q, k, v))

    shard = ShardedBoundaries.from_row(row, group=None, rank=rank, world_size=world, layout=cp_layout)
    local = [shard.take(t).detach().requires_grad_() for t in (q, k, v)]
    output = attention(*local, shard)
    assert_close(gather_tokens(output.detach(), shard), expected.detach(), "output", tol=TOL)
    grads = torch.autograd.grad((output * shard.take(weight)).sum(), local, retain_graph=True)
    for name, grad, want in zip("qkv", grads, expected_grads, strict=True):
        assert_close(gather_tokens(grad, shard), want, f"d{name}", tol=TOL)

    for segment, (start, length) in enumerate(zip(row.starts, row.segment_lengths, strict=True)):
        mask = torch.zeros(1, total, 1, 1, dtype=torch.float64)
        mask[:, start:start + length] = 1
        loss = (output * shard.take(weight) * shard.take(mask)).sum()
        leaks = torch.autograd.grad(loss, local, retain_graph=True, allow_unused=True)
        outside = torch.ones(total, dtype=torch.bool)
        outside[start:start + length] = False
        for name, grad, tensor in zip("qkv", leaks, local, strict=True):
            full = gather_tokens(torch.zeros_like(tensor) if grad is None else grad, shard)
            leak = full[0, outside].abs().max().item() if outside.any() else 0.0
            assert leak == 0.0, f"segment {segment}'s output has gradient {leak:g} w.r.t. other segments' {name}"


def usable_backends() -> list[str]:
    """The attention backends that run here (on CPU: the pure-torch one; kernels where they pass their check)."""
    return [record.backend for record in backends.available("attention") if record.usable]


def cases(world: int, names: list[str]) -> dict[str, Callable[[int], None]]:
    out = {}
    for backend in names:
        for cp_layout in LAYOUTS:
            for window in WINDOWS:
                for name, row in rows(world).items():
                    out[f"{backend}-{cp_layout}-window{window}-{name}"] = (
                        lambda rank, row=row, cp=cp_layout, b=backend, w=window: check(row, cp, b, w, rank, world))
    return out


def main(out_path: str) -> None:
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))  # a case that hangs fails instead
    names = usable_backends()
    write_on_rank0(out_path, {"backends": ",".join(names), **run_cases(cases(dist.get_world_size(), names))})
    end_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
    exit_without_finalizing(0)
