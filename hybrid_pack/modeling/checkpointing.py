"""Activation checkpointing of the native model's decoder layers, turned on the way transformers' ``Trainer`` and
TRL turn it on (``activation_checkpointing_enable(activation_checkpointing_kwargs, every_n_layers, offload)``).

A checkpointed layer sits in its ``nn.ModuleList`` slot inside torch's checkpoint wrapper: its forward keeps only the
layer's inputs, and the backward runs the layer again as a module (its hooks, its ``boundaries``, the same random
state) before differentiating it. State dict keys stay the unwrapped model's (the wrapper strips its prefix).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any

from torch import nn
from torch.autograd.graph import save_on_cpu
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl, checkpoint_wrapper
from torch.distributed.fsdp import FSDPModule
from torch.utils.checkpoint import checkpoint

from hybrid_pack.errors import InputError

__all__ = ["CHECKPOINT_OPTIONS", "Checkpointing", "checkpointing_of", "checkpoint_layers", "is_checkpointed_layer"]

CHECKPOINT_OPTIONS: dict[str, Any] = {"use_reentrant": False, "early_stop": False}
"""``torch.utils.checkpoint.checkpoint``'s keywords by default: non-reentrant, recomputing the whole layer (a
context-parallel shard's recompute then repeats every exchange of the forward, on every rank)."""

Checkpointing = tuple[tuple[tuple[str, Any], ...], int, bool]
"""What :func:`checkpoint_layers` was asked for: the sorted checkpoint keywords, ``every_n_layers``, ``offload``."""

_WRAPPED = "_checkpoint_wrapped_module"


def checkpointing_of(kwargs: Mapping[str, Any] | None, every_n_layers: int, offload: bool) -> Checkpointing:
    """Validate transformers' three arguments: ``kwargs`` for ``torch.utils.checkpoint.checkpoint`` (over
    :data:`CHECKPOINT_OPTIONS`), a positive int ``every_n_layers``, a bool ``offload``."""
    if kwargs is not None and not isinstance(kwargs, Mapping):
        raise InputError(f"activation_checkpointing_kwargs: expected a dict of torch.utils.checkpoint.checkpoint "
                         f"keywords such as {{'use_reentrant': False}}; got {type(kwargs).__name__}")
    if type(every_n_layers) is not int or every_n_layers < 1:
        raise InputError(f"every_n_layers: expected a positive int (1: every layer); got {every_n_layers!r}")
    if type(offload) is not bool:
        raise InputError(f"offload: expected True or False; got {offload!r}")
    return tuple(sorted({**CHECKPOINT_OPTIONS, **(kwargs or {})}.items())), every_n_layers, offload


def is_checkpointed_layer(layer: nn.Module) -> bool:
    """Whether ``layer`` is in a checkpoint wrapper."""
    return hasattr(layer, _WRAPPED)


def checkpoint_layers(layers: nn.ModuleList, checkpointing: Checkpointing | None) -> None:
    """Put every ``every_n_layers``-th layer of ``layers`` (the first included) in a checkpoint wrapper and take the
    others out of theirs; ``None``: take every layer out. Raises InputError, changing nothing, where a layer to
    change is sharded by FSDP2 or compiled (that wrapper would be dropped)."""
    wanted = [checkpointing is not None and index % checkpointing[1] == 0 for index in range(len(layers))]
    for index, layer in enumerate(layers):
        if (is_checkpointed_layer(layer) or wanted[index]) and (
                isinstance(layer, FSDPModule) or getattr(layer, "_compiled_call_impl", None) is not None):
            raise InputError(f"activation_checkpointing: decoder layer {index} is sharded by FSDP2 or compiled "
                             "already, and changing its checkpointing would drop that; turn checkpointing on before "
                             "(hybrid_pack.parallel.parallelize(..., activation_checkpointing=True) does, with the "
                             "default settings transformers' Trainer asks for)")
    for index, layer in enumerate(layers):
        if is_checkpointed_layer(layer):
            layer = layers[index] = getattr(layer, _WRAPPED)
        if wanted[index]:
            layers[index] = _wrapped(layer, checkpointing)


def _wrapped(layer: nn.Module, checkpointing: Checkpointing) -> nn.Module:
    options, _, offload = checkpointing
    keywords = dict(options)
    reentrant = bool(keywords.pop("use_reentrant"))
    impl = CheckpointImpl.REENTRANT if reentrant else CheckpointImpl.NO_REENTRANT
    if not offload:
        return checkpoint_wrapper(layer, checkpoint_impl=impl, **keywords)
    return checkpoint_wrapper(layer, checkpoint_impl=impl, checkpoint_fn=functools.partial(
        _offloaded_checkpoint, use_reentrant=reentrant), **keywords)


def _offloaded_checkpoint(function: Callable[..., Any], *args: Any, use_reentrant: bool, **kwargs: Any) -> Any:
    """``torch.utils.checkpoint.checkpoint`` keeping the inputs it saves in host memory (pinned where there is an
    accelerator), as transformers' ``offload=True``."""
    device_type = next((a.device.type for a in args if hasattr(a, "device")), "cpu")
    with save_on_cpu(pin_memory=device_type != "cpu", device_type=device_type):
        return checkpoint(function, *args, use_reentrant=use_reentrant, **kwargs)
