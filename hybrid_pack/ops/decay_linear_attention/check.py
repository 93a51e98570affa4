"""Decay linear attention's self-check contract: a call's signature and inputs of a signature."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from hybrid_pack.boundaries import PackedBoundaries
from hybrid_pack.ops.decay_linear_attention.kernel_fla import KERNEL_CHUNK_SIZE
from hybrid_pack.ops.selfcheck.contract import CheckCase, OpContract, Signature, make_signature, random_tensor

__all__ = ["OP", "CONTRACT", "signature_of", "make_inputs"]

OP = "decay_linear_attention"


def signature_of(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, *,
                 initial_state: torch.Tensor | None, output_final_state: bool) -> Signature:
    return make_signature(H=q.shape[2], K=q.shape[3], V=v.shape[3], output_final_state=output_final_state,
                          q=q.dtype, k=k.dtype, v=v.dtype, g=g.dtype,
                          initial_state=None if initial_state is None else initial_state.dtype)


def make_inputs(signature: Signature, boundaries: PackedBoundaries, generator: torch.Generator) -> CheckCase:
    """Inputs of a stable recurrence in the signature's dtypes.

    ``q, k [1, T, H, K]`` of N(0, 1), ``v [1, T, H, V]`` of N(0, 1), a per-token log decay
    ``g = logsigmoid(N(0, 1) + 3)`` (<= 0, about 20 tokens of memory) and an ``initial_state [N, H, K, V]`` of
    N(0, 0.1) when the signature has one; ``scale = 0.75 / sqrt(K)`` (not the default: a kernel that drops the
    caller's scale differs).
    """
    s = dict(signature)
    t, device = boundaries.total_tokens, boundaries.device
    q, k = (random_tensor((1, t, s["H"], s["K"]), s[name], device, generator) for name in ("q", "k"))
    v = random_tensor((1, t, s["H"], s["V"]), s["v"], device, generator)
    g = F.logsigmoid(random_tensor((1, t, s["H"]), torch.float32, device, generator, shift=3.0))
    h0 = None if s["initial_state"] is None else random_tensor(
        (boundaries.num_docs, s["H"], s["K"], s["V"]), s["initial_state"], device, generator, scale=0.1)
    arguments = {"q": q, "k": k, "v": v, "g": g.to(getattr(torch, s["g"])), "scale": 0.75 * s["K"] ** -0.5,
                 "initial_state": h0, "output_final_state": s["output_final_state"]}
    return CheckCase(arguments, positional=("q", "k", "v", "g"), token_inputs=("q", "k", "v", "g"),
                     document_inputs=("initial_state",))


def _outputs(result: Any) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    o, final_state = result
    return [o], [] if final_state is None else [final_state]


def _default_signature(dtype: torch.dtype, device_type: str) -> Signature:
    """A MiniMax-Text-01-style layer: 64 heads of 128 (CPU: 2 of 16), the decay in float32."""
    heads, dim = (64, 128) if device_type == "cuda" else (2, 16)
    return make_signature(H=heads, K=dim, V=dim, output_final_state=False, q=dtype, k=dtype, v=dtype,
                          g=torch.float32, initial_state=None)


CONTRACT = OpContract(name=OP, make_case=make_inputs, outputs=_outputs, default_signature=_default_signature,
                      edge=lambda signature: KERNEL_CHUNK_SIZE)
