"""The Mamba-1 selective scan (:mod:`hybrid_pack.ops.selective_scan`): a registered op whose pure-torch backend
equals a token-by-token recurrence run on each document alone for every chunk size, forward and backward, and
never saves a ``[T, D, N]`` tensor; the static chunked scan equals the packed one for every chunk size, both keep
non-finite values and gradients inside their segment, and the static form compiles to one graph for every layout
of the same (T, S). A row split across ranks: tests/parallel/test_cp_selective_scan.py.

Every layout holds T = 40 tokens in S = 7 slots (6 documents at most, then the padding slot).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F

from hybrid_pack import PackedBoundaries, backends, use_backends
from hybrid_pack.boundaries import StaticBoundaries
from hybrid_pack.errors import InputError
from hybrid_pack.ops.selective_scan import selective_scan, torch_backend, torch_static
from tests import kit
from tests.kit import Layout

MAX_DOCUMENTS = 6
CHANNELS, STATE = 6, 5
LAYOUTS = kit.named(  # the static scan's chunks end on 16, 32 (CHUNK_SIZE = 16)
    Layout("one_token_docs", (1,) * 6, num_pad_tokens=34),
    Layout("chunk_edges", (17, 14, 2, 7)),  # ends on 17, 31, 33, 40: one past, one short of, one past edges
    Layout("long_beside_short", (2, 33, 1, 4)),
    Layout("padding_and_unused_slots", (5, 9, 3), num_pad_tokens=23),
    Layout("single_document", (40,)),
    Layout("every_slot", (4, 4, 8, 7, 2, 6), num_pad_tokens=9),  # ends on 16 and 31
)
ScanInputs = dict[str, torch.Tensor]


def inputs(boundaries: PackedBoundaries, *, dtype: torch.dtype = torch.float64, seed: int = 0) -> ScanInputs:
    """The op's inputs, every one a leaf requiring grad: ``x, dt, z [1, T, D]``, ``B, C [1, T, N]``, a negative
    ``A [D, N]``, ``D, dt_bias [D]``."""
    generator = torch.Generator().manual_seed(seed)
    t = boundaries.total_tokens

    def draw(*shape: int) -> torch.Tensor:
        return torch.randn(shape, generator=generator, dtype=torch.float64)

    tensors = {"x": draw(1, t, CHANNELS), "dt": draw(1, t, CHANNELS) - 1, "A": -torch.exp(draw(CHANNELS, STATE)),
               "B": draw(1, t, STATE), "C": draw(1, t, STATE), "D": draw(CHANNELS), "z": draw(1, t, CHANNELS),
               "dt_bias": draw(CHANNELS) / 2}
    return {name: value.to(dtype).requires_grad_() for name, value in tensors.items()}


def sequential_reference(args: ScanInputs, boundaries: PackedBoundaries) -> torch.Tensor:
    """The recurrence token by token, every segment alone from a zero state."""
    dt = F.softplus(args["dt"][0] + args["dt_bias"])
    outputs = []
    for span in kit.segment_spans(boundaries):
        state = args["x"].new_zeros(CHANNELS, STATE)
        for t in range(span.start, span.stop):
            state = torch.exp(dt[t, :, None] * args["A"]) * state + (dt[t] * args["x"][0, t])[:, None] * args["B"][0, t]
            y = state @ args["C"][0, t] + args["D"] * args["x"][0, t]
            outputs.append(y * F.silu(args["z"][0, t]))
    return torch.stack(outputs).unsqueeze(0)


def on_static(boundaries: PackedBoundaries) -> StaticBoundaries:
    return StaticBoundaries.from_boundaries(boundaries, MAX_DOCUMENTS)


def forward_backward(fn: Callable[..., torch.Tensor], args: ScanInputs, boundaries: object) -> ScanInputs:
    """``fn``'s output and the gradients of one fixed random projection of it."""
    out = fn(**args, boundaries=boundaries)
    weight = torch.randn(out.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    grads = torch.autograd.grad((out.double() * weight).sum(), list(args.values()))
    return {"output": out} | {f"d{name}": grad for name, grad in zip(args, grads)}


def assert_all_close(got: ScanInputs, want: ScanInputs, *, tol: float, what: str) -> None:
    assert set(got) == set(want), what
    for name, value in want.items():
        kit.assert_close(got[name], value, f"{what}: {name}", tol=tol)


def reference(**args: torch.Tensor) -> torch.Tensor:
    boundaries = args.pop("boundaries")
    return sequential_reference(args, boundaries)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_packed_scan_equals_each_document_alone(layout: str) -> None:
    boundaries = LAYOUTS[layout].boundaries()
    args = inputs(boundaries)
    assert_all_close(forward_backward(selective_scan, args, boundaries),
                     forward_backward(reference, args, boundaries), tol=1e-10, what=layout)


def chunked_scan(chunk_size: int) -> Callable[..., torch.Tensor]:
    """The pure-torch scan at ``chunk_size`` (its outputs only)."""
    def run(*, boundaries: PackedBoundaries, **args: torch.Tensor) -> torch.Tensor:
        return torch_backend.scan(**args, boundaries=boundaries, chunk_size=chunk_size)[0]
    return run


@pytest.mark.parametrize("chunk_size", [1, 3, 16])
@pytest.mark.parametrize("layout", ["one_token_docs", "chunk_edges", "long_beside_short", "padding_and_unused_slots"])
def test_every_chunk_size_gives_the_same_scan(layout: str, chunk_size: int) -> None:
    """Chunks of 1, 3 and 16 tokens (documents longer than a chunk, chunks holding several documents) against
    the default 64 (one chunk for the whole row), forward and backward, float64."""
    boundaries = LAYOUTS[layout].boundaries()
    args = scan_inputs(inputs(boundaries))
    assert_all_close(forward_backward(chunked_scan(chunk_size), args, boundaries),
                     forward_backward(chunked_scan(torch_backend.CHUNK_SIZE), args, boundaries), tol=1e-10,
                     what=f"{layout}, chunk {chunk_size}")


def test_initial_state_and_final_state_gradients() -> None:
    """The state before the first token and the state after the last, in and out of the chunked backward,
    checked against finite differences (float64)."""
    boundaries = LAYOUTS["long_beside_short"].boundaries()
    args = scan_inputs(inputs(boundaries))
    initial = torch.randn(CHANNELS, STATE, generator=torch.Generator().manual_seed(2), dtype=torch.float64)

    def run(initial_state: torch.Tensor, *tensors: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return torch_backend.scan(*tensors, boundaries, initial_state=initial_state, chunk_size=3)

    assert torch.autograd.gradcheck(run, (initial.requires_grad_(), *args.values()))


def test_no_tensor_of_the_whole_row_and_its_states_is_saved() -> None:
    """The memory bound: what autograd keeps from the forward for the backward holds no ``[T, D, N]`` tensor,
    and in all at most the inputs, the ``[T, D]`` step sizes and one ``[D, N]`` state per chunk."""
    boundaries = PackedBoundaries.from_lengths([300, 100, 112])
    args = inputs(boundaries, dtype=torch.float32)
    saved: list[torch.Tensor] = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        out = selective_scan(**args, boundaries=boundaries)
    out.sum().backward()
    tokens, chunks = boundaries.total_tokens, -(-boundaries.total_tokens // torch_backend.CHUNK_SIZE)
    assert max(t.numel() for t in saved) <= tokens * CHANNELS
    budget = 12 * tokens * CHANNELS + tokens * 2 * STATE + chunks * CHANNELS * STATE
    assert sum(t.numel() for t in saved) <= budget


def test_registered_with_the_torch_backend_only() -> None:
    """A registered op: its pure-torch backend serves and is the reference; another name is refused by name."""
    records = {record.backend: record for record in backends.available("selective_scan")}
    assert set(records) == {"torch"} and records["torch"].usable
    assert backends.select("selective_scan", device="cpu", dtype=torch.float32, requires_grad=True) == "torch"
    boundaries = LAYOUTS["chunk_edges"].boundaries()
    with pytest.raises(InputError, match="mamba_ssm"), use_backends(selective_scan="mamba_ssm"):
        selective_scan(**inputs(boundaries), boundaries=boundaries)


def scan_inputs(args: ScanInputs) -> ScanInputs:
    """The scans' own inputs from the op's (``dt`` discretised, batch dim dropped), leaves requiring grad."""
    dt = F.softplus(args["dt"][0] + args["dt_bias"])
    scan_args = {"x": args["x"][0], "dt": dt, "A": args["A"], "B": args["B"][0], "C": args["C"][0]}
    return {name: value.detach().requires_grad_() for name, value in scan_args.items()}


@pytest.mark.parametrize("chunk_size", [1, 4, 6, 16, 64])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_static_scan_equals_packed_scan(layout: str, chunk_size: int) -> None:
    """The chunked scan against the packed one on the same discretised inputs, forward and backward, float64."""
    boundaries = LAYOUTS[layout].boundaries()
    args = scan_inputs(inputs(boundaries))
    want = forward_backward(chunked_scan(torch_backend.CHUNK_SIZE), args, boundaries)
    got = forward_backward(functools.partial(torch_static.scan, chunk_size=chunk_size), args, on_static(boundaries))
    assert_all_close(got, want, tol=1e-10, what=f"{layout}, chunk {chunk_size}")


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_static_op_equals_packed_op(layout: str) -> None:
    boundaries = LAYOUTS[layout].boundaries()
    args = inputs(boundaries)
    assert_all_close(forward_backward(selective_scan, args, on_static(boundaries)),
                     forward_backward(selective_scan, args, boundaries), tol=1e-10, what=layout)


@pytest.mark.parametrize("form", ["packed", "static"])
@pytest.mark.parametrize("layout", ["chunk_edges", "long_beside_short", "every_slot"])
def test_no_gradient_crosses_segments(layout: str, form: str) -> None:
    """The gradient of each segment's outputs is zero on every other segment's tokens, nonzero on its own."""
    boundaries = LAYOUTS[layout].boundaries()
    args = inputs(boundaries)
    out = selective_scan(**args, boundaries=boundaries if form == "packed" else on_static(boundaries))
    for segment, span in enumerate(kit.segment_spans(boundaries)):
        grads = torch.autograd.grad(out[:, span].sum(), [args[name] for name in ("x", "dt", "B", "C", "z")],
                                    retain_graph=True)
        outside = torch.ones(boundaries.total_tokens, dtype=torch.bool)
        outside[span] = False
        for name, grad in zip(("x", "dt", "B", "C", "z"), grads):
            assert torch.count_nonzero(grad[0, outside]) == 0, f"d{name}: segment {segment} reaches other segments"
            assert torch.count_nonzero(grad[0, span]) > 0, f"d{name}: zero inside segment {segment}"


@pytest.mark.parametrize("form", ["packed", "static", "static_chunks_of_4"])
def test_non_finite_values_stay_in_their_segment(form: str) -> None:
    """inf and NaN in document 0 (tokens 0..16, across chunk edges) leave every later document's output as it
    was; in chunks of 4 the NaN decay sits in chunk 1, whose carry then meets the later chunks' doubling passes."""
    boundaries = LAYOUTS["chunk_edges"].boundaries()
    clean = {name: value.detach() for name, value in inputs(boundaries).items()}
    poisoned = dict(clean, x=clean["x"].clone(), dt=clean["dt"].clone())
    poisoned["x"][0, 3] = float("inf")
    poisoned["dt"][0, 5] = poisoned["dt"][0, 16] = float("nan")
    if form == "packed":
        want, got = (selective_scan(**args, boundaries=boundaries) for args in (clean, poisoned))
    elif form == "static":
        want, got = (selective_scan(**args, boundaries=on_static(boundaries)) for args in (clean, poisoned))
    else:
        want, got = (torch_static.scan(**scan_inputs(args), boundaries=on_static(boundaries), chunk_size=4).unsqueeze(0)
                     for args in (clean, poisoned))
    assert torch.equal(got[:, 17:], want[:, 17:])
    assert not got[0, 16].isfinite().all()


@pytest.mark.parametrize("chunk_size", [4, 64])
def test_non_finite_values_stay_in_their_segment_backward(chunk_size: int) -> None:
    """With inf and NaN in document 0, a loss on the later documents gives their tokens the same, finite
    gradients as without: the chunked backward drops the adjoint at a segment start rather than scaling it."""
    boundaries = LAYOUTS["chunk_edges"].boundaries()
    clean = scan_inputs(inputs(boundaries))
    poisoned = {name: value.detach().clone() for name, value in clean.items()}
    poisoned["x"][3] = float("inf")
    poisoned["dt"][5] = poisoned["dt"][16] = float("nan")
    grads = []
    for args in (clean, poisoned):
        args = {name: value.detach().requires_grad_() for name, value in args.items()}
        y = chunked_scan(chunk_size)(**args, boundaries=boundaries)
        grads.append(torch.autograd.grad(y[17:].sum(), [args[name] for name in ("x", "dt", "B", "C")]))
    for name, want, got in zip(("x", "dt", "B", "C"), *grads):
        assert got[17:].isfinite().all() and torch.equal(got[17:], want[17:]), f"d{name}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_lower_precision_is_close_to_float64(dtype: torch.dtype) -> None:
    """Computed in float32: output in x's dtype, gradients in their inputs' dtypes, close to float64's."""
    boundaries = LAYOUTS["chunk_edges"].boundaries()
    want = forward_backward(selective_scan, inputs(boundaries), boundaries)
    got = forward_backward(selective_scan, inputs(boundaries, dtype=dtype), on_static(boundaries))
    for name, value in want.items():
        assert got[name].dtype == dtype, name
        scale = value.abs().max()
        kit.assert_close(got[name].double() / scale, value / scale, name, tol=1e-5 if dtype == torch.float32 else 3e-2)


@pytest.mark.parametrize(("backend", "layouts"), [
    ("aot_eager", list(LAYOUTS)),
    ("inductor", ["padding_and_unused_slots", "chunk_edges", "one_token_docs"]),
])
def test_one_graph_for_every_layout(backend: str, layouts: list[str]) -> None:
    """``fullgraph=True`` (no graph break, no host read) compiles one graph for every layout of the same (T, S),
    and the compiled forward and backward match eager in float32."""
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    compiled = torch.compile(selective_scan, backend=backend, fullgraph=True, dynamic=False)
    with torch._dynamo.config.patch(error_on_recompile=True):
        for layout in layouts:
            boundaries = LAYOUTS[layout].boundaries()
            args = inputs(boundaries, dtype=torch.float32)
            want = forward_backward(selective_scan, args, on_static(boundaries))
            assert_all_close(forward_backward(compiled, args, on_static(boundaries)), want, tol=1e-5,
                             what=f"{backend}, {layout}")
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1
