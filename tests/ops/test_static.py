"""Every op on static boundaries (docs/api.md §9): the same results as on the plain boundaries of the same documents,
forward and backward, and one compiled graph for every layout of the same shapes.

Static boundaries end in zero-length segments (the unused document slots). The pure-torch backends' static forms
(``ops/<op>/torch_static.py``) take them as they are and are traced inline, so a compiled backward is derived by the
compiler and runs no forward of the op; a backend with no static form (a kernel) runs as the op's opaque node
(:mod:`hybrid_pack.ops.library`), which leaves them out first, so no kernel ever sees one.
"""

from __future__ import annotations

import dataclasses
import functools
import gc
from typing import Any

import pytest
import torch

from hybrid_pack import PackedBoundaries, backends
from hybrid_pack.boundaries import StaticBoundaries
from hybrid_pack.errors import InputError
from hybrid_pack.ops import library
from hybrid_pack.ops.dispatch.registry import backends_of, reference_of
from hybrid_pack.ops.dispatch.route import route_of
from hybrid_pack.ops.library import _packed_boundaries
from tests import kit
from tests.kit import Layout

MAX_DOCUMENTS = 6
LAYOUTS = kit.named(
    Layout("padding_and_unused_slots", (5, 9, 3), num_pad_tokens=7),
    Layout("every_slot_no_padding", (4, 4, 1, 7, 2, 6)),
    Layout("every_slot_and_padding", (4, 4, 1, 7, 2, 1), num_pad_tokens=5),
    Layout("one_document", (24,)),
)
SIGNATURES = {
    "attention": kit.attention_signature(heads=4, kv_heads=2),
    "conv": kit.conv_signature(activation="silu"),
    "gated_delta": kit.gated_delta_signature(heads=2, v_heads=4, use_qk_l2norm=True),
    "ssd": kit.ssd_signature(D="H", z=True, dt_bias=True, chunk_size=4),
}


def _static(boundaries: PackedBoundaries) -> StaticBoundaries:
    return StaticBoundaries.from_boundaries(boundaries, MAX_DOCUMENTS)


def _forward_backward(op: str, fn: kit.OpFn, case: kit.CheckCase, boundaries: PackedBoundaries
                      ) -> dict[str, torch.Tensor]:
    """:func:`kit.forward_backward` on the static form; the final states of the unused slots and of the padding
    segment (outputs the plain form does not have) are checked, then left out of the loss."""
    outputs = kit.run(op, fn, case, _static(boundaries))
    if "final_state" in outputs:
        states = outputs["final_state"]
        assert states.shape[0] == MAX_DOCUMENTS + 1
        unused = states[boundaries.num_segments:]
        assert torch.equal(unused, torch.zeros_like(unused)), "an unused slot's final state is its initial one"
        outputs["final_state"] = states[:boundaries.num_docs]
    weights = kit.projection(outputs, seed=1)
    loss = sum((out.double() * weights[name]).sum() for name, out in outputs.items())
    return outputs | kit.gradients(loss, case.arguments)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("op", SIGNATURES)
def test_static_boundaries_give_the_plain_results(op: str, layout: str) -> None:
    boundaries = LAYOUTS[layout].boundaries()
    case = kit.op_inputs(op, SIGNATURES[op], boundaries)
    plain = kit.forward_backward(op, kit.public_op(op), case, boundaries)
    static = _forward_backward(op, kit.public_op(op), case, boundaries)
    for name, expected in plain.items():
        kit.assert_close(static[name], expected, f"{op} {name}: static against plain", tol=1e-10)


def test_states_are_per_slot() -> None:
    """An initial state per slot: the documents start from theirs, an unused slot passes its own through."""
    boundaries = LAYOUTS["padding_and_unused_slots"].boundaries()
    case = kit.op_inputs("gated_delta", kit.gated_delta_signature(initial_state=True), boundaries)
    slots = torch.randn(MAX_DOCUMENTS + 1, *case.arguments["initial_state"].shape[1:], dtype=torch.float64)
    static = kit.run("gated_delta", kit.public_op("gated_delta"), case, _static(boundaries),
                     case.arguments | {"initial_state": slots})
    plain = kit.run("gated_delta", kit.public_op("gated_delta"), case, boundaries,
                    case.arguments | {"initial_state": slots[:boundaries.num_docs]})
    real = sum(boundaries.document_lengths)
    kit.assert_close(static["output"][:, :real], plain["output"][:, :real], "output", tol=1e-10)
    kit.assert_close(static["final_state"][:boundaries.num_docs], plain["final_state"], "final states", tol=1e-10)
    assert torch.equal(static["final_state"][boundaries.num_segments:], slots[boundaries.num_segments:])


def test_kernels_never_see_zero_length_segments() -> None:
    cu_seqlens = _static(LAYOUTS["padding_and_unused_slots"].boundaries()).cu_seqlens
    assert cu_seqlens.tolist() == [0, 5, 14, 17, 24, 24, 24, 24]
    assert _packed_boundaries("test", cu_seqlens).segment_lengths == (5, 9, 3, 7)


def test_too_many_documents_name_max_documents() -> None:
    with pytest.raises(InputError, match="max_documents"):
        _static(PackedBoundaries.from_lengths([1] * (MAX_DOCUMENTS + 1)))


@pytest.mark.parametrize("op", SIGNATURES)
def test_one_graph_for_every_layout(op: str) -> None:
    """The op compiles with no graph break and never recompiles across layouts of the same (T, M)."""
    torch._dynamo.reset()
    compiled = torch.compile(kit.public_op(op), backend="aot_eager", fullgraph=True)
    with torch._dynamo.config.patch(error_on_recompile=True):
        for layout in LAYOUTS.values():
            boundaries = layout.boundaries()
            case = kit.op_inputs(op, SIGNATURES[op], boundaries)
            expected = kit.forward_backward(op, kit.public_op(op), case, boundaries)
            got = _forward_backward(op, compiled, case, boundaries)
            for name, value in expected.items():
                kit.assert_close(got[name], value, f"{op} {name} ({layout.name})", tol=1e-10)


@pytest.mark.parametrize("op, scale", [("attention", "softmax_scale"), ("conv", None), ("gated_delta", "scale"),
                                       ("ssd", None)])
def test_symbolic_sizes_compile_whole(op: str, scale: str | None) -> None:
    """With every size symbolic (``dynamic=True``: what automatic dynamic shapes turn a second size into) the op
    compiles whole, with its default scale (head dim ** -0.5, specialised) where it has one, equal to eager."""
    torch._dynamo.reset()
    compiled = torch.compile(kit.public_op(op), backend="aot_eager", fullgraph=True, dynamic=True)
    boundaries = LAYOUTS["padding_and_unused_slots"].boundaries()
    case = kit.op_inputs(op, SIGNATURES[op], boundaries)
    case = dataclasses.replace(case, arguments={k: v for k, v in case.arguments.items() if k != scale})
    expected = kit.forward_backward(op, kit.public_op(op), case, boundaries)
    got = _forward_backward(op, compiled, case, boundaries)
    for name, value in expected.items():
        kit.assert_close(got[name], value, f"{op} {name}", tol=1e-10)


def _counting(fn: kit.OpFn, calls: list[str]) -> kit.OpFn:
    def counted(*args: object, **kwargs: object) -> object:
        calls.append(getattr(fn, "__qualname__", "op"))
        return fn(*args, **kwargs)
    return counted


def _forward_then_backward_calls(op: str, calls: list[str], backend: str | None = None,
                                 compiler: str = "aot_eager") -> tuple[int, int, dict[str, torch.Tensor]]:
    """Compile the op, run it on a static row, then its backward: how many calls of a backend each phase made, and
    the outputs and gradients."""
    torch._dynamo.reset()
    compiled = torch.compile(functools.partial(kit.public_op(op), backend=backend), backend=compiler,
                             fullgraph=True)
    boundaries = LAYOUTS["every_slot_and_padding"].boundaries()
    case = kit.op_inputs(op, SIGNATURES[op], boundaries)
    if backend is not None:  # one eager call checks it (no check runs while tracing)
        kit.run(op, functools.partial(kit.public_op(op), backend=backend), case, boundaries)
        calls.clear()
    outputs = kit.run(op, compiled, case, _static(boundaries))
    forward = len(calls)
    grads = kit.gradients(_loss(outputs), case.arguments)
    return forward, len(calls) - forward, outputs | grads


def _loss(outputs: dict[str, torch.Tensor]) -> torch.Tensor:
    weights = kit.projection(outputs, seed=1)
    return sum((out.double() * weights[name]).sum() for name, out in outputs.items())


@pytest.mark.parametrize("op", SIGNATURES)
def test_the_compiled_backward_runs_the_op_forward_zero_times(op: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every backend's functions are counted: the compiled backward calls none of them (no second forward)."""
    calls: list[str] = []
    for backend in backends_of(op):
        for attribute in ("fn", "static_fn"):
            if getattr(backend, attribute) is not None:
                monkeypatch.setitem(backend.__dict__, attribute, _counting(getattr(backend, attribute), calls))
    forward, backward, _ = _forward_then_backward_calls(op, calls)
    assert forward >= 1, "the count sees the traced static form"
    assert backward == 0, f"the compiled backward ran the op's forward {backward} times"


@pytest.mark.parametrize("compiler", ["aot_eager", "inductor"])
def test_a_backend_without_a_static_form_runs_as_the_opaque_node(compiler: str) -> None:
    """A kernel (here a planted CPU one, no static form) is one opaque node: the eager results exactly, and its
    backward uses the graph its forward kept (no second forward, as in eager); nothing stays kept after it."""
    calls: list[str] = []
    backends.register("conv", "planted", _counting(reference_of("conv").fn, calls), priority=100,
                      devices=("cpu",), dtypes=(torch.float64,))
    try:
        forward, backward, got = _forward_then_backward_calls("conv", calls, backend="planted", compiler=compiler)
    finally:
        backends.unregister("conv", "planted")
    assert (forward, backward) == (1, 0)
    boundaries = LAYOUTS["every_slot_and_padding"].boundaries()
    case = kit.op_inputs("conv", SIGNATURES["conv"], boundaries)
    for name, expected in kit.forward_backward("conv", kit.public_op("conv"), case, boundaries).items():
        kit.assert_close(got[name], expected, name, tol=0.0)
    assert not library._graphs, "the backward took the graph its forward kept"


def _opaque_conv(requires_grad: bool) -> tuple[dict[str, torch.Tensor], kit.CheckCase, StaticBoundaries]:
    """The conv's opaque node called eagerly on a static row (the torch backend, through the node)."""
    boundaries = LAYOUTS["padding_and_unused_slots"].boundaries()
    case = kit.op_inputs("conv", SIGNATURES["conv"], boundaries)
    case = dataclasses.replace(case, arguments=case.leaves(case.floats() if requires_grad else ()))
    static = _static(boundaries)
    outputs = route_of("conv").opaque(case.arguments, static.cu_seqlens, None, backend="torch",
                                      requires_grad=requires_grad)
    return {"output": outputs[0]}, case, static


def test_a_forward_without_its_backward_keeps_nothing() -> None:
    """The graph kept for the backward goes with the forward's outputs: a forward whose backward never comes (an
    evaluation with gradients on, a checkpoint's discarded forward) leaves nothing behind."""
    outputs, _, _ = _opaque_conv(requires_grad=True)
    assert len(library._graphs) == 1
    del outputs
    gc.collect()
    assert not library._graphs
    _opaque_conv(requires_grad=False)
    assert not library._graphs


def test_a_second_backward_runs_the_forward_again_with_the_same_gradients() -> None:
    """``retain_graph=True``: the first backward takes the kept graph, the second runs the forward again; both equal
    the plain call's gradients exactly."""
    outputs, case, static = _opaque_conv(requires_grad=True)
    loss = _loss(outputs)
    first = kit.gradients(loss, case.arguments, retain_graph=True)
    second = kit.gradients(loss, case.arguments)
    expected = kit.forward_backward("conv", kit.public_op("conv"), case, static)
    for name in first:
        kit.assert_close(first[name], expected[name], name, tol=0.0)
        kit.assert_close(second[name], expected[name], name, tol=0.0)


def test_a_checkpointed_opaque_node_keeps_nothing_and_its_recompute_serves_the_backward() -> None:
    """Under ``torch.utils.checkpoint`` (non-reentrant): the discarded forward keeps no graph, the backward runs the
    graph of the recompute (two forwards, no third), and the gradients are the plain call's exactly."""
    calls: list[str] = []
    backends.register("conv", "planted", _counting(reference_of("conv").fn, calls), priority=100,
                      devices=("cpu",), dtypes=(torch.float64,))
    try:
        boundaries = LAYOUTS["padding_and_unused_slots"].boundaries()
        case = kit.op_inputs("conv", SIGNATURES["conv"], boundaries)
        case = dataclasses.replace(case, arguments=case.leaves(case.floats()))
        planted = functools.partial(kit.public_op("conv"), backend="planted")
        kit.run("conv", planted, case, boundaries)  # its self-check
        calls.clear()

        def block(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
            return kit.run("conv", planted, case, _static(boundaries), {**case.arguments, "x": x,
                                                                        "weight": weight})["output"]

        output = torch.utils.checkpoint.checkpoint(block, case.arguments["x"], case.arguments["weight"],
                                                   use_reentrant=False)
        assert len(calls) == 1 and not library._graphs
        got = kit.gradients(_loss({"output": output}), case.arguments)
    finally:
        backends.unregister("conv", "planted")
    assert len(calls) == 2 and not library._graphs
    expected = kit.forward_backward("conv", kit.public_op("conv"), case, _static(boundaries))
    for name in got:
        kit.assert_close(got[name], expected[name], name, tol=0.0)


class _SavesItsOutput(torch.autograd.Function):
    """Identity that saves its output for the backward, as flash-attn does: a gradient that is wrong if that
    memory is overwritten after the forward."""

    @staticmethod
    def forward(ctx: Any, y: torch.Tensor) -> torch.Tensor:
        out = y.clone()
        ctx.save_for_backward(out)
        ctx.copy = out.detach().clone()
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        (saved,) = ctx.saved_tensors
        return grad * (1 + (saved - ctx.copy))


def test_a_compiled_consumer_cannot_overwrite_what_the_kept_graph_holds() -> None:
    """Inductor computes a pointwise consumer of the node's output in place into that output's memory once the
    output is dead. The node keeps its outputs alive for its backward, so a kernel that saved its output still
    finds it intact: exact gradients, and no second forward."""
    calls: list[str] = []
    reference = reference_of("conv").fn
    kernel = _counting(lambda *args, **kwargs: _SavesItsOutput.apply(reference(*args, **kwargs)), calls)
    backends.register("conv", "planted", kernel, priority=100, devices=("cpu",), dtypes=(torch.float64,))
    try:
        boundaries = LAYOUTS["padding_and_unused_slots"].boundaries()
        case = kit.op_inputs("conv", SIGNATURES["conv"], boundaries)
        planted = functools.partial(kit.public_op("conv"), backend="planted")
        kit.run("conv", planted, case, boundaries)  # its self-check

        def block(*args: Any, **kwargs: Any) -> torch.Tensor:
            return planted(*args, **kwargs) * 3.0 + 1.0

        torch._dynamo.reset()
        compiled = torch.compile(block, fullgraph=True)
        got, expected = ({"output": case.call(fn, _static(boundaries))} for fn in (compiled, block))
        calls.clear()
        got = got | kit.gradients(_loss(got), case.arguments)
        assert len(calls) == 0, "the compiled backward ran the kernel's forward again"
        expected = expected | kit.gradients(_loss(expected), case.arguments)
    finally:
        backends.unregister("conv", "planted")
    for name, value in expected.items():
        kit.assert_close(got[name], value, name, tol=0.0)


def test_a_backward_handed_other_memory_runs_the_forward_again() -> None:
    """The kept graph serves only the very inputs it was made from: a backward handed copies (an input the compiler
    recomputed for the backward) runs the forward again on them."""
    outputs, case, _ = _opaque_conv(requires_grad=True)
    node = route_of("conv").opaque
    handle = library._new_handle()
    leaves = [case.arguments[name.rstrip("?")] for name in node.tensors]
    library._graphs[handle.untyped_storage().data_ptr()] = (object(), leaves, [outputs["output"]])
    copies = [None if t is None else t.detach().clone() for t in leaves]
    assert library._take(handle, copies, [outputs["output"]]) is None
    assert handle.untyped_storage().data_ptr() not in library._graphs, "taken, not served"
    library._graphs[handle.untyped_storage().data_ptr()] = (object(), leaves, [outputs["output"]])
    assert library._take(handle, leaves, [outputs["output"].detach()]) is not None
