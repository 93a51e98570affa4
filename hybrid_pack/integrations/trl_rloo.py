"""TRL's ``RLOOTrainer`` with every log-probability forward on packed rows: :class:`PackedRLOOTrainer`.

TRL 1.16's ``RLOOTrainer`` scores completions with the same ``_get_per_token_logps_and_entropies`` as its
``GRPOTrainer`` (same parameters, same padded batch, same fused LM head), so the packed override of
:class:`~hybrid_pack.integrations.trl_grpo.PackedLogProbs` serves it unchanged::

    trainer = PackedRLOOTrainer(model=model, reward_funcs=reward, args=RLOOConfig(...),
                                train_dataset=dataset)                  # was RLOOTrainer(...)
"""

from __future__ import annotations

from hybrid_pack.errors import MissingExtraError
from hybrid_pack.integrations.transformers.trainer import (
    BatchInvariantSteps,
    ResumesRenamedWeights,
    SettlesBackendsAfterFirstStep,
)
from hybrid_pack.integrations.trl_grpo import PackedLogProbs

try:
    import accelerate  # noqa: F401  (imported first: trl's lazy imports would wrap a missing one in a RuntimeError)
    from trl import RLOOTrainer
except ImportError as err:
    raise MissingExtraError("PackedRLOOTrainer", "trl", err) from err

__all__ = ["PackedRLOOTrainer"]


class PackedRLOOTrainer(PackedLogProbs, SettlesBackendsAfterFirstStep, BatchInvariantSteps, ResumesRenamedWeights,
                        RLOOTrainer):
    """``trl.RLOOTrainer`` computing every per-token log-probability on packed rows.

    Takes every argument of ``RLOOTrainer`` (and its ``RLOOConfig``), plus ``packing_capacity``, ``batch_invariant``
    and ``max_documents`` as for
    :class:`~hybrid_pack.integrations.trl.PackedGRPOTrainer`, which it equals in everything but TRL's trainer:
    the old policy's, the reference model's and the policy's log-probabilities on packed rows, results in TRL's
    ``[B, C]`` layout, as many forwards on every rank.

    Raises:
        InputError: a TRL release other than :data:`~hybrid_pack.integrations.trl.TESTED_TRL`, a bad
            ``packing_capacity`` or ``max_documents``, ``batch_invariant`` without ``packing_capacity`` or with what
            the mode does not cover; during training, multimodal inputs or a sequence longer than ``packing_capacity``.
    """

    trl_trainer = RLOOTrainer
