"""The pure-torch gated delta rule on packed rows: exact per document, forward and backward.

Every check goes through the public op, ``hybrid_pack.ops.gated_delta_rule(..., backend="torch")``,
except the chunk-size check, which calls the backend with its ``chunk_size``.
"""

from __future__ import annotations

import functools

import pytest
import torch

from hybrid_pack import PackedBoundaries
from hybrid_pack.ops.gated_delta import torch_backend
from tests import kit
from tests.kit import GATED_DELTA_LAYOUTS as LAYOUTS
from tests.ops.reference.gated_delta import gated_delta_rule_reference

OP = "gated_delta"
TORCH = kit.public_op(OP)
TOLERANCE = {torch.float64: 1e-12, torch.float32: 5e-6}
CONFIGS = {  # q/k heads, value heads, q/k normalised in the op, initial states given
    "mha": {"heads": 2, "v_heads": 2, "use_qk_l2norm": False, "initial_state": False},
    "gva_l2norm_h0": {"heads": 2, "v_heads": 4, "use_qk_l2norm": True, "initial_state": True},
}


def inputs(layout: str | PackedBoundaries, config: str, dtype: torch.dtype = torch.float64, **flags
           ) -> tuple[kit.CheckCase, PackedBoundaries]:
    """The op's inputs on a layout (by name) or on given boundaries, for ``CONFIGS[config]`` changed by ``flags``."""
    boundaries = LAYOUTS[layout].boundaries() if isinstance(layout, str) else layout
    signature = kit.gated_delta_signature(**CONFIGS[config] | flags, dtype=dtype)
    return kit.op_inputs(OP, signature, boundaries), boundaries


@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_matches_per_token_reference(layout: str, config: str) -> None:
    case, boundaries = inputs(layout, config)
    arguments = {**case.arguments, "scale": 0.3}
    got = kit.forward_backward(OP, TORCH, case, boundaries, arguments=arguments)
    want = kit.forward_backward(OP, gated_delta_rule_reference, case, boundaries, arguments=arguments)
    v_heads, k_dim, v_dim = case.arguments["v"].shape[2], case.arguments["k"].shape[3], case.arguments["v"].shape[3]
    assert got["output"].dtype == torch.float64
    assert got["final_state"].shape == (boundaries.num_docs, v_heads, k_dim, v_dim)
    assert set(got) == set(want)
    for name in got:
        kit.assert_close(got[name], want[name], name, tol=TOLERANCE[torch.float64])


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_packed_equals_each_document_alone(layout: str, config: str, dtype: torch.dtype) -> None:
    case, boundaries = inputs(layout, config, dtype)
    kit.assert_packed_equals_segments_alone(OP, TORCH, case, boundaries, tol=TOLERANCE[dtype], seed=2)


@pytest.mark.parametrize("layout", ["many_tiny_docs", "chunk_edges", "trailing_padding"])
def test_no_gradient_crosses_documents(layout: str) -> None:
    case, boundaries = inputs(layout, "gva_l2norm_h0", torch.float32)
    kit.assert_no_gradient_crosses_segments(OP, TORCH, case, boundaries)


def test_inert_tail_tokens_leave_the_state_unchanged() -> None:
    """Tokens with g = beta = k = 0 (what masked chunk slots hold) change neither state nor earlier outputs."""
    length, tail = torch_backend.CHUNK_SIZE + 5, torch_backend.CHUNK_SIZE - 5
    case, long_ = inputs(PackedBoundaries.from_lengths([length + tail]), "mha", initial_state=True)
    inert = {name: x.detach().clone() if isinstance(x, torch.Tensor) else x for name, x in case.arguments.items()}
    for name in ("k", "g", "beta"):
        inert[name][:, length:] = 0
    o_long, final_long = case.call(TORCH, long_, inert)
    head = {name: inert[name][:, :length] if name in case.token_inputs else x for name, x in inert.items()}
    o_short, final_short = case.call(TORCH, PackedBoundaries.from_lengths([length]), head)
    kit.assert_close(final_long, final_short, "final state", tol=5e-13)
    kit.assert_close(o_long[:, :length], o_short, "output", tol=5e-13)


@pytest.mark.parametrize("chunk_size", [1, 16, 64])
def test_chunk_size_does_not_change_the_result(chunk_size: int) -> None:
    case, boundaries = inputs("long_among_short", "gva_l2norm_h0")
    chunked = functools.partial(torch_backend.gated_delta_rule, chunk_size=chunk_size)
    o, final = case.call(chunked, boundaries)
    o_default, final_default = case.call(TORCH, boundaries)
    kit.assert_close(o, o_default, "output", tol=TOLERANCE[torch.float64])
    kit.assert_close(final, final_default, "final state", tol=TOLERANCE[torch.float64])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_inputs_track_float32(dtype: torch.dtype) -> None:
    low, boundaries = inputs("long_among_short", "gva_l2norm_h0", dtype)
    high = {name: x.detach().float().requires_grad_() if isinstance(x, torch.Tensor) else x
            for name, x in low.arguments.items()}
    o_low, final_low = low.call(TORCH, boundaries)
    o_high, final_high = low.call(TORCH, boundaries, high)
    assert o_low.dtype == dtype and final_low.dtype == torch.float32
    kit.assert_close(o_low.float(), o_high, "output", tol=1e-2)
    kit.assert_close(final_low, final_high, "final state", tol=5e-5)

    weight = torch.randn(o_high.shape, generator=torch.Generator().manual_seed(3))
    low_grads = kit.gradients((o_low.float() * weight).sum(), low.arguments)
    high_grads = kit.gradients((o_high * weight).sum(), high)
    for name, grad in low_grads.items():
        assert grad.dtype == dtype
        kit.assert_close(grad.float(), high_grads[name], name, tol=1.5e-2)


def test_final_state_is_optional() -> None:
    case, boundaries = inputs("many_tiny_docs", "mha", torch.float32, output_final_state=False)
    o, final = case.call(TORCH, boundaries)
    o_with, _ = case.call(TORCH, boundaries, {**case.arguments, "output_final_state": True})
    assert final is None
    assert torch.equal(o, o_with)
