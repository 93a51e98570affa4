"""What every adapter of flash-linear-attention's own context parallelism (``fla.ops.cp``) shares: the
conditions it runs under, and its ``FLACPContext`` for a rank's :class:`ShardedBoundaries`.

fla's CP collectives pass ``all_gather_into_tensor`` an output of shape ``[world_size, ...]``, which
gloo rejects (it wants ``[world_size * n, ...]``), so they run only on CUDA tensors over NCCL: never on
CPU, not even in Triton's interpreter. ``build_cp_context`` splits the row contiguously, exactly as
:meth:`ShardedBoundaries.from_row` does (row length divisible by the group's size, batch 1).
"""

from __future__ import annotations

import importlib.util
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from hybrid_pack.boundaries.sharded import ShardedBoundaries

__all__ = ["FLA_CP", "fla_cp_device_reason", "fla_cp_group_reason", "fla_cp_reason", "fla_cp_context"]

FLA_CP = "fla_cp"
"""The backend name of fla's context parallelism, for every op that has it (``backend="fla_cp"`` forces it)."""


def fla_cp_device_reason(device: torch.device) -> str:
    """Why fla's context parallelism cannot run on ``device`` in this process ("" when it may): the device, NCCL,
    the installation, and the default process group's backend when one is initialised. Starts no collective."""
    if device.type != "cuda":
        return f"fla's context parallelism runs on CUDA over NCCL only, not on {device.type}"
    if not dist.is_nccl_available():
        return "fla's context parallelism runs on CUDA over NCCL only; this torch has no NCCL"
    if importlib.util.find_spec("fla") is None or importlib.util.find_spec("fla.ops.cp") is None:
        return "flash-linear-attention with fla.ops.cp is not installed (pip install flash-linear-attention)"
    if dist.is_initialized() and dist.get_backend() != "nccl":
        return f"fla's context parallelism needs an NCCL process group; the default one is {dist.get_backend()}"
    return ""


def fla_cp_group_reason(boundaries: ShardedBoundaries) -> str:
    """Why fla's context parallelism cannot run over the group and layout of ``boundaries`` ("" when it can)."""
    if not dist.is_initialized():
        return "fla's context parallelism needs an initialised NCCL process group (torch.distributed is not)"
    process_backend = dist.get_backend(boundaries.group)
    if process_backend != "nccl":
        return f"fla's context parallelism needs an NCCL process group; this one is {process_backend}"
    if boundaries.layout != "contiguous":
        return f"fla's context parallelism is wired here for the contiguous layout only, not {boundaries.layout!r}"
    return ""


def fla_cp_reason(device_reason: str, boundaries: ShardedBoundaries, dtype: torch.dtype) -> str:
    """Why fla's context parallelism cannot take a call ("" when it can, pending the self-check): the op's own
    ``device_reason``, then the group and layout, then the dtype. Starts no collective."""
    supported = dtype in (torch.float16, torch.bfloat16, torch.float32)
    return (device_reason or fla_cp_group_reason(boundaries)
            or ("" if supported else f"fla's kernels take float16, bfloat16 or float32, not {dtype}"))


def fla_cp_context(boundaries: ShardedBoundaries, device: torch.device, conv_width: int | None = None) -> Any:
    """fla's ``FLACPContext`` for this rank (built once per boundaries object, device and conv width; from the
    row's host-side lengths, so without a device-to-host copy)."""
    from fla.ops.cp import build_cp_context

    def build() -> Any:
        row = boundaries.row
        cu_seqlens_cpu = torch.from_numpy(np.concatenate([[0], np.cumsum(row.segment_lengths, dtype=np.int64)]))
        return build_cp_context(row.cu_seqlens.to(device), group=boundaries.group or dist.group.WORLD,
                                conv1d_kernel_size=conv_width, cu_seqlens_cpu=cu_seqlens_cpu)

    return boundaries.view(("fla_cp_context", str(device), conv_width), build)
