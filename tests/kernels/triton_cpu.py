"""Run the Triton kernels of flash-linear-attention and mamba-ssm on CPU, in Triton's interpreter.

The real-kernel tier's set-up: ``tests/kernels/conftest.py`` calls :func:`enable_cpu_interpreter`.
``TRITON_INTERPRET=1`` (set before ``fla`` / ``mamba_ssm`` are imported) makes ``@triton.jit`` kernels run
as numpy on the host, so CI without a GPU can check the adapters against the real kernels. Four gaps stay
between those packages and a CPU-only torch build; :func:`enable_cpu_interpreter` closes each one, and only
that:

1. **Autotuning needs a GPU driver.** ``Autotuner`` times every config with the active driver's
   benchmarker, and there is no driver on CPU. Here every config reports the same time, so the
   autotuner keeps its first config and runs nothing just to time it.
2. **Loop counters are Python ints.** Inside a compiled kernel ``for i in range(n)`` yields
   ``tl.tensor`` counters; the interpreter yields ints, and fla's ``chunk_delta_h`` kernels call
   ``i_t.to(tl.int64)``. Here each counter of a ``range`` / ``tl.range`` loop is wrapped into a
   tensor at the top of the loop body, as the interpreter already does for every assignment.
3. **``torch.cuda.device(None)`` raises on CPU builds.** It is documented as a no-op, but the
   CPU build's ``_exchange_device`` compares ``None < 0``; mamba-ssm wraps every launch in
   ``with torch.cuda.device(x.device.index)``. Here ``None`` is treated as ``-1`` (no device).
4. **mamba-ssm's backward reads the SM count**, ``torch.cuda.get_device_properties(dev)
   .multi_processor_count``, which raises without CUDA. Here a CPU device reports one SM.

The CUDA extension modules the packages import at module level (``causal_conv1d_cuda``,
``selective_scan_cuda``, skipped at build time by ``scripts/install_kernels_cpu.sh``) are stood in for by
modules whose every function raises; only the Triton paths run. Then
:func:`hybrid_pack.ops.triton_device.mark_cpu_interpreter_ready` lets the backends' device probe send float32
calls on CPU to these kernels.
"""

from __future__ import annotations

import ast
import importlib.util
import os
import sys
import types
from collections.abc import Callable
from typing import Any

import torch

from hybrid_pack.errors import InputError
from hybrid_pack.ops.triton_device import INTERPRET_ENV, cpu_interpreter_enabled, mark_cpu_interpreter_ready

__all__ = ["CUDA_EXTENSIONS", "MissingExtension", "enable_cpu_interpreter"]

CUDA_EXTENSIONS = ("causal_conv1d_cuda", "selective_scan_cuda")


def enable_cpu_interpreter() -> None:
    """Patch the four CPU gaps (see the module docstring) and stub the CUDA extensions. Idempotent.

    Raises:
        InputError: ``TRITON_INTERPRET`` is not ``1``, or triton is not installed.
    """
    if cpu_interpreter_enabled():
        return
    if os.environ.get(INTERPRET_ENV) != "1":
        raise InputError(f"{INTERPRET_ENV}: expected '1' (set it before importing triton, fla or mamba_ssm); "
                         f"got {os.environ.get(INTERPRET_ENV)!r}")
    if importlib.util.find_spec("triton") is None:
        raise InputError("triton is not installed; run scripts/install_kernels_cpu.sh")
    _stub_cuda_extensions()
    _autotune_keeps_first_config()
    _loop_counters_as_tensors()
    _cuda_device_none_is_noop()
    _cpu_device_properties()
    mark_cpu_interpreter_ready()


class MissingExtension(types.ModuleType):
    """A CUDA extension module that is not built: importable, every function raises."""

    def __getattr__(self, attr: str) -> Callable[..., Any]:
        if attr.startswith("__"):
            raise AttributeError(attr)

        def unavailable(*args: Any, **kwargs: Any) -> Any:
            raise RuntimeError(f"{self.__name__}.{attr}: this CUDA extension is not built")

        return unavailable


def _stub_cuda_extensions() -> None:
    for name in CUDA_EXTENSIONS:
        if name not in sys.modules and importlib.util.find_spec(name) is None:
            sys.modules[name] = MissingExtension(name)


def _same_time_for_every_config(kernel_call: Callable[[], None], quantiles: tuple[float, ...] = ()) -> list[float]:
    return [0.0] * max(len(quantiles), 1)


def _autotune_keeps_first_config() -> None:
    from triton.runtime.autotuner import Autotuner

    Autotuner.do_bench = property(lambda self: _same_time_for_every_config)


def _loop_counters_as_tensors() -> None:
    from triton.runtime import interpreter

    class LoopCounterAsTensor(interpreter.ASTTransformer):
        """Also rewrites ``for i in range(...): body`` into ``for i in range(...): i = i; body``."""

        def visit_For(self, node: ast.For) -> ast.For:
            self.generic_visit(node)
            func = node.iter.func if isinstance(node.iter, ast.Call) else None
            is_range = (isinstance(func, ast.Name) and func.id == "range") or (
                isinstance(func, ast.Attribute) and func.attr == "range")
            if is_range and isinstance(node.target, ast.Name):
                counter = node.target.id
                rebind = ast.Assign(targets=[ast.Name(id=counter, ctx=ast.Store())],
                                    value=ast.Name(id=counter, ctx=ast.Load()))
                node.body.insert(0, self.visit_Assign(rebind))
            return node

    interpreter.FunctionRewriter.ast_transformer = LoopCounterAsTensor()
    interpreter.InterpretedFunction.rewritten_fn.clear()


def _cuda_device_none_is_noop() -> None:
    if hasattr(torch._C, "_cuda_exchangeDevice"):
        return
    exchange, maybe_exchange = torch.cuda._exchange_device, torch.cuda._maybe_exchange_device
    torch.cuda._exchange_device = lambda device: exchange(-1 if device is None else device)
    torch.cuda._maybe_exchange_device = lambda device: maybe_exchange(-1 if device is None else device)


def _cpu_device_properties() -> None:
    get_properties = torch.cuda.get_device_properties

    def device_properties(device: Any = None) -> Any:
        if isinstance(device, torch.device) and device.type == "cpu":
            return types.SimpleNamespace(name="cpu (Triton interpreter)", multi_processor_count=1)
        return get_properties(device)

    torch.cuda.get_device_properties = device_properties
