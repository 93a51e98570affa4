"""The thin dispatch (docs/api.md §5, §9b): one route per op, a dictionary look-up per call, verdicts settled by
one warm-up, a loud failure where it was skipped, compiled graphs that follow the verdicts, and an import of the ops
that loads neither the compiler stack nor FSDP. Exercised with a planted CPU conv kernel (the pure-torch one)."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
import threading
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch._dynamo

from hybrid_pack import backends
from hybrid_pack.boundaries.static import StaticBoundaries
from hybrid_pack.ops import causal_conv1d
from hybrid_pack.ops.compiler import assume_constant_result
from hybrid_pack.ops.conv import op as conv_op
from hybrid_pack.ops.dispatch import route, selector, verdicts
from hybrid_pack.ops.dispatch.registry import contract_of, reference_of, registered_ops
from hybrid_pack.ops.dispatch.route import route_of
from hybrid_pack.ops.selfcheck import kept
from tests import kit

PLANTED = "planted"
ROW = kit.Layout("three_docs_and_padding", (3, 1, 9), num_pad_tokens=3)
CALLS: list[int] = []


def planted_conv(*args: Any, **kwargs: Any) -> torch.Tensor:
    """A conv kernel stand-in: the pure-torch backend, counted."""
    CALLS.append(1)
    return reference_of("conv").fn(*args, **kwargs)


@pytest.fixture(autouse=True)
def fresh(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Each test: its own results cache, no override, no planted kernel left behind."""
    monkeypatch.setenv(kept.CACHE_ENV, str(tmp_path / "cache"))
    monkeypatch.delenv(selector.ENV_VAR, raising=False)
    monkeypatch.delenv(selector.VERIFY_ENV, raising=False)
    monkeypatch.setattr(kept, "_memory", {})
    monkeypatch.setattr(kept, "_loaded_from", None)
    CALLS.clear()
    yield
    if any(b.name == PLANTED for b in backends.backends_of("conv")):
        backends.unregister("conv", PLANTED)
    torch._dynamo.reset()


def plant() -> None:
    backends.register("conv", PLANTED, planted_conv, priority=100, devices=("cpu",), dtypes=(torch.float32,))


def conv_case(boundaries: Any, seed: int = 0) -> dict[str, Any]:
    signature = contract_of("conv").default_signature(torch.float32, "cpu")
    return kit.op_inputs("conv", signature, boundaries, seed=seed, requires_grad=False).arguments


def conv(args: dict[str, Any], boundaries: Any) -> torch.Tensor:
    return causal_conv1d(args["x"], args["weight"], args["bias"], boundaries, activation=args["activation"])


def test_every_op_takes_the_one_route() -> None:
    assert {op: route_of(op).op for op in registered_ops()} == {op: op for op in registered_ops()}


def test_importing_the_ops_loads_neither_the_compiler_nor_fsdp_nor_the_model_transforms() -> None:
    code = ("import sys, hybrid_pack.ops; loaded = list(sys.modules); "
            "assert not any('fsdp' in m for m in loaded), [m for m in loaded if 'fsdp' in m]; "
            "assert 'torch._dynamo' not in loaded; "
            "assert not any(m.startswith('hybrid_pack.parallel') for m in loaded)")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_the_constant_mark_is_what_torch_compiler_sets() -> None:
    def ours() -> int:
        return 1

    def theirs() -> int:
        return 1

    marked = torch.compiler.assume_constant_result(theirs)
    assert assume_constant_result(ours) is ours
    assert dict(vars(marked)) == dict(vars(ours)) != {}


def test_a_call_is_a_lookup_after_its_key_is_chosen(monkeypatch: pytest.MonkeyPatch) -> None:
    """The call's signature is built and the backend chosen once per key; every later call only looks it up."""
    signatures, choices = [], []
    signature_of, resolve = conv_op.signature_of, route.resolve
    monkeypatch.setattr(conv_op, "signature_of", lambda *a, **k: signatures.append(1) or signature_of(*a, **k))
    monkeypatch.setattr(route, "resolve", lambda *a, **k: choices.append(1) or resolve(*a, **k))
    plant()
    boundaries = ROW.boundaries()
    conv(conv_case(boundaries), boundaries)  # checks the kernel, then serves the call
    checked = len(CALLS)
    for seed in range(1, 10):
        args = conv_case(boundaries, seed)
        torch.testing.assert_close(conv(args, boundaries), reference_of("conv").fn(
            args["x"], args["weight"], args["bias"], boundaries, activation=args["activation"]))
    assert (len(signatures), len(choices)) == (1, 1)
    assert len(CALLS) == checked + 9


def test_under_torch_distributed_an_unsettled_kernel_fails_loudly(monkeypatch: pytest.MonkeyPatch) -> None:
    """Ranks may not check on their own mid-step: without the warm-up a kernel that could serve raises, naming it
    (never the pure-torch fallback, silently slower); after it, the settled verdict serves."""
    monkeypatch.setattr(selector, "distributed", lambda: True)
    plant()
    boundaries = ROW.boundaries()
    args = conv_case(boundaries)
    with pytest.raises(backends.WarmUpError, match=r"conv: backend 'planted' could serve .*torch\.distributed: "
                                                   r"call hybrid_pack\.backends\.verify\(model=model, batch=batch\)"):
        conv(args, boundaries)
    assert CALLS == []
    with backends.discovering():  # the warm-up's pass records the key (and runs the pure-torch backend)
        conv(args, boundaries)
    assert CALLS == []
    monkeypatch.setattr("hybrid_pack.ops.dispatch.warmup.distributed", lambda: False)  # one rank's agreement
    (result,) = [r for r in backends.verify(device="cpu") if r.backend == PLANTED]
    assert result.ok, result.reason
    served = len(CALLS)
    conv(args, boundaries)
    assert len(CALLS) == served + 1


def test_a_compiled_graph_fails_loudly_without_the_warm_up() -> None:
    plant()
    boundaries = ROW.boundaries()
    args = conv_case(boundaries)
    compiled = torch.compile(lambda b: conv(args, b), backend="eager", fullgraph=True)
    with pytest.raises(Exception, match=r"could serve .* in a compiled graph .*backends\.verify\("):
        compiled(StaticBoundaries.from_boundaries(boundaries, max_documents=4))
    torch._dynamo.reset()
    compiled = torch.compile(lambda b: conv(args, b), backend="eager")  # not fullgraph: the error itself
    with pytest.raises(backends.WarmUpError, match=r"could serve .* in a compiled graph"):
        compiled(StaticBoundaries.from_boundaries(boundaries, max_documents=4))
    assert CALLS == []


def test_a_compiled_graph_follows_the_verdicts_settled_after_it_was_traced() -> None:
    """A graph traced while only the pure-torch backend exists is not frozen to it: once a kernel is registered
    and its verdict settled, the same compiled function calls the kernel."""
    boundaries = ROW.boundaries()
    static = StaticBoundaries.from_boundaries(boundaries, max_documents=4)
    args = conv_case(boundaries)
    compiled = torch.compile(lambda b: conv(args, b), backend="eager", fullgraph=True)
    expected = conv(args, boundaries)
    torch.testing.assert_close(compiled(static), expected)
    plant()
    conv(args, boundaries)  # one eager call settles the key (a single process's warm-up of it)
    served = len(CALLS)
    torch.testing.assert_close(compiled(static), expected)
    assert len(CALLS) == served + 1, "the compiled graph ran the planted kernel (its opaque node)"


def test_a_compiled_graph_follows_use_backends() -> None:
    """Forcing a backend after a graph was traced reaches the graph: inside ``use_backends`` the compiled function
    runs the forced backend, and after the block the selector's choice again."""
    plant()
    boundaries = ROW.boundaries()
    static = StaticBoundaries.from_boundaries(boundaries, max_documents=4)
    args = conv_case(boundaries)
    expected = conv(args, boundaries)  # settles the planted kernel's key: it serves from now on
    compiled = torch.compile(lambda b: conv(args, b), backend="eager", fullgraph=True)
    compiled(static)
    served = len(CALLS)
    with backends.use_backends(conv="torch"):
        torch.testing.assert_close(compiled(static), expected)
    assert len(CALLS) == served, "inside use_backends(conv='torch') the graph ran the planted kernel"
    torch.testing.assert_close(compiled(static), expected)
    assert len(CALLS) == served + 1, "after the block the graph is back on the planted kernel"
    with torch._dynamo.config.patch(error_on_recompile=True):  # each forcing's graph is used again
        for _ in range(10):
            with backends.use_backends(conv="torch"):
                compiled(static)
            compiled(static)
    assert len(CALLS) == served + 11


def test_a_compiled_graph_keeps_a_forcing_while_another_threads_block_ends() -> None:
    """Another thread's ``use_backends`` block ending put the process's forcing back to that thread's view (none):
    a graph called inside this thread's still open block ran the planted kernel."""
    plant()
    boundaries = ROW.boundaries()
    static = StaticBoundaries.from_boundaries(boundaries, max_documents=4)
    args = conv_case(boundaries)
    conv(args, boundaries)  # settles the planted kernel's key
    compiled = torch.compile(lambda b: conv(args, b), backend="eager", fullgraph=True)
    compiled(static)  # the graph without forcing, on the planted kernel
    inside, ended = threading.Event(), threading.Event()
    served: list[int] = []

    def forcing_thread() -> None:
        with backends.use_backends(conv="torch"):
            inside.set()
            ended.wait()
            before = len(CALLS)
            compiled(static)
            served.append(len(CALLS) - before)

    def other_thread() -> None:
        inside.wait()
        with backends.use_backends(ssd="torch"):
            pass
        ended.set()

    threads = [threading.Thread(target=forcing_thread), threading.Thread(target=other_thread)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert served == [0], "inside use_backends(conv='torch') the graph ran the planted kernel"


def test_keys_tell_apart_what_signatures_tell_apart(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each op's cheap key fixes its signature: calls with equal keys have equal signatures, over dtypes and optional
    inputs (as the routes receive them from the public ops)."""
    seen: list[tuple[route.OpRoute, tuple[torch.Tensor, ...], dict[str, Any]]] = []
    call = route.OpRoute.__call__
    monkeypatch.setattr(route.OpRoute, "__call__", lambda self, t, o, *rest, **kw: seen.append((self, t, o)) or call(
        self, t, o, *rest, **kw))
    boundaries = ROW.boundaries()
    for op in registered_ops():
        contract = contract_of(op)
        for dtype in (torch.float32, torch.float64):
            case = contract.make_case(contract.default_signature(dtype, "cpu"), boundaries,
                                      torch.Generator().manual_seed(0))
            optional = [name for name, value in case.arguments.items()
                        if isinstance(value, torch.Tensor) and name not in case.positional]
            for absent in (None, *optional):
                arguments = {**case.arguments, **({absent: None} if absent else {})}
                public = route_of(op).public
                if op == "linear_cross_entropy":  # no boundaries
                    public(**arguments)
                else:
                    case.call(public, boundaries, arguments)
    signatures: dict[tuple[str, tuple[Any, ...]], Any] = {}
    for ops_route, tensors, options in seen:
        signature = ops_route.signature(ops_route.arguments(tensors, options))
        assert signatures.setdefault((ops_route.op, ops_route.key(tensors, options)), signature) == signature, \
            ops_route.op
    assert {op for op, _ in signatures} == set(registered_ops())
    assert len(signatures) > 2 * len(registered_ops())


def test_the_warm_up_leaves_the_random_stream_as_it_was() -> None:
    """The warm-up's own pass of the model (training mode: dropout draws) does not shift the training's draws."""
    model = torch.nn.Dropout(0.5).train()
    before = torch.get_rng_state()
    backends.verify(model=model, batch={"input": torch.ones(64)})
    assert torch.equal(torch.get_rng_state(), before)


def test_the_warm_up_leaves_accumulated_gradients_as_they_were() -> None:
    """A warm-up between two micro-batches of a step (the fix ``WarmUpError`` names for a new batch shape) set every
    gradient to None: the first micro-batch's contribution was lost."""
    model = torch.nn.Linear(4, 3)
    model(torch.ones(2, 4)).sum().backward()
    before = [p.grad.clone() for p in model.parameters()]
    backends.verify(model=model, batch={"input": torch.full((2, 4), 3.0)})
    for p, grad in zip(model.parameters(), before, strict=True):
        assert torch.equal(p.grad, grad)
    fresh = torch.nn.Linear(4, 3)
    backends.verify(model=fresh, batch={"input": torch.ones(2, 4)})
    assert all(p.grad is None for p in fresh.parameters())


def test_a_discovered_step_that_met_no_key_checks_nothing() -> None:
    """After a discovery pass that met no key (a step on the pure-torch backends only) the warm-up settles nothing,
    instead of falling back to every op's typical keys."""
    with backends.discovering(training_step=True):
        pass
    assert backends.verify() == []


def test_a_warm_up_that_changes_no_verdict_leaves_compiled_graphs_standing() -> None:
    """Settling again what a call reads already (a second warm-up; an evaluation's warm-up, whose calls without
    gradients read the check with them) traces nothing again; a changed verdict does."""
    from torch._dynamo.testing import CompileCounter

    plant()
    boundaries = ROW.boundaries()
    static = StaticBoundaries.from_boundaries(boundaries, max_documents=4)
    args = conv_case(boundaries)  # no gradients
    (settled,) = [r for r in backends.verify(op="conv", device="cpu") if r.backend == PLANTED]  # with gradients
    counter = CompileCounter()
    compiled = torch.compile(lambda b: conv(args, b), backend=counter, fullgraph=True)
    expected = conv(args, boundaries)
    served = len(CALLS)
    torch.testing.assert_close(compiled(static), expected)
    backends.verify(op="conv", device="cpu")
    backends.verify(op="conv", device="cpu", requires_grad=False)
    torch.testing.assert_close(compiled(static), expected)
    assert (counter.frame_count, len(CALLS)) == (1, served + 2), "traced once, the planted kernel ran each time"
    key = next(k for k in verdicts.SETTLED if k.backend == PLANTED and not k.requires_grad)
    verdicts.settle(key, dataclasses.replace(settled, ok=False, reason="failed on another rank"))
    torch.testing.assert_close(compiled(static), expected)
    assert (counter.frame_count, len(CALLS)) == (2, served + 2), "traced again, on the pure-torch backend"


def test_a_call_without_gradients_reads_a_failed_check_with_them_until_its_own_warm_up() -> None:
    """A kernel whose backward fails its check serves no call without gradients either (the same in one process and
    under ``torch.distributed``), until a warm-up without gradients checks that key itself: its forward passes."""
    backends.register("conv", PLANTED, kit.with_defect(planted_conv, "backward_raises"), priority=100,
                      devices=("cpu",), dtypes=(torch.float32,))
    boundaries = ROW.boundaries()
    args = conv_case(boundaries)  # no gradients
    (with_grad,) = [r for r in backends.verify(op="conv", device="cpu") if r.backend == PLANTED]
    assert not with_grad.ok and "planted backward failure" in with_grad.reason
    served = len(CALLS)
    conv(args, boundaries)
    assert len(CALLS) == served, "the pure-torch backend served the call without gradients"
    (forward,) = [r for r in backends.verify(op="conv", device="cpu", requires_grad=False) if r.backend == PLANTED]
    assert forward.ok and not forward.requires_grad, forward
    checked = len(CALLS)
    assert checked > served, "the check without gradients ran the kernel"
    conv(args, boundaries)
    assert len(CALLS) == checked + 1, "the kernel serves the call without gradients"
