"""TRL's ``DPOTrainer`` scoring chosen and rejected sequences on packed rows: :class:`PackedDPOTrainer`.

TRL 1.16's ``DPOTrainer`` pads (its ``padding_free`` is disabled), and scores a batch by one call of the
model with its fused LM head: ``model(input_ids [2B, T], attention_mask, labels, fused_lm_head=True)``
returns per-token ``log_probs [2B, T - 1]`` (0 where the next label is -100), which TRL sums per sequence.
:class:`PackedFusedCalls` is a pair of forward hooks on the policy and the reference model: the pre-hook lays
the real tokens of every row (prompt + chosen, prompt + rejected: the prompt is repeated, as TRL does) end
to end in one packed row with its boundary keys, and the post-hook puts each per-token field back in TRL's
padded layout. The rows' real lengths come with the batch from the trainer's collator (TRL's, wrapped: it reads its
own host-side mask), so a call reads no device tensor. TRL's own code does the rest (its loss, rewards, margins,
metrics), unchanged. With
``batch_invariant=True`` the row is a static row of ``packing_capacity`` tokens and every step runs inside
:func:`hybrid_pack.batch_invariant` (docs/rl.md, "On-policy numerics").
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import torch

from hybrid_pack.boundaries import PackedBoundaries
from hybrid_pack.errors import InputError, MissingExtraError
from hybrid_pack.integrations.transformers import patch_model
from hybrid_pack.integrations.transformers.trainer import (
    BatchInvariantSteps,
    ResumesRenamedWeights,
    SettlesBackendsAfterFirstStep,
    check_batch_invariant,
    refuse_neftune,
)
from hybrid_pack.integrations.trl_grpo import refuse_untested_trl
from hybrid_pack.schema import ATTENTION_MASK, HOST_BOUNDARIES, IGNORE_INDEX, INPUT_IDS, LABELS, NUM_PAD_TOKENS

try:
    import accelerate  # noqa: F401  (imported first: trl's lazy imports would wrap a missing one in a RuntimeError)
    from trl import DPOTrainer
except ImportError as err:
    raise MissingExtraError("PackedDPOTrainer", "trl", err) from err

__all__ = ["PackedDPOTrainer", "PackedFusedCalls"]

FUSED_LM_HEAD = "fused_lm_head"
_PER_TOKEN = ("log_probs", "entropy", "log_sum_sq_probs", "mean_logits", "is_top1")


ROW_LENGTHS = "hybrid_pack_row_lengths"
"""The batch entry :class:`PackedDPOTrainer`'s collator adds: the rows' real token counts (:class:`RowLengths`)."""


@dataclasses.dataclass(frozen=True)
class RowLengths:
    """Each row's real token count, taken by the collator from its host-side ``attention_mask``: an object (not a
    tensor, not a sequence) that HF ``Trainer`` and accelerate hand to the model untouched (docs/api.md §9b)."""

    lengths: tuple[int, ...]


class _CollatorWithLengths:
    """TRL's preference collator, adding :data:`ROW_LENGTHS` to each batch (read on the host, where it pads)."""

    def __init__(self, collator: Any) -> None:
        self.collator = collator

    def __call__(self, examples: list[dict[str, Any]]) -> dict[str, Any]:
        batch = self.collator(examples)
        mask = batch.get(ATTENTION_MASK)
        if isinstance(mask, torch.Tensor) and mask.device.type == "cpu" and mask.dim() == 2:
            batch[ROW_LENGTHS] = RowLengths(tuple(_right_padded_lengths(mask)))
        return batch


def _right_padded_lengths(mask: torch.Tensor) -> list[int]:
    """Each row's real tokens, in one copy to the host (the collator's host mask, or the fallback read of a call
    whose batch carries no :data:`ROW_LENGTHS`); a row with a real token after padding (not TRL's right padding)
    raises."""
    keep = mask.bool()
    lengths = keep.sum(1)
    misplaced = (keep != (torch.arange(keep.shape[1], device=keep.device) < lengths[:, None])).any(1)
    lengths, misplaced = torch.stack([lengths, misplaced.long()]).tolist()
    if any(misplaced):
        raise InputError(f"{ATTENTION_MASK}: expected right padding (TRL's DPO collator pads right); row "
                         f"{misplaced.index(1)} has a real token after padding")
    return lengths


class PackedFusedCalls:
    """Forward hooks packing the right-padded calls of a model with TRL's fused LM head into one row.

    A call ``model(input_ids [N, T], attention_mask [N, T], labels [N, T], fused_lm_head=True, ...)`` runs as
    ``model(input_ids [1, R], labels [1, R], <boundary keys>, fused_lm_head=True, ...)`` over its ``R`` real
    tokens; the output's per-token fields ``[1, R - 1]`` come back as ``[N, T - 1]``, 0 wherever TRL's are 0
    (the label of a padding token, or of a sequence's first token). Any other call is left alone. With
    ``pack_length``, the row is padded to exactly ``pack_length`` tokens (one trailing padding segment, its labels
    -100); a call with more real tokens raises.
    """

    def __init__(self, model: torch.nn.Module, pack_length: int | None = None) -> None:
        self._layout: tuple[list[int], int] | None = None   # the packed call's sequence lengths and padded width
        self.pack_length = pack_length
        self.handles = [model.register_forward_pre_hook(self.before, with_kwargs=True),
                        model.register_forward_hook(self.after, with_kwargs=True, always_call=True)]

    def before(self, module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        known = kwargs.pop(ROW_LENGTHS, None)   # never reaches the model
        mask, ids = kwargs.get(ATTENTION_MASK), kwargs.get(INPUT_IDS)
        if args or not kwargs.get(FUSED_LM_HEAD) or mask is None or ids is None or ids.dim() != 2:
            return args, kwargs
        if isinstance(known, RowLengths) and len(known.lengths) == ids.shape[0] \
                and max(known.lengths, default=0) <= ids.shape[1]:
            lengths = list(known.lengths)
        else:
            lengths = _right_padded_lengths(mask)   # the call's one read (docs/api.md §9b)
        real = sum(lengths)
        pad = 0 if self.pack_length is None else self.pack_length - real
        if pad < 0:
            raise InputError(f"packing_capacity: the call has {real} real tokens, more than packing_capacity="
                             f"{self.pack_length} (the static row of batch_invariant); raise it to at least "
                             "2 * per_device_train_batch_size * max_length")
        boundaries = PackedBoundaries.from_document_lengths([n for n in lengths if n], num_pad_tokens=pad,
                                                            device=ids.device)
        width = ids.shape[1]
        index = torch.cat([torch.arange(b * width, b * width + n) for b, n in enumerate(lengths)]).to(ids.device)
        first = torch.tensor(boundaries.starts[:boundaries.num_docs], device=ids.device)
        labels = torch.cat([kwargs[LABELS].reshape(-1)[index], kwargs[LABELS].new_full((pad,), IGNORE_INDEX)])[None]
        labels[0, first] = IGNORE_INDEX   # a sequence's first token is never a target
        self._layout = (lengths, width)
        rest = {key: value for key, value in kwargs.items() if key not in (INPUT_IDS, ATTENTION_MASK, LABELS)}
        row = torch.cat([ids.reshape(-1)[index], ids.new_zeros(pad)])[None]
        return (), {**rest, INPUT_IDS: row, LABELS: labels, **boundaries.hf_kwargs(),
                    HOST_BOUNDARIES: boundaries.host(), **({NUM_PAD_TOKENS: pad} if pad else {})}

    def after(self, module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> Any:
        layout, self._layout = self._layout, None
        if layout is None or output is None:
            return None
        lengths, width = layout
        # TRL's [N, T - 1] field at (b, j) scores token j + 1 of sequence b: the packed [1, R - 1] field at the
        # sequence's start + j, for every j < length - 1 (a real token followed by a real one); 0 elsewhere.
        starts = np.cumsum([0, *lengths[:-1]])
        source = torch.cat([torch.arange(start, start + n - 1) for start, n in zip(starts.tolist(), lengths) if n])
        target = torch.cat([torch.arange(b * (width - 1), b * (width - 1) + n - 1)
                            for b, n in enumerate(lengths) if n])
        fields = {}
        for name in _PER_TOKEN:
            packed = getattr(output, name, None)
            if packed is not None:
                padded = packed.new_zeros(len(lengths) * (width - 1))
                padded[target.to(packed.device)] = packed[0, source.to(packed.device)]
                fields[name] = padded.view(len(lengths), width - 1)
        return dataclasses.replace(output, **fields)

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


class PackedDPOTrainer(SettlesBackendsAfterFirstStep, BatchInvariantSteps, ResumesRenamedWeights, DPOTrainer):
    """``trl.DPOTrainer`` whose policy and reference forwards run on packed rows.

    Takes every argument of ``trl.DPOTrainer``. The policy and the reference model are patched
    (:func:`~hybrid_pack.integrations.transformers.patch_model`) and every fused log-probability call TRL makes
    on them (the loss, the reference log-probabilities, evaluation) runs on one packed row of the batch's real
    tokens (:class:`PackedFusedCalls`): per-sequence log-probability sums, loss, rewards and updated parameters
    are TRL's padded step's. Not packed: reference log-probabilities precomputed in TRL's constructor
    (``precompute_ref_log_probs=True``) and the reference pass of a PEFT policy without ``ref_model`` (padded,
    still isolated: docs/rl.md). A router's auxiliary loss (``output_router_logits``) is computed over the same real
    tokens: TRL masks the padding out of it, the packed row has none.

    Args:
        batch_invariant: every call's row a static row of exactly ``packing_capacity`` tokens and every training and
            evaluation step inside :func:`hybrid_pack.batch_invariant`: a pair's log-probabilities bitwise the same
            whatever the other pairs of its batch (docs/rl.md, "On-policy numerics"). Refused without
            ``packing_capacity``, with what the mode does not cover (torch_compile, context parallelism, gradient
            checkpointing off the CPU) and with a router's auxiliary loss (it would count the row's padding).
        packing_capacity: the static row's length, with ``batch_invariant`` only.
        *args, **kwargs: as for ``trl.DPOTrainer``.
    """

    def __init__(self, *args: Any, batch_invariant: bool = False, packing_capacity: int | None = None,
                 **kwargs: Any) -> None:
        refuse_untested_trl("PackedDPOTrainer", "DPOTrainer's fused LM head call")
        if packing_capacity is not None and (isinstance(packing_capacity, bool) or not isinstance(packing_capacity, int)
                                             or packing_capacity < 2 or not batch_invariant):
            raise InputError(f"packing_capacity: PackedDPOTrainer packs each call into one row of its real tokens; "
                             f"packing_capacity (an int >= 2) is that row's fixed length under batch_invariant=True "
                             f"only; got {packing_capacity!r} with batch_invariant={batch_invariant!r}")
        super().__init__(*args, **kwargs)
        if batch_invariant is True and getattr(self, "aux_loss_enabled", False):
            raise InputError("batch_invariant: not with a router's auxiliary loss: it would count the padding of the "
                             "static row; set DPOConfig(router_aux_loss_coef=0.0)")
        refuse_neftune("PackedDPOTrainer", self.args)
        self.batch_invariant = check_batch_invariant("PackedDPOTrainer", batch_invariant, self.args,
                                                     capacity=packing_capacity, capacity_name="packing_capacity",
                                                     models=(self.model, None if self.ref_model is None else
                                                             self.accelerator.unwrap_model(self.ref_model)))
        self.data_collator = _CollatorWithLengths(self.data_collator)
        self.packed_calls = []
        for model in (self.model, self.ref_model):
            if model is not None:
                patch_model(model)
                self.packed_calls.append(PackedFusedCalls(model, packing_capacity if self.batch_invariant else None))

