"""A correct gated ``chunk_bwd_dqkwg`` for flash-linear-attention on Hopper with Triton in [3.4, 3.7.1).

Triton 3.4 to 3.7.0 miscompiles fla's gated ``chunk_bwd_dqkwg`` kernel on Hopper GPUs (wrong dk and
dg), so fla 0.6 raises there instead of training wrongly. That Triton is what torch 2.11 and 2.12.0
pin. fla's own remedies are Triton >= 3.7.1 (torch >= 2.12.1) or its TileLang backend
(``pip install "tilelang[nvcc]"``). Where neither is present, this module registers, through fla's
own backend dispatch, a pure-torch version of that one kernel for gated calls: the rest of the
forward and backward stays on fla's Triton kernels. It serves only where fla's own flags say the
Triton kernel is wrong, and after TileLang (fla tries it first when installed); the self-check
then proves the whole backward against the float64 torch backend before fla serves a call.

The kernel's contract, per 64-token chunk ``c`` of a segment (positions ``i``, ``j`` inside it): ``g`` is
the chunk-local cumulative log decay in log2 units, ``h``/``dh`` the state entering the chunk and its
gradient ``[K, V]``, ``v`` the corrected values, ``do`` the output gradient, ``dv`` the value gradient::

    ds[i, j] = scale * (do_i . v_j) * 2^(g_i - g_j)                  (j <= i)
    dq_i = scale * 2^g_i * (do_i h^T) + sum_j ds[i, j] k_j
    dk_j = 2^(g_last - g_j) * (v_j dh^T) + sum_i ds[i, j] q_i
    dw_i = -(dv_i h^T)
    dg_i = q_i . dq_i - k_i . dk_i  (+ sum(h * dh) 2^g_last + sum_j k_j . dk_j^inter at the last position)

with q/k heads repeated over their value heads and summed back (grouped value heads).
"""

from __future__ import annotations

import importlib.util
import os
from typing import Any

import torch

__all__ = ["affected", "install", "chunk_bwd_dqkwg"]

BACKEND_TYPE = "hybrid_pack_dqkwg"
PRIORITY = 6  # fla tries lower numbers first: TileLang (5) wins when it is installed


def affected() -> bool:
    """Whether fla's own flags say its gated ``chunk_bwd_dqkwg`` raises here (Hopper, Triton in [3.4, 3.7.1))."""
    from fla.ops.common import chunk_o

    return bool(chunk_o.IS_NVIDIA_HOPPER and chunk_o.TRITON_ABOVE_3_4_0 and not chunk_o.TRITON_ABOVE_3_7_1)


def tilelang_fix_present() -> bool:
    """Whether fla's TileLang backend can take the kernel over (installed and not switched off)."""
    return importlib.util.find_spec("tilelang") is not None and os.environ.get("FLA_TILELANG", "1") != "0"


def _chunk_spans(batch: int, tokens: int, chunk: int, cu_seqlens: torch.Tensor | None,
                 chunk_indices: torch.Tensor | None, device: torch.device
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(row, start, end)`` of every chunk, in the order of fla's chunk axis of ``h`` / ``dh``."""
    if cu_seqlens is None:
        per_row = -(-tokens // chunk)
        row = torch.arange(batch, device=device).repeat_interleave(per_row)
        start = (torch.arange(per_row, device=device) * chunk).repeat(batch)
        return row, start, torch.clamp(start + chunk, max=tokens)
    cu, index = cu_seqlens.to(device).long(), chunk_indices.to(device).long()
    start = cu[index[:, 0]] + index[:, 1] * chunk
    return torch.zeros_like(start), start, torch.minimum(start + chunk, cu[index[:, 0] + 1])


def chunk_bwd_dqkwg(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, do: torch.Tensor, h: torch.Tensor,
                    dh: torch.Tensor, w: torch.Tensor | None = None, g: torch.Tensor | None = None,
                    g_gamma: torch.Tensor | None = None, dv: torch.Tensor | None = None, scale: float | None = None,
                    state_v_first: bool = False, cu_seqlens: torch.Tensor | None = None, chunk_size: int = 64,
                    chunk_indices: torch.Tensor | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """fla's gated ``chunk_bwd_dqkwg`` in torch (same arguments): ``(dq, dk [B, T, H, K], dw [B, T, HV, K] or None,
    dg [B, T, HV] float32)``.

    All chunks are computed at once, in float32 whatever autocast the backward runs under: memory about
    ``chunks * HV * 64 * (6 K + 2 V + 64) * 4`` bytes (the chunk-major q, k, dq, dk, dw, v, do and ``ds``).
    """
    with torch.autocast(q.device.type, enabled=False):
        return _chunk_bwd_dqkwg(q, k, v, do, h, dh, w, g, dv, scale, state_v_first, cu_seqlens, chunk_size,
                                chunk_indices)


def _chunk_bwd_dqkwg(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, do: torch.Tensor, h: torch.Tensor,
                     dh: torch.Tensor, w: torch.Tensor | None, g: torch.Tensor, dv: torch.Tensor | None, scale: float,
                     state_v_first: bool, cu_seqlens: torch.Tensor | None, chunk_size: int,
                     chunk_indices: torch.Tensor | None
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor]:
    batch, tokens, heads, _ = k.shape
    v_heads = v.shape[2]
    group, device = v_heads // heads, q.device
    row, start, end = _chunk_spans(batch, tokens, chunk_size, cu_seqlens, chunk_indices, device)
    offsets = torch.arange(chunk_size, device=device)
    valid = offsets[None, :] < (end - start)[:, None]                              # [C, L]
    tokens_of = torch.where(valid, start[:, None] + offsets[None, :], start[:, None])
    rows_of = row[:, None].expand_as(tokens_of)

    def chunks(x: torch.Tensor, repeat: int = 1) -> torch.Tensor:  # [B, T, n, d] -> [C, n, L, d], 0 in masked slots
        y = x[rows_of, tokens_of].float().repeat_interleave(repeat, dim=2)
        return torch.where(valid[..., None, None], y, 0.0).permute(0, 2, 1, 3)

    qc, kc, vc, doc = chunks(q, group), chunks(k, group), chunks(v), chunks(do)
    gc = torch.where(valid[..., None], g[rows_of, tokens_of].float(), 0.0).transpose(1, 2)   # [C, HV, L]
    g_last = g[row, end - 1].float()[..., None]                                               # [C, HV, 1]
    state = h.reshape(-1, v_heads, *h.shape[-2:]).float()
    d_state = dh.reshape(-1, v_heads, *dh.shape[-2:]).float()
    if state_v_first:
        state, d_state = state.transpose(-1, -2), d_state.transpose(-1, -2)

    dq = doc @ state.mT * (torch.exp2(gc)[..., None] * scale)
    dk = vc @ d_state.mT * torch.where(valid[:, None, :], torch.exp2(g_last - gc), 0.0)[..., None]
    dg_last = (state * d_state).sum((-1, -2))[..., None] * torch.exp2(g_last) + (dk * kc).sum((-1, -2))[..., None]
    causal = (offsets[:, None] >= offsets[None, :])[None, None] & valid[:, None, :, None] & valid[:, None, None, :]
    ds = torch.where(causal, (doc @ vc.mT) * torch.exp2(gc[..., :, None] - gc[..., None, :]), 0.0) * scale
    ds = ds.to(k.dtype).float()  # the Triton kernel rounds ds to the input dtype before its two products
    dq = dq + ds @ kc
    dk = dk + ds.mT @ qc
    dg = (dq * qc).sum(-1) - (dk * kc).sum(-1)                                                # [C, HV, L]
    dg = dg.scatter_add(-1, (end - start - 1)[:, None, None].expand(-1, v_heads, 1), dg_last)

    def tokens_major(chunked: torch.Tensor, width: int | None) -> torch.Tensor:
        """Chunk slots back to ``[B, T, HV(, width)]``; a masked slot holds 0 and adds 0 to its chunk's first token
        (no data-dependent indexing, so no host sync)."""
        slots = chunked.transpose(1, 2) if width is None else chunked.permute(0, 2, 1, 3)       # [C, L, HV(, d)]
        shape = (batch, tokens, v_heads) + ((width,) if width is not None else ())
        out = torch.zeros(shape, dtype=torch.float32, device=device)
        return out.index_put_((rows_of.flatten(), tokens_of.flatten()), slots.flatten(0, 1), accumulate=True)

    dq_t, dk_t, dg_t = tokens_major(dq, q.shape[-1]), tokens_major(dk, k.shape[-1]), tokens_major(dg, None)
    dw_t = None
    if w is not None:
        dw_t = tokens_major(-(chunks(dv) @ state.mT), w.shape[-1]).to(w.dtype)
    if group > 1:
        dq_t, dk_t = (x.view(batch, tokens, heads, group, -1).sum(3) for x in (dq_t, dk_t))
    return dq_t.to(q.dtype), dk_t.to(k.dtype), dw_t, dg_t


def _gated(*args: Any, g: torch.Tensor | None = None, g_gamma: torch.Tensor | None = None, **kwargs: Any
           ) -> tuple[bool, str | None]:
    """fla verifier: take gated calls only, and only where the Triton kernel is wrong and TileLang absent."""
    if g is None or g_gamma is not None:
        return False, "hybrid_pack's torch chunk_bwd_dqkwg covers the gated case only"
    if not affected():
        return False, "fla's Triton kernel is correct here"
    return True, None


_installed = False
_decided = False


def install() -> bool:
    """Register :func:`chunk_bwd_dqkwg` with fla's dispatch, where :func:`affected` and TileLang is absent.

    Decided once per process; returns whether it is registered.
    """
    global _installed, _decided
    if _decided:
        return _installed
    _decided = True
    if not affected() or tilelang_fix_present():
        return False
    from fla.backends import BaseBackend, register

    class TorchDqkwg(BaseBackend):
        backend_type = BACKEND_TYPE
        priority = PRIORITY

        def chunk_bwd_dqkwg(self, *args: Any, **kwargs: Any) -> Any:
            return chunk_bwd_dqkwg(*args, **kwargs)

        def chunk_bwd_dqkwg_verifier(self, *args: Any, **kwargs: Any) -> tuple[bool, str | None]:
            return _gated(*args, **kwargs)

    register("common")(TorchDqkwg)
    _installed = True
    return True
