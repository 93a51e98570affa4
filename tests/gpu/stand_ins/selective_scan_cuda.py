"""Stand-in for mamba-ssm's CUDA extension when it was not built (``MAMBA_CUDA=skip`` in
scripts/install_kernels_gpu.sh): mamba-ssm imports it at package import, though the Triton SSD that hybrid_pack
uses never calls it. scripts/gpu_tier.sh puts this folder on the path only when the real module is missing.
Every function raises, so nothing can run on it unnoticed."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def __getattr__(name: str) -> Callable[..., Any]:
    if name.startswith("__"):
        raise AttributeError(name)

    def unavailable(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(f"selective_scan_cuda.{name}: mamba-ssm's CUDA extension is not built here "
                           "(scripts/install_kernels_gpu.sh with MAMBA_CUDA=build builds it)")

    return unavailable
