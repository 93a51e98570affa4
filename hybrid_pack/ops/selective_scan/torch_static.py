"""The Mamba-1 selective scan on :class:`StaticBoundaries`: a chunked scan whose resets come from ``seq_idx``.

With ``a_t = exp(dt_t A)`` and ``u_t = dt_t x_t B_t^T`` (``[D, N]`` per token), the row (padded to whole
chunks of ``chunk_size`` tokens) is cut into chunks, each scanned from a zero state, all chunks side by side
in ``chunk_size`` steps::

    local_t = a_t * local_{t-1} + u_t          carry_t = a_t * carry_{t-1}   (carry starting at one)

``carry_t`` being the factor the state entering the chunk is multiplied by at ``t``. At a segment's first
token (``seq_idx`` differs from the token before) both restart: the value before it is replaced by zero,
never multiplied, so not even a non-finite value crosses. The states at the chunks' ends are then carried
across chunks by recursive doubling (``log2(chunks)`` passes over ``[chunks, D, N]``, each step taken only
between chunks whose last tokens share a segment), and the state at every token is

    h_t = local_t + carry_t * h_in      (h_in, the state entering t's chunk, taken where t's segment began
                                         in an earlier chunk)

The work is ``O(T)``, every shape comes from ``T`` and no value is read on the host: one graph serves every
layout of the same ``T``. Padding tokens carry ``dt = 0, x = 0`` in a segment of their own; their outputs
are dropped.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hybrid_pack.boundaries.static import StaticBoundaries
from hybrid_pack.ops.selective_scan.torch_backend import scan_inputs, skip_and_gate
from hybrid_pack.ops.validate import without_autocast

__all__ = ["selective_scan", "scan", "CHUNK_SIZE"]

CHUNK_SIZE = 16  # sequential steps per chunk; the chunks' ends then take log2(T / CHUNK_SIZE) passes


@without_autocast
def selective_scan(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
                   boundaries: StaticBoundaries, *, D: torch.Tensor | None, z: torch.Tensor | None,
                   dt_bias: torch.Tensor | None) -> torch.Tensor:
    """The op (:func:`hybrid_pack.ops.selective_scan`) on a static row: ``y [1, T, D]`` in x's dtype."""
    tokens, step, a, b, c = scan_inputs(x, dt, A, B, C, dt_bias)
    y = scan(tokens, step, a, b, c, boundaries)
    return skip_and_gate(y, tokens, D, z).unsqueeze(0).to(x.dtype)


def scan(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
         boundaries: StaticBoundaries, *, chunk_size: int = CHUNK_SIZE) -> torch.Tensor:
    """The state-space part of the selective scan, restarting at every segment, read from tensors only.

    Args:
        x, dt: ``[T, D]`` (``dt`` discretised: ``softplus(dt + dt_bias)``).
        A: ``[D, N]``.
        B, C: ``[T, N]``.
        boundaries: the row's static boundaries (only ``seq_idx`` is read, as a tensor).
        chunk_size: tokens per chunk.

    Returns:
        ``y [T, D]`` in the inputs' (common) dtype.
    """
    num_tokens, channels = x.shape
    num_chunks = -(-num_tokens // chunk_size)
    pad = num_chunks * chunk_size - num_tokens
    token_segment = F.pad(boundaries.seq_idx[0], (0, pad), value=-1)
    segment = token_segment.view(num_chunks, chunk_size)
    continues = torch.cat([token_segment.new_zeros(1, dtype=torch.bool), token_segment[1:] == token_segment[:-1]])
    continues = continues.view(num_chunks, chunk_size, 1, 1)                   # t's segment holds t - 1
    previous_end = torch.cat([segment.new_full((1,), -1), segment[:-1, -1]])     # segment ending each previous chunk
    from_previous = (segment == previous_end[:, None]) & (torch.arange(num_chunks, device=x.device) > 0)[:, None]
    from_previous = from_previous.view(num_chunks, chunk_size, 1, 1)           # t's segment began in a chunk before

    x, dt, B, C = (F.pad(t, (0, 0, 0, pad)).view(num_chunks, chunk_size, -1) for t in (x, dt, B, C))
    decay = torch.exp(dt.unsqueeze(-1) * A)                                    # [chunks, chunk, D, N]
    inject = (dt * x).unsqueeze(-1) * B.unsqueeze(-2)                          # [chunks, chunk, D, N]
    local = x.new_zeros(num_chunks, channels, A.shape[-1])
    carry = x.new_ones(num_chunks, channels, A.shape[-1])
    locals_, carries = [], []
    for step in range(chunk_size):
        holds_previous = continues[:, step]
        local = decay[:, step] * torch.where(holds_previous, local, 0.0) + inject[:, step]
        carry = decay[:, step] * torch.where(holds_previous, carry, 0.0)
        locals_.append(local)
        carries.append(carry)
    local, carry = torch.stack(locals_, dim=1), torch.stack(carries, dim=1)    # [chunks, chunk, D, N]

    ends = _states_at_chunk_ends(local[:, -1], carry[:, -1], segment[:, -1])
    entering = torch.cat([torch.zeros_like(ends[:1]), ends[:-1]]).unsqueeze(1)  # [chunks, 1, D, N]
    states = local + carry * torch.where(from_previous, entering, 0.0)
    y = (states @ C.unsqueeze(-1)).squeeze(-1)                                 # [chunks, chunk, D]
    return y.reshape(-1, channels)[:num_tokens]


def _states_at_chunk_ends(local: torch.Tensor, carry: torch.Tensor, segment: torch.Tensor) -> torch.Tensor:
    """``h[c] = local[c] + carry[c] * h[c - 1]`` where chunk ``c`` ends in the segment chunk ``c - 1`` ends in
    (else ``h[c] = local[c]``), by recursive doubling.

    Args:
        local, carry: ``[chunks, D, N]`` at each chunk's last token.
        segment: ``[chunks]``, the segment of each chunk's last token (segments are contiguous, so chunk
            ``c - k`` reaches chunk ``c`` exactly when both end in one segment).

    Returns:
        ``[chunks, D, N]``, the state after each chunk's last token.
    """
    num_chunks = segment.shape[0]
    state, factor = local, carry
    shift = 1
    while shift < num_chunks:
        same = (segment[shift:] == segment[:-shift])[:, None, None]
        state = torch.cat([state[:shift], state[shift:] + factor[shift:] * torch.where(same, state[:-shift], 0.0)])
        factor = torch.cat([factor[:shift], factor[shift:] * torch.where(same, factor[:-shift], 0.0)])
        shift *= 2
    return state
