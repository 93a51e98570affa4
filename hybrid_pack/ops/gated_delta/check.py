"""The gated delta rule's self-check contract: a call's signature and inputs of a signature."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from hybrid_pack.boundaries import PackedBoundaries
from hybrid_pack.ops.gated_delta.kernel_fla import KERNEL_CHUNK_SIZE
from hybrid_pack.ops.selfcheck.contract import CheckCase, OpContract, Signature, make_signature, random_tensor

__all__ = ["OP", "CONTRACT", "signature_of", "make_inputs"]

OP = "gated_delta"


def signature_of(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, *,
                 initial_state: torch.Tensor | None, output_final_state: bool, use_qk_l2norm: bool) -> Signature:
    return make_signature(H=q.shape[2], K=q.shape[3], HV=v.shape[2], V=v.shape[3], use_qk_l2norm=use_qk_l2norm,
                          output_final_state=output_final_state, q=q.dtype, k=k.dtype, v=v.dtype, g=g.dtype,
                          beta=beta.dtype, initial_state=None if initial_state is None else initial_state.dtype)


def make_inputs(signature: Signature, boundaries: PackedBoundaries, generator: torch.Generator) -> CheckCase:
    """Inputs of a stable recurrence in the signature's dtypes.

    ``q, k [1, T, H, K]`` (unit-norm over K when the kernel does not normalise them, as the delta rule
    needs), ``v [1, T, HV, V]``, log decay ``g = logsigmoid(N(0, 1) + 2)`` (<= 0), ``beta = sigmoid(N(0, 1))``,
    and an ``initial_state [N, HV, K, V]`` of N(0, 0.1) when the signature has one.
    """
    s = dict(signature)
    t, device = boundaries.total_tokens, boundaries.device

    def qk(name: str) -> torch.Tensor:
        x = random_tensor((1, t, s["H"], s["K"]), torch.float32, device, generator)
        return (x if s["use_qk_l2norm"] else F.normalize(x, dim=-1)).to(getattr(torch, s[name]))

    q, k = qk("q"), qk("k")
    v = random_tensor((1, t, s["HV"], s["V"]), s["v"], device, generator)
    g = F.logsigmoid(random_tensor((1, t, s["HV"]), torch.float32, device, generator, shift=2.0))
    beta = torch.sigmoid(random_tensor((1, t, s["HV"]), torch.float32, device, generator))
    h0 = None if s["initial_state"] is None else random_tensor(
        (boundaries.num_docs, s["HV"], s["K"], s["V"]), s["initial_state"], device, generator, scale=0.1)
    arguments = {"q": q, "k": k, "v": v, "g": g.to(getattr(torch, s["g"])), "beta": beta.to(getattr(torch, s["beta"])),
                 "scale": 0.75 * s["K"] ** -0.5, "initial_state": h0, "output_final_state": s["output_final_state"],
                 "use_qk_l2norm": s["use_qk_l2norm"]}
    return CheckCase(arguments, positional=("q", "k", "v", "g", "beta"), token_inputs=("q", "k", "v", "g", "beta"),
                     document_inputs=("initial_state",))


def _outputs(result: Any) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    o, final_state = result
    return [o], [] if final_state is None else [final_state]


def _default_signature(dtype: torch.dtype, device_type: str) -> Signature:
    """A Qwen3-Next-style layer: 4 q/k heads of 128 serving 8 value heads of 128 (CPU: 1 of 16 serving 2),
    q/k normalised in the kernel, log decay in float32."""
    heads, dim = (4, 128) if device_type == "cuda" else (1, 16)
    return make_signature(H=heads, K=dim, HV=2 * heads, V=dim, use_qk_l2norm=True, output_final_state=False, q=dtype,
                          k=dtype, v=dtype, g=torch.float32, beta=dtype, initial_state=None)


CONTRACT = OpContract(name=OP, make_case=make_inputs, outputs=_outputs, default_signature=_default_signature,
                      edge=lambda signature: KERNEL_CHUNK_SIZE)
