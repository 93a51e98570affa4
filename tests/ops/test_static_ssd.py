"""Mamba-2 SSD on static boundaries (:mod:`hybrid_pack.ops.ssd.torch_static`): the pure-torch backend's results
on the plain boundaries of the same documents, forward and backward, for every chunk size; states per segment
slot; no gradient across segments; one compiled graph, with no break, for every layout of the same (T, S).

Every layout below holds T = 40 tokens in S = 7 slots (6 documents at most, then the padding slot), cut into
chunks of 6 tokens (the row pads to 42).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from hybrid_pack import PackedBoundaries
from hybrid_pack.boundaries import StaticBoundaries
from hybrid_pack.ops.ssd import torch_backend, torch_static
from tests import kit
from tests.kit import Layout

OP = "ssd"
MAX_DOCUMENTS = 6
CHUNK = 6
LAYOUTS = kit.named(
    Layout("one_token_docs", (1, 1, 1, 1, 1, 1), num_pad_tokens=34),
    Layout("chunk_edges", (6, 5, 1, 7, 11, 10)),  # ends on 6, 11, 12, 19, 30, 40: at, one short of, one past edges
    Layout("long_beside_short", (2, 33, 1, 4)),
    Layout("padding_and_unused_slots", (5, 9, 3), num_pad_tokens=23),
    Layout("single_document", (40,)),
    Layout("every_slot", (4, 4, 1, 7, 2, 6), num_pad_tokens=16),
)
FLAGS = {  # groups, skip weights D (per head or per channel), gate z, dt_bias, softplus, initial states
    "full": {"groups": 2, "D": "H,P", "z": True, "dt_bias": True, "dt_softplus": True, "initial_states": True},
    "plain": {"groups": 4, "D": "H", "z": False, "dt_bias": True, "dt_softplus": False, "initial_states": False},
}


def inputs(layout: str, flags: str = "full", *, dtype: torch.dtype = torch.float64, chunk_size: int = CHUNK,
           seed: int = 0) -> tuple[kit.CheckCase, PackedBoundaries]:
    boundaries = LAYOUTS[layout].boundaries()
    signature = kit.ssd_signature(**FLAGS[flags], chunk_size=chunk_size, dtype=dtype)
    return kit.op_inputs(OP, signature, boundaries, seed=seed), boundaries


def on_plain_boundaries(static_fn: kit.OpFn) -> kit.OpFn:
    """``static_fn`` called like the torch backend: plain boundaries, one initial state per document in, one
    final state per document out (the slots after the documents start from zero and are left out)."""

    def call(*args: Any, initial_states: torch.Tensor | None, return_final_states: bool, **options: Any) -> Any:
        *tensors, boundaries = args
        static = StaticBoundaries.from_boundaries(boundaries, MAX_DOCUMENTS)
        if initial_states is not None:
            unused = initial_states.new_zeros(static.num_segments - boundaries.num_docs, *initial_states.shape[1:])
            initial_states = torch.cat([initial_states, unused])
        result = static_fn(*tensors, static, initial_states=initial_states,
                           return_final_states=return_final_states, **options)
        return (result[0], result[1][:boundaries.num_docs]) if return_final_states else result

    return call


STATIC = on_plain_boundaries(torch_static.mamba2_ssd)


def assert_all_close(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], *, tol: float, what: str) -> None:
    assert set(got) == set(want), what
    for name, value in want.items():
        kit.assert_close(got[name], value, f"{what}: {name}", tol=tol)


@pytest.mark.parametrize("flags", list(FLAGS))
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_matches_torch_backend(layout: str, flags: str) -> None:
    """Output, final states and the gradient of every floating input (initial states included) in float64."""
    case, boundaries = inputs(layout, flags)
    want = kit.forward_backward(OP, torch_backend.mamba2_ssd, case, boundaries)
    got = kit.forward_backward(OP, STATIC, case, boundaries)
    assert len(want) == 2 + sum(isinstance(v, torch.Tensor) for v in case.arguments.values())
    assert_all_close(got, want, tol=1e-10, what=layout)


@pytest.mark.parametrize("chunk_size", [1, 4, 16, 64])
@pytest.mark.parametrize("layout", ["chunk_edges", "long_beside_short", "every_slot"])
def test_results_do_not_depend_on_chunk_size(layout: str, chunk_size: int) -> None:
    case, boundaries = inputs(layout, chunk_size=chunk_size)
    want = kit.forward_backward(OP, torch_backend.mamba2_ssd, case, boundaries)
    assert_all_close(kit.forward_backward(OP, STATIC, case, boundaries), want, tol=1e-10,
                     what=f"{layout}, chunk {chunk_size}")


@pytest.mark.parametrize("layout", ["one_token_docs", "padding_and_unused_slots", "every_slot"])
def test_every_slot_starts_from_its_own_state(layout: str) -> None:
    """The padding slot starts from its own initial state like a document (the torch backend with the padding
    as one more document); an unused slot's final state is its initial state, gradient included."""
    case, boundaries = inputs(layout)
    static = StaticBoundaries.from_boundaries(boundaries, MAX_DOCUMENTS)
    used = boundaries.num_segments
    slots = torch.randn(static.num_segments, *case.arguments["initial_states"].shape[1:], dtype=torch.float64,
                        generator=torch.Generator().manual_seed(3)).requires_grad_()
    got = kit.forward_backward(OP, torch_static.mamba2_ssd, case, static, arguments=case.arguments
                               | {"initial_states": slots})
    as_documents = PackedBoundaries.from_document_lengths(boundaries.segment_lengths)
    want = kit.forward_backward(OP, torch_backend.mamba2_ssd, case, as_documents, arguments=case.arguments
                                | {"initial_states": slots[:used].detach().requires_grad_()})
    unused_weight = kit.projection(got, seed=1)["final_state"][used:]
    assert torch.equal(got["final_state"][used:], slots[used:])
    assert torch.equal(got["dinitial_states"][used:], unused_weight)
    for name in ("final_state", "dinitial_states"):
        got[name] = got[name][:used]
    assert_all_close(got, want, tol=1e-10, what=layout)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_no_gradient_crosses_segments(layout: str) -> None:
    case, boundaries = inputs(layout)
    kit.assert_no_gradient_crosses_segments(OP, STATIC, case, boundaries)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_lower_precision_is_close_to_torch_backend(dtype: torch.dtype) -> None:
    """Computed in float32 like the torch backend: outputs in x's dtype, final states in float32, gradients in
    their inputs' dtypes."""
    case, boundaries = inputs("chunk_edges", dtype=dtype)
    want = kit.forward_backward(OP, torch_backend.mamba2_ssd, case, boundaries)
    got = kit.forward_backward(OP, STATIC, case, boundaries)
    assert got["output"].dtype == dtype and got["final_state"].dtype == torch.float32
    for name, value in want.items():
        assert got[name].dtype == value.dtype, name
        scale = value.abs().max().double()
        kit.assert_close(got[name].double() / scale, value.double() / scale, name,
                         tol=1e-5 if dtype == torch.float32 else 2e-2)


@pytest.mark.parametrize(("backend", "flags", "layouts"), [
    ("aot_eager", "full", list(LAYOUTS)),
    pytest.param("inductor", "plain", ["padding_and_unused_slots", "chunk_edges", "one_token_docs"],
                 marks=pytest.mark.slow),  # 30 to 70 s compiling on a loaded 2-core machine, cold cache
])
def test_one_graph_for_every_layout(backend: str, flags: str, layouts: list[str]) -> None:
    """``fullgraph=True`` (no graph break, no host read) compiles one graph for every layout of the same (T, S),
    and the compiled forward and backward match eager in float32 (inductor on the smaller graph without initial
    states)."""
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    compiled = on_plain_boundaries(torch.compile(torch_static.mamba2_ssd, backend=backend, fullgraph=True,
                                                 dynamic=False))
    with torch._dynamo.config.patch(error_on_recompile=True):
        for layout in layouts:
            case, boundaries = inputs(layout, flags, dtype=torch.float32)
            want = kit.forward_backward(OP, STATIC, case, boundaries)
            assert_all_close(kit.forward_backward(OP, compiled, case, boundaries), want, tol=1e-5,
                             what=f"{backend}, {layout}")
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1
