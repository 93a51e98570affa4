"""transformers' own torch path for the families' kernels, on a CPU where the kernel packages are installed.

transformers dispatches the convolution and the delta rule of an ordinary (unpacked) call to installed kernel
packages (flash-linear-attention, causal-conv1d), which need a GPU; the undecorated originals (``__wrapped__``) are
plain torch. The tests' unpacked references run on those, and the docs' programs run with every family module
switched as it loads (:func:`switch_on_import`), so a page reads as it would on a GPU.
"""

from __future__ import annotations

import contextlib
import importlib.abc
import importlib.machinery
import sys
from collections.abc import Iterator
from types import ModuleType
from typing import Any

KERNEL_FUNCTIONS = ("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule", "causal_conv1d_fn",
                    "causal_conv1d_update", "chunk_kimi_delta_attention", "recurrent_kimi_delta_attention")


def _switch(module: ModuleType) -> dict[str, Any]:
    """Point ``module``'s kernel functions at their torch originals; returns what was there."""
    saved = {name: getattr(module, name) for name in KERNEL_FUNCTIONS if hasattr(module, name)}
    for name, fn in saved.items():
        setattr(module, name, getattr(fn, "__wrapped__", fn))
    return saved


@contextlib.contextmanager
def pure_torch_transformers(model: Any) -> Iterator[None]:
    """Run ``model``'s family code (``model``: a model or a model class) on transformers' own torch functions for
    the convolution and the delta rule while inside (the CPU reference for ordinary, unpacked calls)."""
    module = sys.modules[(model if isinstance(model, type) else type(model)).__module__]
    saved = _switch(module)
    try:
        yield
    finally:
        for name, fn in saved.items():
            setattr(module, name, fn)


class _SwitchingLoader(importlib.abc.Loader):
    def __init__(self, loader: importlib.abc.Loader) -> None:
        self.loader = loader

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self.loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self.loader.exec_module(module)
        _switch(module)


class _SwitchingFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, name: str, path: Any, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if not (name.startswith("transformers.models.") and ".modeling_" in name):
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is not None and spec.loader is not None:
            spec.loader = _SwitchingLoader(spec.loader)
        return spec


def switch_on_import() -> None:
    """From now on, every transformers modeling module runs its families' kernels on the torch originals."""
    sys.meta_path.insert(0, _SwitchingFinder())
    for name, module in list(sys.modules.items()):
        if name.startswith("transformers.models.") and ".modeling_" in name:
            _switch(module)
