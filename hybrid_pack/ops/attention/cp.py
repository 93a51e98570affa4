"""Causal attention on one rank's slice of a row split across a context-parallel group (docs/parallel.md).

Only this rank's first document can have earlier tokens elsewhere (a document that began on an
earlier rank). The rank receives that document's earlier keys and values (both in one exchange,
:func:`~hybrid_pack.parallel.exchange.with_preceding_tokens`); the document's local queries attend to
``[earlier, local]`` keys with the causal diagonal aligned to the bottom right (query ``i`` sees keys
``<= halo + i``), in torch SDPA. The other local segments run the single-device op (the selected
backend) as they are. Keys' and values' gradients go back to the ranks that sent them. Bytes received
per rank: ``2 * first_position * Hkv * D`` elements, the continuing document's earlier keys and values.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

from hybrid_pack.errors import InputError
from hybrid_pack.parallel.boundaries import ShardedBoundaries
from hybrid_pack.parallel.exchange import with_preceding_tokens

__all__ = ["varlen_attention_cp"]


def varlen_attention_cp(op: Callable[..., torch.Tensor], q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                        boundaries: ShardedBoundaries, *, causal: bool, softmax_scale: float,
                        backend: str | None) -> torch.Tensor:
    """This rank's slice of :func:`hybrid_pack.ops.varlen_attention` over the whole row.

    Args:
        op: the public single-device op (called with plain boundaries and ``backend``).
        q: ``[1, T_local, H, D]``; k, v: ``[1, T_local, Hkv, D]`` (the same dtype).
        boundaries: this rank's :class:`ShardedBoundaries` (a collective over its group).
        causal: must be True (a bidirectional document would also need its later ranks' keys).
        softmax_scale: multiplies ``q @ k^T``.

    Returns:
        ``[1, T_local, H, D]``.
    """
    if not causal:
        raise InputError("causal: context-parallel attention is causal only (a bidirectional document split "
                         "across ranks would need keys from later ranks); run causal=False unsharded")
    boundaries.check_group()
    local = functools.partial(op, causal=True, softmax_scale=softmax_scale, backend=backend)
    keys_values, halo = with_preceding_tokens(torch.stack([k[0], v[0]], dim=1), boundaries)
    if not halo:
        return local(q, keys_values[None, :, 0], keys_values[None, :, 1], boundaries.local)
    first = boundaries.local.segment_lengths[0]
    head_kv = keys_values[: halo + first].movedim(0, 2).unsqueeze(1)  # [2, 1, Hkv, halo + first, D]
    head = F.scaled_dot_product_attention(
        q[:, :first].transpose(1, 2), head_kv[0], head_kv[1], attn_mask=causal_lower_right(first, halo + first),
        scale=softmax_scale, enable_gqa=q.shape[2] != k.shape[2]).transpose(1, 2)
    rest = boundaries.after_first()
    if rest is None:
        return head
    tail_kv = keys_values[halo + first:]
    return torch.cat([head, local(q[:, first:], tail_kv[None, :, 0], tail_kv[None, :, 1], rest)], dim=1)
