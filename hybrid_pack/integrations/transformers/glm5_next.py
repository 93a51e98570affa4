"""Boundary-safe forward for GLM-5-Next's DSA-indexed MLA layers (``Glm5NextTextAttention``).

Such a layer mixes tokens in two places, both kept inside each document here:

- its indexer (``Glm5NextTextIndexer``) pools every ``index_kpool`` consecutive keys into one candidate,
  counted from the sequence's first token, scores the pools and keeps the ``index_topk // index_kpool`` best
  whose last token the query sees, plus the query's own incomplete pool (its tail). Packed, pools, top-k and
  tails are counted per document (:func:`dsa_indexer_forward`, on :mod:`hybrid_pack.ops.attention.indexed`);
- its attention over the selected tokens, which runs as
  :func:`hybrid_pack.ops.attention.indexed.indexed_attention` instead of a mask built from the top-k indices.

A ``"shared"`` layer (no indexer of its own) reuses the indices of the full layer before it, as the module
does: the decoder layers pass them on as ``prev_topk_indices``, row positions of the same packed row.
Projections, the latent key/value expansion and the output projection are the module's own (token by token).
The layers are NoPE (the config refuses RoPE dims), so no position enters. The KDA mixers of GLM-5-Next are
Kimi Linear's (:func:`.kda.kda_forward`); the hyper-connections and MoE act token by token.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from hybrid_pack.boundaries import PackedBoundaries
from hybrid_pack.errors import InputError, UnsupportedModelError
from hybrid_pack.ops.attention.indexed import document_pools, document_topk, indexed_attention, visible_tail
from hybrid_pack.ops.invariant import refuse_in_batch_invariant_mode

__all__ = ["dsa_indexer_forward", "indexed_mla_forward", "refuse_unselected_tail"]


def _refuse_unserved(boundaries: Any, indexer: torch.nn.Module | None, layer: str) -> None:
    """Boundaries and settings the per-document pools cannot serve, refused with the fix."""
    if not isinstance(boundaries, PackedBoundaries):
        raise UnsupportedModelError(f"{layer}: GLM-5-Next's indexed attention needs the host-side document lengths "
                                    f"of a PackedBoundaries (got {type(boundaries).__name__}); it runs neither under "
                                    "torch.compile nor with a context-parallel group")
    if indexer is not None:
        refuse_unselected_tail(indexer)


def refuse_unselected_tail(indexer: torch.nn.Module) -> None:
    """A ``Glm5NextTextIndexer`` setting the per-document pools cannot serve, refused by ``patch_model``."""
    if not indexer.index_kpool_always_select_tail and indexer.index_kpool > 1:
        raise UnsupportedModelError(
            f"config.index_kpool_always_select_tail: False leaves the first index_kpool - 1 = "
            f"{indexer.index_kpool - 1} tokens of every document with no key to attend to (the model's own "
            "attention then averages masked-out keys, future ones included); set it to True before patch_model")


def dsa_indexer_forward(indexer: torch.nn.Module, hidden_states: torch.Tensor, q_resid: torch.Tensor,
                        boundaries: PackedBoundaries) -> torch.Tensor:
    """The tokens each query of ``Glm5NextTextIndexer`` selects, every document pooled and ranked on its own.

    Args:
        indexer: the layer's ``Glm5NextTextIndexer``.
        hidden_states: ``[1, T, hidden]``, the attention's input.
        q_resid: ``[1, T, q_lora_rank]``, the attention's ``q_a_layernorm(q_a_proj(hidden_states))``.
        boundaries: where the documents of the row start.

    Returns:
        int32 ``[1, T, index_topk + index_kpool - 1]`` (``[1, T, index_topk]`` without the tail): row positions
        of the tokens of the chosen pools, then of the query's tail; ``-1`` in unused slots. Computed without
        gradient, as the module does; the set of tokens equals the module's on each document alone.
    """
    size = indexer.index_kpool
    with torch.no_grad():
        q = indexer.wq_b(q_resid).unflatten(-1, (-1, indexer.head_dim))               # [1, T, H, D]
        k = indexer.k_norm(indexer.wk(hidden_states))                                 # [1, T, D]
        gate = F.linear(hidden_states, indexer.index_kpool_compress_gate)             # [1, T, D]
        pools = document_pools(boundaries, size)                                      # [P, size]
        # Each pool's key: a softmax-weighted mean of its tokens' keys, per channel.
        logits = gate[0][pools].float() + indexer.index_kpool_compress_ape.float()    # [P, size, D]
        pool_keys = (logits.softmax(dim=1).to(k.dtype) * k[0][pools]).sum(dim=1)      # [P, D]
        scores = F.relu(q.float() @ pool_keys.float().T * indexer.softmax_scale)      # [1, T, H, P]
        weights = indexer.weights_proj(hidden_states.to(indexer.weights_proj.weight.dtype)).float()
        weights = weights * indexer.n_heads ** -0.5                                    # [1, T, H]
        index_scores = (weights.unsqueeze(-2) @ scores).squeeze(-2)                   # [1, T, P]
        chosen = document_topk(index_scores, pools[:, -1], boundaries, indexer.index_topk // size)
        tokens = pools[chosen.clamp(min=0)].masked_fill(chosen.unsqueeze(-1) < 0, -1).flatten(-2)
        width = indexer.index_topk
        if indexer.index_kpool_always_select_tail:
            tokens = torch.cat([tokens, visible_tail(boundaries, size)], dim=-1)
            width += size - 1
        return F.pad(tokens, (0, width - tokens.shape[-1]), value=-1).to(torch.int32)


def indexed_mla_forward(attention: torch.nn.Module, boundaries: PackedBoundaries, hidden_states: torch.Tensor,
                        attention_mask: torch.Tensor | None = None, cache: Any = None,
                        prev_topk_indices: torch.Tensor | None = None, **kwargs: Any,
                        ) -> tuple[torch.Tensor, None, torch.Tensor | None]:
    """``Glm5NextTextAttention``'s call on a packed row (:class:`.families.WholeCall`).

    ``hidden_states [1, T, hidden]`` -> ``(output [1, T, hidden], None, topk_indices or None)`` as the module
    returns: the indices (int32 ``[1, T, width]``, :func:`dsa_indexer_forward`) only where the next layer shares
    them. ``attention_mask`` (the model's all-true padding mask of a packed row, or the eager document mask) is
    not read: the boundaries separate the documents. Attention weights are not computed (None).
    """
    layer = type(attention).__name__
    refuse_in_batch_invariant_mode(layer, "DSA indexed attention")
    _refuse_unserved(boundaries, attention.indexer, layer)
    if cache is not None:
        raise InputError(f"cache: {layer} cannot use a cache on a packed row; packed rows are for training and "
                         "scoring; generate from unpacked inputs")
    q_resid = attention.q_a_layernorm(attention.q_a_proj(hidden_states))
    query = attention.q_b_proj(q_resid).unflatten(-1, (-1, attention.qk_head_dim))    # [1, T, H, Dqk]
    kv_pass, k_rot = attention.kv_a_proj_with_mqa(hidden_states).split(
        [attention.kv_lora_rank, attention.qk_rope_head_dim], dim=-1)
    key, value = attention.expand_kv(attention.kv_a_layernorm(kv_pass).unsqueeze(1), k_rot.unsqueeze(1))
    if attention.indexer is not None:
        indices = dsa_indexer_forward(attention.indexer, hidden_states, q_resid, boundaries)
    elif prev_topk_indices is None:
        raise InputError(f"prev_topk_indices: {layer} {attention.layer_idx} shares the top-k of the full indexer "
                         "layer before it; call the whole model (or pass that layer's indices)")
    else:
        indices = prev_topk_indices
    out = indexed_attention(query, key.transpose(1, 2), value.transpose(1, 2), indices, boundaries,
                            softmax_scale=attention.scaling)                          # [1, T, H, Dv]
    return attention.o_proj(out.flatten(-2)), None, indices if attention.next_skip_topk else None
