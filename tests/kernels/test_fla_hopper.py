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

from hybrid_pack import PackedBoundaries
from hybrid_pack.ops.gated_delta import fla_hopper
from tests import kit

pytestmark = [pytest.mark.kernels, pytest.mark.usefixtures("without_selfcheck")]

TOL = 1e-4  # float32 kernels against float32 torch
SIGNATURE = kit.gated_delta_signature(heads=1, v_heads=2, k_dim=16, v_dim=8, use_qk_l2norm=True,
                                      output_final_state=False, dtype=torch.float32)


@pytest.fixture
def hopper_with_triton_3_6(monkeypatch: pytest.MonkeyPatch) -> None:
    from fla.ops.common import chunk_o

    monkeypatch.setattr(chunk_o, "IS_NVIDIA_HOPPER", True)
    monkeypatch.setattr(chunk_o, "TRITON_ABOVE_3_4_0", True)
    monkeypatch.setattr(chunk_o, "TRITON_ABOVE_3_7_1", False)
    monkeypatch.setattr(fla_hopper, "_installed", False)
    monkeypatch.setattr(fla_hopper, "_decided", False)


def gradients(backend: str, boundaries: PackedBoundaries) -> dict[str, torch.Tensor]:
    case = kit.op_inputs("gated_delta", SIGNATURE, boundaries)
    return kit.forward_backward("gated_delta", kit.public_op("gated_delta", backend), case, boundaries)


@pytest.mark.usefixtures("hopper_with_triton_3_6")
def test_fla_refuses_the_gated_backward_there() -> None:
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    boundaries = kit.Layout("across_chunks", (70, 1, 60)).boundaries()
    args = kit.op_inputs("gated_delta", SIGNATURE, boundaries).arguments
    o, _ = chunk_gated_delta_rule(*(args[name] for name in ("q", "k", "v", "g", "beta")),
                                  cu_seqlens=boundaries.cu_seqlens.long(), use_qk_l2norm_in_kernel=True)
    with pytest.raises(RuntimeError, match="Hopper"):
        o.sum().backward()


@pytest.mark.usefixtures("hopper_with_triton_3_6")
def test_fla_backend_trains_there_with_the_torch_dqkwg() -> None:
    boundaries = kit.Layout("chunk_edges_and_padding", (1, 63, 65, 1, 40), num_pad_tokens=3).boundaries()
    got, want = gradients("fla", boundaries), gradients("torch", boundaries)
    assert set(got) == set(want) == {"output", "dq", "dk", "dv", "dg", "dbeta"}
    for name in got:
        kit.assert_close(got[name], want[name], name, tol=TOL)
    assert fla_hopper.affected() and fla_hopper._installed


def test_nothing_is_registered_where_the_triton_kernel_is_right(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fla_hopper, "_installed", False)
    monkeypatch.setattr(fla_hopper, "_decided", False)
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
        kit.assert_close(got, want, name, tol=TOL)
