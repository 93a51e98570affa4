"""Every op x every backend usable here x {float32, bfloat16}, at real sizes (T = 32,768, or
``$HYBRID_PACK_GPU_TOKENS`` >= 8192 for a short run), on CUDA.

Each case is the backends' self-check run on a real-size row instead of its short one: the backend against
the pure-torch backend in float64, forward and backward; every document alone against the packed row; and the
gradient of every segment's outputs with respect to every other segment's inputs exactly zero. A float32 kernel
that misses the 1e-5 serving bound (one multiplying in TF32 does) is held to TF32's bound instead and recorded
as not serving float32. Layouts hold one-token documents, documents ending on the kernel's block edges,
a 4096-token document beside dozens under 64 tokens, and a padding segment.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch

from hybrid_pack.isolation import REAL_TOKENS, SELF_CHECK_TOLERANCE, TOLERANCE, real_size_layout
from hybrid_pack.ops.dispatch.registry import backends_of, contract_of, reference_of
from hybrid_pack.ops.selfcheck.contract import Signature, make_signature
from hybrid_pack.ops.selfcheck.whole_row import run_check

F32 = torch.float32
TOKENS = int(os.environ.get("HYBRID_PACK_GPU_TOKENS") or REAL_TOKENS)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def attention(dtype: torch.dtype, dim: int, causal: bool = True) -> Signature:
    return make_signature(H=8, Hkv=2, D=dim, causal=causal, q=dtype, k=dtype, v=dtype)


def conv(dtype: torch.dtype, channels: int, width: int, bias: bool, activation: str | None) -> Signature:
    return make_signature(D=channels, W=width, activation=activation, x=dtype, weight=dtype,
                          bias=dtype if bias else None)


def gated_delta(dtype: torch.dtype, k_dim: int, v_dim: int, states: bool = False) -> Signature:
    return make_signature(H=4, K=k_dim, HV=8, V=v_dim, use_qk_l2norm=True, output_final_state=states, q=dtype,
                          k=dtype, v=dtype, g=F32, beta=dtype, initial_state=F32 if states else None)


def ssd(dtype: torch.dtype, head_dim: int, groups: int, state: int, chunk: int, gate: bool, d_per_channel: bool
        ) -> Signature:
    return make_signature(H=8, P=head_dim, G=groups, N=state, chunk_size=chunk, D_per_channel=d_per_channel,
                          dt_softplus=True, return_final_states=False, x=dtype, dt=dtype, A=F32, B=dtype, C=dtype,
                          D=F32, z=dtype if gate else None, dt_bias=F32, initial_states=None)


CASES: dict[str, tuple[str, Any]] = {
    "attention-d64": ("attention", lambda dt: attention(dt, 64)),
    "attention-d128": ("attention", lambda dt: attention(dt, 128)),
    "attention-d256": ("attention", lambda dt: attention(dt, 256)),
    "attention-d128-bidirectional": ("attention", lambda dt: attention(dt, 128, causal=False)),
    "conv-w4-silu-bias": ("conv", lambda dt: conv(dt, 1024, 4, True, "silu")),
    "conv-w2-plain": ("conv", lambda dt: conv(dt, 1024, 2, False, None)),
    "conv-w4-odd-channels": ("conv", lambda dt: conv(dt, 1000, 4, True, "silu")),
    "gated_delta-k64": ("gated_delta", lambda dt: gated_delta(dt, 64, 64)),
    "gated_delta-k128": ("gated_delta", lambda dt: gated_delta(dt, 128, 128)),
    "gated_delta-k256": ("gated_delta", lambda dt: gated_delta(dt, 256, 128)),
    "gated_delta-k128-states": ("gated_delta", lambda dt: gated_delta(dt, 128, 128, states=True)),
    "ssd-p64-chunk64": ("ssd", lambda dt: ssd(dt, 64, 1, 128, 64, gate=False, d_per_channel=False)),
    "ssd-p128-chunk256-gated": ("ssd", lambda dt: ssd(dt, 128, 2, 64, 256, gate=True, d_per_channel=True)),
}
BACKENDS = [(case, b.name) for case, (op, _) in CASES.items() for b in backends_of(op)]


@pytest.mark.parametrize("dtype", sorted(DTYPES))
@pytest.mark.parametrize(("case", "backend"), BACKENDS)
def test_backend_keeps_documents_apart_at_real_size(case: str, backend: str, dtype: str, cuda: torch.device,
                                                    measured: list[dict[str, Any]]) -> None:
    op, make = CASES[case]
    chosen = next(b for b in backends_of(op) if b.name == backend)
    signature = make(DTYPES[dtype])
    why = chosen.reason(cuda, DTYPES[dtype], True)
    if why:
        pytest.skip(f"{op}/{backend} cannot run here: {why}")
    contract = contract_of(op)
    layout = real_size_layout(contract.edge(signature), TOKENS)
    if chosen.accepts is not None:
        case_inputs = contract.make_case(signature, layout.boundaries(cuda), torch.Generator().manual_seed(0)).arguments
        why = chosen.accepts({**case_inputs, "requires_grad": True})
        if why:
            pytest.skip(f"{op}/{backend} refuses this signature (the call goes to the next backend): {why}")
    result = run_check(chosen, reference_of(op), contract, signature, cuda, True, layout=layout)
    serves = result.ok
    if not serves and dtype == "float32":
        # docs/backends.md: a kernel multiplying float32 in TF32 misses the 1e-5 serving bound and the pure-torch
        # backend serves float32; it must still keep documents apart exactly, within TF32 rounding of the oracle
        with pytest.MonkeyPatch.context() as patch:
            patch.setitem(SELF_CHECK_TOLERANCE, torch.float32, TOLERANCE[torch.float32])
            result = run_check(chosen, reference_of(op), contract, signature, cuda, True, layout=layout)
    measured.append({"case": case, "op": op, "backend": backend, "dtype": dtype, "ok": result.ok, "serves": serves,
                     "max_error": result.max_error, "seconds": result.seconds, "reason": result.reason,
                     "tokens": layout.total_tokens, "documents": len(layout.lengths)})
    assert result.ok, result.reason

