"""No attention mask for a packed call: the boundaries replace it.

A patched model's backbone still calls its family's ``create_causal_mask`` with the restarting
``position_ids`` of a packed row; transformers would then read them on the host (a synchronisation) and
build a ``[1, 1, T, T]`` per-document mask that the packed attention never reads (O(T²) memory). While a
Hugging Face model entry runs a packed call its config is marked (:func:`mark_packed_call`), and the
family's ``create_causal_mask``, wrapped once in its module (:func:`skip_masks_of_packed_calls`), returns
None. Any other call, and every unpatched model, builds its mask as before. The mark never outlives the
call, so it is never saved with the config.
"""

from __future__ import annotations

import sys
from typing import Any

import torch

__all__ = ["mark_packed_call", "unmark_packed_call", "skip_masks_of_packed_calls"]

_PACKED_CALL = "_hybrid_pack_packed_call"
_WRAPS = "_hybrid_pack_wraps"
_MASK_FUNCTIONS = ("create_causal_mask",)


def mark_packed_call(config: Any, packed: bool) -> None:
    """Say whether the call now running on the model of ``config`` is packed (until :func:`unmark_packed_call`)."""
    setattr(config, _PACKED_CALL, packed)


def unmark_packed_call(config: Any) -> None:
    if getattr(config, _PACKED_CALL, None) is not None:
        delattr(config, _PACKED_CALL)


def _skipping(original: Any) -> Any:
    def create_mask(config: Any, *args: Any, **kwargs: Any) -> Any:
        if getattr(config, _PACKED_CALL, False):
            return None
        return original(config, *args, **kwargs)

    create_mask.__name__ = original.__name__
    create_mask.__doc__ = original.__doc__
    setattr(create_mask, _WRAPS, original)
    return create_mask


def skip_masks_of_packed_calls(model: torch.nn.Module) -> None:
    """Wrap the mask builders of ``model``'s family module (and of every model class inside it), once."""
    for module in {sys.modules[type(m).__module__] for m in model.modules()}:
        for name in _MASK_FUNCTIONS:
            original = getattr(module, name, None)
            if original is not None and not hasattr(original, _WRAPS):
                setattr(module, name, _skipping(original))
