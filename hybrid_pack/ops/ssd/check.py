"""The Mamba-2 SSD scan's self-check contract: a call's signature and inputs of a signature."""

from __future__ import annotations

from typing import Any

import torch

from hybrid_pack.boundaries import PackedBoundaries
from hybrid_pack.ops.selfcheck.contract import CheckCase, OpContract, Signature, make_signature, random_tensor

__all__ = ["OP", "CONTRACT", "signature_of", "make_inputs"]

OP = "ssd"


def _dtype(t: torch.Tensor | None) -> torch.dtype | None:
    return None if t is None else t.dtype


def signature_of(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor, *,
                 D: torch.Tensor | None, z: torch.Tensor | None, dt_bias: torch.Tensor | None, dt_softplus: bool,
                 chunk_size: int, initial_states: torch.Tensor | None, return_final_states: bool) -> Signature:
    return make_signature(H=x.shape[2], P=x.shape[3], G=B.shape[2], N=B.shape[3], chunk_size=chunk_size,
                          D_per_channel=None if D is None else D.dim() == 2, dt_softplus=dt_softplus,
                          return_final_states=return_final_states, x=x.dtype, dt=dt.dtype, A=A.dtype, B=B.dtype,
                          C=C.dtype, D=_dtype(D), z=_dtype(z), dt_bias=_dtype(dt_bias),
                          initial_states=_dtype(initial_states))


def make_inputs(signature: Signature, boundaries: PackedBoundaries, generator: torch.Generator) -> CheckCase:
    """Inputs of a stable scan in the signature's dtypes.

    ``x [1, T, H, P]`` and ``B, C [1, T, G, N]`` from N(0, 1); raw ``dt [1, T, H]`` from N(0, 0.5) with
    ``dt_bias`` around -2 (softplus then gives steps near 0.1); without softplus, ``dt`` is the step itself
    (``|N(0, 0.1)|``) and ``dt_bias`` N(0, 0.02), small enough to leave most steps positive rather than
    clamped to zero; ``A [H]`` in [-1.5, -0.5]; ``D`` ([H] or [H, P]), ``z`` and ``initial_states
    [N, H, P, N]`` when the signature has them.
    """
    s = dict(signature)
    t, device = boundaries.total_tokens, boundaries.device
    h, p, g, n = s["H"], s["P"], s["G"], s["N"]

    def draw(name: str, shape: tuple[int, ...], **kwargs: float) -> torch.Tensor | None:
        return None if s[name] is None else random_tensor(shape, s[name], device, generator, **kwargs)

    a = -(torch.rand(h, generator=generator) + 0.5)
    bias_scale, bias_shift = (0.5, -2.0) if s["dt_softplus"] else (0.02, 0.0)
    arguments = {
        "x": draw("x", (1, t, h, p)),
        "dt": draw("dt", (1, t, h), scale=0.5, shift=0.0 if s["dt_bias"] is not None or not s["dt_softplus"] else -2.0),
        "A": a.to(device=device, dtype=getattr(torch, s["A"])),
        "B": draw("B", (1, t, g, n)),
        "C": draw("C", (1, t, g, n)),
        "D": draw("D", (h, p) if s["D_per_channel"] else (h,)),
        "z": draw("z", (1, t, h, p)),
        "dt_bias": draw("dt_bias", (h,), scale=bias_scale, shift=bias_shift),
        "dt_softplus": s["dt_softplus"],
        "chunk_size": s["chunk_size"],
        "initial_states": draw("initial_states", (boundaries.num_docs, h, p, n), scale=0.1),
        "return_final_states": s["return_final_states"],
    }
    if not s["dt_softplus"]:
        arguments["dt"] = arguments["dt"].abs() * 0.2  # already a step size: positive and small
    return CheckCase(arguments, positional=("x", "dt", "A", "B", "C"), token_inputs=("x", "dt", "B", "C", "z"),
                     document_inputs=("initial_states",))


def _outputs(result: Any) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    if isinstance(result, tuple):
        y, states = result
        return [y], [states]
    return [result], []


def _default_signature(dtype: torch.dtype, device_type: str) -> Signature:
    """A Bamba-style layer: 8 heads of 64, one group of 128 states (CPU: 2 heads of 8, 8 states), D per head,
    parameters in float32."""
    heads, head_dim, states = (8, 64, 128) if device_type == "cuda" else (2, 8, 8)
    f32 = torch.float32
    return make_signature(H=heads, P=head_dim, G=1, N=states, chunk_size=64, D_per_channel=False, dt_softplus=True,
                          return_final_states=False, x=dtype, dt=dtype, A=f32, B=dtype, C=dtype, D=f32, z=None,
                          dt_bias=f32, initial_states=None)


CONTRACT = OpContract(name=OP, make_case=make_inputs, outputs=_outputs, default_signature=_default_signature,
                      edge=lambda signature: dict(signature)["chunk_size"])
