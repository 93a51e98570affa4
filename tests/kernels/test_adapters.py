"""Kernel adapters against the pure-torch oracles, forward and backward, on adversarial packed layouts.

Every comparison goes through the public op with the backend forced, so the adapter sees exactly
what users' calls give it; the kernels are the real fla / mamba-ssm Triton kernels, interpreted.
"""

from __future__ import annotations

import pytest
import torch

from hybrid_pack.boundaries import PackedBoundaries
from hybrid_pack.ops import varlen_attention
from tests import kit
from tests.kit import KERNEL_LAYOUTS as LAYOUTS

pytestmark = [pytest.mark.kernels, pytest.mark.usefixtures("without_selfcheck")]

TOL = 1e-4  # float32 kernels against the float32 torch backend


def assert_kernel_matches_torch(op: str, kernel: str, case: kit.CheckCase, boundaries: PackedBoundaries,
                                expected: set[str]) -> None:
    """The kernel's outputs and gradients equal the torch backend's on the same inputs."""
    got = kit.forward_backward(op, kit.public_op(op, kernel), case, boundaries)
    want = kit.forward_backward(op, kit.public_op(op, "torch"), case, boundaries)
    assert set(got) == set(want) == expected
    for name in got:
        kit.assert_close(got[name], want[name], name, tol=TOL)


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_fla_gated_delta_rule_matches_torch(layout: str) -> None:
    boundaries = LAYOUTS[layout].boundaries()
    signature = kit.gated_delta_signature(heads=1, v_heads=2, k_dim=16, v_dim=8, use_qk_l2norm=True,
                                          initial_state=True, dtype=torch.float32)
    case = kit.op_inputs("gated_delta", signature, boundaries)
    assert_kernel_matches_torch("gated_delta", "fla", case, boundaries,
                                {"output", "final_state", "dq", "dk", "dv", "dg", "dbeta", "dinitial_state"})


@pytest.mark.parametrize("width", [2, 4, 5])
def test_fla_causal_conv1d_matches_torch(width: int) -> None:
    boundaries = LAYOUTS["one_token_docs_and_chunk_edges"].boundaries()
    signature = kit.conv_signature(channels=12, width=width, activation="silu", dtype=torch.float32)
    case = kit.op_inputs("conv", signature, boundaries, seed=width)
    assert_kernel_matches_torch("conv", "fla", case, boundaries, {"output", "dx", "dweight", "dbias"})


@pytest.mark.parametrize("layout", ["one_token_docs_and_chunk_edges", "long_next_to_short"])
def test_mamba_ssm_matches_torch(layout: str) -> None:
    boundaries = LAYOUTS[layout].boundaries()
    signature = kit.ssd_signature(heads=2, head_dim=4, groups=1, state_dim=8, chunk_size=64, D="H", z=True,
                                  dt_bias=True, return_final_states=False, dtype=torch.float32)
    case = kit.op_inputs("ssd", signature, boundaries, seed=3)
    assert_kernel_matches_torch("ssd", "mamba_ssm", case, boundaries,
                                {"output", "dx", "ddt", "dA", "dB", "dC", "dD", "dz", "ddt_bias"})


def test_mamba_ssm_final_states_match_torch() -> None:
    boundaries = LAYOUTS["one_token_docs_and_chunk_edges"].boundaries()
    signature = kit.ssd_signature(heads=2, head_dim=4, groups=1, state_dim=8, chunk_size=32, dtype=torch.float32)
    case = kit.op_inputs("ssd", signature, boundaries, seed=5, requires_grad=False)
    got = kit.run("ssd", kit.public_op("ssd", "mamba_ssm"), case, boundaries)
    want = kit.run("ssd", kit.public_op("ssd", "torch"), case, boundaries)
    assert got["final_state"].shape == (boundaries.num_docs, 2, 4, 8)
    for name in ("output", "final_state"):
        kit.assert_close(got[name], want[name], name, tol=TOL)


@pytest.mark.filterwarnings("ignore:.*flex_attention.*:UserWarning")
@pytest.mark.parametrize("causal", [True, False])
def test_flex_document_mask_matches_torch(causal: bool) -> None:
    """Flex attention has no CPU backward, so its document mask is checked forward, through the adapter."""
    from hybrid_pack.ops.attention.kernel_flex import varlen_attention as flex_varlen_attention

    boundaries = LAYOUTS["one_token_docs_and_chunk_edges"].boundaries()
    signature = kit.attention_signature(heads=4, kv_heads=2, dim=16, causal=causal, dtype=torch.float32)
    case = kit.op_inputs("attention", signature, boundaries, seed=6, requires_grad=False)
    arguments = {**case.arguments, "softmax_scale": 0.25}
    out = case.call(flex_varlen_attention, boundaries, arguments)
    expected = case.call(varlen_attention, boundaries, arguments | {"backend": "torch"})
    kit.assert_close(out, expected, "output", tol=TOL)
