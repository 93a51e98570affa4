"""Compiling a packed hybrid LM block by block, under FSDP2 and context parallelism (docs/compile.md).

torchtitan's regional compile: every decoder block is compiled in place (``block.compile()``) and the model around
the blocks stays eager, so FSDP2's hooks (registered after this, on the blocks and the root) run outside the graphs.
The graphs compiled for the first batch serve every layout because of what reaches the blocks:

- a static batch (``PackingCollator(pack_length=L, max_documents=M)``): a forward pre-hook on the model turns its
  boundary keys into ``boundaries=StaticBoundaries`` (their tensors, nothing read from them), the form a whole
  compiled model builds inside its graph;
- a context-parallel shard (``boundaries=ShardedBoundaries``, host values that change with every layout): every
  public op called on it inside a graph runs eagerly (:func:`~hybrid_pack.ops.cp.eager.run_eagerly`: a graph
  break at the op), so the graphs hold the blocks' dense work and read only the shard's local token count and
  device, never a segment.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn

from hybrid_pack.boundaries.static import StaticBoundaries
from hybrid_pack.parallel.fsdp import decoder_blocks
from hybrid_pack.schema import BOUNDARIES, BOUNDARY_KEYS, HOST_BOUNDARIES, PRIMARY_BOUNDARY_KEYS

__all__ = ["compile_blocks", "static_boundaries_from_keys"]

def compile_blocks(model: nn.Module, *, backend: str | Callable[..., Any] = "inductor") -> nn.Module:
    """Compile every decoder block of ``model`` in place and return ``model`` (the root stays eager).

    Call it after activation checkpointing and before FSDP2 (torchtitan's order: the checkpointed blocks are
    compiled, FSDP2's hooks wrap the compiled blocks). The model is called as before, with static batches
    (docs/compile.md) or with a shard's ``boundaries=`` (docs/parallel.md). Idempotent.

    Args:
        model: a native preset (:class:`~hybrid_pack.modeling.HybridForCausalLM`) or any causal LM whose forward
            takes ``boundaries=``, with decoder blocks (:func:`~hybrid_pack.parallel.fsdp.decoder_blocks`).
        backend: ``torch.compile``'s backend.

    Raises:
        UnsupportedModelError: ``model`` has no decoder blocks.
    """
    for block in decoder_blocks(model):
        if block._compiled_call_impl is None:
            block.compile(backend=backend)
    if not getattr(model, "_hybrid_pack_static_boundaries", False):
        model.register_forward_pre_hook(static_boundaries_from_keys, with_kwargs=True)
        model._hybrid_pack_static_boundaries = True
    return model


def static_boundaries_from_keys(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
                                ) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """A forward pre-hook: a call with the collator's boundary keys and no ``boundaries`` gets
    ``boundaries=StaticBoundaries`` of its ``cu_seq_lens_q``, ``seq_idx`` and ``position_ids`` instead of the keys
    (no value is read, so the compiled blocks see only tensors of the batch's static shapes)."""
    if kwargs.get(BOUNDARIES) is not None or any(kwargs.get(key) is None for key in PRIMARY_BOUNDARY_KEYS):
        return args, kwargs
    boundaries = StaticBoundaries.from_batch(kwargs)
    kept = {key: value for key, value in kwargs.items() if key not in (*BOUNDARY_KEYS, HOST_BOUNDARIES)}
    return args, {**kept, BOUNDARIES: boundaries}
