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
import warnings
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from hybrid_pack.collate import PackingCollator
from hybrid_pack.errors import InputError
from hybrid_pack.packing.plan import PackPlan, plan_packs
from hybrid_pack.schema import (
    ADVANTAGES,
    CU_SEQ_LENS_Q,
    IGNORE_INDEX,
    INPUT_IDS,
    LABELS,
    NUM_PAD_TOKENS,
    OLD_LOGPROBS,
    RESPONSE_MASK,
    ROLLOUT_TOKEN_KEYS,
    SAMPLE_INDEX,
    TOOL_MASK,
)

__all__ = ["ROLLOUT_TOKEN_KEYS", "pack_rollouts", "unpack_rollouts", "tool_masks_from_trl"]

TokenIds = Sequence[int] | np.ndarray | torch.Tensor

_OVERFLOW_POLICIES = ("error", "truncate", "drop")
"""The ``overflow`` policies of :func:`pack_rollouts` (not ``"split"``: a piece without its prompt is no rollout)."""


def _flat(field: str, values: Sequence[Any], lengths: np.ndarray, dtype: type) -> np.ndarray:
    """One array of ``sum(lengths)`` entries from per-sample sequences, each checked against its length."""
    if len(values) != lengths.shape[0]:
        raise InputError(f"{field}: expected one entry per sample ({lengths.shape[0]}); got {len(values)}")
    arrays = [np.asarray(v.detach().cpu() if isinstance(v, torch.Tensor) else v) for v in values]
    for i, (array, n) in enumerate(zip(arrays, lengths.tolist(), strict=True)):
        if array.ndim != 1 or array.shape[0] != n:
            expected = f"{n} values" if array.ndim == 1 else "values"
            raise InputError(f"{field}[{i}]: expected a flat sequence of {expected} (one per token); "
                             f"got shape {list(array.shape)}")
        if dtype is np.int64 and array.size and array.dtype.kind not in "iub":  # a float id or mask: never rounded
            raise InputError(f"{field}[{i}]: expected integers; got dtype {array.dtype} (cast it first, e.g. "
                             f"[int(t) for t in ...])")
    return np.concatenate(arrays).astype(dtype, copy=False) if arrays else np.zeros(0, dtype)


def _token_lengths(sequences: Sequence[TokenIds]) -> np.ndarray:
    """int64 ``[N]``, the length of each sequence."""
    return np.fromiter((len(s) for s in sequences), dtype=np.int64, count=len(sequences))


def _ranges(lengths: np.ndarray) -> np.ndarray:
    """``concat(arange(n) for n in lengths)`` without a Python loop."""
    starts = np.repeat(np.cumsum(lengths) - lengths, lengths)
    return np.arange(int(lengths.sum()), dtype=np.int64) - starts


def _check_rollouts(prompts: Sequence[TokenIds], responses: Sequence[TokenIds],
                    overflow: str) -> tuple[np.ndarray, np.ndarray]:
    """``(prompt_lengths, response_lengths)``, int64 ``[N]``, after checking the samples and ``overflow``."""
    if len(prompts) != len(responses):
        raise InputError(f"responses: expected one response per prompt ({len(prompts)}); got {len(responses)}")
    if overflow not in _OVERFLOW_POLICIES:
        raise InputError(f"overflow: expected 'error', 'truncate' or 'drop' (a rollout piece without its "
                         f"prompt cannot be trained on, so 'split' is not offered); got {overflow!r}")
    prompt_lengths = _token_lengths(prompts)
    response_lengths = _token_lengths(responses)
    empty = np.flatnonzero(response_lengths == 0)
    if empty.size:
        raise InputError(f"responses[{int(empty[0])}]: expected at least one token; got an empty response "
                         f"({empty.size} sample(s) affected)")
    return prompt_lengths, response_lengths


def _sample_starts(lengths: np.ndarray) -> np.ndarray:
    """int64 ``[N+1]``, where each sample starts in the concatenation of all samples (then the total)."""
    starts = np.zeros(lengths.shape[0] + 1, dtype=np.int64)
    np.cumsum(lengths, out=starts[1:])
    return starts


def _response_tokens(sample_start: np.ndarray, prompt_lengths: np.ndarray) -> np.ndarray:
    """bool ``[T]`` over the concatenated samples: True on every response token."""
    is_response = np.ones(int(sample_start[-1]), dtype=bool)
    is_response[np.repeat(sample_start[:-1], prompt_lengths) + _ranges(prompt_lengths)] = False
    return is_response


def _token_ids(prompts: Sequence[TokenIds], responses: Sequence[TokenIds], prompt_lengths: np.ndarray,
               response_lengths: np.ndarray, is_response: np.ndarray) -> np.ndarray:
    """int64 ``[T]``, the token ids of every sample, prompt then response, samples one after another."""
    input_ids = np.empty(is_response.shape[0], dtype=np.int64)
    input_ids[~is_response] = _flat("prompts", prompts, prompt_lengths, np.int64)
    input_ids[is_response] = _flat("responses", responses, response_lengths, np.int64)
    return input_ids


def _tool_mask(tool_masks: Sequence[Sequence[int]], response_lengths: np.ndarray) -> np.ndarray:
    """int64, one 0/1 per response token of every sample (checked)."""
    tool = _flat("tool_masks", tool_masks, response_lengths, np.int64)
    if ((tool != 0) & (tool != 1)).any():
        raise InputError("tool_masks: expected only 0 and 1 (1 where a tool's output was injected; TRL's tool_mask "
                         "is the opposite, 1 on the policy's own tokens: convert it with tool_masks_from_trl)")
    return tool


def _advantages(advantages: Sequence[Any], response_lengths: np.ndarray) -> np.ndarray:
    """Per-response-token advantages from per-sample scalars (broadcast) or per-token sequences."""
    if len(advantages) != response_lengths.shape[0]:
        raise InputError(f"advantages: expected one entry per sample ({response_lengths.shape[0]}); "
                         f"got {len(advantages)}")
    scalar = np.array([np.ndim(a) == 0 for a in advantages])
    if scalar.all():
        return np.repeat(np.asarray(advantages, dtype=np.float32), response_lengths)
    if scalar.any():
        i = int(np.argmax(scalar))
        raise InputError(f"advantages[{i}]: expected the same form for every sample (all scalars or all "
                         f"per-token sequences); got a scalar among sequences")
    return _flat(ADVANTAGES, advantages, response_lengths, np.float32)


def _rollout_fields(is_response: np.ndarray, lengths: np.ndarray, response_lengths: np.ndarray,
                    tool_masks: Sequence[Sequence[int]] | None,
                    advantages: Sequence[float] | Sequence[Sequence[float]] | None,
                    old_logprobs: Sequence[Sequence[float]] | None) -> dict[str, np.ndarray]:
    """The per-token RL fields (:data:`ROLLOUT_TOKEN_KEYS`) over the concatenated samples; 0 where not given."""
    num_tokens = is_response.shape[0]
    fields = {
        RESPONSE_MASK: is_response.astype(np.int64),
        TOOL_MASK: np.zeros(num_tokens, dtype=np.int64),
        SAMPLE_INDEX: np.repeat(np.arange(lengths.shape[0], dtype=np.int64), lengths),
        ADVANTAGES: np.zeros(num_tokens, dtype=np.float32),
        OLD_LOGPROBS: np.zeros(num_tokens, dtype=np.float32),
    }
    if tool_masks is not None:
        fields[TOOL_MASK][is_response] = _tool_mask(tool_masks, response_lengths)
    if advantages is not None:
        fields[ADVANTAGES][is_response] = _advantages(advantages, response_lengths)
    if old_logprobs is not None:
        fields[OLD_LOGPROBS][is_response] = _flat(OLD_LOGPROBS, old_logprobs, response_lengths, np.float32)
    return fields


def _policy_labels(input_ids: np.ndarray, fields: dict[str, np.ndarray]) -> np.ndarray:
    """The token ids on the policy's own tokens (response, not tool output), IGNORE_INDEX elsewhere."""
    policy_token = (fields[RESPONSE_MASK] == 1) & (fields[TOOL_MASK] == 0)
    return np.where(policy_token, input_ids, IGNORE_INDEX)


def _collate_packs(plan: PackPlan, sample_start: np.ndarray, input_ids: np.ndarray, labels: np.ndarray,
                   fields: dict[str, np.ndarray], pad_to_multiple_of: int | None) -> list[dict[str, Any]]:
    """One collator batch per pack of ``plan``, cut from the per-token arrays of the concatenated samples.

    ``sample_index`` is -1 on the padding segment.
    """
    collator = PackingCollator(extra_token_keys=tuple(fields), pad_to_multiple_of=pad_to_multiple_of)
    starts = sample_start[plan.example_index] + plan.start
    stops = sample_start[plan.example_index] + plan.stop
    batches = []
    for first, last in itertools.pairwise(plan.pack_offsets.tolist()):
        features = [{INPUT_IDS: input_ids[a:b], LABELS: labels[a:b], **{k: v[a:b] for k, v in fields.items()}}
                    for a, b in zip(starts[first:last].tolist(), stops[first:last].tolist(), strict=True)]
        batch = collator(features)
        if batch.get(NUM_PAD_TOKENS):
            batch[SAMPLE_INDEX][:, -batch[NUM_PAD_TOKENS]:] = -1
        batches.append(batch)
    return batches


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
        tool_masks: per sample, one 0/1 per response token, 1 where a tool's output was injected (not
            TRL's convention, where ``tool_mask`` is 1 on the tokens the policy wrote:
            :func:`tool_masks_from_trl` converts).
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
        -100 elsewhere, so :func:`~hybrid_pack.packed_loss` on them is the NLL of the policy's tokens.

    Raises:
        InputError: (a ``ValueError``) mismatched or malformed per-sample sequences, an empty
            response, a tool mask other than 0/1, or any :func:`~hybrid_pack.plan_packs` error.
    """
    prompt_lengths, response_lengths = _check_rollouts(prompts, responses, overflow)
    lengths = prompt_lengths + response_lengths
    plan = plan_packs(lengths, capacity, strategy=strategy, overflow=overflow)
    sample_start = _sample_starts(lengths)
    is_response = _response_tokens(sample_start, prompt_lengths)
    input_ids = _token_ids(prompts, responses, prompt_lengths, response_lengths, is_response)
    fields = _rollout_fields(is_response, lengths, response_lengths, tool_masks, advantages, old_logprobs)
    _show_overflow(plan, lengths, prompt_lengths)
    return _collate_packs(plan, sample_start, input_ids, _policy_labels(input_ids, fields), fields,
                          pad_to_multiple_of)


def _show_overflow(plan: PackPlan, lengths: np.ndarray, prompt_lengths: np.ndarray) -> None:
    """Warn with the count and the first samples of the rollouts ``overflow`` dropped or cut (none: silent)."""
    over = np.flatnonzero(lengths > plan.capacity)
    if over.size == 0:
        return
    shown = ", ".join(map(str, over[:8].tolist())) + (", ..." if over.size > 8 else "")
    if plan.overflow == "drop":
        what = "left them out: their indices appear in no sample_index"
    else:
        cut = int((prompt_lengths[over] >= plan.capacity).sum())
        what = "cut their response tails" + (f"; {cut} of them keep no response token (no gradient)" if cut else "")
    warnings.warn(f"pack_rollouts: {over.size} of {len(lengths)} rollouts are longer than capacity={plan.capacity} "
                  f"(samples {shown}); overflow={plan.overflow!r} {what}", stacklevel=3)


def tool_masks_from_trl(tool_mask: torch.Tensor | Sequence[Sequence[int]],
                        completion_lengths: Sequence[int] | None = None) -> list[list[int]]:
    """TRL's ``tool_mask`` (1 on a completion token the policy wrote, 0 on injected tool output) as
    :func:`pack_rollouts`'s ``tool_masks`` (1 on injected tool output), one list per sample.

    Args:
        tool_mask: int ``[B, C]`` (a right-padded completion batch, as TRL keeps it) or one sequence per sample.
        completion_lengths: each sample's real completion length (TRL's ``completion_mask.sum(1)``); needed for
            a padded ``[B, C]`` tensor, whose padding is cut. Default: every entry is real.
    """
    rows = tool_mask.tolist() if isinstance(tool_mask, torch.Tensor) else [list(row) for row in tool_mask]
    if completion_lengths is not None:
        if len(completion_lengths) != len(rows):
            raise InputError(f"completion_lengths: expected one per sample ({len(rows)}); "
                             f"got {len(completion_lengths)}")
        rows = [row[:int(n)] for row, n in zip(rows, completion_lengths, strict=True)]
    for i, row in enumerate(rows):
        if any(value not in (0, 1) for value in row):
            raise InputError(f"tool_mask[{i}]: expected only 0 and 1 (TRL: 1 on the policy's own tokens)")
    return [[1 - value for value in row] for row in rows]


def unpack_rollouts(batch: dict[str, Any], values: torch.Tensor) -> dict[int, torch.Tensor]:
    """Each rollout's response values from per-token ``values`` computed on a :func:`pack_rollouts` batch.

    Args:
        batch: one batch of :func:`pack_rollouts` (its ``sample_index``, ``response_mask``, ``cu_seq_lens_q``).
        values: ``[1, T, ...]`` aligned with the batch's tokens (value ``t`` describes token ``t``, as
            :func:`~hybrid_pack.loss.token_logprobs` returns), any dtype and device.

    Returns:
        ``{sample index: values of its response tokens [R, ...]}`` in the order the rollouts sit in the row (tool
        outputs included: mask them with the batch's ``tool_mask`` if needed); a truncated rollout gives the
        response tokens it kept; the padding segment gives nothing.
    """
    for key in (SAMPLE_INDEX, RESPONSE_MASK):
        if key not in batch:
            raise InputError(f"batch: no {key!r}; expected a batch of hybrid_pack.packing.pack_rollouts")
    tokens = batch[SAMPLE_INDEX].shape[-1]
    if values.dim() < 2 or values.shape[0] != 1 or values.shape[1] != tokens:
        raise InputError(f"values: expected [1, {tokens}, ...] (one value per token of the batch); got "
                         f"{list(values.shape)}")
    cu_seqlens = torch.as_tensor(batch[CU_SEQ_LENS_Q]).cpu()
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).tolist()
    samples = torch.as_tensor(batch[SAMPLE_INDEX])[0].cpu()[cu_seqlens[:-1]].tolist()
    responses = torch.as_tensor(batch[RESPONSE_MASK])[0].cpu().split(lengths)
    out: dict[int, torch.Tensor] = {}
    for sample, piece, response in zip(samples, values[0].split(lengths), responses, strict=True):
        if sample >= 0:
            count = int(response.sum())
            out[int(sample)] = piece[piece.shape[0] - count:]
    return out
