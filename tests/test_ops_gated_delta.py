"""The pure-torch gated delta rule on packed rows: exact per document, forward and backward.

Every check goes through the public op, ``hybrid_pack.ops.gated_delta_rule(..., backend="torch")``.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from hybrid_pack import PackedBoundaries
from hybrid_pack.ops import gated_delta_rule
from hybrid_pack.ops.gated_delta import torch_backend
from tests.reference.gated_delta import gated_delta_rule_reference

C = torch_backend.CHUNK_SIZE
INPUTS = ("q", "k", "v", "g", "beta", "initial_state")
TOLERANCE = {torch.float64: 1e-10, torch.float32: 1e-5}

# Segment lengths; a trailing ("pad", n) entry is a padding segment of n tokens.
LAYOUTS = {
    "one_token_docs": [1, 1, 1, 1, 1],
    "many_tiny_docs": [3, 1, 5, 2, 7, 1, 4, 2],
    "chunk_edges": [C - 1, C, C + 1, 2 * C, 2 * C + 1],
    "edges_63_to_129": [63, 64, 65, 128, 129],
    "long_among_short": [5, 300, 2, 17, 1],
    "trailing_padding": [40, 70, 9, ("pad", 13)],
}
# (q/k heads, value heads, use_qk_l2norm, initial_state given)
CONFIGS = {
    "mha": (2, 2, False, False),
    "gva_l2norm_h0": (2, 4, True, True),
}
K_DIM, V_DIM = 16, 12



def make_boundaries(layout: list) -> PackedBoundaries:
    pad = layout[-1][1] if isinstance(layout[-1], tuple) else 0
    lengths = [n for n in layout if not isinstance(n, tuple)] + ([pad] if pad else [])
    return PackedBoundaries.from_lengths(lengths, num_pad_tokens=pad)


def make_inputs(boundaries: PackedBoundaries, heads: int, v_heads: int, *, l2norm_inside: bool, with_h0: bool,
                dtype: torch.dtype, seed: int = 0) -> dict[str, torch.Tensor | None]:
    """Leaf tensors in a stable regime: log decays -softplus(randn), beta = sigmoid, unit-norm keys."""
    gen = torch.Generator().manual_seed(seed)
    t = boundaries.total_tokens

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    k = randn(1, t, heads, K_DIM)
    inputs = {
        "q": randn(1, t, heads, K_DIM),
        "k": 3 * k if l2norm_inside else F.normalize(k, dim=-1),
        "v": randn(1, t, v_heads, V_DIM),
        "g": -F.softplus(randn(1, t, v_heads)),
        "beta": randn(1, t, v_heads).sigmoid(),
        "initial_state": randn(boundaries.num_docs, v_heads, K_DIM, V_DIM) if with_h0 else None,
    }
    return {name: None if x is None else x.to(dtype).requires_grad_() for name, x in inputs.items()}


def run(inputs: dict, boundaries: PackedBoundaries, use_qk_l2norm: bool, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
    return gated_delta_rule(inputs["q"], inputs["k"], inputs["v"], inputs["g"], inputs["beta"], boundaries,
                            initial_state=inputs["initial_state"], output_final_state=True,
                            use_qk_l2norm=use_qk_l2norm, backend="torch", **kwargs)


def grads(loss: torch.Tensor, inputs: dict, retain_graph: bool = False) -> dict[str, torch.Tensor]:
    leaves = {name: x for name, x in inputs.items() if x is not None}
    return dict(zip(leaves, torch.autograd.grad(loss, list(leaves.values()), retain_graph=retain_graph)))


def assert_close(actual: torch.Tensor, expected: torch.Tensor, tol: float, what: str) -> None:
    """Max abs error within ``tol`` relative to the larger of 1 and the expected magnitude."""
    assert actual.shape == expected.shape, what
    bound = tol * max(1.0, expected.abs().max().item())
    err = (actual.double() - expected.double()).abs().max().item()
    assert err <= bound, f"{what}: max abs error {err:.3e} > {bound:.3e}"


def segment_slices(boundaries: PackedBoundaries) -> list[slice]:
    return [slice(s, s + n) for s, n in zip(boundaries.starts, boundaries.segment_lengths)]


@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_matches_per_token_reference(layout: str, config: str) -> None:
    heads, v_heads, l2norm, with_h0 = CONFIGS[config]
    boundaries = make_boundaries(LAYOUTS[layout])
    inputs = make_inputs(boundaries, heads, v_heads, l2norm_inside=l2norm, with_h0=with_h0, dtype=torch.float64)
    gen = torch.Generator().manual_seed(1)
    o_weight = torch.randn(1, boundaries.total_tokens, v_heads, V_DIM, generator=gen, dtype=torch.float64)
    s_weight = torch.randn(boundaries.num_docs, v_heads, K_DIM, V_DIM, generator=gen, dtype=torch.float64)

    o, final = run(inputs, boundaries, l2norm, scale=0.3)
    o_ref, final_ref = gated_delta_rule_reference(*(inputs[n] for n in INPUTS[:5]), boundaries, scale=0.3,
                                                  initial_state=inputs["initial_state"], use_qk_l2norm=l2norm)
    assert o.dtype == torch.float64 and final.shape == (boundaries.num_docs, v_heads, K_DIM, V_DIM)
    assert_close(o, o_ref, 1e-10, "output")
    assert_close(final, final_ref, 1e-10, "final state")

    got = grads((o * o_weight).sum() + (final * s_weight).sum(), inputs)
    want = grads((o_ref * o_weight).sum() + (final_ref * s_weight).sum(), inputs)
    for name in got:
        assert_close(got[name], want[name], 1e-10, f"grad {name}")


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_packed_equals_each_document_alone(layout: str, config: str, dtype: torch.dtype) -> None:
    heads, v_heads, l2norm, with_h0 = CONFIGS[config]
    boundaries = make_boundaries(LAYOUTS[layout])
    inputs = make_inputs(boundaries, heads, v_heads, l2norm_inside=l2norm, with_h0=with_h0, dtype=dtype)
    gen = torch.Generator().manual_seed(2)
    o_weight = torch.randn(1, boundaries.total_tokens, v_heads, V_DIM, generator=gen).to(dtype)
    s_weight = torch.randn(boundaries.num_docs, v_heads, K_DIM, V_DIM, generator=gen).to(dtype)

    o, final = run(inputs, boundaries, l2norm)
    packed_grads = grads((o * o_weight).sum() + (final * s_weight).sum(), inputs)

    alone_loss = 0
    for n, span in enumerate(segment_slices(boundaries)):
        doc = {name: inputs[name][:, span] for name in INPUTS[:5]}
        is_doc = n < boundaries.num_docs
        doc["initial_state"] = inputs["initial_state"][n:n + 1] if with_h0 and is_doc else None
        o_doc, final_doc = run(doc, PackedBoundaries.from_lengths([span.stop - span.start]), l2norm)
        assert_close(o[:, span], o_doc, TOLERANCE[dtype], f"output of segment {n}")
        alone_loss = alone_loss + (o_doc * o_weight[:, span]).sum()
        if is_doc:
            assert_close(final[n:n + 1], final_doc, TOLERANCE[dtype], f"final state of document {n}")
            alone_loss = alone_loss + (final_doc * s_weight[n:n + 1]).sum()
    alone_grads = grads(alone_loss, inputs)
    for name in packed_grads:
        assert_close(packed_grads[name], alone_grads[name], TOLERANCE[dtype], f"grad {name}")


@pytest.mark.parametrize("layout", ["many_tiny_docs", "chunk_edges", "trailing_padding"])
def test_no_gradient_crosses_documents(layout: str) -> None:
    heads, v_heads, l2norm, _ = CONFIGS["gva_l2norm_h0"]
    boundaries = make_boundaries(LAYOUTS[layout])
    inputs = make_inputs(boundaries, heads, v_heads, l2norm_inside=l2norm, with_h0=True, dtype=torch.float32)
    o, final = run(inputs, boundaries, l2norm)
    spans = segment_slices(boundaries)
    for i, span in enumerate(spans):
        loss = o[:, span].sum() + (final[i].sum() if i < boundaries.num_docs else 0)
        g = grads(loss, inputs, retain_graph=True)
        for name in INPUTS[:5]:
            outside = torch.ones(boundaries.total_tokens, dtype=torch.bool)
            outside[span] = False
            assert torch.equal(g[name][:, outside], torch.zeros_like(g[name][:, outside])), (
                f"segment {i}'s output has a gradient on {name} of other segments")
            assert g[name][:, span].abs().sum() > 0, f"segment {i}: no gradient on its own {name}"
        others = [n for n in range(boundaries.num_docs) if n != i]
        assert torch.equal(g["initial_state"][others], torch.zeros_like(g["initial_state"][others]))


def test_inert_tail_tokens_leave_the_state_unchanged() -> None:
    """Tokens with g = beta = k = 0 (what masked chunk slots hold) change neither state nor earlier outputs."""
    length, tail = C + 5, C - 5
    short, long_ = PackedBoundaries.from_lengths([length]), PackedBoundaries.from_lengths([length + tail])
    inputs = make_inputs(long_, 2, 2, l2norm_inside=False, with_h0=True, dtype=torch.float64)
    inert = {name: x.detach().clone() for name, x in inputs.items()}
    for name in ("k", "g", "beta"):
        inert[name][:, length:] = 0
    o_long, final_long = run(inert, long_, False)
    head = {name: x if name == "initial_state" else x[:, :length] for name, x in inert.items()}
    o_short, final_short = run(head, short, False)
    assert_close(final_long, final_short, 1e-12, "final state")
    assert_close(o_long[:, :length], o_short, 1e-12, "output")


@pytest.mark.parametrize("chunk_size", [1, 16, 64])
def test_chunk_size_does_not_change_the_result(chunk_size: int) -> None:
    heads, v_heads, l2norm, _ = CONFIGS["gva_l2norm_h0"]
    boundaries = make_boundaries(LAYOUTS["long_among_short"])
    inputs = make_inputs(boundaries, heads, v_heads, l2norm_inside=l2norm, with_h0=True, dtype=torch.float64)
    o, final = torch_backend.gated_delta_rule(*(inputs[n] for n in INPUTS[:5]), boundaries, scale=K_DIM ** -0.5,
                                              initial_state=inputs["initial_state"], output_final_state=True,
                                              use_qk_l2norm=l2norm, chunk_size=chunk_size)
    o_default, final_default = run(inputs, boundaries, l2norm)
    assert_close(o, o_default, 1e-10, "output")
    assert_close(final, final_default, 1e-10, "final state")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_inputs_track_float32(dtype: torch.dtype) -> None:
    heads, v_heads, l2norm, _ = CONFIGS["gva_l2norm_h0"]
    boundaries = make_boundaries(LAYOUTS["long_among_short"])
    low = make_inputs(boundaries, heads, v_heads, l2norm_inside=l2norm, with_h0=True, dtype=dtype)
    high = {name: x.detach().float().requires_grad_() for name, x in low.items()}
    o_low, final_low = run(low, boundaries, l2norm)
    o_high, final_high = run(high, boundaries, l2norm)
    assert o_low.dtype == dtype and final_low.dtype == torch.float32
    assert_close(o_low, o_high, 2e-2, "output")
    assert_close(final_low, final_high, 1e-4, "final state")

    weight = torch.randn(o_high.shape, generator=torch.Generator().manual_seed(3))
    low_grads = grads((o_low.float() * weight).sum(), low)
    high_grads = grads((o_high * weight).sum(), high)
    for name in low_grads:
        assert low_grads[name].dtype == dtype
        assert_close(low_grads[name], high_grads[name], 3e-2, f"grad {name}")


def test_final_state_is_optional() -> None:
    boundaries = make_boundaries(LAYOUTS["many_tiny_docs"])
    inputs = make_inputs(boundaries, 2, 2, l2norm_inside=False, with_h0=False, dtype=torch.float32)
    o, final = gated_delta_rule(*(inputs[n] for n in INPUTS[:5]), boundaries, backend="torch")
    o_with, _ = run(inputs, boundaries, False)
    assert final is None
    assert torch.equal(o, o_with)
