"""Where a packed batch enters a patched model: the boundaries become one keyword argument.

A trainer or wrapper may call the top-level model, its backbone (TRL's fused LM head calls
``model.base_model`` directly) or one decoder layer (pipeline schedules). Each of them gets a forward
pre-hook (:func:`install_entry`): the first one that receives the packed keys (the collator's
``cu_seq_lens_q/k``, ``seq_idx``, ``max_length_q/k``, ``num_pad_tokens``, ``host_boundaries``, or restarting
``position_ids`` alone) replaces them by ``boundaries=`` (a :class:`~hybrid_pack.PackedBoundaries`), restarting
``position_ids`` (for RoPE and the model's own packed-sequence masks) and ``use_cache=False``. With the
collator's ``host_boundaries`` the boundaries are built without reading a tensor (docs/api.md §9b); without it
they are read from the boundary tensors, one device-to-host copy per forward when those are on an accelerator.

From there the model's own ``**kwargs`` plumbing carries ``boundaries`` to every decoder layer, attention
function and sequence mixer, as it carries transformers' own flash-attention keywords. Nothing is held
outside the call: a gradient-checkpointing recompute gets the same keywords back, and ``torch.compile``
traces the hook like any other code (inside a trace the boundaries are
:class:`~hybrid_pack.boundaries.static.StaticBoundaries`, read from shapes only). An entry's ``forward`` is its
class's, except where the model's forward drops the keywords (:func:`hand_off`): there a direct eager
``module.forward(...)``, which skips the hooks, goes through ``module(...)``; signatures stay the unpatched ones.
"""

from __future__ import annotations

import contextvars
import functools
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from hybrid_pack.boundaries import PackedBoundaries
from hybrid_pack.boundaries.sharded import ShardedBoundaries, require_row_count
from hybrid_pack.boundaries.static import StaticBoundaries
from hybrid_pack.errors import BoundaryError, InputError
from hybrid_pack.integrations.transformers.attention import wrap_attention
from hybrid_pack.integrations.transformers.keys import EXPLICIT_BOUNDARY_KEYS, explicit_keys_in
from hybrid_pack.integrations.transformers.mask import enter_call, exit_call, skip_masks_of_packed_calls
from hybrid_pack.mrope import numbers_with_mrope
from hybrid_pack.schema import (
    ATTENTION_MASK,
    BOUNDARIES,
    BOUNDARY_KEYS,
    CACHE_KEYS,
    HOST_BOUNDARIES,
    IMAGE_GRID_THW,
    INPUT_IDS,
    INPUTS_EMBEDS,
    LABELS,
    NUM_ITEMS_IN_BATCH,
    POSITION_IDS,
    SHIFT_LABELS,
    USE_CACHE,
    VIDEO_GRID_THW,
)

__all__ = ["install_entry", "is_entry", "entry_modules", "packed_call_boundaries", "hand_off", "handed_off",
           "receives_hand_offs", "forward_slot", "mark_weightless"]


OUTPUT_ATTENTIONS = "output_attentions"
_HIDDEN_STATES = "hidden_states"
_ENTRY_FLAG = "_hybrid_pack_entry"
_WEIGHTLESS_FLAG = "_hybrid_pack_weightless"


def mark_weightless(module: torch.nn.Module) -> None:
    """``module``'s packed forward forms no attention weights (an indexed attention): a packed call asking for
    them is refused."""
    setattr(module, _WEIGHTLESS_FLAG, True)


def _tokens(arguments: dict[str, Any]) -> torch.Tensor | None:
    for name in (INPUT_IDS, INPUTS_EMBEDS, _HIDDEN_STATES):
        if isinstance(arguments.get(name), torch.Tensor):
            return arguments[name]
    return None


def _restarts(position_ids: Any) -> bool:
    """Whether ``position_ids`` is one row ``[1, T]`` that restarts at 0 after its first token.

    Read on the host, so only outside ``torch.compile``: a compiled model marks packed rows by the
    collator's explicit keys (the static batches of docs/compile.md carry them all).
    """
    return (not torch.compiler.is_compiling() and isinstance(position_ids, torch.Tensor) and position_ids.dim() == 2
            and position_ids.shape[0] == 1 and bool((position_ids[0, 1:] == 0).any()))


def _only_restarting_positions(arguments: dict[str, Any]) -> bool:
    """A flattened batch marked by restarting ``position_ids`` alone."""
    return (arguments.get(ATTENTION_MASK) is None and all(arguments.get(key) is None for key in CACHE_KEYS)
            and _restarts(arguments.get(POSITION_IDS)))


def _build(arguments: dict[str, Any]) -> PackedBoundaries | StaticBoundaries:
    """The boundaries of the call's keys: from the collator's ``host_boundaries`` and the boundary tensors as they
    are when the call carries it (no value read, §9b), else read from the tensors (one device-to-host copy when they
    are on an accelerator); inside ``torch.compile`` from the tensors' shapes (§9)."""
    keys = {key: arguments[key] for key in (*BOUNDARY_KEYS, INPUT_IDS, HOST_BOUNDARIES)
            if arguments.get(key) is not None}
    if torch.compiler.is_compiling():
        return StaticBoundaries.from_batch(keys)
    return PackedBoundaries.from_batch(keys)


def packed_call_boundaries(arguments: dict[str, Any], *, by_positions: bool = True,
                           ) -> PackedBoundaries | StaticBoundaries | None:
    """The boundaries of a packed call, or None for a call to pass through unchanged.

    ``arguments`` are the call's named arguments (positional ones bound to their names). A call is packed
    when it carries ``boundaries=`` or an explicit boundary key, or (with ``by_positions``) a ``[1, T]``
    ``position_ids`` that restarts at 0 with no ``attention_mask`` and no cache.

    Raises:
        InputError: packed keys with a batch of several rows, an ``attention_mask``, a cache, ``use_cache``
            or ``output_attentions`` that the packed row cannot honour.
        BoundaryError: boundary keys that disagree with each other or with the tokens.
    """
    given = arguments.get(BOUNDARIES)
    explicit = explicit_keys_in(arguments) + [HOST_BOUNDARIES] * (arguments.get(HOST_BOUNDARIES) is not None)
    if given is None and not explicit and not (by_positions and _only_restarting_positions(arguments)):
        return None
    tokens = _tokens(arguments)
    if tokens is not None and tokens.shape[0] != 1:
        raise InputError(f"{INPUT_IDS}: a packed batch is one row [1, T]; got batch size {tokens.shape[0]} with "
                         "boundary keys (flatten the batch with hybrid_pack.PackingCollator)")
    if arguments.get(ATTENTION_MASK) is not None and given is None:
        keys = ", ".join(explicit) or POSITION_IDS
        raise InputError(f"{ATTENTION_MASK}: not allowed with packed boundary keys ({keys} already separate the "
                         f"documents); drop {ATTENTION_MASK} from the batch")
    for key in CACHE_KEYS:
        if arguments.get(key) is not None:
            raise InputError(f"{key}: a KV / state cache cannot be used with a packed batch; packed rows are for "
                             "training and scoring; generate from unpacked inputs (a backbone whose .forward() "
                             "was called directly built one from config.use_cache, skipping the hook that turns "
                             "it off: call the module itself, or pass use_cache=False)")
    if arguments.get(USE_CACHE):
        raise InputError(f"{USE_CACHE}: must be False (or unset) with a packed batch; a cache would mix documents")
    if given is None:
        return _build(arguments)
    if not isinstance(given, (PackedBoundaries, StaticBoundaries, ShardedBoundaries)):
        raise BoundaryError(f"{BOUNDARIES}: expected a hybrid_pack.PackedBoundaries (or a context-parallel shard's "
                            f"ShardedBoundaries from shard_batch); got {type(given).__name__}")
    return given


def _positions(given: Any, boundaries: Any) -> torch.Tensor:
    """The ``position_ids`` a packed call runs with: each token's position in its document ``[1, T]``; for a
    vision-language model's M-RoPE ids (``[3, 1, T]``, computed per document: §3b) those ids under the text row
    ``[4, 1, T]``, the layout transformers' M-RoPE text models split into text and rotary positions."""
    if isinstance(given, torch.Tensor) and given.dim() == 3:
        if given.shape[0] == 3:
            return torch.cat([boundaries.document_positions.to(given.device)[None], given])
        return given
    return boundaries.document_positions


def is_entry(module: torch.nn.Module) -> bool:
    """Whether :func:`install_entry` has been applied to ``module``."""
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
    """What an entry's forward takes: its positional parameter names, which of the rewritten keywords,
    and whether restarting ``position_ids`` alone mark a packed call there (models: yes; decoder layers,
    which receive a mask the backbone may have dropped, only on explicit keys)."""

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


def _refuse_attention_weights(module: torch.nn.Module, kwargs: dict[str, Any]) -> None:
    """Attention weights of a packed row exist only where the model computes them itself (``eager``)."""
    config = getattr(module, "config", None)
    wanted = kwargs.get(OUTPUT_ATTENTIONS)
    if wanted is None:
        wanted = getattr(config, OUTPUT_ATTENTIONS, False)
    implementation = getattr(config, "_attn_implementation", "eager")
    if wanted and implementation != "eager":
        raise InputError(f"{OUTPUT_ATTENTIONS}: attention weights of a packed row are returned with the 'eager' "
                         f"attention implementation only (this model uses {implementation!r}); call "
                         "model.set_attn_implementation('eager') first, or run each document unpacked")
    weightless = [type(m).__name__ for m in module.modules() if getattr(m, _WEIGHTLESS_FLAG, False)] if wanted else []
    if weightless:
        raise InputError(f"{OUTPUT_ATTENTIONS}: {weightless[0]} forms no attention weights on a packed row (its "
                         "indexed attention attends to selected keys only); run each document unpacked for them")


def _refuse_text_positions_for_images(module: torch.nn.Module, arguments: dict[str, Any]) -> None:
    """A packed row with images or videos, for a model that numbers its tokens with M-RoPE, needs each document's
    3-D positions as it gets them alone (docs/api.md §3b): 2-D (or no) ``position_ids`` would number the vision
    tokens as text, silently."""
    grids = [arguments.get(key) for key in (IMAGE_GRID_THW, VIDEO_GRID_THW)]
    if all(grid is None or (isinstance(grid, torch.Tensor) and grid.numel() == 0) for grid in grids):
        return
    positions = arguments.get(POSITION_IDS)
    if getattr(positions, "ndim", 0) != 3 and numbers_with_mrope(module):
        got = "none" if positions is None else f"{getattr(positions, 'ndim', '?')}-D ones"
        raise InputError(f"{POSITION_IDS}: a packed row with images or videos needs the M-RoPE positions each "
                         f"document gets alone ([3, 1, T]); got {got}: collate with "
                         "PackingCollator(position_ids_fn=mrope_position_ids(model))")


def _enter(signature: _Signature, module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any],
           ) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
    """Forward pre-hook: a packed call's keywords as ``boundaries=``; None (unchanged) for any other call.

    The keywords lose the collator's boundary keys and ``attention_mask``, and get ``boundaries``, restarting
    ``position_ids`` and ``use_cache=False`` where the forward takes them by keyword. Positional arguments stay
    positional (reentrant checkpointing needs the hidden states there).
    """
    given_positionally = signature.positional[:len(args)]
    arguments = {**dict(zip(given_positionally, args, strict=False)), **kwargs}
    if arguments.get(BOUNDARIES) is None and handed_off(module) is not None:
        arguments[BOUNDARIES] = handed_off(module)
    boundaries = packed_call_boundaries(arguments, by_positions=signature.by_positions)
    if boundaries is None:
        return None
    _refuse_attention_weights(module, kwargs)
    _refuse_text_positions_for_images(module, arguments)
    if arguments.get(SHIFT_LABELS) is not None or arguments.get(LABELS) is not None:
        require_row_count(boundaries, arguments.get(NUM_ITEMS_IN_BATCH),
                          labels_given=arguments.get(SHIFT_LABELS) is None)
    tokens = _tokens(arguments)   # input_ids, inputs_embeds or hidden_states, given by name or position
    if tokens is not None and boundaries.device != tokens.device:
        boundaries = boundaries.to(tokens.device)
    kwargs = {key: value for key, value in kwargs.items()
              if key not in (*EXPLICIT_BOUNDARY_KEYS, HOST_BOUNDARIES, ATTENTION_MASK)}
    kwargs[BOUNDARIES] = boundaries
    if signature.takes_position_ids and POSITION_IDS not in given_positionally:
        kwargs[POSITION_IDS] = _positions(arguments.get(POSITION_IDS), boundaries)
    if signature.takes_use_cache and USE_CACHE not in given_positionally:
        kwargs[USE_CACHE] = False
    return args, kwargs


class _EntryHook:
    """The hooks of one entry (a class, not a closure: a patched model deep-copies and pickles). A Hugging Face
    model entry also records its call, packed or not, in the running context for the length of the call
    (:mod:`.mask`: no mask for a packed row); nothing is stored on the model or its config."""

    def __init__(self, signature: _Signature) -> None:
        self.signature = signature

    def __call__(self, module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        call = _enter(self.signature, module, args, kwargs)
        if self.signature.by_positions:
            if call is not None:   # an implementation registered after patch_model is served too
                wrap_attention(module.config._attn_implementation)
            if not torch.compiler.is_compiling():   # a traced mask is dead code in the packed graph
                if call is not None:   # a model patched in another process: its family's builders, here
                    skip_masks_of_packed_calls(module)
                enter_call(module, module.config, call is not None)
        return call

    def after(self, module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> None:
        if not torch.compiler.is_compiling():
            exit_call(module)


# {id(child): boundaries} handed by a parent to its child for the parent's call running in this context.
_HANDED: contextvars.ContextVar[dict[int, Any] | None] = contextvars.ContextVar("hybrid_pack_handed_off", default=None)
# While torch.compile traces a call (it cannot trace a ContextVar), the same hand-off as an attribute of the child:
# the trace bakes it into the graph, and the attribute is None again when the call returns.
_TRACED_HAND_OFF = "_hybrid_pack_traced_boundaries"


def _hand(child: torch.nn.Module, boundaries: Any) -> Any:
    """Hand ``boundaries`` (None: take them back) to ``child`` in this context; returns what it held before."""
    before = handed_off(child)
    if torch.compiler.is_compiling():
        setattr(child, _TRACED_HAND_OFF, boundaries)
        return before
    handed = _HANDED.get() or {}
    _HANDED.set({key: value for key, value in handed.items() if key != id(child)} if boundaries is None
                else {**handed, id(child): boundaries})
    return before


def handed_off(module: torch.nn.Module) -> PackedBoundaries | StaticBoundaries | None:
    """The boundaries a parent handed to ``module`` for the parent's call in this context (:func:`hand_off`)."""
    if torch.compiler.is_compiling():
        return getattr(module, _TRACED_HAND_OFF, None)
    return (_HANDED.get() or {}).get(id(module))


class _HandOff:
    """Pre- and post-hook of a module whose forward does not pass its keywords on to its child ``name`` (Jamba's
    Mamba decoder layer, Mamba2's causal LM): the module's ``boundaries`` are handed to the child, in the running
    context only, for the duration of the module's call and of every gradient-checkpointing recompute of it
    (transformers checkpoints the forward inside the hooks, with the call's keywords: :class:`_RecomputeHandingOff`
    reads them from there)."""

    def __init__(self, name: str) -> None:
        self.name = name

    def before(self, module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if not torch.compiler.is_compiling():  # the module's own call: its forward is not entered directly
            _CALLING.set((*_CALLING.get(), id(module)))
        checkpoint = getattr(module, "_gradient_checkpointing_func", None)
        if checkpoint is not None and not isinstance(checkpoint, _RecomputeHandingOff):
            module._gradient_checkpointing_func = _RecomputeHandingOff(module, self.name, checkpoint)
        for child in _receivers(module, self.name):
            _hand(child, kwargs.get(BOUNDARIES))

    def after(self, module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> None:
        calling = () if torch.compiler.is_compiling() else _CALLING.get()
        if id(module) in calling:
            last = len(calling) - 1 - calling[::-1].index(id(module))
            _CALLING.set(calling[:last] + calling[last + 1:])
        for child in _receivers(module, self.name):
            _hand(child, None)


def forward_slot(module: torch.nn.Module) -> str:
    """Where ``module``'s forward is replaced: ``forward``, or under an accelerate hook (offloading, ``device_map``)
    the ``_old_forward`` the hook wraps."""
    return "_old_forward" if hasattr(module, "_hf_hook") and hasattr(module, "_old_forward") else "forward"


def receives_hand_offs(module: torch.nn.Module) -> None:
    """Mark ``module`` as one that reads the boundaries a parent hands it (an entry, a patched mixer); the attribute
    is there from the patch on: a compiled graph guards on it."""
    if _TRACED_HAND_OFF not in module.__dict__:
        setattr(module, _TRACED_HAND_OFF, None)


def _receivers(module: torch.nn.Module, name: str) -> list[torch.nn.Module]:
    """The modules reading what ``module`` hands to ``module.<name>`` (each module of it when it is a ``ModuleList``,
    a backbone's layers): the child itself, or, in a wrapper around it (PEFT's ``modules_to_save`` copies), each
    outermost module below it that reads hand-offs."""
    child = getattr(module, name)
    return [reader for m in (child if isinstance(child, torch.nn.ModuleList) else [child]) for reader in _readers(m)]


def _readers(module: torch.nn.Module) -> list[torch.nn.Module]:
    if _TRACED_HAND_OFF in module.__dict__:
        return [module]
    return [reader for child in module.children() for reader in _readers(child)]


class _RecomputeHandingOff:
    """``module``'s gradient-checkpointing function, handing the checkpointed call's ``boundaries`` to the child
    ``name`` while the call (and its recompute, possibly on another thread) runs. Picklable."""

    def __init__(self, module: torch.nn.Module, name: str, checkpoint: Callable[..., Any]) -> None:
        self.module, self.name, self.checkpoint = module, name, checkpoint

    def __call__(self, function: functools.partial, *args: Any, **kwargs: Any) -> Any:
        return self.checkpoint(_HandingOff(_receivers(self.module, self.name), function), *args, **kwargs)


class _HandingOff:
    """``function`` run with its ``boundaries`` keyword handed to ``children`` (see :class:`_RecomputeHandingOff`)."""

    def __init__(self, children: list[torch.nn.Module], function: functools.partial) -> None:
        self.children, self.function = children, function

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        restore = [_hand(child, self.function.keywords.get(BOUNDARIES)) for child in self.children]
        try:
            return self.function(*args, **kwargs)
        finally:
            for child, before in zip(self.children, restore):
                _hand(child, before)


def hand_off(module: torch.nn.Module, child: str) -> None:
    """Hand ``module``'s ``boundaries`` keyword to ``module.<child>`` during every call of ``module`` (nothing
    where the child is None: a layer without it); a direct eager call of ``module.forward`` goes through
    ``module(...)`` (:class:`_ThroughHooks`)."""
    if getattr(module, child, None) is None:
        return
    hook = _HandOff(child)
    module.register_forward_pre_hook(hook.before, with_kwargs=True)
    module.register_forward_hook(hook.after, with_kwargs=True, always_call=True)
    slot = forward_slot(module)
    if not isinstance(module.__dict__.get(slot), _ThroughHooks):
        setattr(module, slot, _ThroughHooks(module, module.__dict__.get(slot)))


_CALLING: contextvars.ContextVar[tuple[int, ...]] = contextvars.ContextVar("hybrid_pack_calling", default=())
"""The hand-off modules being called (``module(...)``, their hooks run) in the running context, innermost last."""
_BYPASSING: contextvars.ContextVar[int | None] = contextvars.ContextVar("hybrid_pack_bypassing", default=None)
"""The module a direct call is going through ``module(...)`` for: once only, should its hooks not run."""


class _ThroughHooks:
    """The forward of a module that hands its boundaries off: the one it had (``forward``: one set on the instance,
    such as TRL's fused LM head; None: its class's), except for a direct ``module.forward(...)`` call in eager
    mode. That call skips the module's hooks, the entry's and the hand-off's, and the forward drops the packed
    keys (or never passes ``boundaries`` on), so a packed row would run as one document: it goes through
    ``module(...)`` instead, which is the same call for an unpacked one. Picklable (with a picklable
    ``forward``)."""

    def __init__(self, module: torch.nn.Module, forward: Callable[..., Any] | None = None) -> None:
        self.module, self.forward = module, forward

    @property
    def __signature__(self) -> inspect.Signature:
        return inspect.signature(self.forward or type(self.module).forward.__get__(self.module))

    @property
    def __name__(self) -> str:
        return "forward"

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        module = self.module
        if not torch.compiler.is_compiling() and id(module) not in _CALLING.get() and _BYPASSING.get() != id(module):
            token = _BYPASSING.set(id(module))
            try:
                return module(*args, **kwargs)
            finally:
                _BYPASSING.reset(token)
        if self.forward is not None:
            return self.forward(*args, **kwargs)
        return type(module).forward(module, *args, **kwargs)


def install_entry(module: torch.nn.Module) -> None:
    """Give ``module`` the packed-call pre-hook (idempotent); its ``forward`` is left as it is."""
    if is_entry(module):
        return
    hook = _EntryHook(_Signature.of(module))
    receives_hand_offs(module)
    module.register_forward_pre_hook(hook, with_kwargs=True, prepend=True)
    if hook.signature.by_positions:
        module.register_forward_hook(hook.after, with_kwargs=True, always_call=True)
    setattr(module, _ENTRY_FLAG, True)
