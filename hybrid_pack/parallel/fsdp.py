"""FSDP2 for a packed hybrid LM: ``fully_shard`` every decoder block, then the root (docs/distributed.md).

Each decoder block is its own FSDP unit (its parameters are all-gathered just before it runs and freed
after), and the root holds what is left (embeddings, final norm, LM head, tied or not). The packed batch
is untouched: every rank feeds its own packed row with its own boundaries.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from hybrid_pack.errors import InputError, UnsupportedModelError

__all__ = ["apply_fsdp", "decoder_block_slots", "decoder_blocks", "mixed_precision"]

_BLOCK_LISTS = ("layers", "h", "blocks")
_WRAPPED = ("_checkpoint_wrapped_module", "_orig_mod")
"""Where a wrapper keeps the module it wraps: torch's checkpoint wrapper, ``torch.compile``'s module."""


def decoder_block_slots(model: nn.Module) -> list[tuple[nn.Module, str]]:
    """Where each decoder block of ``model`` sits: ``(parent, name)`` with ``parent.get_submodule(name)`` the block,
    or the wrapper (activation checkpointing, compile) that took its place.

    The blocks are the modules a Hugging Face model names in ``_no_split_modules``, else the entries of its
    ``layers`` (``h``, ``blocks``) module lists.

    Raises:
        UnsupportedModelError: no decoder blocks found.
    """
    names = set(getattr(model, "_no_split_modules", None) or ())
    slots: list[tuple[nn.Module, str]] = []

    def visit(parent: nn.Module) -> None:
        for name, child in parent.named_children():
            if type(_unwrapped(child)).__name__ in names:
                slots.append((parent, name))
            else:
                visit(child)

    if names:
        visit(model)
    if not slots:
        slots = [(m, index) for name, m in model.named_modules() if isinstance(m, nn.ModuleList)
                 and name.rsplit(".", 1)[-1] in _BLOCK_LISTS for index, _ in m.named_children()]
    if not slots:
        raise UnsupportedModelError(f"model: found no decoder blocks in {type(model).__name__} (no "
                                    "_no_split_modules, no 'layers' module list); shard or wrap its blocks by hand")
    return slots


def decoder_blocks(model: nn.Module) -> list[nn.Module]:
    """The decoder blocks of ``model`` (:func:`decoder_block_slots`), each as it sits there now (wrapped or not)."""
    return [parent.get_submodule(name) for parent, name in decoder_block_slots(model)]


def _unwrapped(module: nn.Module) -> nn.Module:
    while (inner := next((getattr(module, a) for a in _WRAPPED if hasattr(module, a)), None)) is not None:
        module = inner
    return module


def mixed_precision(device: torch.device) -> MixedPrecisionPolicy | None:
    """bf16 parameters and compute with float32 gradient reduction where the device has bf16 (CUDA), else None:
    on CPU the run stays in float32."""
    if device.type == "cuda" and torch.cuda.is_bf16_supported():
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    return None


def apply_fsdp(model: nn.Module, mesh: DeviceMesh, *, mp_policy: MixedPrecisionPolicy | None = None,
               reshard_after_forward: bool = True) -> nn.Module:
    """Shard ``model`` in place with FSDP2 over ``mesh`` (1-D) and return it: every decoder block (as it sits,
    wrapped or not), then the root.

    Args:
        model: a causal LM with decoder blocks (:func:`decoder_blocks`); its parameters on ``mesh``'s device type.
        mesh: the ranks that share the parameters, 1-D (a 2-D mesh would give HSDP: flatten a ``("dp", "cp")``
            mesh first, :func:`hybrid_pack.parallel.mesh.flattened`).
        mp_policy: FSDP2 mixed precision (:func:`mixed_precision` gives the run's); None keeps the parameters'
            dtype.
        reshard_after_forward: free each block's gathered parameters after its forward (ZeRO-3); False keeps them
            until the backward (ZeRO-2, more memory, fewer all-gathers).

    Raises:
        InputError: a mesh of more than one dimension.
    """
    if mesh.ndim != 1:
        raise InputError(f"mesh: expected a 1-D mesh of the ranks that share the parameters; got {mesh.ndim}-D "
                         f"{mesh.mesh_dim_names} (fully_shard would replicate over the first dimension: HSDP); "
                         "pass hybrid_pack.parallel.mesh.flattened(mesh)")
    options = {"mesh": mesh, "reshard_after_forward": reshard_after_forward}
    if mp_policy is not None:
        options["mp_policy"] = mp_policy
    for block in decoder_blocks(model):
        fully_shard(block, **options)
    fully_shard(model, **options)
    return model
