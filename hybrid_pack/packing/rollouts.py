"""Packing RL rollouts (prompt + response, tool outputs masked) into collator batches.

A rollout is a prompt and the policy's response. Agentic responses also contain tool outputs that
the environment injected; they are part of the context but the policy did not produce them, so
they take no policy gradient. :func:`pack_rollouts` plans packs of whole rollouts and returns one
:class:`~hybrid_pack.PackingCollator` batch per pack with the per-token RL fields alongside.

Every per-token field is aligned with the tokens (value ``t`` describes token ``t``), like
``input_ids`` and the unshifted ``labels``; :func:`~hybrid_pack.loss.token_logprobs` returns new
log-probabilities in the same alignment.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from hybrid_pack.collate import IGNORE_INDEX, PackingCollator
from hybrid_pack.packing.plan import plan_packs

__all__ = ["ROLLOUT_TOKEN_KEYS", "pack_rollouts"]

ROLLOUT_TOKEN_KEYS = ("response_mask", "tool_mask", "advantages", "old_logprobs", "sample_index")
"""Per-token keys :func:`pack_rollouts` adds to each collator batch."""

TokenIds = Sequence[int] | np.ndarray | torch.Tensor


def _flat(field: str, values: Sequence[Any], lengths: np.ndarray, dtype: type) -> np.ndarray:
    """One array of ``sum(lengths)`` entries from per-sample sequences, each checked against its length."""
    if len(values) != lengths.shape[0]:
        raise ValueError(f"{field}: expected one entry per sample ({lengths.shape[0]}); got {len(values)}")
    arrays = [np.asarray(v.detach().cpu() if isinstance(v, torch.Tensor) else v, dtype=dtype) for v in values]
    for i, (array, n) in enumerate(zip(arrays, lengths.tolist())):
        if array.ndim != 1 or array.shape[0] != n:
            raise ValueError(f"{field}[{i}]: expected a flat sequence of {n} values (one per token); "
                             f"got shape {list(array.shape)}")
    return np.concatenate(arrays) if arrays else np.zeros(0, dtype)


def _token_lengths(sequences: Sequence[TokenIds]) -> np.ndarray:
    return np.fromiter((len(s) for s in sequences), dtype=np.int64, count=len(sequences))


def _advantages(advantages: Sequence[Any], response_lengths: np.ndarray) -> np.ndarray:
    """Per-response-token advantages from per-sample scalars (broadcast) or per-token sequences."""
    if len(advantages) != response_lengths.shape[0]:
        raise ValueError(f"advantages: expected one entry per sample ({response_lengths.shape[0]}); "
                         f"got {len(advantages)}")
    scalar = np.array([np.ndim(a) == 0 for a in advantages])
    if scalar.all():
        return np.repeat(np.asarray(advantages, dtype=np.float32), response_lengths)
    if scalar.any():
        i = int(np.argmax(scalar))
        raise ValueError(f"advantages[{i}]: expected the same form for every sample (all scalars or all "
                         f"per-token sequences); got a scalar among sequences")
    return _flat("advantages", advantages, response_lengths, np.float32)


def pack_rollouts(
    prompts: Sequence[TokenIds],
    responses: Sequence[TokenIds],
    capacity: int,
    *,
    tool_masks: Sequence[Sequence[int]] | None = None,
    advantages: Sequence[float] | Sequence[Sequence[float]] | None = None,
    old_logprobs: Sequence[Sequence[float]] | None = None,
    strategy: str = "bfd",
    overflow: str = "error",
    pad_to_multiple_of: int | None = None,
) -> list[dict[str, Any]]:
    """Pack rollouts ``prompt + response`` into collator batches of at most ``capacity`` tokens.

    Args:
        prompts, responses: token ids per sample (lists, arrays or 1-D tensors); sample ``i`` is
            ``prompts[i] + responses[i]``. Prompts repeated for several responses are given repeated.
        capacity: tokens per pack.
        tool_masks: per sample, one 0/1 per response token, 1 where a tool's output was injected.
        advantages: per sample a scalar (broadcast over its response tokens) or one value per
            response token.
        old_logprobs: per sample, the behaviour policy's log-probability of each response token.
        strategy: any :func:`~hybrid_pack.plan_packs` strategy.
        overflow: a rollout longer than ``capacity``: ``"error"``, ``"truncate"`` (keep its first
            ``capacity`` tokens: the response tail is cut) or ``"drop"`` (its index is then absent
            from every ``sample_index``).
        pad_to_multiple_of: pad each batch to a multiple of this many tokens (one trailing padding
            segment, see :class:`~hybrid_pack.PackingCollator`).

    Returns:
        One dict per pack: the :class:`~hybrid_pack.PackingCollator` batch (``input_ids``,
        ``labels``, ``position_ids``, ``seq_idx``, ``cu_seq_lens_q/k``, ``max_length_q/k``) plus,
        each ``[1, T]``: ``response_mask`` (int64, 1 on every response token, tool outputs included),
        ``tool_mask`` (int64, 1 on injected tool output), ``advantages`` and ``old_logprobs``
        (float32, 0 on prompt tokens; all zeros when not given) and ``sample_index`` (int64, the sample of
        each token, -1 on padding). ``labels`` are the token ids where ``response_mask * (1 - tool_mask)`` is 1 and
        -100 elsewhere, so ``packed_loss(logits, batch["labels"])`` is the NLL of the policy's tokens.
    """
    if len(prompts) != len(responses):
        raise ValueError(f"responses: expected one response per prompt ({len(prompts)}); got {len(responses)}")
    if overflow not in ("error", "truncate", "drop"):
        raise ValueError(f"overflow: expected 'error', 'truncate' or 'drop' (a rollout piece without its "
                         f"prompt cannot be trained on, so 'split' is not offered); got {overflow!r}")
    prompt_lengths = _token_lengths(prompts)
    response_lengths = _token_lengths(responses)
    empty = np.flatnonzero(response_lengths == 0)
    if empty.size:
        raise ValueError(f"responses[{int(empty[0])}]: expected at least one token; got an empty response "
                         f"({empty.size} sample(s) affected)")
    lengths = prompt_lengths + response_lengths
    plan = plan_packs(lengths, capacity, strategy=strategy, overflow=overflow)

    num_samples = lengths.shape[0]
    sample_start = np.zeros(num_samples + 1, dtype=np.int64)
    np.cumsum(lengths, out=sample_start[1:])
    is_response = np.ones(int(sample_start[-1]), dtype=bool)
    is_response[np.repeat(sample_start[:-1], prompt_lengths) + _ranges(prompt_lengths)] = False
    response_positions = np.flatnonzero(is_response)
    input_ids = np.empty(is_response.shape[0], dtype=np.int64)
    input_ids[~is_response] = _flat("prompts", prompts, prompt_lengths, np.int64)
    input_ids[response_positions] = _flat("responses", responses, response_lengths, np.int64)

    fields: dict[str, np.ndarray] = {
        "response_mask": is_response.astype(np.int64),
        "tool_mask": np.zeros(input_ids.shape[0], dtype=np.int64),
        "sample_index": np.repeat(np.arange(num_samples, dtype=np.int64), lengths),
    }
    if tool_masks is not None:
        tool = _flat("tool_masks", tool_masks, response_lengths, np.int64)
        if ((tool != 0) & (tool != 1)).any():
            raise ValueError("tool_masks: expected only 0 and 1 (1 where a tool's output was injected)")
        fields["tool_mask"][response_positions] = tool
    fields["advantages"] = np.zeros(input_ids.shape[0], dtype=np.float32)
    fields["old_logprobs"] = np.zeros(input_ids.shape[0], dtype=np.float32)
    if advantages is not None:
        fields["advantages"][response_positions] = _advantages(advantages, response_lengths)
    if old_logprobs is not None:
        fields["old_logprobs"][response_positions] = _flat("old_logprobs", old_logprobs, response_lengths, np.float32)
    policy_token = (fields["response_mask"] == 1) & (fields["tool_mask"] == 0)
    labels = np.where(policy_token, input_ids, IGNORE_INDEX)

    collator = PackingCollator(extra_token_keys=tuple(fields), pad_to_multiple_of=pad_to_multiple_of)
    starts = sample_start[plan.example_index] + plan.start
    stops = sample_start[plan.example_index] + plan.stop
    offsets = plan.pack_offsets.tolist()
    batches = []
    for first, last in itertools.pairwise(offsets):
        features = [{"input_ids": input_ids[a:b], "labels": labels[a:b], **{k: v[a:b] for k, v in fields.items()}}
                    for a, b in zip(starts[first:last].tolist(), stops[first:last].tolist())]
        batch = collator(features)
        if batch.get("num_pad_tokens"):
            batch["sample_index"][:, -batch["num_pad_tokens"]:] = -1
        batches.append(batch)
    return batches


def _ranges(lengths: np.ndarray) -> np.ndarray:
    """``concat(arange(n) for n in lengths)`` without a Python loop."""
    starts = np.repeat(np.cumsum(lengths) - lengths, lengths)
    return np.arange(int(lengths.sum()), dtype=np.int64) - starts
