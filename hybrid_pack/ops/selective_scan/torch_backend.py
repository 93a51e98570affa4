"""The Mamba-1 selective scan in pure torch: the registry's oracle, exact on every device, memory bounded.

``h_t = exp(dt_t A) ⊙ h_{t-1} + (dt_t x_t) B_t^T`` and ``y_t = h_t C_t``, a state ``h`` of shape ``[D, N]`` per
token, restarting from zero at every segment start. The row is scanned token by token in chunks of
``chunk_size`` tokens. The forward keeps only the state entering each chunk (``[T / chunk_size, D, N]``); the
backward recomputes one chunk's states at a time and runs the adjoint recurrence back through it. So the memory
beyond inputs and outputs is ``O(T·D)`` for the ``[T, D]`` step sizes and gradients, ``O(T·D·N / chunk_size)``
for the saved states and ``O(chunk_size·D·N)`` while a chunk runs: never ``[T, D, N]``.

A segment's first token takes ``(dt_t x_t) B_t^T`` as its state: the state before it is dropped, not multiplied
by zero, and the adjoint is dropped the same way going back, so not even a non-finite value crosses a boundary.
Reads the segments' starts on the host (:attr:`PackedBoundaries.starts`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

from hybrid_pack.boundaries import PackedBoundaries
from hybrid_pack.ops.ssd.torch_backend import discretize_dt
from hybrid_pack.ops.validate import state_dtype, without_autocast

__all__ = ["selective_scan", "scan", "scan_inputs", "skip_and_gate", "CHUNK_SIZE"]

CHUNK_SIZE = 64  # tokens whose [D, N] states exist at once; one [D, N] state is saved per chunk


def scan_inputs(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
                dt_bias: torch.Tensor | None) -> tuple[torch.Tensor, ...]:
    """The scan's inputs from the op's: ``x, dt [T, D]`` (``dt`` as ``softplus(dt + dt_bias)``), ``A [D, N]``,
    ``B, C [T, N]``, in float32 (float64 for float64 ``x``), batch dim dropped.

    ``softplus`` then a clamp at zero (:func:`~hybrid_pack.ops.ssd.torch_backend.discretize_dt`, as the SSD
    applies it) equals ``softplus`` alone in value and gradient.
    """
    dtype = state_dtype(x.dtype)
    step = discretize_dt(dt[0].to(dtype), None if dt_bias is None else dt_bias.to(dtype), dt_softplus=True)
    return x[0].to(dtype), step, A.to(dtype), B[0].to(dtype), C[0].to(dtype)


def skip_and_gate(y: torch.Tensor, x: torch.Tensor, D: torch.Tensor | None, z: torch.Tensor | None) -> torch.Tensor:
    """``(y + D ⊙ x) ⊙ silu(z)`` (each part when given) in ``y``'s dtype: ``y, x [T, D]``, ``D [D]``,
    ``z [1, T, D]``."""
    if D is not None:
        y = y + x * D.to(y.dtype)
    if z is not None:
        y = y * F.silu(z[0].to(y.dtype))
    return y


@without_autocast
def selective_scan(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
                   boundaries: PackedBoundaries, *, D: torch.Tensor | None, z: torch.Tensor | None,
                   dt_bias: torch.Tensor | None) -> torch.Tensor:
    """The op (:func:`hybrid_pack.ops.selective_scan`) on a whole packed row: ``y [1, T, D]`` in x's dtype."""
    tokens, step, a, b, c = scan_inputs(x, dt, A, B, C, dt_bias)
    y, _ = scan(tokens, step, a, b, c, boundaries)
    return skip_and_gate(y, tokens, D, z).unsqueeze(0).to(x.dtype)


def scan(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
         boundaries: PackedBoundaries, *, initial_state: torch.Tensor | None = None,
         chunk_size: int = CHUNK_SIZE) -> tuple[torch.Tensor, torch.Tensor]:
    """The state-space part of the selective scan, restarting at every segment start.

    Args:
        x, dt: ``[T, D]`` (``dt`` discretised).
        A: ``[D, N]``.
        B, C: ``[T, N]``.
        boundaries: the row's segments.
        initial_state: ``[D, N]``, the state before the row's first token (zero when None); later segments
            start from zero.
        chunk_size: tokens recomputed together in the backward (results do not depend on it).

    Returns:
        ``(y [T, D], the state after the last token [D, N])``, in the inputs' (common) dtype.
    """
    return _ChunkedScan.apply(x, dt, A, B, C, initial_state, tuple(boundaries.starts[1:]), chunk_size)


def _chunk_states(entering: torch.Tensor, x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor,
                  restarts: set[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """``(states [c, D, N], decay [c, D, N])`` of one chunk of ``c`` tokens entered with state ``entering``;
    ``restarts`` are the chunk's tokens (0-based in the chunk) that start a segment."""
    decay = torch.exp(dt.unsqueeze(-1) * A)
    states = (dt * x).unsqueeze(-1) * B.unsqueeze(-2)            # the inputs, turned into the states in place
    state = entering
    for i in range(states.shape[0]):
        if i not in restarts:
            states[i].addcmul_(decay[i], state)
        state = states[i]
    return states, decay


def _chunks(total: int, chunk_size: int, restarts: Sequence[int]) -> list[tuple[int, int, set[int]]]:
    """``(lo, hi, restarts in the chunk, 0-based)`` of every chunk of the row."""
    return [(lo, min(lo + chunk_size, total), {s - lo for s in restarts if lo <= s < lo + chunk_size})
            for lo in range(0, total, chunk_size)]


class _ChunkedScan(torch.autograd.Function):
    """The chunked scan with its hand-written backward (states recomputed chunk by chunk, last chunk first).

    With ``g_t = dL/dh_t = gy_t C_t^T + a_{t+1} ⊙ g_{t+1}`` (the second term only when ``t + 1`` does not start
    a segment): ``dC_t = h_t^T gy_t``, ``d(dt_t x_t) = g_t B_t``, ``dB_t = g_t^T (dt_t x_t)``, and the decay's log
    ``dt_t A`` gets ``g_t ⊙ h_{t-1} ⊙ a_t`` (zero at a segment's first token).
    """

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
                initial_state: torch.Tensor | None, restarts: tuple[int, ...],
                chunk_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        state = initial_state if initial_state is not None else x.new_zeros(A.shape)
        y = x.new_empty(x.shape)
        entering = []
        for lo, hi, chunk_restarts in _chunks(x.shape[0], chunk_size, restarts):
            entering.append(state)
            states, _ = _chunk_states(state, x[lo:hi], dt[lo:hi], A, B[lo:hi], chunk_restarts)
            y[lo:hi] = torch.einsum("tdn,tn->td", states, C[lo:hi])
            state = states[-1].clone()                                # not a view: the chunk's states go
        ctx.save_for_backward(x, dt, A, B, C, torch.stack(entering))
        ctx.restarts, ctx.chunk_size = restarts, chunk_size
        ctx.has_initial_state = initial_state is not None
        return y, state

    @staticmethod
    @once_differentiable
    @without_autocast
    def backward(ctx: Any, grad_y: torch.Tensor | None, grad_final: torch.Tensor | None) -> tuple[Any, ...]:
        x, dt, A, B, C, entering = ctx.saved_tensors
        grad_y = torch.zeros_like(x) if grad_y is None else grad_y
        grad_x, grad_dt, grad_B, grad_C = (torch.empty_like(t) for t in (x, dt, B, C))
        grad_A = torch.zeros_like(A)
        carry = torch.zeros_like(A) if grad_final is None else grad_final    # dL/dh of the token after the chunk
        chunks = _chunks(x.shape[0], ctx.chunk_size, ctx.restarts)
        for index in reversed(range(len(chunks))):
            lo, hi, chunk_restarts = chunks[index]
            states, decay = _chunk_states(entering[index], x[lo:hi], dt[lo:hi], A, B[lo:hi], chunk_restarts)
            grad_h = grad_y[lo:hi].unsqueeze(-1) * C[lo:hi].unsqueeze(-2)    # [c, D, N], g_t once carried in
            for i in reversed(range(hi - lo)):
                grad_h[i] += carry
                carry = torch.zeros_like(carry) if i in chunk_restarts else decay[i] * grad_h[i]
            grad_C[lo:hi] = torch.einsum("tdn,td->tn", states, grad_y[lo:hi])
            grad_input = torch.einsum("tdn,tn->td", grad_h, B[lo:hi])        # d(dt x)
            grad_x[lo:hi] = grad_input * dt[lo:hi]
            grad_B[lo:hi] = torch.einsum("tdn,td->tn", grad_h, dt[lo:hi] * x[lo:hi])
            previous = torch.cat([entering[index].unsqueeze(0), states[:-1]])
            previous[sorted(chunk_restarts)] = 0.0                           # no state before a segment's start
            grad_log_decay = grad_h.mul_(previous).mul_(decay)               # grad_h is not needed any more
            grad_dt[lo:hi] = grad_input * x[lo:hi] + torch.einsum("tdn,dn->td", grad_log_decay, A)
            grad_A += torch.einsum("tdn,td->dn", grad_log_decay, dt[lo:hi])
        grad_initial = carry if ctx.has_initial_state else None
        return grad_x, grad_dt, grad_A, grad_B, grad_C, grad_initial, None, None
