"""The attention op's self-check contract: a call's signature and inputs of a signature."""

from __future__ import annotations

from typing import Any

import torch

from hybrid_pack.boundaries import PackedBoundaries
from hybrid_pack.ops.dispatch.contract import CheckCase, OpContract, Signature, make_signature, random_tensor

__all__ = ["OP", "CONTRACT", "signature_of", "make_inputs"]

OP = "attention"
TILE = 128  # flash kernels tile the sequence in 128-token blocks: the check's documents end on their edges


def signature_of(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, window: int | None = None
                 ) -> Signature:
    """The call's key; a sliding window is part of it (a kernel is checked with the window it serves)."""
    windowed = {} if window is None else {"window": window}
    return make_signature(H=q.shape[2], Hkv=k.shape[2], D=q.shape[3], causal=causal, q=q.dtype, k=k.dtype,
                          v=v.dtype, **windowed)


def make_inputs(signature: Signature, boundaries: PackedBoundaries, generator: torch.Generator) -> CheckCase:
    """``q [1, T, H, D]``, ``k, v [1, T, Hkv, D]`` drawn from N(0, 1) in the signature's dtypes, and ``window``
    where the signature has one."""
    s = dict(signature)
    t, device = boundaries.total_tokens, boundaries.device
    q = random_tensor((1, t, s["H"], s["D"]), s["q"], device, generator)
    k = random_tensor((1, t, s["Hkv"], s["D"]), s["k"], device, generator)
    v = random_tensor((1, t, s["Hkv"], s["D"]), s["v"], device, generator)
    windowed = {"window": s["window"]} if "window" in s else {}
    return CheckCase({"q": q, "k": k, "v": v, "causal": s["causal"], "softmax_scale": s["D"] ** -0.5, **windowed},
                     positional=("q", "k", "v"), token_inputs=("q", "k", "v"))


def _outputs(result: Any) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    return [result], []


def _default_signature(dtype: torch.dtype, device_type: str) -> Signature:
    """Grouped-query attention as hybrid models use it: 8 query heads on 2 key/value heads of 128 (CPU: small)."""
    heads, kv_heads, dim = (8, 2, 128) if device_type == "cuda" else (2, 1, 16)
    return make_signature(H=heads, Hkv=kv_heads, D=dim, causal=True, q=dtype, k=dtype, v=dtype)


CONTRACT = OpContract(name=OP, make_case=make_inputs, outputs=_outputs, default_signature=_default_signature,
                      edge=lambda signature: TILE)
