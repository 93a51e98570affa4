"""A caller's ``torch.autocast`` does not reach inside the recurrences' pure-torch backends: float32 inputs give the
same outputs, states and gradients with and without it (docs/ops.md: the recurrences compute in float32)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hybrid_pack.boundaries import PackedBoundaries, StaticBoundaries
from hybrid_pack.ops.dispatch.registry import contract_of, get_backend
from hybrid_pack.ops.dispatch.route import route_of

ROOT = Path(__file__).parents[2]
RECURRENCES = ("gated_delta", "kda", "decay_linear_attention", "ssd", "selective_scan")
BOUNDARIES = PackedBoundaries.from_document_lengths([3, 20, 1, 17], num_pad_tokens=3)


def _run(op: str, fn: object, boundaries: object, autocast: bool) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Outputs and token-input gradients of ``fn`` on the op's float32 case, under bfloat16 autocast or not."""
    contract = contract_of(op)
    case = contract.make_case(contract.default_signature(torch.float32, "cpu"), BOUNDARIES,
                              torch.Generator().manual_seed(0))
    leaves = {name: case.arguments[name].detach().clone().requires_grad_(True) for name in case.token_inputs
              if case.arguments[name] is not None}
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        result = case.call(fn, boundaries, {**case.arguments, **leaves})
    outputs = [t for t in (result if isinstance(result, tuple) else (result,)) if isinstance(t, torch.Tensor)]
    sum(o.double().sum() * (i + 1) for i, o in enumerate(outputs)).backward()
    return outputs, [leaf.grad for leaf in leaves.values()]


@pytest.mark.parametrize(("op", "form"), [(op, "public") for op in RECURRENCES]
                         + [(op, "static") for op in RECURRENCES if get_backend(op, "torch").static_fn is not None])
def test_float32_inputs_compute_in_float32_under_autocast(op: str, form: str) -> None:
    if form == "public":
        fn, boundaries = route_of(op).public, BOUNDARIES
    else:
        fn, boundaries = get_backend(op, "torch").static_fn, StaticBoundaries.from_boundaries(BOUNDARIES, 6)
    plain, plain_grads = _run(op, fn, boundaries, autocast=False)
    cast, cast_grads = _run(op, fn, boundaries, autocast=True)
    assert [o.dtype for o in cast] == [o.dtype for o in plain]
    for expected, got in zip(plain + plain_grads, cast + cast_grads, strict=True):
        torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)


CONTEXT_PARALLEL = """
import torch, torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore
dist.init_process_group("fake", store=FakeStore(), rank=1, world_size=2)
import importlib
for name in ("gated_delta", "decay_linear_attention", "ssd", "selective_scan"):
    module = importlib.import_module(f"hybrid_pack.ops.{name}.cp")
    module.gather_summaries = lambda summary, boundaries: torch.stack([summary, summary])  # rank 0's as its own
    module.tie = lambda y, summaries: y
from hybrid_pack import PackedBoundaries
from hybrid_pack.ops import decay_linear_attention, gated_delta_rule, kda, mamba2_ssd, selective_scan
from hybrid_pack.parallel import ShardedBoundaries
shard = ShardedBoundaries.from_row(PackedBoundaries.from_document_lengths([5, 27]), group=None, rank=1, world_size=2)
g = torch.Generator().manual_seed(0)
t = {n: torch.randn(1, 16, 2, 8, generator=g) for n in ("q", "k", "v", "x", "B", "C")}
t |= {"g": -torch.rand(1, 16, 2, generator=g), "gk": -torch.rand(1, 16, 2, 8, generator=g),
      "beta": torch.rand(1, 16, 2, generator=g), "dt": torch.randn(1, 16, 2, generator=g),
      "u": torch.randn(1, 16, 6, generator=g), "Bs": torch.randn(1, 16, 4, generator=g)}
A, A2 = -torch.rand(2, generator=g) - 0.5, -torch.rand(6, 4, generator=g) - 0.5
calls = {
    "gated_delta": lambda: gated_delta_rule(t["q"], t["k"], t["v"], t["g"], t["beta"], shard, use_qk_l2norm=True)[0],
    "kda": lambda: kda(t["q"], t["k"], t["v"], t["gk"], t["beta"], shard, use_qk_l2norm=True)[0],
    "decay_linear_attention": lambda: decay_linear_attention(t["q"], t["k"], t["v"], t["g"], shard)[0],
    "ssd": lambda: mamba2_ssd(t["x"], t["dt"], A, t["B"], t["C"], shard),
    "selective_scan": lambda: selective_scan(t["u"], t["u"].sigmoid(), A2, t["Bs"], t["Bs"], shard),
}
for name, call in calls.items():
    plain = call()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        cast = call()
    print(name, float((cast - plain).abs().max()))
"""


def test_context_parallel_recurrences_compute_in_float32_under_autocast() -> None:
    """The context-parallel paths' own state passing (einsums over the incoming state) ran under the caller's
    autocast: a rank's float32 outputs moved by up to 3.6e-2 (SSD). One process, a fake two-rank group whose
    all-gather returns this rank's summary twice."""
    result = subprocess.run([sys.executable, "-c", CONTEXT_PARALLEL], cwd=ROOT, capture_output=True, text=True,
                            check=False, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    differences = dict(line.split() for line in result.stdout.splitlines())
    assert set(differences) == set(RECURRENCES)
    assert all(float(d) == 0.0 for d in differences.values()), differences
