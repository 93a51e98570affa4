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

import torch
import torch.distributed as dist

from hybrid_pack.parallel.boundaries import ShardedBoundaries

__all__ = ["FLA_CP", "fla_cp_environment_reason", "fla_cp_context"]

FLA_CP = "fla_cp"
"""The backend name of fla's context parallelism, for every op that has it (``backend="fla_cp"`` forces it)."""


def fla_cp_environment_reason(device: torch.device, boundaries: ShardedBoundaries) -> str:
    """Why fla's context parallelism cannot run for this device and group ("" when it can)."""
    if device.type != "cuda":
        return f"fla's context parallelism runs on CUDA over NCCL only; the inputs are on {device.type}"
    if importlib.util.find_spec("fla") is None or importlib.util.find_spec("fla.ops.cp") is None:
        return "flash-linear-attention with fla.ops.cp is not installed (pip install flash-linear-attention)"
    process_backend = dist.get_backend(boundaries.group)
    if process_backend != "nccl":
        return f"fla's context parallelism needs an NCCL process group; this one is {process_backend}"
    if boundaries.layout != "contiguous":
        return f"fla's context parallelism is wired here for the contiguous layout only, not {boundaries.layout!r}"
    return ""


def fla_cp_context(boundaries: ShardedBoundaries, device: torch.device, conv_width: int | None = None) -> Any:
    """fla's ``FLACPContext`` for this rank (built once per boundaries object, device and conv width)."""
    from fla.ops.cp import build_cp_context

    def build() -> Any:
        cu_seqlens_cpu = boundaries.row.cu_seqlens.cpu()
        return build_cp_context(cu_seqlens_cpu.to(device), group=boundaries.group or dist.group.WORLD,
                                conv1d_kernel_size=conv_width, cu_seqlens_cpu=cu_seqlens_cpu)

    return boundaries.view(("fla_cp_context", str(device), conv_width), build)
