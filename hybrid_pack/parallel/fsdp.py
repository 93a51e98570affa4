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

from hybrid_pack.errors import UnsupportedModelError

__all__ = ["apply_fsdp", "decoder_blocks", "mixed_precision"]

_BLOCK_LISTS = ("layers", "h", "blocks")


def decoder_blocks(model: nn.Module) -> list[nn.Module]:
    """The decoder blocks of ``model``: the modules a Hugging Face model names in ``_no_split_modules``, else
    the entries of its ``layers`` (``h``, ``blocks``) module lists."""
    names = set(getattr(model, "_no_split_modules", None) or ())
    blocks = [m for m in model.modules() if type(m).__name__ in names]
    if not blocks:
        blocks = [block for name, m in model.named_modules() if isinstance(m, nn.ModuleList)
                  and name.rsplit(".", 1)[-1] in _BLOCK_LISTS for block in m]
    if not blocks:
        raise UnsupportedModelError(f"model: found no decoder blocks in {type(model).__name__} to shard (no "
                                    "_no_split_modules, no 'layers' module list); call fully_shard on its blocks")
    return blocks


def mixed_precision(device: torch.device) -> MixedPrecisionPolicy | None:
    """bf16 parameters and compute with float32 gradient reduction where the device has bf16 (CUDA), else None:
    on CPU the run stays in float32."""
    if device.type == "cuda" and torch.cuda.is_bf16_supported():
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    return None


def apply_fsdp(model: nn.Module, mesh: DeviceMesh, *, mp_policy: MixedPrecisionPolicy | None = None,
               reshard_after_forward: bool = True) -> nn.Module:
    """Shard ``model`` in place with FSDP2 over the data-parallel ``mesh`` (1-D) and return it.

    Args:
        model: a causal LM with decoder blocks (:func:`decoder_blocks`); its parameters on ``mesh``'s device type.
        mesh: the ranks that share the parameters.
        mp_policy: FSDP2 mixed precision (:func:`mixed_precision` gives the run's); None keeps the parameters'
            dtype.
        reshard_after_forward: free each block's gathered parameters after its forward (ZeRO-3); False keeps them
            until the backward (ZeRO-2, more memory, fewer all-gathers).
    """
    options = {"mesh": mesh, "reshard_after_forward": reshard_after_forward}
    if mp_policy is not None:
        options["mp_policy"] = mp_policy
    for block in decoder_blocks(model):
        fully_shard(block, **options)
    fully_shard(model, **options)
    return model
