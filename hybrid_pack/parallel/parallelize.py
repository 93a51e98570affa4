"""One entry that applies the scale-out features to a model, in the order they compose (docs/parallel.md).

``parallelize(model, mesh=..., fsdp=..., activation_checkpointing=..., compile=...)`` is a plain function
over the model's decoder blocks, as torchtitan's ``parallelize_*`` functions are: nothing is threaded through
the model code. The order:

1. activation checkpointing: every decoder block wrapped (non-reentrant ``torch.utils.checkpoint``);
2. compile: every (wrapped) block compiled in place, the root eager
   (:func:`~hybrid_pack.parallel.compile.compile_blocks`, torchtitan's regional compile);
3. FSDP2: every block as it now sits, then the root, sharded over all ranks of ``mesh`` flattened: the
   ``("dp", "cp")`` mesh becomes one ``"dp_cp"`` dimension, so each parameter is sharded over the world.

Gradient semantics (what makes the sharded run equal one process): every rank's loss is its share of the
step's loss (its rows' targets, or under context parallelism its shard's, over the step's target count summed
over the world), scaled by the world size; FSDP2's reduce-scatter averages over the world, so each gradient
shard is the sum of the shares' gradients, the one-process step's gradient. DDP averages the same way, so the
training loop is the same with and without FSDP.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy

from hybrid_pack.parallel.activation_checkpointing import apply_activation_checkpointing
from hybrid_pack.parallel.compile import compile_blocks
from hybrid_pack.parallel.fsdp import apply_fsdp
from hybrid_pack.parallel.mesh import flattened, world_mesh

__all__ = ["parallelize"]


def parallelize(model: nn.Module, *, mesh: DeviceMesh | None, fsdp: bool = False,
                activation_checkpointing: bool = False, compile: bool = False,
                mp_policy: MixedPrecisionPolicy | None = None) -> nn.Module:
    """Apply activation checkpointing, per-block compile and FSDP2 to ``model`` in place; return it.

    Args:
        model: a native preset or a patched Hugging Face causal LM (its decoder blocks:
            :func:`~hybrid_pack.parallel.fsdp.decoder_block_slots`), on its device.
        mesh: the run's mesh: the ``("dp", "cp")`` mesh of :func:`~hybrid_pack.parallel.mesh.context_parallel_mesh`,
            a 1-D mesh, or None (FSDP then shards over the whole world).
        fsdp: shard every decoder block and the root with FSDP2 over ``mesh`` flattened.
        activation_checkpointing: recompute every decoder block's forward in the backward.
        compile: compile every decoder block in place (after checkpointing, before sharding; the model is
            called as before, with static batches or a context-parallel shard's ``boundaries``).
        mp_policy: FSDP2's mixed precision (:func:`~hybrid_pack.parallel.fsdp.mixed_precision`); None keeps the
            parameters' dtype.

    Raises:
        UnsupportedModelError: ``model`` has no decoder blocks.
        InputError: ``fsdp`` without a torch.distributed process group.
    """
    if activation_checkpointing:
        apply_activation_checkpointing(model)
    if compile:
        compile_blocks(model)
    if fsdp:
        device_type = next(model.parameters()).device.type
        apply_fsdp(model, world_mesh(device_type) if mesh is None else flattened(mesh), mp_policy=mp_policy)
    return model
