"""Boundary-safe forwards for the Per-Layer Embedding (PLE) of Qwen4-Exp.

A PLE layer mixes tokens in two places, both made to restart at every document start here:

- its hashed n-gram embedding (``Qwen4ExpTextNGramEmbedding``) hashes each token with the ``ngram_size - 1``
  tokens before it, reading EOS in place of tokens before the sequence start or before the last EOS; packed,
  a document start counts as such a restart (:func:`ngram_embedding_forward`);
- its depthwise convolution dilated by ``ngram_size`` (:func:`dilated_causal_conv`), whose taps read zeros
  before the document start, as before the sequence start alone.

Everything else in the layer (projections, the key/query gate, the grouped RMSNorms) acts token by token and
is the module's own. The Gated DeltaNet mixers of Qwen4-Exp are Qwen3.5's (:mod:`.gated_deltanet`); its QSA
indexed attention is :mod:`.qsa`.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F

from hybrid_pack.boundaries import PackedBoundaries
from hybrid_pack.boundaries.sharded import ShardedBoundaries
from hybrid_pack.errors import InputError, UnsupportedModelError
from hybrid_pack.ops.invariant import refuse_in_batch_invariant_mode

__all__ = ["ngram_embedding_forward", "dilated_causal_conv", "ple_forward", "ple_call"]


def _refuse_shards(boundaries: PackedBoundaries, layer: str) -> None:
    """The look-backs here read earlier tokens of the same row; a context-parallel shard lacks those of its
    documents' beginnings on earlier ranks."""
    if isinstance(boundaries, ShardedBoundaries):
        raise UnsupportedModelError(f"{layer}: Qwen4-Exp's per-layer n-gram embedding is not supported under "
                                    "context parallelism; train this model without a context-parallel group")


def _restarts_at_documents_and_eos(input_ids: torch.Tensor, eos_token_id: int,
                                   boundaries: PackedBoundaries) -> torch.Tensor:
    """int64 ``[1, T]``: how many tokens before each one are in its n-gram context (since the later of its
    document's start and the last EOS strictly before it)."""
    positions = torch.arange(input_ids.shape[1], device=input_ids.device)
    eos_at = torch.where(input_ids == eos_token_id, positions, -1)
    last_eos_before = F.pad(torch.cummax(eos_at, dim=1).values[:, :-1], (1, 0), value=-1)
    document_start = positions - boundaries.document_positions.to(input_ids.device)
    return positions - torch.maximum(last_eos_before + 1, document_start)


def ngram_embedding_forward(embedding: torch.nn.Module, input_ids: torch.Tensor,
                            boundaries: PackedBoundaries) -> torch.Tensor:
    """``input_ids [1, T]`` -> ``[1, T, ngram_heads * head_dim]``, every document hashed on its own.

    For each order ``n`` in ``2..ngram_size`` the ids of the token and the ``n - 1`` before it (EOS where the
    context restarts) are multiplied by the layer's multipliers and xor-ed, then taken modulo each of the order's
    head vocabulary sizes and offset into the shared table, as the module does.
    """
    _refuse_shards(boundaries, type(embedding).__name__)
    ids = input_ids.long()
    eos = embedding.eos_token_id
    context = _restarts_at_documents_and_eos(ids, eos, boundaries)
    positions = torch.arange(ids.shape[1], device=ids.device)
    multipliers = embedding.layer_multipliers
    mixed = ids * multipliers[0]
    blocks = []
    for shift in range(1, embedding.ngram_size):
        previous = ids.gather(1, (positions - shift).clamp_min(0).unsqueeze(0))
        previous = torch.where(context >= shift, previous, ids.new_full((), eos))
        mixed = torch.bitwise_xor(mixed, previous * multipliers[shift])
        heads = slice((shift - 1) * embedding.heads_per_ngram, shift * embedding.heads_per_ngram)
        sizes, offsets = embedding.ngram_heads_vocab_sizes[heads], embedding.ngram_heads_offsets[heads]
        blocks.append(torch.remainder(mixed.unsqueeze(-1), sizes) + offsets)
    ngram_ids = torch.cat(blocks, dim=-1)
    table = embedding.ngram_embedding
    table_device = table.weight.device if table.weight.device.type != "meta" else ngram_ids.device
    return table(ngram_ids.to(table_device)).to(ids.device).flatten(-2)


def dilated_causal_conv(x: torch.Tensor, conv: torch.nn.Conv1d, boundaries: PackedBoundaries) -> torch.Tensor:
    """``x [1, T, C]`` through the depthwise causal ``conv`` (weights ``[C, 1, W]``, dilation ``d``) -> ``[1, T, C]``.

    Tap ``j`` reads ``x`` at ``(W - 1 - j) * d`` tokens back, zero where that is before the token's document start.
    """
    _refuse_shards(boundaries, type(conv).__name__)
    width, dilation = conv.kernel_size[0], conv.dilation[0]
    within = boundaries.document_positions.to(x.device)[0]
    out = x * conv.weight[:, 0, width - 1]
    for tap in range(width - 1):
        back = (width - 1 - tap) * dilation
        earlier = F.pad(x, (0, 0, back, 0))[:, : x.shape[1]]
        out = out + earlier * (within >= back).to(x.dtype)[:, None] * conv.weight[:, 0, tap]
    return out if conv.bias is None else out + conv.bias


def ple_forward(ple: torch.nn.Module, hidden_states: torch.Tensor, boundaries: PackedBoundaries,
                input_ids: torch.Tensor, conv_mask: torch.Tensor | None = None) -> torch.Tensor:
    """``Qwen4ExpTextPLELayer``: ``hidden_states [1, T, hc * hidden]`` and ``input_ids [1, T]`` ->
    ``[1, T, hc * hidden]``, every document on its own. ``conv_mask [1, T]`` (1 keep, 0 padding) zeroes the
    convolution's input where the module zeroes it."""
    _refuse_shards(boundaries, type(ple).__name__)
    refuse_in_batch_invariant_mode(type(ple).__name__, "the per-layer n-gram embedding")
    embeddings = ngram_embedding_forward(ple.ple_embedding, input_ids, boundaries)
    streams = (ple.hc_count, ple.hidden_size)
    key = ple.norm_key(ple.key_proj(embeddings)).unflatten(-1, streams)
    query = ple.norm_query(hidden_states).unflatten(-1, streams)
    gate = (key * query).sum(dim=-1, keepdim=True) / math.sqrt(ple.hidden_size)
    gate = gate.abs().clamp_min(1e-6).sqrt() * gate.sign()
    gated_value = (torch.sigmoid(gate) * ple.value_proj(embeddings).unsqueeze(-2)).flatten(-2)
    conv_input = ple.norm_conv(gated_value)
    if conv_mask is not None:
        keep = conv_mask[:, :, None]
        gated_value, conv_input = (gated_value * keep).to(gated_value.dtype), (conv_input * keep).to(conv_input.dtype)
    convolved = F.silu(dilated_causal_conv(conv_input, ple.conv1d, boundaries))
    return gated_value + convolved


def ple_call(ple: torch.nn.Module, boundaries: PackedBoundaries, hidden_states: torch.Tensor,
             input_ids: torch.Tensor, cache: Any = None, conv_mask: torch.Tensor | None = None) -> torch.Tensor:
    """``Qwen4ExpTextPLELayer``'s whole call on a packed row (its decoder layer passes ``(hidden_states,
    ple_input_ids, cache, conv_mask=...)``): :func:`ple_forward`; a cache is refused."""
    if cache is not None:
        raise InputError(f"{type(ple).__name__}.cache: a convolution cache cannot be used with a packed batch; "
                         "generate from unpacked inputs")
    return ple_forward(ple, hidden_states, boundaries, input_ids, conv_mask)
