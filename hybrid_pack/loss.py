"""Next-token cross-entropy on packed batches, equal to the loss on the unpacked documents.

A packed row ``[1, T]`` holds several documents back to back. Labels are given unshifted: the
token at position ``t`` is predicted from the logits at ``t - 1``. :class:`~hybrid_pack.PackingCollator`
sets the first label of every document to ``-100``, so no document's last logit learns to predict
the next document's first token; when ``boundaries`` are passed the loss also ignores those targets
itself, so labels built by hand are safe too.

Everything stays on the device: token counts and per-document sums are tensors, never Python
numbers, so nothing here waits for the GPU. Logits are upcast to float32 before the softmax, so
bf16 / fp16 logits accumulate in fp32.
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F

from hybrid_pack.boundaries import PackedBoundaries
from hybrid_pack.boundaries.sharded import ShardedBoundaries, require_row_count
from hybrid_pack.boundaries.targets import shift_labels
from hybrid_pack.errors import InputError
from hybrid_pack.schema import IGNORE_INDEX

__all__ = ["packed_loss", "shift_labels", "token_logprobs"]

Reduction = Literal["token", "sequence"]


def _check_shapes(logits: torch.Tensor, labels: torch.Tensor, boundaries: PackedBoundaries | None) -> None:
    if logits.dim() != 3:
        raise InputError(f"logits: expected shape [B, T, V] (a packed batch is [1, T, V]); "
                         f"got shape {list(logits.shape)}")
    if tuple(labels.shape) != tuple(logits.shape[:2]):
        raise InputError(f"labels: expected shape {list(logits.shape[:2])} (the logits' [B, T]); "
                         f"got shape {list(labels.shape)}")
    if labels.dtype.is_floating_point or labels.dtype == torch.bool:
        raise InputError(f"labels: expected an integer tensor (token ids, -100 ignored); got {labels.dtype}")
    if boundaries is not None:
        if logits.shape[0] != 1:
            raise InputError(f"logits: boundaries describe one packed row, so the batch must be 1; "
                             f"got shape {list(logits.shape)}")
        here = boundaries.local if isinstance(boundaries, ShardedBoundaries) else boundaries
        if here.total_tokens != logits.shape[1]:
            raise InputError(f"boundaries: expected {logits.shape[1]} tokens (the logits' T); got {here.total_tokens}")


def token_logprobs(logits: torch.Tensor, labels: torch.Tensor, *, boundaries: PackedBoundaries | None = None,
                   shifted: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probability of every labelled token under the logits of the position before it, in float32.

    Args:
        logits: ``[B, T, V]`` (a packed batch is ``[1, T, V]``), any float dtype.
        labels: int ``[B, T]``, unshifted, ``-100`` where no loss is taken.
        boundaries: the row's boundaries; when given, the first token of every document is never a
            target (it would be predicted from the previous document).
        shifted: ``labels`` are already shifted (:func:`shift_labels`, what a context-parallel shard
            carries as ``shift_labels``): ``labels[:, t]`` is the target of ``logits[:, t]``.

    Returns:
        ``(logprobs, mask)``, both ``[B, T]`` and aligned with the tokens: ``logprobs[:, t]`` is
        ``log p(labels[:, t] | tokens < t)`` (float32, or float64 for float64 logits; 0 where there
        is no target) and ``mask`` (bool)
        marks the positions that are targets. Position 0 is never a target. With ``shifted`` they are
        aligned with the logits instead: ``logprobs[:, t]`` is ``log p(labels[:, t] | tokens <= t)``.
    """
    _check_shapes(logits, labels, boundaries)
    if isinstance(boundaries, ShardedBoundaries) and not shifted:
        raise InputError("labels: a context-parallel shard's last target is the next rank's first label; pass the "
                         "shard's shift_labels from shard_batch with shifted=True (the model takes shift_labels=)")
    targets = labels if shifted else shift_labels(labels, boundaries)[:, :-1]
    logits = (logits if shifted else logits[:, :-1]).to(torch.promote_types(logits.dtype, torch.float32))
    nll = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=IGNORE_INDEX, reduction="none")
    logprobs, mask = -nll.view_as(targets), targets != IGNORE_INDEX
    return (logprobs, mask) if shifted else (F.pad(logprobs, (1, 0)), F.pad(mask, (1, 0)))


def packed_loss(logits: torch.Tensor, labels: torch.Tensor, *, boundaries: PackedBoundaries | None = None,
                reduction: Reduction = "token",
                num_items_in_batch: int | torch.Tensor | None = None, shifted: bool = False) -> torch.Tensor:
    """Next-token cross-entropy of a packed batch, equal to the same loss on the unpacked documents.

    Args:
        logits: ``[1, T, V]`` (any ``[B, T, V]`` for ``reduction="token"``), any float dtype.
        labels: int ``[1, T]``, unshifted (the shift happens here), ``-100`` ignored.
        boundaries: the row's :class:`~hybrid_pack.PackedBoundaries`; required for
            ``reduction="sequence"``. When given, targets at document starts are ignored.
        reduction: ``"token"``: the summed token losses over the number of target tokens (the
            mean a padded batch of the unpacked documents gives). ``"sequence"``: the mean over
            documents of each document's mean token loss; documents without any target (all labels
            -100, or a single token, and the padding segment) are left out of the mean.
        num_items_in_batch: for gradient accumulation, divide by this instead of the local count.
            It counts target tokens for ``"token"`` and documents with at least one target for
            ``"sequence"``, over all micro-batches of the optimizer step (and all ranks if the
            gradients are summed rather than averaged). An int below 1 raises; a tensor is not read on
            the host (SPEC §9b), so one below 1 divides by 1 (a step without targets counts 0: loss 0).
        shifted: ``labels`` are already shifted (:func:`shift_labels`; a context-parallel shard's
            ``shift_labels``, whose ``num_items_in_batch`` counts the whole row's targets, so that the
            shards' losses sum to the row's).

    Returns:
        A float32 scalar (float64 for float64 logits). With no target at all it is 0 (with a zero
        gradient).
    """
    if reduction not in ("token", "sequence"):
        raise InputError(f"reduction: expected 'token' or 'sequence'; got {reduction!r}")
    if reduction == "sequence" and boundaries is None:
        raise InputError("boundaries: reduction='sequence' needs the row's document boundaries "
                         "(pass boundaries=PackedBoundaries.from_batch(batch))")
    if reduction == "sequence" and isinstance(boundaries, ShardedBoundaries):
        raise InputError("reduction: 'sequence' needs whole documents, and these boundaries are one rank's shard "
                         "of a context-parallel row; use reduction='token'")
    logprobs, mask = token_logprobs(logits, labels, boundaries=boundaries, shifted=shifted)
    require_row_count(boundaries, num_items_in_batch)
    if reduction == "token":
        total = -logprobs.sum()
        count = mask.sum() if num_items_in_batch is None else num_items_in_batch
    else:
        doc = boundaries.seq_idx.to(device=logprobs.device, dtype=torch.long).flatten()
        doc_sum = logprobs.new_zeros(boundaries.num_segments).index_add_(0, doc, -logprobs.flatten())
        doc_count = logprobs.new_zeros(boundaries.num_segments).index_add_(0, doc, mask.flatten().to(logprobs.dtype))
        total = (doc_sum / doc_count.clamp(min=1)).sum()
        count = (doc_count > 0).sum() if num_items_in_batch is None else num_items_in_batch
    if isinstance(count, torch.Tensor):
        return total / count.to(device=total.device, dtype=total.dtype).clamp(min=1)
    if count < 1:
        raise InputError(f"num_items_in_batch: expected a positive count; got {count}")
    return total / count
