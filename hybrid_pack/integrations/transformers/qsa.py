"""Qwen4-Exp's QSA indexed attention (``Qwen4ExpTextAttention``) on a packed row, every document on its own.

The module's indexer picks, for the query at position ``i`` of a document, which earlier keys it attends to: the
keys are cut into complete blocks of ``r = indexer_compress_ratio`` tokens counted from the document's first token
(the blocks of ``[0, i]``); each block's raw indexer keys are averaged (in float32), normalised (``k_layernorm``)
and rotated at the block's first position; the indexer query is normalised (``q_layernorm``) and rotated at ``i``;
a block scores ``sum over heads relu(q . k) / sqrt(index_head_dim)``. The query attends to the tokens of its
``indexer_budget // r`` best blocks plus the tokens after the last complete block, up to itself. Packed, the blocks,
the top-k and the attention are cut at every document start (:mod:`hybrid_pack.ops.attention.indexed`); the
position embeddings the layer receives on a packed call already restart at every document.

The selection is not differentiable in the module either (it only masks the attention), so no gradient reaches
the indexer. Blocks with equal scores (relu makes exact zeros common) are taken earlier block first; the module
leaves that choice to ``torch.topk``, whose order among ties is unspecified and differs between devices.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from hybrid_pack.boundaries import PackedBoundaries
from hybrid_pack.boundaries.sharded import ShardedBoundaries
from hybrid_pack.errors import InputError, UnsupportedModelError
from hybrid_pack.ops.attention.indexed import document_pools, document_topk, indexed_attention, visible_tail
from hybrid_pack.ops.invariant import refuse_in_batch_invariant_mode

__all__ = ["qsa_attention_forward", "qsa_selection"]


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on the first ``cos.shape[-1]`` features of ``x`` (the rest pass), ``cos``/``sin`` broadcast to ``x``."""
    rotary = cos.shape[-1]
    rope, rest = x[..., :rotary], x[..., rotary:]
    first, second = rope.chunk(2, dim=-1)
    return torch.cat([rope * cos + torch.cat([-second, first], dim=-1) * sin, rest], dim=-1)


def qsa_selection(indexer: torch.nn.Module, hidden_states: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                  boundaries: PackedBoundaries) -> torch.Tensor:
    """The keys each query of ``hidden_states [1, T, hidden]`` attends to, chosen by ``Qwen4ExpTextQSAIndexer``.

    ``cos``/``sin`` are ``[1, T, rotary_dim]``, at per-document positions. Returns int64
    ``[1, T, min(block_topk, P) * r + r - 1]`` (``P`` complete blocks in the row): row positions (the selected
    blocks' tokens, then the tail), ``-1`` for none.
    """
    ratio, heads, head_dim = indexer.compress_ratio, indexer.index_n_heads, indexer.index_head_dim
    if indexer.index_kv_heads != 1:
        raise UnsupportedModelError(f"config.indexer_kv_heads: {indexer.index_kv_heads}; Qwen4-Exp's QSA indexer "
                                    "pools one key head (the module itself needs indexer_kv_heads=1)")
    tail = visible_tail(boundaries, ratio)
    if indexer.block_topk == 0:
        return tail
    with torch.no_grad():
        query, keys = indexer.index_qk_proj(hidden_states).split([heads * head_dim, head_dim], dim=-1)
        query = _rotate(indexer.q_layernorm(query.unflatten(-1, (heads, head_dim))), cos[:, :, None], sin[:, :, None])
        pools = document_pools(boundaries, ratio)                                          # [P, r]
        pooled = indexer.k_layernorm(keys[0][pools].float().mean(dim=1).to(keys.dtype))     # [P, d]
        pooled = _rotate(pooled, cos[0][pools[:, 0]], sin[0][pools[:, 0]])
        scores = torch.einsum("thd,pd->thp", query[0].float(), pooled.float()).relu().sum(dim=1)
        chosen = document_topk((scores / math.sqrt(head_dim))[None], pools[:, -1], boundaries, indexer.block_topk)
    tokens = torch.where(chosen[..., None] >= 0, pools[chosen.clamp(min=0)], -1).flatten(2)  # [1, T, k * r]
    return torch.cat([tokens, tail], dim=-1)


def qsa_attention_forward(attention: torch.nn.Module, boundaries: PackedBoundaries, hidden_states: torch.Tensor,
                          position_embeddings: tuple[torch.Tensor, torch.Tensor], attention_mask: Any = None,
                          cache: Any = None, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """``Qwen4ExpTextAttention``'s whole call on a packed row: ``hidden_states [1, T, hidden]`` ->
    ``([1, T, hidden], None)``, every document on its own (no attention weights are formed).

    ``attention_mask`` is not read (the boundaries replace it); a cache is refused.
    """
    layer = type(attention).__name__
    refuse_in_batch_invariant_mode(layer, "QSA indexed attention")
    if isinstance(boundaries, ShardedBoundaries):
        raise UnsupportedModelError(f"{layer}: Qwen4-Exp's QSA indexed attention selects blocks of whole documents "
                                    "and is not supported under context parallelism; train without a "
                                    "context-parallel group")
    if not isinstance(boundaries, PackedBoundaries):
        raise UnsupportedModelError(f"{layer}: Qwen4-Exp's QSA indexed attention needs the host-side document "
                                    f"lengths of a PackedBoundaries (got {type(boundaries).__name__}); it does not "
                                    "run under torch.compile on static packed batches: run it eagerly")
    if cache is not None:
        raise InputError(f"{layer}.cache: a KV / indexer cache cannot be used with a packed batch; generate from "
                         "unpacked inputs")
    cos, sin = (x[:, -hidden_states.shape[1]:] for x in position_embeddings)
    selected = qsa_selection(attention.indexer, hidden_states, cos, sin, boundaries)
    head_dim = attention.head_dim
    query, gate = attention.q_proj(hidden_states).unflatten(-1, (-1, 2 * head_dim)).chunk(2, dim=-1)
    query = _rotate(attention.q_norm(query), cos[:, :, None], sin[:, :, None])
    key = _rotate(attention.k_norm(attention.k_proj(hidden_states).unflatten(-1, (-1, head_dim))),
                  cos[:, :, None], sin[:, :, None])
    value = attention.v_proj(hidden_states).unflatten(-1, (-1, head_dim))
    out = indexed_attention(query, key, value, selected, boundaries, softmax_scale=attention.scaling)
    out = out * torch.sigmoid(gate)
    return attention.o_proj(out.flatten(-2)), None
