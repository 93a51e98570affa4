"""Decay linear attention (MiniMax's lightning attention) on packed rows: exact per document, forward and backward.

Every check goes through the public op, ``hybrid_pack.ops.decay_linear_attention(..., backend="torch")``, except
the chunk-size check (the backend with its ``chunk_size``) and the static form's checks (its function on
:class:`StaticBoundaries`).
"""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch

from hybrid_pack import PackedBoundaries
from hybrid_pack.boundaries import StaticBoundaries
from hybrid_pack.errors import InputError
from hybrid_pack.ops import decay_linear_attention
from hybrid_pack.ops.decay_linear_attention import torch_backend, torch_static
from hybrid_pack.ops.selfcheck.contract import make_signature
from tests import kit
from tests.kit import GATED_DELTA_LAYOUTS as LAYOUTS
from tests.ops.reference.decay_linear_attention import decay_linear_attention_reference

OP = "decay_linear_attention"
TORCH = functools.partial(decay_linear_attention, backend="torch")
TOLERANCE = {torch.float64: 1e-10, torch.float32: 5e-6}


def signature(*, heads: int = 2, k_dim: int = 8, v_dim: int = 6, initial_state: bool = False,
              output_final_state: bool = True, dtype: torch.dtype = torch.float64) -> kit.Signature:
    return make_signature(H=heads, K=k_dim, V=v_dim, output_final_state=output_final_state, q=dtype, k=dtype,
                          v=dtype, g=dtype, initial_state=dtype if initial_state else None)


def inputs(layout: str | PackedBoundaries, dtype: torch.dtype = torch.float64, **flags
           ) -> tuple[kit.CheckCase, PackedBoundaries]:
    boundaries = LAYOUTS[layout].boundaries() if isinstance(layout, str) else layout
    return kit.op_inputs(OP, signature(dtype=dtype, **flags), boundaries), boundaries


@pytest.mark.parametrize("initial_state", [False, True], ids=["zero_state", "initial_state"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_matches_per_token_reference(layout: str, initial_state: bool) -> None:
    case, boundaries = inputs(layout, initial_state=initial_state)
    arguments = {**case.arguments, "scale": 0.3}
    got = kit.forward_backward(OP, TORCH, case, boundaries, arguments=arguments)
    want = kit.forward_backward(OP, decay_linear_attention_reference, case, boundaries, arguments=arguments)
    assert got["final_state"].shape == (boundaries.num_docs, 2, 8, 6)
    assert set(got) == set(want)
    for name in got:
        kit.assert_close(got[name], want[name], name, tol=1e-12)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_packed_equals_each_document_alone(layout: str, dtype: torch.dtype) -> None:
    case, boundaries = inputs(layout, dtype, initial_state=True)
    kit.assert_packed_equals_segments_alone(OP, TORCH, case, boundaries, tol=TOLERANCE[dtype], seed=2)


@pytest.mark.parametrize("layout", ["one_token_docs", "many_tiny_docs", "chunk_edges", "trailing_padding"])
def test_no_gradient_crosses_documents(layout: str) -> None:
    case, boundaries = inputs(layout, initial_state=True)
    kit.assert_no_gradient_crosses_segments(OP, TORCH, case, boundaries)


def test_a_constant_decay_per_head_is_the_decay_at_every_token() -> None:
    """``g [H]`` (MiniMax's slopes) equals ``g`` repeated over the tokens, and its gradient is their sum; packed
    equals alone with it too."""
    case, boundaries = inputs("long_among_short", initial_state=True)
    slopes = torch.tensor([0.05, 0.7], dtype=torch.float64, requires_grad=True)
    per_token = (-slopes.detach()).expand(1, boundaries.total_tokens, 2).clone().requires_grad_()
    constant = case.call(TORCH, boundaries, {**case.arguments, "g": -slopes})
    repeated = case.call(TORCH, boundaries, {**case.arguments, "g": per_token})
    for got, want, name in zip(constant, repeated, ("output", "final state")):
        kit.assert_close(got, want, name, tol=1e-14)
    weight = torch.randn(constant[0].shape, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    (d_slopes,) = torch.autograd.grad((constant[0] * weight).sum(), slopes)
    (d_per_token,) = torch.autograd.grad((repeated[0] * weight).sum(), per_token)
    kit.assert_close(d_slopes, -d_per_token.sum((0, 1)), "gradient of the slopes", tol=1e-12)

    shared_decay = dataclasses.replace(case, token_inputs=("q", "k", "v"),
                                       arguments={**case.arguments, "g": (-slopes).detach().requires_grad_()})
    kit.assert_packed_equals_segments_alone(OP, TORCH, shared_decay, boundaries, tol=1e-10)


@pytest.mark.parametrize("chunk_size", [1, 16, 64])
def test_chunk_size_does_not_change_the_result(chunk_size: int) -> None:
    case, boundaries = inputs("long_among_short", initial_state=True)
    o, final = case.call(functools.partial(torch_backend.decay_linear_attention, chunk_size=chunk_size), boundaries)
    o_default, final_default = case.call(TORCH, boundaries)
    kit.assert_close(o, o_default, "output", tol=1e-12)
    kit.assert_close(final, final_default, "final state", tol=1e-12)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_inputs_track_float32(dtype: torch.dtype) -> None:
    low, boundaries = inputs("long_among_short", dtype, initial_state=True)
    high = {name: x.detach().float().requires_grad_() if isinstance(x, torch.Tensor) else x
            for name, x in low.arguments.items()}
    o_low, final_low = low.call(TORCH, boundaries)
    o_high, final_high = low.call(TORCH, boundaries, high)
    assert o_low.dtype == dtype and final_low.dtype == torch.float32
    kit.assert_close(o_low.float(), o_high, "output", tol=2e-2)
    kit.assert_close(final_low, final_high, "final state", tol=1e-4)


# ---------------------------------------------------------------- the static form
STATIC_CHUNK = 8
MAX_DOCUMENTS = 7
STATIC_LAYOUTS = kit.named(
    kit.Layout("one_token_docs_and_padding", (1, 1, 1, 1, 1, 1, 1), num_pad_tokens=38),
    kit.Layout("chunk_edges_and_unused_slots", (8, 9, 15, 1, 7), num_pad_tokens=5),
    kit.Layout("long_among_short", (2, 38, 1, 3, 1)),
    kit.Layout("single_doc", (45,)),
)


def _on_the_static_form(q, k, v, g, boundaries: PackedBoundaries, *, initial_state, **options):
    """The static form called as the torch backend is: per-document states in and out (zeros for the other slots)."""
    static = StaticBoundaries.from_boundaries(boundaries, MAX_DOCUMENTS)
    if initial_state is not None:
        rest = initial_state.new_zeros(static.num_segments - boundaries.num_docs, *initial_state.shape[1:])
        initial_state = torch.cat([initial_state, rest])
    o, final = torch_static.decay_linear_attention(q, k, v, g, static, initial_state=initial_state,
                                                   chunk_size=STATIC_CHUNK, **options)
    return o, None if final is None else final[:boundaries.num_docs]


@pytest.mark.parametrize("layout", STATIC_LAYOUTS)
def test_static_form_matches_the_torch_backend(layout: str) -> None:
    boundaries = STATIC_LAYOUTS[layout].boundaries()
    case = kit.op_inputs(OP, signature(initial_state=True), boundaries)
    got = kit.forward_backward(OP, _on_the_static_form, case, boundaries)
    want = kit.forward_backward(OP, TORCH, case, boundaries)
    for name in want:
        kit.assert_close(got[name], want[name], name, tol=1e-10)


@pytest.mark.parametrize("layout", ["one_token_docs_and_padding", "chunk_edges_and_unused_slots"])
def test_static_form_keeps_gradients_inside_documents(layout: str) -> None:
    boundaries = STATIC_LAYOUTS[layout].boundaries()
    case = kit.op_inputs(OP, signature(initial_state=True), boundaries)
    kit.assert_no_gradient_crosses_segments(OP, _on_the_static_form, case, boundaries)


def test_static_boundaries_route_to_the_static_form_in_one_compiled_graph() -> None:
    """The public op on static boundaries compiles once (no graph break) for rows of the same (T, M) and equals
    the eager op."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(TORCH, backend="aot_eager", fullgraph=True, dynamic=False)
    with torch._dynamo.config.patch(error_on_recompile=True):
        for name in ("chunk_edges_and_unused_slots", "long_among_short"):
            boundaries = STATIC_LAYOUTS[name].boundaries()
            case = kit.op_inputs(OP, signature(dtype=torch.float32, output_final_state=False), boundaries)
            static = StaticBoundaries.from_boundaries(boundaries, MAX_DOCUMENTS)
            got, _ = case.call(compiled, static)
            want, _ = case.call(TORCH, boundaries)
            kit.assert_close(got, want, f"output ({name})", tol=1e-5)
    assert counters["stats"]["unique_graphs"] == 1
    assert not counters["graph_break"], dict(counters["graph_break"])


# ---------------------------------------------------------------- bad input
def test_bad_shapes_are_refused_by_name() -> None:
    boundaries = PackedBoundaries.from_lengths([3, 4])
    q = torch.randn(1, 7, 2, 4)
    with pytest.raises(InputError, match="v: expected 2 heads"):
        decay_linear_attention(q, q, torch.randn(1, 7, 3, 4), torch.zeros(2), boundaries)
    with pytest.raises(InputError, match="g: expected shape"):
        decay_linear_attention(q, q, q, torch.zeros(3), boundaries)
    with pytest.raises(InputError, match="initial_state: expected shape"):
        decay_linear_attention(q, q, q, torch.zeros(2), boundaries, initial_state=torch.zeros(1, 2, 4, 4))
