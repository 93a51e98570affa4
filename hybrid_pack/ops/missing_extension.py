"""A stand-in for a kernel package's CUDA extension module that was not built.

mamba-ssm imports its selective-scan CUDA extension at package import, though its Triton SSD kernel
(what the ``mamba_ssm`` backend runs) never calls it; installed with ``MAMBA_SKIP_CUDA_BUILD=TRUE``
the package then fails to import. A stand-in module lets it import; every function of it raises.
"""

from __future__ import annotations

import importlib.util
import sys
import types
from collections.abc import Callable
from typing import Any

__all__ = ["MissingExtension", "stand_in_for"]


class MissingExtension(types.ModuleType):
    """An extension module that is not built: importable, every function raises."""

    def __getattr__(self, attr: str) -> Callable[..., Any]:
        if attr.startswith("__"):
            raise AttributeError(attr)

        def unavailable(*args: Any, **kwargs: Any) -> Any:
            raise RuntimeError(f"{self.__name__}.{attr}: this CUDA extension is not built")

        return unavailable


def stand_in_for(name: str) -> None:
    """Make ``import name`` succeed with a :class:`MissingExtension` when no such module is installed."""
    if name not in sys.modules and importlib.util.find_spec(name) is None:
        sys.modules[name] = MissingExtension(name)
