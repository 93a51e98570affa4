"""Activation checkpointing of the native model's decoder layers, turned on the way transformers' ``Trainer`` and
TRL turn it on (``activation_checkpointing_enable(activation_checkpointing_kwargs, every_n_layers, offload)``).

A checkpointed layer sits in its ``nn.ModuleList`` slot inside torch's checkpoint wrapper: its forward keeps only the
layer's inputs, and the backward runs the layer again as a module (its hooks, its ``boundaries``, the same random
state) before differentiating it. State dict keys stay the unwrapped model's (the wrapper strips its prefix).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from torch import nn
from torch.autograd.graph import save_on_cpu
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl, checkpoint_wrapper
from torch.utils.checkpoint import checkpoint

from hybrid_pack.errors import InputError

__all__ = ["Checkpointing", "checkpointing_of", "checkpoint_layers", "is_checkpointed_layer"]

Checkpointing = tuple[tuple[tuple[str, Any], ...], int, bool]
"""What :func:`checkpoint_layers` was asked for: the sorted checkpoint keywords, ``every_n_layers``, ``offload``."""

_WRAPPED = "_checkpoint_wrapped_module"


def checkpointing_of(kwargs: Mapping[str, Any] | None, every_n_layers: int, offload: bool) -> Checkpointing:
    """Validate transformers' three arguments: ``kwargs`` for ``torch.utils.checkpoint.checkpoint`` (default:
    non-reentrant), a positive int ``every_n_layers``, a bool ``offload``."""
    if kwargs is not None and not isinstance(kwargs, Mapping):
        raise InputError(f"activation_checkpointing_kwargs: expected a dict of torch.utils.checkpoint.checkpoint "
                         f"keywords such as {{'use_reentrant': False}}; got {type(kwargs).__name__}")
    if type(every_n_layers) is not int or every_n_layers < 1:
        raise InputError(f"every_n_layers: expected a positive int (1: every layer); got {every_n_layers!r}")
    if type(offload) is not bool:
        raise InputError(f"offload: expected True or False; got {offload!r}")
    options = {"use_reentrant": False, **(kwargs or {})}
    return tuple(sorted(options.items())), every_n_layers, offload


def is_checkpointed_layer(layer: nn.Module) -> bool:
    """Whether ``layer`` (or the module a ``torch.compile`` wrapper holds) is in a checkpoint wrapper."""
    while not hasattr(layer, _WRAPPED) and hasattr(layer, "_orig_mod"):
        layer = layer._orig_mod
    return hasattr(layer, _WRAPPED)


def checkpoint_layers(layers: nn.ModuleList, checkpointing: Checkpointing | None) -> None:
    """Put every ``every_n_layers``-th layer of ``layers`` (the first included) in a checkpoint wrapper and take the
    others out of theirs; ``None``: take every layer out."""
    for index, layer in enumerate(layers):
        if hasattr(layer, _WRAPPED):
            layer = layers[index] = getattr(layer, _WRAPPED)
        if checkpointing is not None and index % checkpointing[1] == 0:
            layers[index] = _wrapped(layer, checkpointing)


def _wrapped(layer: nn.Module, checkpointing: Checkpointing) -> nn.Module:
    options, _, offload = checkpointing
    keywords = dict(options)
    reentrant = bool(keywords.pop("use_reentrant"))
    impl = CheckpointImpl.REENTRANT if reentrant else CheckpointImpl.NO_REENTRANT
    if not offload:
        return checkpoint_wrapper(layer, checkpoint_impl=impl, **keywords)
    return checkpoint_wrapper(layer, checkpoint_impl=impl, checkpoint_fn=_offloaded(reentrant), **keywords)


def _offloaded(reentrant: bool) -> Callable[..., Any]:
    """``torch.utils.checkpoint.checkpoint`` keeping the inputs it saves in (pinned, where there is an accelerator)
    host memory, as transformers' ``offload=True``."""

    def run(function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        device_type = next((a.device.type for a in args if hasattr(a, "device")), "cpu")
        with save_on_cpu(pin_memory=device_type != "cpu", device_type=device_type):
            return checkpoint(function, *args, use_reentrant=reentrant, **kwargs)

    return run
