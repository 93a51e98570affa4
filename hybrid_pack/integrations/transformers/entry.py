"""Where a packed batch enters a patched model: every call path sets the boundaries its layers read.

A trainer or wrapper may call the top-level model, its backbone (TRL's fused LM head calls
``model.base_model`` directly) or one decoder layer (pipeline schedules). :func:`wrap_entry` is put on
each of them; whichever one first receives the packed keys builds the
:class:`~hybrid_pack.PackedBoundaries`, makes them current (:func:`.context.packed_row`) and calls the
module's own forward without the keys. Entries nested inside a packed call pass through.
"""

from __future__ import annotations

import functools
import inspect
import types
from dataclasses import dataclass
from typing import Any

import torch

from hybrid_pack.boundaries import PackedBoundaries
from hybrid_pack.errors import BoundaryError, InputError
from hybrid_pack.integrations.transformers.context import carry_boundaries, current_boundaries, packed_row
from hybrid_pack.schema import (
    ATTENTION_MASK,
    BOUNDARIES,
    BOUNDARY_KEYS,
    CACHE_KEYS,
    INPUT_IDS,
    INPUTS_EMBEDS,
    POSITION_IDS,
    USE_CACHE,
)

__all__ = ["EXPLICIT_BOUNDARY_KEYS", "wrap_entry", "is_entry", "entry_modules", "explicit_keys_in", "stray_keys_error",
           "packed_call_boundaries", "rebound"]

EXPLICIT_BOUNDARY_KEYS = tuple(key for key in BOUNDARY_KEYS if key != POSITION_IDS)
"""Keys that only a packed call carries (``position_ids`` alone is packed only when it restarts)."""

_HIDDEN_STATES = "hidden_states"
_ENTRY_FLAG = "_hybrid_pack_entry"


def explicit_keys_in(kwargs: dict[str, Any]) -> list[str]:
    """The explicit boundary keys (and ``boundaries``) given a value in ``kwargs``."""
    return [key for key in (*EXPLICIT_BOUNDARY_KEYS, BOUNDARIES) if kwargs.get(key) is not None]


def stray_keys_error(layer: str, keys: list[str]) -> BoundaryError:
    """The error of a patched layer that receives packed ``keys`` outside a packed call."""
    return BoundaryError(
        f"{layer}: received {', '.join(keys)} but no packed boundaries, so it would run the packed row as one "
        "document. The keys reached this layer without passing through a patched entry (the model, its backbone "
        "or a decoder layer). Fix: pass the batch to the patched model, model.base_model or a decoder layer, or "
        "run the call inside hybrid_pack.integrations.transformers.packed_row(PackedBoundaries.from_batch(batch))")


def _tokens(arguments: dict[str, Any]) -> torch.Tensor | None:
    for name in (INPUT_IDS, INPUTS_EMBEDS, _HIDDEN_STATES):
        if isinstance(arguments.get(name), torch.Tensor):
            return arguments[name]
    return None


def _restarts(position_ids: Any) -> bool:
    """Whether ``position_ids`` is one row ``[1, T]`` that restarts at 0 after its first token."""
    return (isinstance(position_ids, torch.Tensor) and position_ids.dim() == 2 and position_ids.shape[0] == 1
            and bool((position_ids[0, 1:] == 0).any()))


def _only_restarting_positions(arguments: dict[str, Any]) -> bool:
    """A flattened batch marked by restarting ``position_ids`` alone, outside any packed call."""
    return (current_boundaries() is None and arguments.get(ATTENTION_MASK) is None
            and all(arguments.get(key) is None for key in CACHE_KEYS) and _restarts(arguments.get(POSITION_IDS)))


def packed_call_boundaries(arguments: dict[str, Any], *, by_positions: bool = True) -> PackedBoundaries | None:
    """The boundaries of a packed call, or None for a call to pass through unchanged.

    ``arguments`` are the call's named arguments (positional ones bound to their names). A call is packed
    when it carries an explicit boundary key or ``boundaries=``, or (with ``by_positions``, outside a packed
    call) a ``[1, T]`` ``position_ids`` that restarts at 0 with no ``attention_mask`` and no cache. Nested
    calls inside a packed call carry neither (the entry that set the boundaries removed the keys) and pass
    through.

    Raises:
        InputError: packed keys with a batch of several rows, an ``attention_mask``, a cache or ``use_cache``.
        BoundaryError: boundary keys that disagree with each other or with the tokens.
    """
    explicit = explicit_keys_in(arguments)
    if not explicit and not (by_positions and _only_restarting_positions(arguments)):
        return None
    tokens = _tokens(arguments)
    if tokens is not None and tokens.shape[0] != 1:
        raise InputError(f"{INPUT_IDS}: a packed batch is one row [1, T]; got batch size {tokens.shape[0]} with "
                         "boundary keys (flatten the batch with hybrid_pack.PackingCollator)")
    if arguments.get(ATTENTION_MASK) is not None:
        keys = ", ".join(explicit) or POSITION_IDS
        raise InputError(f"{ATTENTION_MASK}: not allowed with packed boundary keys ({keys} already separate the "
                         f"documents); drop {ATTENTION_MASK} from the batch")
    for key in CACHE_KEYS:
        if arguments.get(key) is not None:
            raise InputError(f"{key}: a KV / state cache cannot be used with a packed batch; packed rows are for "
                             "training and scoring; generate from unpacked inputs")
    if arguments.get(USE_CACHE):
        raise InputError(f"{USE_CACHE}: must be False (or unset) with a packed batch; a cache would mix documents")
    given = arguments.get(BOUNDARIES)
    if given is not None and not isinstance(given, PackedBoundaries):
        raise BoundaryError(f"{BOUNDARIES}: expected a hybrid_pack.PackedBoundaries; got {type(given).__name__}")
    boundaries = given if given is not None else PackedBoundaries.from_batch(
        {key: arguments[key] for key in (*BOUNDARY_KEYS, INPUT_IDS) if arguments.get(key) is not None})
    device = tokens.device if tokens is not None else boundaries.device
    return boundaries.to(device) if boundaries.device != device else boundaries


def rebound(method: Any, module: torch.nn.Module) -> Any:
    """``method`` bound to ``module`` (a deep copy of a patched model must run its own weights, not the original's)."""
    if isinstance(method, types.MethodType) and method.__self__ is not module:
        return types.MethodType(method.__func__, module)
    return method


def is_entry(module: torch.nn.Module) -> bool:
    """Whether :func:`wrap_entry` has been applied to ``module``."""
    return getattr(module, _ENTRY_FLAG, False)


def entry_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """Where packed keys can enter ``model``: the model, every Hugging Face model inside it (its backbone)
    and every decoder layer (``GradientCheckpointingLayer``)."""
    from transformers import PreTrainedModel
    from transformers.modeling_layers import GradientCheckpointingLayer

    return [model] + [module for module in model.modules()
                      if module is not model and isinstance(module, (PreTrainedModel, GradientCheckpointingLayer))]


@dataclass(frozen=True)
class _Signature:
    """What an entry's forward takes (its positional parameter names, and which of the rewritten keywords),
    and whether restarting ``position_ids`` alone mark a packed call there (models: yes; decoder layers, which
    receive a mask the backbone may have dropped, only on explicit keys)."""

    positional: tuple[str, ...]
    takes_position_ids: bool
    takes_use_cache: bool
    by_positions: bool

    @classmethod
    def of(cls, module: torch.nn.Module) -> _Signature:
        from transformers import PreTrainedModel

        parameters = inspect.signature(module.forward).parameters
        kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
        return cls(tuple(name for name, p in parameters.items() if p.kind in kinds), POSITION_IDS in parameters,
                   USE_CACHE in parameters, isinstance(module, PreTrainedModel))


@torch.compiler.disable
def _packed_call(module: torch.nn.Module, signature: _Signature, args: tuple[Any, ...],
                 kwargs: dict[str, Any]) -> tuple[PackedBoundaries, dict[str, Any]] | None:
    """The boundaries of a packed call and the keywords to run it with, or None to pass the call through.

    The keywords lose the boundary keys and ``attention_mask``, and get restarting ``position_ids`` (for RoPE)
    and ``use_cache=False`` where the forward takes them by keyword. Every gradient-checkpointing function
    below ``module`` is made to restore the boundaries in its backward recompute.
    """
    given_positionally = signature.positional[:len(args)]
    boundaries = packed_call_boundaries({**dict(zip(given_positionally, args, strict=False)), **kwargs},
                                        by_positions=signature.by_positions)
    if boundaries is None:
        return None
    kwargs = {key: value for key, value in kwargs.items() if key not in (*BOUNDARY_KEYS, BOUNDARIES, ATTENTION_MASK)}
    if signature.takes_position_ids and POSITION_IDS not in given_positionally:
        kwargs[POSITION_IDS] = boundaries.document_positions
    if signature.takes_use_cache and USE_CACHE not in given_positionally:
        kwargs[USE_CACHE] = False
    for inner in module.modules():
        if getattr(inner, "_gradient_checkpointing_func", None) is not None:
            inner._gradient_checkpointing_func = carry_boundaries(inner._gradient_checkpointing_func)
    return boundaries, kwargs


def wrap_entry(module: torch.nn.Module) -> None:
    """Make ``module.forward`` set the boundaries of the packed calls it receives (idempotent).

    A packed call runs the original forward with the boundaries current and the keywords of
    :func:`_packed_call`; positional arguments stay positional (reentrant checkpointing needs the hidden
    states there). Any other call runs the original forward unchanged.

    ``torch.compile`` skips the wrapper's own frame and :func:`_packed_call` (the boundaries are Python-level
    state) and compiles the original forward it calls.
    """
    if is_entry(module):
        return
    original = module.forward
    signature = _Signature.of(module)

    @functools.wraps(original)
    def forward(self: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
        own = rebound(original, self)
        call = _packed_call(self, signature, args, kwargs)
        if call is None:
            return own(*args, **kwargs)
        boundaries, kwargs = call
        with packed_row(boundaries):
            return own(*args, **kwargs)

    module.forward = types.MethodType(torch.compiler.disable(forward, recursive=False), module)
    setattr(module, _ENTRY_FLAG, True)
