"""The conv op's self-check contract: a call's signature and inputs of a signature."""

from __future__ import annotations

from typing import Any

import torch

from hybrid_pack.boundaries import PackedBoundaries
from hybrid_pack.ops.conv.kernel_fla import KERNEL_CHUNK_SIZE
from hybrid_pack.ops.selfcheck.contract import CheckCase, OpContract, Signature, make_signature, random_tensor

__all__ = ["OP", "ACTIVATIONS", "CONTRACT", "signature_of", "make_inputs"]

OP = "conv"
ACTIVATIONS = (None, "silu", "swish")


def signature_of(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, activation: str | None
                 ) -> Signature:
    return make_signature(D=x.shape[2], W=weight.shape[1], activation=activation, x=x.dtype, weight=weight.dtype,
                          bias=None if bias is None else bias.dtype)


def make_inputs(signature: Signature, boundaries: PackedBoundaries, generator: torch.Generator) -> CheckCase:
    """``x [1, T, D]`` from N(0, 1), ``weight [D, W]`` scaled by ``W ** -0.5``, ``bias [D]`` (when the
    signature has one), in the signature's dtypes."""
    s = dict(signature)
    device = boundaries.device
    x = random_tensor((1, boundaries.total_tokens, s["D"]), s["x"], device, generator)
    weight = random_tensor((s["D"], s["W"]), s["weight"], device, generator, scale=s["W"] ** -0.5)
    bias = None if s["bias"] is None else random_tensor((s["D"],), s["bias"], device, generator, scale=0.5)
    return CheckCase({"x": x, "weight": weight, "bias": bias, "activation": s["activation"]},
                     positional=("x", "weight", "bias"), token_inputs=("x",))


def _outputs(result: Any) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    return [result], []


def _default_signature(dtype: torch.dtype, device_type: str) -> Signature:
    """The short conv of a Mamba-2 / Gated DeltaNet mixer: width 4, SiLU, with bias, 256 channels (CPU: 16)."""
    return make_signature(D=256 if device_type == "cuda" else 16, W=4, activation="silu", x=dtype, weight=dtype,
                          bias=dtype)


CONTRACT = OpContract(name=OP, make_case=make_inputs, outputs=_outputs, default_signature=_default_signature,
                      edge=lambda signature: KERNEL_CHUNK_SIZE, reach=lambda signature: dict(signature)["W"])
