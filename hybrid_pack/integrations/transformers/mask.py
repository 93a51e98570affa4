"""No attention mask for a packed call: the boundaries replace it.

A patched model's backbone still calls its family's ``create_causal_mask`` (or the sliding-window one)
with the restarting ``position_ids`` of a packed row; transformers would then read them on the host (a
synchronisation) and build a ``[1, 1, T, T]`` per-document mask that the packed attention never reads
(O(T²) memory). While a patched Hugging Face model entry runs a packed call, that call is recorded in the
running context (:func:`enter_call`: a ``contextvars`` stack, so each thread and each task sees only its own
calls, and nothing is stored on the model or its config). The family module's mask builders are wrapped
once (:class:`SkippedForPackedCalls`): they return None for a config whose innermost call in this context
is packed, and call the original with the same arguments otherwise (under ``torch.compile`` always: the
packed graph never reads the mask, so it is dead code there), so every other call, every other thread
and every unpatched model builds exactly the mask it built before. (transformers' public
``AttentionMaskInterface`` is reached only after its host read of ``position_ids``, too late for this.)
"""

from __future__ import annotations

import contextvars
import sys
import weakref
from typing import Any

import torch

__all__ = ["enter_call", "exit_call", "in_packed_call", "skip_masks_of_packed_calls", "SkippedForPackedCalls"]

_MASK_BUILDERS = ("create_causal_mask", "create_sliding_window_causal_mask", "create_chunked_causal_mask")
# (id(entry module), id(config), packed) for each patched model entry running in this context, innermost last.
_CALLS: contextvars.ContextVar[tuple[tuple[int, int, bool], ...]] = contextvars.ContextVar(
    "hybrid_pack_packed_calls", default=())


def enter_call(module: Any, config: Any, packed: bool) -> None:
    """Record that ``module`` (a model entry with ``config``) starts a call, packed or not, in this context."""
    _CALLS.set((*_CALLS.get(), (id(module), id(config), packed)))


def exit_call(module: Any) -> None:
    """Forget the innermost call of ``module`` in this context (nothing if its entry raised before recording it)."""
    calls = _CALLS.get()
    for position in range(len(calls) - 1, -1, -1):
        if calls[position][0] == id(module):
            _CALLS.set(calls[:position] + calls[position + 1:])
            return


def in_packed_call(config: Any) -> bool:
    """Whether the innermost call of the model of ``config`` running in this context is packed."""
    for _, config_id, packed in reversed(_CALLS.get()):
        if config_id == id(config):
            return packed
    return False


class SkippedForPackedCalls:
    """A family's mask builder (``create_causal_mask(config, ...)``) that returns None for the packed calls of
    patched models in this context. Picklable; holds nothing per call."""

    def __init__(self, original: Any) -> None:
        self.original = original
        self.__name__ = getattr(original, "__name__", type(self).__name__)
        self.__doc__ = getattr(original, "__doc__", None)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        config = kwargs.get("config", args[0] if args else None)
        if config is not None and not torch.compiler.is_compiling() and in_packed_call(config):
            return None
        return self.original(*args, **kwargs)


_WRAPPED_FOR: weakref.WeakSet[Any] = weakref.WeakSet()
"""The models whose family modules' mask builders are wrapped in this process."""


def skip_masks_of_packed_calls(model: Any) -> None:
    """Wrap the mask builders of ``model``'s family module (and of every model class inside it), once each per
    process: at ``patch_model``, and at the first packed call of a patched model that came from another process
    (``pickle``, ``torch.load``, ``torch.multiprocessing.spawn``), whose modules were never wrapped here."""
    if model in _WRAPPED_FOR:
        return
    for module in {sys.modules[type(m).__module__] for m in model.modules()}:
        for name in _MASK_BUILDERS:
            original = getattr(module, name, None)
            if original is not None and not isinstance(original, SkippedForPackedCalls):
                setattr(module, name, SkippedForPackedCalls(original))
    _WRAPPED_FOR.add(model)
