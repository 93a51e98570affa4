"""Mamba-2 SSD on :class:`StaticBoundaries`: static shapes, no host read, traced inline by ``torch.compile``.

The maths is :mod:`~hybrid_pack.ops.ssd.torch_backend`'s chunked state-space duality, but the *row* is cut into
``M = ceil(T / L)`` chunks of ``L`` tokens whatever the documents, so a chunk may hold the end of one segment,
whole segments and the start of another; ``seq_idx`` names each token's segment slot. Per head, with
``a_t = dt_t A`` and ``s_i`` the summed ``a`` of token ``i``'s segment in its chunk up to and including ``i``
(a cumulative sum restarting where a segment starts, taken as a masked sum so that no gradient ever reaches
another segment, not even as rounding residue):

* within a chunk, token ``i`` sees the earlier tokens ``j`` of its own segment:
  ``y_i = sum_{j <= i, same segment} exp(s_i - s_j) (C_i . B_j) dt_j x_j``;
* every token also sees its segment's state entering the chunk, ``exp(s_i) C_i . h_in``: the state carried from
  the previous chunk when its segment *continues* from there, else its slot's initial state (zero without
  initial states, and then skipped);
* ``h_c``, the state leaving chunk ``c``, is that of the chunk's last segment at the chunk's end:
  ``h_c = [continues] exp(s_{L-1}) h_{c-1} + fresh_c``, with ``fresh_c`` built from the chunk's tokens of that
  segment (and its initial state when it starts in the chunk). This linear recurrence over chunks is solved as
  one masked product ``[M, M] @ [M, P * N]`` per head (a segment sum over chunks, like the chunks' own
  ``[L, L]`` form), so the graph does not grow with ``T``;
* each slot's final state is its state at its last token (``cu_seqlens[1:] - 1``), built the same way from the
  chunk holding that token: ``O(S L)`` work. A zero-length slot's final state is its initial state.

Pad tokens (``T`` up to a multiple of ``L``) have ``dt = 0`` and ``x = 0`` and continue the last segment: they
change no state, and their outputs are dropped.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hybrid_pack.boundaries.static import StaticBoundaries
from hybrid_pack.ops.ssd.torch_backend import discretize_dt, skip_and_gate
from hybrid_pack.ops.validate import state_dtype, without_autocast

__all__ = ["mamba2_ssd"]


def _to_chunks(x: torch.Tensor, num_chunks: int, groups: int) -> torch.Tensor:
    """``[Tp, H, ...]`` -> ``[M, G, H / G, L, ...]`` (head ``g * H / G + r`` lands at ``[g, r]``)."""
    return x.reshape(num_chunks, -1, groups, x.shape[1] // groups, *x.shape[2:]).movedim(1, 3)


def _from_chunks(y: torch.Tensor) -> torch.Tensor:
    """``[M, G, H / G, L, P]`` -> ``[Tp, H, P]``."""
    return y.movedim(3, 1).flatten(2, 3).flatten(0, 1)


def _own_segment_states(x_dt: torch.Tensor, B: torch.Tensor, log_in: torch.Tensor, segment: torch.Tensor,
                        at_log: torch.Tensor, at_segment: torch.Tensor) -> torch.Tensor:
    """The state at a point of a chunk from that chunk's tokens of the point's segment, starting from zero.

    ``sum_j [segment_j = at_segment] exp(at_log - log_in_j) dt_j x_j B_j^T`` for ``Q`` points, each given its
    chunk's rows: ``x_dt [Q, G, r, L, P]``, ``B [Q, G, 1, L, N]``, ``log_in [Q, G, r, L]``, ``segment [Q, L]``,
    ``at_log [Q, G, r]`` (``log_in`` at the point) and ``at_segment [Q]``. Every token of the point's segment in
    the chunk comes at or before the point. Returns ``[Q, G, r, P, N]``.
    """
    own = (segment == at_segment[:, None])[:, None, None]
    weight = torch.exp(torch.where(own, at_log[..., None] - log_in, float("-inf")))
    return x_dt.transpose(-1, -2) @ (B * weight[..., None])


def _carry_across_chunks(fresh: torch.Tensor, chunk_log: torch.Tensor, last_segment: torch.Tensor) -> torch.Tensor:
    """Solve ``h_c = [last_segment_c = last_segment_{c-1}] exp(chunk_log_c) h_{c-1} + fresh_c`` for every chunk.

    ``h_c = sum_{j <= c} exp(chunk_log_{j+1} + ... + chunk_log_c) fresh_j`` over the chunks ``j`` ending in the
    segment that ends chunk ``c`` (segments are contiguous, so every chunk between continues it). The sums of
    ``chunk_log`` are taken over their own range, not as differences of one long cumulative sum.

    ``fresh [M, G, r, P, N]``, ``chunk_log [M, G, r]``, ``last_segment [M]``. Returns ``[M, G, r, P, N]``.
    """
    num_chunks = fresh.shape[0]
    ones = torch.ones(num_chunks, num_chunks, dtype=torch.bool, device=fresh.device)
    logs = chunk_log.flatten(1).T[:, :, None].expand(-1, -1, num_chunks)          # [H, M (c), M (j)] = log_c
    summed = torch.cumsum(torch.where(ones.tril(-1), logs, 0.0), dim=1)          # sum over k in (j, c]
    reaches = ones.tril() & (last_segment[:, None] == last_segment[None, :])
    weight = torch.exp(torch.where(reaches, summed, float("-inf")))              # [H, M, M]
    states = weight @ fresh.flatten(1, 2).transpose(0, 1).flatten(2)             # [H, M, P * N]
    return states.transpose(0, 1).reshape(fresh.shape)


def _row(x: torch.Tensor) -> torch.Tensor:
    """``[M, G, r, L]`` -> ``[Tp, G, r]``."""
    return x.movedim(3, 1).flatten(0, 1)


def _final_states(x_dt: torch.Tensor, B: torch.Tensor, log_in: torch.Tensor, segment: torch.Tensor,
                  entering: torch.Tensor, starts: torch.Tensor, ends: torch.Tensor,
                  initial: torch.Tensor | None) -> torch.Tensor:
    """Every slot's state at its last token, rebuilt from the chunk holding that token.

    Chunk tensors as in :func:`mamba2_ssd` (``entering [M, G, r, P, N]``: the state carried into each chunk),
    ``starts``/``ends [S]`` (each slot's first token and one past its last), ``initial [S, G, r, P, N]`` or None.
    Returns ``[S, G, r, P, N]``.
    """
    size = segment.shape[1]
    slots = torch.arange(starts.shape[0], device=starts.device)
    last = (ends - 1).clamp(min=0)
    chunk, position = last // size, last % size
    at_log = log_in[chunk, ..., position]                                                     # [S, G, r]
    state = _own_segment_states(x_dt[chunk], B[chunk], log_in[chunk], segment[chunk], at_log, slots)
    continued = (starts < chunk * size)[:, None, None, None, None]
    entered = torch.where(continued, entering[chunk], 0.0 if initial is None else initial)
    state = state + torch.exp(at_log)[..., None, None] * entered
    if initial is None:  # a zero-length slot has no token and nothing carried in: zero
        return state
    return torch.where((ends > starts)[:, None, None, None, None], state, initial)


@without_autocast
def mamba2_ssd(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
               boundaries: StaticBoundaries, *, D: torch.Tensor | None, z: torch.Tensor | None,
               dt_bias: torch.Tensor | None, dt_softplus: bool, chunk_size: int,
               initial_states: torch.Tensor | None,
               return_final_states: bool) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Chunked SSD scan of a packed row given as tensors only; the state restarts at every segment slot.

    Shapes as in :func:`hybrid_pack.ops.mamba2_ssd`: x ``[1, T, H, P]``, dt ``[1, T, H]``, A ``[H]``,
    B/C ``[1, T, G, N]``, D ``[H]`` or ``[H, P]``, z ``[1, T, H, P]``, dt_bias ``[H]``, initial_states
    ``[S, H, P, N]`` (one per segment slot, ``S = boundaries.num_segments``). Computed in float32 (float64 for
    float64 inputs); ``chunk_size`` changes the speed, not the results.

    Returns:
        ``y [1, T, H, P]`` in x's dtype, or ``(y, final_states [S, H, P, N])`` with the final states in the
        compute dtype; a zero-length slot's final state is its initial state (zero without one).
    """
    _, total, heads, head_dim = x.shape
    groups, state_dim = B.shape[2], B.shape[3]
    cdtype = state_dtype(x.dtype)
    size = min(chunk_size, total)
    num_chunks = -(-total // size)
    pad = num_chunks * size - total

    x_f = x[0].to(cdtype)
    dt_f = discretize_dt(dt[0].to(cdtype), None if dt_bias is None else dt_bias.to(cdtype), dt_softplus)
    x_dt = _to_chunks(F.pad(x_f * dt_f[..., None], (0, 0, 0, 0, 0, pad)), num_chunks, groups)  # [M, G, r, L, P]
    log_step = _to_chunks(F.pad(dt_f * A.to(cdtype), (0, 0, 0, pad)), num_chunks, groups)     # [M, G, r, L]
    Bc = _to_chunks(F.pad(B[0].to(cdtype), (0, 0, 0, 0, 0, pad)), num_chunks, groups)         # [M, G, 1, L, N]
    Cc = _to_chunks(F.pad(C[0].to(cdtype), (0, 0, 0, 0, 0, pad)), num_chunks, groups)         # [M, G, 1, L, N]

    # Each token's slot (pad tokens continue the last one); whether its segment began in an earlier chunk.
    seq = boundaries.seq_idx[0].long()
    seq = torch.cat([seq, seq[-1:].expand(pad)])
    segment = seq.view(num_chunks, size)                                                      # [M, L]
    starts, ends = boundaries.cu_seqlens[:-1].long(), boundaries.cu_seqlens[1:].long()
    continues = starts[segment] < torch.arange(num_chunks, device=x.device)[:, None] * size   # [M, L]
    causal = torch.ones(size, size, dtype=torch.bool, device=x.device).tril()
    same = (causal & (segment[:, :, None] == segment[:, None, :]))[:, None, None]             # [M, 1, 1, L, L]
    log_in = (same.to(cdtype) @ log_step[..., None]).squeeze(-1)                              # s, [M, G, r, L]

    # Within chunks: token i sees tokens j <= i of its own segment.
    decay = torch.exp(torch.where(same, log_in[..., :, None] - log_in[..., None, :], float("-inf")))
    y = ((Cc @ Bc.transpose(-1, -2)) * decay) @ x_dt                                         # [M, G, r, L, P]

    # The state leaving every chunk (its last segment's, at its end), then the continuing tokens see it.
    initial = None
    if initial_states is not None:
        initial = initial_states.to(cdtype).reshape(-1, groups, heads // groups, head_dim, state_dim)
    last_segment = segment[:, -1]
    fresh = _own_segment_states(x_dt, Bc, log_in, segment, log_in[..., -1], last_segment)
    if initial is not None:
        starts_here = torch.exp(torch.where(continues[:, -1, None, None], float("-inf"), log_in[..., -1]))
        fresh = fresh + starts_here[..., None, None] * initial[last_segment]
    leaving = _carry_across_chunks(fresh, log_in[..., -1], last_segment)
    entering = torch.cat([torch.zeros_like(leaving[:1]), leaving[:-1]])                       # [M, G, r, P, N]
    carried = torch.exp(torch.where(continues[:, None, None], log_in, float("-inf")))
    y = _from_chunks(y + (Cc * carried[..., None]) @ entering.transpose(-1, -2))[:total]      # [T, H, P]

    if initial is not None:
        # The tokens of a segment starting inside their chunk see its initial state: exp(s_i) C_i . h0.
        starts_here = torch.exp(torch.where(continues[:, None, None], float("-inf"), log_in))
        seen = (initial[seq[:total]] @ C[0].to(cdtype)[:, :, None, :, None]).squeeze(-1)      # [T, G, r, P]
        y = y + (_row(starts_here)[:total, ..., None] * seen).flatten(1, 2)
    y = skip_and_gate(y, x_f, D, z).to(x.dtype).unsqueeze(0)
    if not return_final_states:
        return y
    final = _final_states(x_dt, Bc, log_in, segment, entering, starts, ends, initial)
    return y, final.reshape(-1, heads, head_dim, state_dim)
