"""fla's gated DeltaNet backward on Hopper with a Triton that miscompiles it, on CPU: fla's own flags are
set to say "Hopper, Triton 3.6", as on an H100 with torch 2.11.

fla then refuses the backward (it raises rather than train wrongly); hybrid_pack registers a torch
``chunk_bwd_dqkwg`` with fla's dispatch for exactly that case, and the fla backend trains again:
its gradients match the pure-torch backend. The torch kernel itself is checked against fla's Triton
kernel (interpreted) on fixed-length, variable-length and grouped-value-head inputs.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F

from hybrid_pack import PackedBoundaries
from hybrid_pack.ops import gated_delta_rule
from hybrid_pack.ops.gated_delta import fla_hopper
from tests.kernels.layouts import assert_close

pytestmark = [pytest.mark.kernels, pytest.mark.usefixtures("without_selfcheck")]


@pytest.fixture
def hopper_with_triton_3_6(monkeypatch: pytest.MonkeyPatch) -> None:
    from fla.ops.common import chunk_o

    monkeypatch.setattr(chunk_o, "IS_NVIDIA_HOPPER", True)
    monkeypatch.setattr(chunk_o, "TRITON_ABOVE_3_4_0", True)
    monkeypatch.setattr(chunk_o, "TRITON_ABOVE_3_7_1", False)
    monkeypatch.setattr(fla_hopper, "_installed", False)


def gdn_inputs(boundaries: PackedBoundaries, seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    t = boundaries.total_tokens
    q, k = torch.randn(2, 1, t, 1, 16, generator=gen)
    v = torch.randn(1, t, 2, 8, generator=gen)
    g = F.logsigmoid(torch.randn(1, t, 2, generator=gen) + 2)
    beta = torch.rand(1, t, 2, generator=gen)
    return [x.requires_grad_() for x in (q, k, v, g, beta)]


def gradients(backend: str, boundaries: PackedBoundaries) -> list[torch.Tensor]:
    inputs = gdn_inputs(boundaries)
    o, _ = gated_delta_rule(*inputs, boundaries, use_qk_l2norm=True, backend=backend)
    weights = torch.randn(o.shape, generator=torch.Generator().manual_seed(1))
    return [o, *torch.autograd.grad((o * weights).sum(), inputs)]


@pytest.mark.usefixtures("hopper_with_triton_3_6")
def test_fla_refuses_the_gated_backward_there() -> None:
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    boundaries = PackedBoundaries.from_lengths([70, 1, 60])
    q, k, v, g, beta = gdn_inputs(boundaries)
    o, _ = chunk_gated_delta_rule(q, k, v, g, beta, cu_seqlens=boundaries.cu_seqlens.long(),
                                  use_qk_l2norm_in_kernel=True)
    with pytest.raises(RuntimeError, match="Hopper"):
        o.sum().backward()


@pytest.mark.usefixtures("hopper_with_triton_3_6")
def test_fla_backend_trains_there_with_the_torch_dqkwg() -> None:
    boundaries = PackedBoundaries.from_document_lengths([1, 63, 65, 1, 40], num_pad_tokens=3)
    names = ("o", "dq", "dk", "dv", "dg", "dbeta")
    for name, got, want in zip(names, gradients("fla", boundaries), gradients("torch", boundaries)):
        assert_close(got, want, name)
    assert fla_hopper.affected() and fla_hopper._installed


def test_nothing_is_registered_where_the_triton_kernel_is_right() -> None:
    assert not fla_hopper.affected()
    assert not fla_hopper.install()


def chunk_inputs(lengths: list[int] | None, heads: int, v_heads: int, k_dim: int, v_dim: int,
                 state_v_first: bool) -> dict[str, Any]:
    """Inputs of fla's ``chunk_bwd_dqkwg`` for one row of these segment lengths (or two fixed rows of 150)."""
    from fla.ops.utils import chunk_local_cumsum, prepare_chunk_indices

    gen = torch.Generator().manual_seed(0)
    batch, tokens = (1, sum(lengths)) if lengths else (2, 150)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()]) if lengths else None
    index = prepare_chunk_indices(cu, 64) if lengths else None
    chunks = len(index) if lengths else batch * -(-tokens // 64)
    q, k = (torch.randn(batch, tokens, heads, k_dim, generator=gen) for _ in range(2))
    v, do, dv = (torch.randn(batch, tokens, v_heads, v_dim, generator=gen) for _ in range(3))
    state_shape = (chunks, v_heads, v_dim, k_dim) if state_v_first else (chunks, v_heads, k_dim, v_dim)
    g = chunk_local_cumsum(-torch.rand(batch, tokens, v_heads, generator=gen) * 0.3, chunk_size=64, cu_seqlens=cu,
                           chunk_indices=index)
    return {"q": q, "k": k, "v": v, "do": do, "h": torch.randn(*state_shape, generator=gen),
            "dh": torch.randn(*state_shape, generator=gen),
            "w": torch.randn(batch, tokens, v_heads, k_dim, generator=gen),
            "g": g, "dv": dv, "scale": k_dim ** -0.5, "state_v_first": state_v_first, "cu_seqlens": cu,
            "chunk_size": 64, "chunk_indices": index}


@pytest.mark.parametrize(("lengths", "heads", "v_heads", "k_dim", "v_dim", "state_v_first"), [
    (None, 2, 2, 64, 64, False),
    ([70, 1, 129], 2, 4, 128, 64, False),
    ([64, 66], 1, 1, 32, 128, True),
])
def test_torch_dqkwg_matches_flas_triton_kernel(lengths: list[int] | None, heads: int, v_heads: int, k_dim: int,
                                                 v_dim: int, state_v_first: bool) -> None:
    from fla.ops.common.chunk_o import chunk_bwd_dqkwg

    inputs = chunk_inputs(lengths, heads, v_heads, k_dim, v_dim, state_v_first)
    for name, got, want in zip(("dq", "dk", "dw", "dg"), fla_hopper.chunk_bwd_dqkwg(**inputs),
                               chunk_bwd_dqkwg(**inputs)):
        assert_close(got, want, name)
