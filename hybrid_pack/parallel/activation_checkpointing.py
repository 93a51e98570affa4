"""Activation checkpointing of a packed hybrid LM: every decoder block recomputes its forward in the backward.

A model with its own mechanism is checkpointed by it, ``activation_checkpointing_enable`` (transformers 5;
``gradient_checkpointing_enable`` before it): a Hugging Face model's decoder layers each call
``torch.utils.checkpoint`` on their own ``__call__``; the native presets put each decoder layer in torch's checkpoint
wrapper (:mod:`hybrid_pack.modeling.checkpointing`). Any other model gets every decoder block
(:func:`hybrid_pack.parallel.fsdp.decoder_blocks`) replaced in its parent by that wrapper; state dict keys stay the
unwrapped model's (the wrapper strips its prefix). Either way the checkpoint is non-reentrant: the
forward keeps only the block's inputs, and the backward runs the block again as a module (with the same keywords,
``boundaries`` included, its hooks, and the same random state) before differentiating it.

Under context parallelism the recompute repeats the block's exchanges on every rank, in the same order: it runs
the whole block (``early_stop=False``), never stopping once it has what the backward needs, which could leave a
rank out of an exchange another rank's recompute makes.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl, checkpoint_wrapper

from hybrid_pack.modeling.checkpointing import CHECKPOINT_OPTIONS
from hybrid_pack.parallel.fsdp import decoder_block_slots

__all__ = ["CHECKPOINT_OPTIONS", "apply_activation_checkpointing", "is_checkpointed"]


def apply_activation_checkpointing(model: nn.Module) -> nn.Module:
    """Checkpoint every decoder block of ``model`` in place; return ``model``. Idempotent.

    Raises:
        UnsupportedModelError: ``model`` has no decoder blocks to wrap (and is not a Hugging Face model supporting
            activation checkpointing).
    """
    if getattr(model, "supports_gradient_checkpointing", False):
        enable = getattr(model, "activation_checkpointing_enable", None)
        if enable is not None:
            enable(activation_checkpointing_kwargs=dict(CHECKPOINT_OPTIONS))
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=dict(CHECKPOINT_OPTIONS))
        return model
    for parent, name in decoder_block_slots(model):
        block = parent.get_submodule(name)
        if not is_checkpointed(block):
            parent.register_module(name, checkpoint_wrapper(block, checkpoint_impl=CheckpointImpl.NO_REENTRANT,
                                                            early_stop=CHECKPOINT_OPTIONS["early_stop"]))
    return model


def is_checkpointed(module: nn.Module) -> bool:
    """Whether ``module`` is a Hugging Face model with activation checkpointing on, or a block wrapped by
    :func:`apply_activation_checkpointing`."""
    for flag in ("is_activation_checkpointing", "is_gradient_checkpointing"):  # transformers 5, then 4
        if hasattr(type(module), flag):
            return bool(getattr(module, flag))
    return hasattr(module, "_checkpoint_wrapped_module")
