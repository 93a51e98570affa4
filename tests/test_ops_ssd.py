"""The pure-torch Mamba-2 SSD backend: packed rows behave exactly like documents run alone.

Every check goes through the public op ``hybrid_pack.ops.mamba2_ssd(..., backend="torch")`` and is
compared with (a) each document run on its own and (b) the per-token recurrence in
``tests.reference.ssd``, forward and backward, on layouts chosen to break chunking: one-token
documents, boundaries at and one off the chunk size, long documents next to short ones, a trailing
padding segment.
"""

from __future__ import annotations

import pytest
import torch

from hybrid_pack import PackedBoundaries
from hybrid_pack.ops import mamba2_ssd
from tests.reference.ssd import mamba2_ssd_reference

HEADS, HEAD_DIM, STATE_DIM = 4, 3, 5

# name -> (segment lengths, padding tokens at the end); chunk size 16 unless a test says otherwise.
LAYOUTS = {
    "one_token_docs": ([1, 1, 1, 1, 1], 0),
    "many_tiny_docs": ([1, 2, 3, 1, 2, 5, 3, 1, 4, 2], 0),
    "at_chunk_size": ([16, 32, 16], 0),
    "one_off_chunk_size": ([15, 17, 33, 1, 31], 0),
    "long_next_to_short": ([3, 70, 1, 20], 0),
    "trailing_padding": ([5, 40, 9, 11], 11),
}
LONG_LAYOUT = ([200, 7, 1, 64, 33, 15], 15)  # T = 320

FLAGS = {
    "plain": dict(groups=HEADS, d_shape=None, gate=False, dt_bias=False, softplus=True, initial=False),
    "full": dict(groups=2, d_shape="H,P", gate=True, dt_bias=True, softplus=True, initial=True),
    "one_group_d_per_head": dict(groups=1, d_shape="H", gate=True, dt_bias=False, softplus=True, initial=True),
    "no_softplus": dict(groups=2, d_shape="H", gate=False, dt_bias=True, softplus=False, initial=False),
}


def make_boundaries(layout: tuple[list[int], int]) -> PackedBoundaries:
    lengths, pad = layout
    return PackedBoundaries.from_lengths(lengths, num_pad_tokens=pad)


def make_inputs(boundaries: PackedBoundaries, *, groups: int, d_shape: str | None, gate: bool, dt_bias: bool,
                softplus: bool, initial: bool, dtype: torch.dtype = torch.float64, seed: int = 0) -> dict:
    """Random leaf tensors (requires_grad) and flags for one call of the op."""
    gen = torch.Generator().manual_seed(seed)
    t = boundaries.total_tokens

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    tensors = {
        "x": rand(1, t, HEADS, HEAD_DIM),
        # Without softplus dt must already be a step size: positive, mostly below 1.
        "dt": rand(1, t, HEADS) if softplus else rand(1, t, HEADS).abs() * 0.5,
        "A": -torch.empty(HEADS, dtype=torch.float64).uniform_(0.3, 2.0, generator=gen),
        "B": rand(1, t, groups, STATE_DIM),
        "C": rand(1, t, groups, STATE_DIM),
        "D": {None: None, "H": rand(HEADS), "H,P": rand(HEADS, HEAD_DIM)}[d_shape],
        "z": rand(1, t, HEADS, HEAD_DIM) if gate else None,
        "dt_bias": rand(HEADS) * 0.5 if dt_bias else None,
        "initial_states": rand(boundaries.num_docs, HEADS, HEAD_DIM, STATE_DIM) if initial else None,
    }
    tensors = {k: None if v is None else v.to(dtype).requires_grad_() for k, v in tensors.items()}
    return {"tensors": tensors, "dt_softplus": softplus}


def run(inputs: dict, boundaries: PackedBoundaries, chunk_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    t = inputs["tensors"]
    return mamba2_ssd(t["x"], t["dt"], t["A"], t["B"], t["C"], boundaries, D=t["D"], z=t["z"], dt_bias=t["dt_bias"],
                      dt_softplus=inputs["dt_softplus"], chunk_size=chunk_size,
                      initial_states=t["initial_states"], return_final_states=True, backend="torch")


def run_documents_alone(inputs: dict, boundaries: PackedBoundaries,
                        chunk_size: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Each segment sliced out of the packed inputs and run with its own one-document boundaries."""
    t = inputs["tensors"]
    ys, finals = [], []
    for seg, (start, length) in enumerate(zip(boundaries.starts, boundaries.segment_lengths)):
        rows = slice(start, start + length)
        init = t["initial_states"]
        is_doc = seg < boundaries.num_docs
        alone = {
            "tensors": {
                **t,
                "x": t["x"][:, rows], "dt": t["dt"][:, rows], "B": t["B"][:, rows], "C": t["C"][:, rows],
                "z": None if t["z"] is None else t["z"][:, rows],
                "initial_states": init[seg : seg + 1] if init is not None and is_doc else None,
            },
            "dt_softplus": inputs["dt_softplus"],
        }
        y, final = run(alone, PackedBoundaries.from_lengths([length]), chunk_size)
        ys.append(y)
        if is_doc:
            finals.append(final)
    return ys, finals


def leaves(inputs: dict) -> dict[str, torch.Tensor]:
    return {k: v for k, v in inputs["tensors"].items() if v is not None}


def grads(loss: torch.Tensor, inputs: dict) -> dict[str, torch.Tensor]:
    named = leaves(inputs)
    return dict(zip(named, torch.autograd.grad(loss, list(named.values()))))


def cotangents(y: torch.Tensor, final: torch.Tensor, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(y.shape, generator=gen, dtype=torch.float64).to(y.dtype),
            torch.randn(final.shape, generator=gen, dtype=torch.float64).to(final.dtype))


def tolerance(dtype: torch.dtype) -> dict[str, float]:
    return {"atol": 1e-10, "rtol": 1e-10} if dtype == torch.float64 else {"atol": 1e-5, "rtol": 1e-5}


def assert_grads_close(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], dtype: torch.dtype) -> None:
    for name in actual:
        torch.testing.assert_close(actual[name], expected[name], **tolerance(dtype), msg=lambda m, n=name: f"d{n}: {m}")


def check_packed_equals_documents_alone(layout: tuple[list[int], int], flags: dict, dtype: torch.dtype) -> None:
    boundaries = make_boundaries(layout)
    inputs = make_inputs(boundaries, **flags, dtype=dtype)
    y, final = run(inputs, boundaries, chunk_size=16)
    ys, finals = run_documents_alone(inputs, boundaries, chunk_size=16)
    assert y.dtype == dtype and final.dtype == dtype
    torch.testing.assert_close(y, torch.cat(ys, dim=1), **tolerance(dtype))
    torch.testing.assert_close(final, torch.cat(finals), **tolerance(dtype))

    gy, gf = cotangents(y, final)
    packed = grads((y * gy).sum() + (final * gf).sum(), inputs)
    alone = grads((torch.cat(ys, dim=1) * gy).sum() + (torch.cat(finals) * gf).sum(), inputs)
    assert_grads_close(packed, alone, dtype)


@pytest.mark.parametrize("flags", list(FLAGS))
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_packed_equals_documents_alone(layout: str, flags: str) -> None:
    check_packed_equals_documents_alone(LAYOUTS[layout], FLAGS[flags], torch.float64)


@pytest.mark.parametrize("layout", ["one_off_chunk_size", "trailing_padding"])
def test_packed_equals_documents_alone_float32(layout: str) -> None:
    check_packed_equals_documents_alone(LAYOUTS[layout], FLAGS["full"], torch.float32)


@pytest.mark.parametrize("chunk_size", [1, 7, 16, 64])
@pytest.mark.parametrize("flags", ["full", "no_softplus"])
def test_matches_per_token_reference(chunk_size: int, flags: str) -> None:
    """Forward and final states equal the recurrence for every chunk size (so chunking is invisible)."""
    boundaries = make_boundaries(LONG_LAYOUT)
    inputs = make_inputs(boundaries, **FLAGS[flags])
    t = inputs["tensors"]
    y, final = run(inputs, boundaries, chunk_size)
    y_ref, final_ref = mamba2_ssd_reference(
        t["x"], t["dt"], t["A"], t["B"], t["C"], boundaries, D=t["D"], z=t["z"], dt_bias=t["dt_bias"],
        dt_softplus=inputs["dt_softplus"], initial_states=t["initial_states"])
    torch.testing.assert_close(y, y_ref, **tolerance(y.dtype))
    torch.testing.assert_close(final, final_ref, **tolerance(y.dtype))


def test_gradients_match_per_token_reference() -> None:
    boundaries = make_boundaries(LONG_LAYOUT)
    inputs = make_inputs(boundaries, **FLAGS["full"])
    t = inputs["tensors"]
    y, final = run(inputs, boundaries, chunk_size=16)
    y_ref, final_ref = mamba2_ssd_reference(
        t["x"], t["dt"], t["A"], t["B"], t["C"], boundaries, D=t["D"], z=t["z"], dt_bias=t["dt_bias"],
        initial_states=t["initial_states"])
    gy, gf = cotangents(y, final)
    ours = grads((y * gy).sum() + (final * gf).sum(), inputs)
    ref = grads((y_ref * gy).sum() + (final_ref * gf).sum(), inputs)
    assert_grads_close(ours, ref, y.dtype)


@pytest.mark.parametrize("layout", ["many_tiny_docs", "one_off_chunk_size", "long_next_to_short", "trailing_padding"])
def test_no_gradient_crosses_documents(layout: str) -> None:
    """The loss of one document has exactly zero gradient on every other document's tokens and state."""
    boundaries = make_boundaries(LAYOUTS[layout])
    inputs = make_inputs(boundaries, **FLAGS["full"])
    per_token = ("x", "dt", "B", "C", "z")
    for doc in range(boundaries.num_docs):
        start, length = boundaries.starts[doc], boundaries.segment_lengths[doc]
        y, final = run(inputs, boundaries, chunk_size=16)
        g = grads(y[:, start : start + length].sum() + final[doc].sum(), inputs)
        for name in per_token:
            outside = torch.ones(boundaries.total_tokens, dtype=torch.bool)
            outside[start : start + length] = False
            leaked = g[name][:, outside]
            assert torch.equal(leaked, torch.zeros_like(leaked)), f"d{name}: doc {doc} leaks into other documents"
            assert g[name][:, start : start + length].abs().sum() > 0, f"d{name} of doc {doc} is zero"
        others = torch.arange(boundaries.num_docs) != doc
        assert torch.equal(g["initial_states"][others], torch.zeros_like(g["initial_states"][others]))


def test_other_documents_do_not_change_the_output() -> None:
    """Rewriting every token outside one document (token 0 included) leaves that document bit-identical."""
    boundaries = make_boundaries(LAYOUTS["one_off_chunk_size"])
    inputs = make_inputs(boundaries, **FLAGS["full"])
    doc, (start, length) = 2, (boundaries.starts[2], boundaries.segment_lengths[2])
    y, final = run(inputs, boundaries, chunk_size=16)
    changed = make_inputs(boundaries, **FLAGS["full"], seed=7)
    rows = slice(start, start + length)
    for name in ("x", "dt", "B", "C", "z"):
        changed["tensors"][name].data[:, rows] = inputs["tensors"][name].data[:, rows]
    for name in ("A", "D", "dt_bias", "initial_states"):
        changed["tensors"][name] = inputs["tensors"][name]
    y2, final2 = run(changed, boundaries, chunk_size=16)
    assert torch.equal(y[:, rows], y2[:, rows])
    assert torch.equal(final[doc], final2[doc])


def test_masked_chunk_tail_changes_nothing() -> None:
    """A document ending mid-chunk keeps the state it had at its last token: appending tokens whose dt
    makes no step (dt = 0 without softplus) yields the same final state."""
    inputs = make_inputs(PackedBoundaries.from_lengths([21]), **FLAGS["no_softplus"])
    longer = make_inputs(PackedBoundaries.from_lengths([32]), **FLAGS["no_softplus"])
    for name in ("x", "dt", "B", "C"):
        longer["tensors"][name].data[:, :21] = inputs["tensors"][name].data
    longer["tensors"]["dt"].data[:, 21:] = 0.0
    longer["tensors"]["dt_bias"] = None
    inputs["tensors"]["dt_bias"] = None
    longer["tensors"]["A"], longer["tensors"]["D"] = inputs["tensors"]["A"], inputs["tensors"]["D"]
    _, final = run(inputs, PackedBoundaries.from_lengths([21]), chunk_size=16)
    _, final_longer = run(longer, PackedBoundaries.from_lengths([32]), chunk_size=16)
    torch.testing.assert_close(final, final_longer, **tolerance(torch.float64))


def test_dt_is_clamped_at_zero_without_softplus() -> None:
    """Like mamba-ssm's default ``dt_limit=(0, inf)``: a negative dt is a zero step."""
    boundaries = make_boundaries(LAYOUTS["one_off_chunk_size"])
    inputs = make_inputs(boundaries, **FLAGS["no_softplus"])
    y, final = run(inputs, boundaries, chunk_size=16)
    inputs["tensors"]["dt"] = inputs["tensors"]["dt"].detach() - 10.0
    inputs["tensors"]["dt_bias"] = None
    y_neg, final_neg = run(inputs, boundaries, chunk_size=16)
    x, D = inputs["tensors"]["x"], inputs["tensors"]["D"]
    torch.testing.assert_close(y_neg, x * D[:, None])
    assert torch.equal(final_neg, torch.zeros_like(final_neg))
    assert not torch.allclose(y, y_neg)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_runs_in_float32(dtype: torch.dtype) -> None:
    """Half inputs are computed in float32: only the output rounding differs from a float32 run."""
    boundaries = make_boundaries(LAYOUTS["long_next_to_short"])
    half = make_inputs(boundaries, **FLAGS["full"], dtype=dtype)
    full = {"tensors": {k: None if v is None else v.detach().float().requires_grad_()
                        for k, v in half["tensors"].items()}, "dt_softplus": True}
    y_half, final_half = run(half, boundaries, chunk_size=16)
    y_full, final_full = run(full, boundaries, chunk_size=16)
    assert y_half.dtype == dtype and final_half.dtype == torch.float32
    torch.testing.assert_close(y_half.float(), y_full, atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(final_half, final_full, atol=1e-5, rtol=1e-5)

    g_half = grads(y_half.float().sum(), half)
    g_full = grads(y_full.sum(), full)
    for name in g_half:
        assert g_half[name].dtype == dtype
        assert torch.isfinite(g_half[name]).all()
        scale = g_full[name].abs().max()
        torch.testing.assert_close(g_half[name].float() / scale, g_full[name] / scale, atol=3e-2, rtol=0)


def test_returns_only_y_without_final_states() -> None:
    boundaries = make_boundaries(LAYOUTS["trailing_padding"])
    t = make_inputs(boundaries, **FLAGS["plain"])["tensors"]
    y = mamba2_ssd(t["x"], t["dt"], t["A"], t["B"], t["C"], boundaries, backend="torch")
    assert isinstance(y, torch.Tensor) and y.shape == t["x"].shape


@pytest.mark.parametrize("field, change", [
    ("D", lambda t: {**t, "D": torch.zeros(HEADS + 1)}),
    ("B", lambda t: {**t, "B": torch.zeros(1, t["x"].shape[1], 3, STATE_DIM),
                     "C": torch.zeros(1, t["x"].shape[1], 3, STATE_DIM)}),
    ("initial_states", lambda t: {**t, "initial_states": torch.zeros(1, HEADS, HEAD_DIM, STATE_DIM)}),
    ("x", lambda t: {**t, "x": torch.zeros(2, t["x"].shape[1], HEADS, HEAD_DIM)}),
])
def test_bad_shapes_raise_value_error(field: str, change) -> None:
    boundaries = make_boundaries(LAYOUTS["one_off_chunk_size"])
    inputs = make_inputs(boundaries, **FLAGS["plain"])["tensors"]
    t = change({k: None if v is None else v.detach() for k, v in inputs.items()})
    with pytest.raises(ValueError, match=rf"^{field}: "):
        mamba2_ssd(t["x"], t["dt"], t["A"], t["B"], t["C"], boundaries, D=t["D"],
                   initial_states=t["initial_states"], backend="torch")
