"""The static gated delta rule (``hybrid_pack/ops/gated_delta/torch_static.py``): the torch backend's results on
every layout, per segment slot, forward and backward; no gradient across segments; one compiled graph.

The row is cut into chunks of ``CHUNK = 8`` tokens whatever the documents, so the layouts put document ends on,
one short of and one past chunk edges, several documents inside one chunk, and a row length that is not a
multiple of the chunk (pad tokens inside the function).
"""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch
from torch._dynamo.utils import counters

from hybrid_pack import PackedBoundaries
from hybrid_pack.boundaries import StaticBoundaries
from hybrid_pack.errors import InputError
from hybrid_pack.ops.gated_delta import torch_backend
from hybrid_pack.ops.gated_delta.torch_static import gated_delta_rule
from tests import kit
from tests.kit import Layout

OP = "gated_delta"
CHUNK = 8
MAX_DOCUMENTS = 7
SLOTS = MAX_DOCUMENTS + 1
ROW = 45  # six chunks, the last one padded by 3 tokens
LAYOUTS = kit.named(
    Layout("one_token_docs_and_padding", (1, 1, 1, 1, 1, 1, 1), num_pad_tokens=38),
    Layout("chunk_edges_and_unused_slots", (8, 9, 15, 1, 7), num_pad_tokens=5),
    Layout("long_among_short", (2, 38, 1, 3, 1)),
    Layout("single_doc", (ROW,)),
    Layout("every_slot", (6, 1, 9, 8, 7, 5, 4), num_pad_tokens=5),
    Layout("whole_chunks", (16, 8, 24)),
)
SAME_SHAPE = [name for name, layout in LAYOUTS.items() if layout.total_tokens == ROW]
CONFIGS = {  # q/k heads, value heads, q/k normalised in the op, initial states given
    "mha": {"heads": 2, "v_heads": 2, "use_qk_l2norm": False, "initial_state": False},
    "gva_l2norm": {"heads": 2, "v_heads": 4, "use_qk_l2norm": True, "initial_state": False},  # the models' call
    "gva_l2norm_h0": {"heads": 2, "v_heads": 4, "use_qk_l2norm": True, "initial_state": True},
}
POSITIONAL = ("q", "k", "v", "g", "beta")


def _segments(layout: Layout) -> PackedBoundaries:
    """The layout's segments with its padding as one more document: the torch backend then starts it from an
    initial state and returns its final state, as the static form does for every slot."""
    segments = PackedBoundaries.from_lengths(layout.lengths + ((layout.num_pad_tokens,) if layout.num_pad_tokens
                                                                 else ()))
    assert torch.equal(segments.seq_idx, layout.boundaries().seq_idx)
    return segments


def _inputs(layout: Layout, config: str, dtype: torch.dtype = torch.float64, **flags: Any
            ) -> tuple[kit.CheckCase, PackedBoundaries, StaticBoundaries]:
    """Inputs (one initial state per segment when the config has them), the segments, and the static form."""
    segments = _segments(layout)
    signature = kit.gated_delta_signature(**CONFIGS[config] | flags, dtype=dtype)
    static = StaticBoundaries.from_boundaries(layout.boundaries(), MAX_DOCUMENTS)
    return kit.op_inputs(OP, signature, segments), segments, static


def _unused_slot_states(case: kit.CheckCase, segments: PackedBoundaries) -> torch.Tensor | None:
    """Initial states (leaves) for the unused slots, when the case has initial states."""
    states = case.arguments["initial_state"]
    if states is None:
        return None
    generator = torch.Generator().manual_seed(5)
    shape = (SLOTS - segments.num_segments, *states.shape[1:])
    return torch.randn(shape, generator=generator, dtype=torch.float64).to(states.dtype).requires_grad_()


def _run_static(fn: kit.OpFn, arguments: dict[str, Any], static: StaticBoundaries,
                unused: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``fn`` on the static form; the initial states of the unused slots follow the segments' own."""
    options = {name: value for name, value in arguments.items() if name not in POSITIONAL}
    if unused is not None:
        options["initial_state"] = torch.cat([options["initial_state"], unused])
    return fn(*(arguments[name] for name in POSITIONAL), static, **options)


def _static_forward_backward(fn: kit.OpFn, case: kit.CheckCase, segments: PackedBoundaries,
                             static: StaticBoundaries, unused: torch.Tensor | None
                             ) -> dict[str, torch.Tensor]:
    """Outputs and gradients under :func:`kit.forward_backward`'s loss for the segments' outputs, plus a loss on
    the unused slots' final states (whose gradient must reach their initial states alone: ``dunused``)."""
    o, final = _run_static(fn, case.arguments, static, unused)
    outputs = {"output": o, "final_state": final[:segments.num_segments]}
    weights = kit.projection(outputs, seed=1)
    loss = sum((out.double() * weights[name]).sum() for name, out in outputs.items())
    unused_final = final[segments.num_segments:]
    unused_weight = torch.randn(unused_final.shape, generator=torch.Generator().manual_seed(6), dtype=torch.float64)
    loss = loss + (unused_final.double() * unused_weight).sum()
    leaves = case.arguments | ({} if unused is None else {"unused": unused})
    return outputs | {"unused_final_state": unused_final, "unused_weight": unused_weight} | kit.gradients(loss, leaves)


STATIC = functools.partial(gated_delta_rule, chunk_size=CHUNK)


@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_matches_the_torch_backend(layout: str, config: str) -> None:
    """Outputs, every slot's final state and the gradients of every input equal the torch backend's; an unused
    slot's final state is its initial state, and its initial state reaches nothing else."""
    case, segments, static = _inputs(LAYOUTS[layout], config)
    unused = _unused_slot_states(case, segments)
    expected = kit.forward_backward(OP, torch_backend.gated_delta_rule, case, segments)
    got = _static_forward_backward(STATIC, case, segments, static, unused)
    for name, value in expected.items():
        kit.assert_close(got[name], value, name, tol=1e-10)
    unused_initial = torch.zeros_like(got["unused_final_state"]) if unused is None else unused
    assert torch.equal(got["unused_final_state"], unused_initial)
    if unused is not None:
        assert torch.equal(got["dunused"], got["unused_weight"])


@pytest.mark.parametrize("chunk_size", [1, 5, torch_backend.CHUNK_SIZE, 64])
def test_chunk_size_does_not_change_the_result(chunk_size: int) -> None:
    case, _, static = _inputs(LAYOUTS["chunk_edges_and_unused_slots"], "gva_l2norm_h0")
    slots = {**case.arguments, "initial_state": torch.randn(SLOTS, *case.arguments["initial_state"].shape[1:],
                                                            dtype=torch.float64)}
    o, final = _run_static(functools.partial(gated_delta_rule, chunk_size=chunk_size), slots, static, None)
    o_8, final_8 = _run_static(STATIC, slots, static, None)
    kit.assert_close(o, o_8, "output", tol=1e-12)
    kit.assert_close(final, final_8, "final state", tol=1e-12)


def _on_the_static_form(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                        boundaries: PackedBoundaries, *, initial_state: torch.Tensor | None, **options: Any
                        ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The static rule called as the torch backend is: per-document states in and out (zero for the others)."""
    static = StaticBoundaries.from_boundaries(boundaries, MAX_DOCUMENTS)
    if initial_state is not None:
        rest = initial_state.new_zeros(SLOTS - boundaries.num_docs, *initial_state.shape[1:])
        initial_state = torch.cat([initial_state, rest])
    o, final = STATIC(q, k, v, g, beta, static, initial_state=initial_state, **options)
    return o, None if final is None else final[:boundaries.num_docs]


@pytest.mark.parametrize("layout", ["one_token_docs_and_padding", "chunk_edges_and_unused_slots", "every_slot"])
def test_no_gradient_crosses_segments(layout: str) -> None:
    boundaries = LAYOUTS[layout].boundaries()
    case = kit.op_inputs(OP, kit.gated_delta_signature(**CONFIGS["gva_l2norm_h0"]), boundaries)
    kit.assert_no_gradient_crosses_segments(OP, _on_the_static_form, case, boundaries)


@pytest.mark.parametrize(("backend", "config", "layouts"), [
    ("aot_eager", "mha", SAME_SHAPE),
    ("aot_eager", "gva_l2norm_h0", SAME_SHAPE),
    pytest.param("inductor", "gva_l2norm", SAME_SHAPE[:3], marks=pytest.mark.slow),  # about a minute compiling
])
def test_one_compiled_graph_equals_eager(backend: str, config: str, layouts: list[str]) -> None:
    """No graph break, one graph for every layout of the same (T, S), forward and backward equal to eager."""
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(STATIC, backend=backend, fullgraph=True, dynamic=False)
    with torch._dynamo.config.patch(error_on_recompile=True):
        for name in layouts:
            case, segments, static = _inputs(LAYOUTS[name], config, torch.float32)
            unused = _unused_slot_states(case, segments)
            expected = _static_forward_backward(STATIC, case, segments, static, unused)
            got = _static_forward_backward(compiled, case, segments, static, unused)
            for key, value in expected.items():
                kit.assert_close(got[key], value, f"{key} ({name})", tol=1e-5)
    assert counters["stats"]["unique_graphs"] == 1, "one graph for every layout"
    assert not counters["graph_break"], dict(counters["graph_break"])


@pytest.mark.parametrize(("dtype", "tol"), [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_low_precision_tracks_the_torch_backend(dtype: torch.dtype, tol: float) -> None:
    """Outputs and gradients in the inputs' dtype, final states in float32, close to the torch backend."""
    case, segments, static = _inputs(LAYOUTS["long_among_short"], "gva_l2norm_h0", dtype)
    unused = _unused_slot_states(case, segments)
    expected = kit.forward_backward(OP, torch_backend.gated_delta_rule, case, segments)
    got = _static_forward_backward(STATIC, case, segments, static, unused)
    assert got["final_state"].dtype == torch.float32 and got["unused_final_state"].dtype == torch.float32
    for name, value in expected.items():
        assert got[name].dtype == (torch.float32 if name == "final_state" else dtype), name
        kit.assert_close(got[name].float(), value.float(), name, tol=tol)


def test_final_state_is_optional() -> None:
    case, _, static = _inputs(LAYOUTS["every_slot"], "mha")
    o, final = _run_static(STATIC, case.arguments | {"output_final_state": False}, static, None)
    o_with, _ = _run_static(STATIC, case.arguments, static, None)
    assert final is None
    assert torch.equal(o, o_with)


def test_per_document_initial_states_name_the_slots() -> None:
    case, _, static = _inputs(LAYOUTS["chunk_edges_and_unused_slots"], "gva_l2norm_h0")
    with pytest.raises(InputError, match="initial_state: expected one state per segment slot"):
        _run_static(STATIC, case.arguments, static, None)
