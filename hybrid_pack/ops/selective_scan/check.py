"""The Mamba-1 selective scan's self-check contract: a call's signature and inputs of a signature."""

from __future__ import annotations

from typing import Any

import torch

from hybrid_pack.boundaries import PackedBoundaries
from hybrid_pack.ops.selective_scan.torch_backend import CHUNK_SIZE
from hybrid_pack.ops.selfcheck.contract import CheckCase, OpContract, Signature, make_signature, random_tensor

__all__ = ["OP", "CONTRACT", "signature_of", "make_inputs"]

OP = "selective_scan"


def _dtype(t: torch.Tensor | None) -> torch.dtype | None:
    return None if t is None else t.dtype


def signature_of(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor, *,
                 D: torch.Tensor | None, z: torch.Tensor | None, dt_bias: torch.Tensor | None) -> Signature:
    return make_signature(D_channels=x.shape[2], N=A.shape[1], x=x.dtype, dt=dt.dtype, A=A.dtype, B=B.dtype,
                          C=C.dtype, D=_dtype(D), z=_dtype(z), dt_bias=_dtype(dt_bias))


def make_inputs(signature: Signature, boundaries: PackedBoundaries, generator: torch.Generator) -> CheckCase:
    """Inputs of a stable scan in the signature's dtypes: ``x, z [1, T, D]`` and ``B, C [1, T, N]`` from N(0, 1),
    raw ``dt [1, T, D]`` from N(0, 0.5) with ``dt_bias`` around -2 (steps near 0.1 after softplus; without a
    bias ``dt`` itself is shifted by -2), ``A [D, N]`` in [-1.5, -0.5], ``D [D]`` when the signature has them."""
    s = dict(signature)
    t, device = boundaries.total_tokens, boundaries.device
    channels, states = s["D_channels"], s["N"]

    def draw(name: str, shape: tuple[int, ...], **kwargs: float) -> torch.Tensor | None:
        return None if s[name] is None else random_tensor(shape, s[name], device, generator, **kwargs)

    a = -(torch.rand(channels, states, generator=generator) + 0.5)
    arguments = {
        "x": draw("x", (1, t, channels)),
        "dt": draw("dt", (1, t, channels), scale=0.5, shift=0.0 if s["dt_bias"] is not None else -2.0),
        "A": a.to(device=device, dtype=getattr(torch, s["A"])),
        "B": draw("B", (1, t, states)),
        "C": draw("C", (1, t, states)),
        "D": draw("D", (channels,)),
        "z": draw("z", (1, t, channels)),
        "dt_bias": draw("dt_bias", (channels,), scale=0.5, shift=-2.0),
    }
    return CheckCase(arguments, positional=("x", "dt", "A", "B", "C"), token_inputs=("x", "dt", "B", "C", "z"))


def _outputs(result: Any) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    return [result], []


def _default_signature(dtype: torch.dtype, device_type: str) -> Signature:
    """A Mamba-1 layer: 2048 channels of 16 states (CPU: 8 of 4), D, gate and dt bias in float32."""
    channels, states = (2048, 16) if device_type == "cuda" else (8, 4)
    f32 = torch.float32
    return make_signature(D_channels=channels, N=states, x=dtype, dt=dtype, A=f32, B=dtype, C=dtype, D=f32, z=dtype,
                          dt_bias=f32)


CONTRACT = OpContract(name=OP, make_case=make_inputs, outputs=_outputs, default_signature=_default_signature,
                      edge=lambda signature: CHUNK_SIZE)
