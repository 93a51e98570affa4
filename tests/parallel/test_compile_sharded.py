"""Compiled decoder blocks (:func:`hybrid_pack.parallel.compile.compile_blocks`) under FSDP2 and under context
parallelism equal the eager model, with every graph compiled in the first step (docs/compile.md).

One torchrun launch on 2 gloo ranks (tests/workers/compile_sharded.py) trains a compiled and an eager copy of a
model side by side on static batches, a new document layout at every step; each case reports one verdict. The
in-process tests check what reaches the compiled blocks.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch._dynamo
from torch._dynamo.exc import RecompileError

from hybrid_pack import PackedBoundaries, PackingCollator
from hybrid_pack.boundaries.static import StaticBoundaries
from hybrid_pack.errors import UnsupportedModelError
from hybrid_pack.modeling import HybridConfig, HybridForCausalLM
from hybrid_pack.ops import causal_conv1d
from hybrid_pack.ops.cp.eager import run_eagerly
from hybrid_pack.ops.dispatch.registry import get_backend
from hybrid_pack.parallel import ShardedBoundaries
from hybrid_pack.parallel.compile import compile_blocks, static_boundaries_from_keys
from hybrid_pack.parallel.fsdp import decoder_blocks
from hybrid_pack.schema import BOUNDARIES, BOUNDARY_KEYS, INPUT_IDS
from tests.kit import assert_close
from tests.workers import compile_sharded as worker
from tests.workers.launch import torchrun

WORKER = Path(worker.__file__)


@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory) -> dict:
    out = tmp_path_factory.mktemp("compile_sharded") / "report.json"
    torchrun(WORKER, str(out), processes=2, timeout=900)
    return json.loads(out.read_text())


@pytest.mark.distributed
@pytest.mark.parametrize("case", list(worker.CASES))
def test_compiled_blocks_equal_eager_with_one_compilation(report, case):
    """Losses, gradients and parameters equal eager over every layout; nothing compiled after the first step."""
    assert report["verdicts"][case] == "ok", report["verdicts"][case]
    assert report["graphs"][case] > 0


# ---------------------------------------------------------------- in process
def _tiny() -> HybridForCausalLM:
    torch.manual_seed(0)
    return HybridForCausalLM(HybridConfig(vocab_size=64, hidden_size=32, layer_pattern="GA", intermediate_size=64))


def test_compile_blocks_compiles_every_block_once_and_keeps_the_root_eager():
    model = _tiny()
    assert compile_blocks(model, backend="eager") is model
    assert compile_blocks(model, backend="eager") is model  # idempotent: one hook, blocks compiled once
    assert all(block._compiled_call_impl is not None for block in decoder_blocks(model))
    assert model._compiled_call_impl is None
    assert len(model._forward_pre_hooks) == 1


def test_a_static_batch_reaches_the_blocks_as_static_boundaries():
    batch = PackingCollator(pack_length=16, max_documents=4)([{INPUT_IDS: torch.arange(1, 6)},
                                                             {INPUT_IDS: torch.arange(1, 8)}])
    _, kwargs = static_boundaries_from_keys(None, (), dict(batch))
    boundaries = kwargs[BOUNDARIES]
    assert isinstance(boundaries, StaticBoundaries)
    assert boundaries.cu_seqlens is batch["cu_seq_lens_q"] and boundaries.num_segments == 5
    assert not set(kwargs) & set(BOUNDARY_KEYS)
    given = {INPUT_IDS: batch[INPUT_IDS], BOUNDARIES: PackedBoundaries.from_batch(batch)}
    assert static_boundaries_from_keys(None, (), given)[1] is given  # ready boundaries are left alone


def test_new_layouts_recompile_the_blocks_unless_static_boundaries_reach_them():
    """What the hook buys: host-valued PackedBoundaries make every new layout a recompilation; the static ones do
    not, and give the eager model's logits."""
    eager, model = _tiny(), compile_blocks(_tiny(), backend="eager")
    collator = PackingCollator(pack_length=16, max_documents=4)
    batches = [collator([{INPUT_IDS: torch.arange(1, n + 1)} for n in lengths]) for lengths in ((5, 7), (3, 3, 3))]
    plain = [{INPUT_IDS: batch[INPUT_IDS], BOUNDARIES: PackedBoundaries.from_batch(batch)} for batch in batches]
    torch._dynamo.reset()
    model(**plain[0])
    with torch._dynamo.config.patch(error_on_recompile=True), pytest.raises(RecompileError):
        model(**plain[1])
    model(**batches[0])
    with torch._dynamo.config.patch(error_on_recompile=True):
        logits = model(**batches[1]).logits
    assert_close(logits, eager(**batches[1]).logits, "logits", tol=1e-5)


def test_run_eagerly_runs_the_route_outside_the_graph_with_row_major_outputs():
    """A graph calling :func:`run_eagerly` breaks there; the route's outputs come back with row-major strides."""
    calls = []

    def route(arguments: dict, boundaries: object, *, backend: str | None, requires_grad: bool) -> torch.Tensor:
        calls.append(torch.compiler.is_compiling())
        x = arguments["x"]
        return torch.cat([x, x], dim=1)[:, 1:]  # a slice: strides of the longer tensor

    x = torch.randn(1, 4, 3)
    out = torch.compile(lambda x: run_eagerly(route, {"x": x}, None, None, False) * 1, backend="eager")(x)
    assert calls == [False]
    assert out.stride() == (21, 3, 1)
    assert torch.equal(out, torch.cat([x, x], dim=1)[:, 1:])


def test_an_op_on_a_shard_runs_eagerly_in_a_graph_and_is_traced_on_a_whole_row(monkeypatch: pytest.MonkeyPatch):
    """The compile rule of docs/compile.md, applied by the ops' routes: on a ShardedBoundaries the op (validation
    aside) runs outside the graph, on a PackedBoundaries its backend is traced; both equal the eager op."""
    torch._dynamo.reset()
    backend = get_backend("conv", "torch")
    calls = []

    def spy(*args, **kwargs):
        calls.append(torch.compiler.is_compiling())
        return real(*args, **kwargs)

    real = backend.fn
    monkeypatch.setitem(backend.__dict__, "fn", spy)
    x, weight, bias = torch.randn(1, 8, 4), torch.randn(4, 3), None
    row = PackedBoundaries.from_lengths([3, 5])
    shard = ShardedBoundaries.from_row(row, group=None, rank=0, world_size=1)
    expected = causal_conv1d(x, weight, bias, row)
    compiled = torch.compile(lambda x, b: causal_conv1d(x, weight, bias, b) * 1, backend="eager")
    calls.clear()
    assert_close(compiled(x, shard), expected, "on a shard", tol=1e-6)
    assert calls and not any(calls)
    calls.clear()
    assert_close(compiled(x, row), expected, "on a whole row", tol=1e-6)
    assert calls and all(calls)


def test_compile_blocks_refuses_a_model_without_blocks():
    with pytest.raises(UnsupportedModelError, match="decoder blocks"):
        compile_blocks(torch.nn.Linear(2, 2))
