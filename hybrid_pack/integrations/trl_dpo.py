"""TRL's ``DPOTrainer`` scoring chosen and rejected sequences on packed rows: :class:`PackedDPOTrainer`.

TRL 1.16's ``DPOTrainer`` pads (its ``padding_free`` is disabled), and scores a batch by one call of the
model with its fused LM head: ``model(input_ids [2B, T], attention_mask, labels, fused_lm_head=True)``
returns per-token ``log_probs [2B, T - 1]`` (0 where the next label is -100), which TRL sums per sequence.
:class:`PackedFusedCalls` is a pair of forward hooks on the policy and the reference model: the pre-hook lays
the real tokens of every row (prompt + chosen, prompt + rejected: the prompt is repeated, as TRL does) end
to end in one packed row with its boundary keys, and the post-hook puts each per-token field back in TRL's
padded layout. TRL's own code does the rest (its loss, rewards, margins, metrics), unchanged.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from hybrid_pack.boundaries import PackedBoundaries
from hybrid_pack.errors import InputError, MissingExtraError
from hybrid_pack.integrations.transformers import patch_model
from hybrid_pack.integrations.transformers.trainer import SettlesBackendsAfterFirstStep
from hybrid_pack.integrations.trl_grpo import refuse_untested_trl
from hybrid_pack.schema import ATTENTION_MASK, IGNORE_INDEX, INPUT_IDS, LABELS

try:
    import accelerate  # noqa: F401  (imported first: trl's lazy imports would wrap a missing one in a RuntimeError)
    from trl import DPOTrainer
except ImportError as err:
    raise MissingExtraError("PackedDPOTrainer", "trl", err) from err

__all__ = ["PackedDPOTrainer", "PackedFusedCalls"]

FUSED_LM_HEAD = "fused_lm_head"
_PER_TOKEN = ("log_probs", "entropy", "log_sum_sq_probs", "mean_logits", "is_top1")


class PackedFusedCalls:
    """Forward hooks packing the right-padded calls of a model with TRL's fused LM head into one row.

    A call ``model(input_ids [N, T], attention_mask [N, T], labels [N, T], fused_lm_head=True, ...)`` runs as
    ``model(input_ids [1, R], labels [1, R], <boundary keys>, fused_lm_head=True, ...)`` over its ``R`` real
    tokens; the output's per-token fields ``[1, R - 1]`` come back as ``[N, T - 1]``, 0 wherever TRL's are 0
    (the label of a padding token, or of a sequence's first token). Any other call is left alone.
    """

    def __init__(self, model: torch.nn.Module) -> None:
        self._keep: torch.Tensor | None = None
        self.handles = [model.register_forward_pre_hook(self.before, with_kwargs=True),
                        model.register_forward_hook(self.after, with_kwargs=True, always_call=True)]

    def before(self, module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        mask, ids = kwargs.get(ATTENTION_MASK), kwargs.get(INPUT_IDS)
        if args or not kwargs.get(FUSED_LM_HEAD) or mask is None or ids is None or ids.dim() != 2:
            return None
        keep = mask.bool()
        if not (keep[:, 1:] <= keep[:, :-1]).all():
            raise InputError(f"{ATTENTION_MASK}: expected right padding (TRL's DPO collator pads right); a row has a "
                             "real token after padding")
        boundaries = PackedBoundaries.from_lengths(keep.sum(1).tolist(), device=ids.device)
        labels = kwargs[LABELS][keep][None].clone()
        labels[0, boundaries.cu_seqlens[:-1].long()] = IGNORE_INDEX   # a sequence's first token is never a target
        self._keep = keep
        rest = {key: value for key, value in kwargs.items() if key not in (INPUT_IDS, ATTENTION_MASK, LABELS)}
        return (), {**rest, INPUT_IDS: ids[keep][None], LABELS: labels, **boundaries.hf_kwargs()}

    def after(self, module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> Any:
        keep, self._keep = self._keep, None
        if keep is None or output is None:
            return None
        source = (keep.flatten().cumsum(0) - 1).view_as(keep)[:, :-1]   # packed position of each padded token
        pair = keep[:, :-1] & keep[:, 1:]                                # a real token followed by a real one
        fields = {}
        for name in _PER_TOKEN:
            packed = getattr(output, name, None)
            if packed is not None:
                padded = packed.new_zeros(pair.shape)
                padded[pair] = packed[0, source[pair]]
                fields[name] = padded
        return dataclasses.replace(output, **fields)

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


class PackedDPOTrainer(SettlesBackendsAfterFirstStep, DPOTrainer):
    """``trl.DPOTrainer`` whose policy and reference forwards run on packed rows.

    Takes every argument of ``trl.DPOTrainer``. The policy and the reference model are patched
    (:func:`~hybrid_pack.integrations.transformers.patch_model`) and every fused log-probability call TRL makes
    on them (the loss, the reference log-probabilities, evaluation) runs on one packed row of the batch's real
    tokens (:class:`PackedFusedCalls`): per-sequence log-probability sums, loss, rewards and updated parameters
    are TRL's padded step's. Not packed: reference log-probabilities precomputed in TRL's constructor
    (``precompute_ref_log_probs=True``) and the reference pass of a PEFT policy without ``ref_model`` (padded,
    still isolated: docs/rl.md). A router's auxiliary loss (``output_router_logits``) is computed over the same real
    tokens: TRL masks the padding out of it, the packed row has none.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        refuse_untested_trl("PackedDPOTrainer", "DPOTrainer's fused LM head call")
        super().__init__(*args, **kwargs)
        self.packed_calls = []
        for model in (self.model, self.ref_model):
            if model is not None:
                patch_model(model)
                self.packed_calls.append(PackedFusedCalls(model))

