"""Kernel adapters against the pure-torch oracles, forward and backward, on adversarial packed layouts.

Every comparison goes through the public op with the backend forced, so the adapter sees exactly
what users' calls give it; the kernels are the real fla / mamba-ssm Triton kernels, interpreted.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from hybrid_pack.ops import causal_conv1d, gated_delta_rule, mamba2_ssd, varlen_attention
from tests.kernels.layouts import LAYOUTS, assert_close, boundaries_of

pytestmark = [pytest.mark.kernels, pytest.mark.usefixtures("without_selfcheck")]


def leaves(*tensors: torch.Tensor | None) -> list[torch.Tensor | None]:
    return [None if t is None else t.detach().clone().requires_grad_() for t in tensors]


def grads_of(outputs: list[torch.Tensor], inputs: list[torch.Tensor | None], seed: int) -> list[torch.Tensor]:
    """Gradients of a random projection of ``outputs`` w.r.t. the non-None ``inputs``."""
    gen = torch.Generator().manual_seed(seed)
    loss = sum((o * torch.randn(o.shape, generator=gen)).sum() for o in outputs)
    return list(torch.autograd.grad(loss, [t for t in inputs if t is not None]))


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_fla_gated_delta_rule_matches_torch(layout: str) -> None:
    b = boundaries_of(layout)
    t, h, hv, k_dim, v_dim = b.total_tokens, 1, 2, 16, 8
    gen = torch.Generator().manual_seed(0)
    q, k = torch.randn(2, 1, t, h, k_dim, generator=gen)
    v = torch.randn(1, t, hv, v_dim, generator=gen)
    g = F.logsigmoid(torch.randn(1, t, hv, generator=gen) + 2)
    beta = torch.rand(1, t, hv, generator=gen)
    h0 = torch.randn(b.num_docs, hv, k_dim, v_dim, generator=gen)
    results = {}
    for backend in ("fla", "torch"):
        inputs = leaves(q, k, v, g, beta, h0)
        o, state = gated_delta_rule(*inputs[:5], b, initial_state=inputs[5], output_final_state=True,
                                    use_qk_l2norm=True, backend=backend)
        results[backend] = (o, state, *grads_of([o, state], inputs, seed=1))
    names = ("o", "final_state", "dq", "dk", "dv", "dg", "dbeta", "dh0")
    for name, got, want in zip(names, results["fla"], results["torch"]):
        assert_close(got, want, name)


@pytest.mark.parametrize("width", [2, 4, 5])
def test_fla_causal_conv1d_matches_torch(width: int) -> None:
    b = boundaries_of("one_token_docs_and_chunk_edges")
    gen = torch.Generator().manual_seed(width)
    x = torch.randn(1, b.total_tokens, 12, generator=gen)
    weight, bias = torch.randn(12, width, generator=gen), torch.randn(12, generator=gen)
    results = {}
    for backend in ("fla", "torch"):
        inputs = leaves(x, weight, bias)
        y = causal_conv1d(*inputs, b, activation="silu", backend=backend)
        results[backend] = (y, *grads_of([y], inputs, seed=2))
    for name, got, want in zip(("y", "dx", "dweight", "dbias"), results["fla"], results["torch"]):
        assert_close(got, want, name)


@pytest.mark.parametrize("layout", ["one_token_docs_and_chunk_edges", "long_next_to_short"])
def test_mamba_ssm_matches_torch(layout: str) -> None:
    b = boundaries_of(layout)
    t, h, p, g_, n = b.total_tokens, 2, 4, 1, 8
    gen = torch.Generator().manual_seed(3)
    x, z = torch.randn(2, 1, t, h, p, generator=gen)
    dt = torch.randn(1, t, h, generator=gen)
    a = -torch.rand(h, generator=gen) - 0.5
    bc = torch.randn(2, 1, t, g_, n, generator=gen)
    d, dt_bias = torch.randn(2, h, generator=gen)
    results = {}
    for backend in ("mamba_ssm", "torch"):
        inputs = leaves(x, dt, a, bc[0], bc[1], d, z, dt_bias)
        y = mamba2_ssd(*inputs[:5], b, D=inputs[5], z=inputs[6], dt_bias=inputs[7], chunk_size=64, backend=backend)
        results[backend] = (y, *grads_of([y], inputs, seed=4))
    names = ("y", "dx", "ddt", "dA", "dB", "dC", "dD", "dz", "ddt_bias")
    for name, got, want in zip(names, results["mamba_ssm"], results["torch"]):
        assert_close(got, want, name)


def test_mamba_ssm_final_states_match_torch() -> None:
    b = boundaries_of("one_token_docs_and_chunk_edges")
    t, h, p, n = b.total_tokens, 2, 4, 8
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(1, t, h, p, generator=gen)
    dt = torch.randn(1, t, h, generator=gen)
    a = -torch.rand(h, generator=gen) - 0.5
    bm, cm = torch.randn(2, 1, t, 1, n, generator=gen)
    with torch.no_grad():
        y, states = mamba2_ssd(x, dt, a, bm, cm, b, chunk_size=32, return_final_states=True, backend="mamba_ssm")
        y_ref, states_ref = mamba2_ssd(x, dt, a, bm, cm, b, chunk_size=32, return_final_states=True, backend="torch")
    assert states.shape == (b.num_docs, h, p, n)
    assert_close(y, y_ref, "y")
    assert_close(states, states_ref, "final_states")


@pytest.mark.filterwarnings("ignore:.*flex_attention.*:UserWarning")
@pytest.mark.parametrize("causal", [True, False])
def test_flex_document_mask_matches_torch(causal: bool) -> None:
    """Flex attention has no CPU backward, so its document mask is checked forward, through the adapter."""
    from hybrid_pack.ops.attention.kernel_flex import varlen_attention as flex_varlen_attention

    b = boundaries_of("one_token_docs_and_chunk_edges")
    gen = torch.Generator().manual_seed(6)
    q = torch.randn(1, b.total_tokens, 4, 16, generator=gen)
    k, v = torch.randn(2, 1, b.total_tokens, 2, 16, generator=gen)
    out = flex_varlen_attention(q, k, v, b, causal=causal, softmax_scale=0.25)
    assert_close(out, varlen_attention(q, k, v, b, causal=causal, softmax_scale=0.25, backend="torch"), "out")
