"""Where a packed batch enters a patched model: the boundaries become one keyword argument.

A trainer or wrapper may call the top-level model, its backbone (TRL's fused LM head calls
``model.base_model`` directly) or one decoder layer (pipeline schedules). Each of them gets a forward
pre-hook (:func:`install_entry`): the first one that receives the packed keys (the collator's
``cu_seq_lens_q/k``, ``seq_idx``, ``max_length_q/k``, ``num_pad_tokens``, or restarting ``position_ids``
alone) replaces them by ``boundaries=`` (a :class:`~hybrid_pack.PackedBoundaries`), restarting
``position_ids`` (for RoPE and the model's own packed-sequence masks) and ``use_cache=False``.

From there the model's own ``**kwargs`` plumbing carries ``boundaries`` to every decoder layer, attention
function and sequence mixer, as it carries transformers' own flash-attention keywords. Nothing is held
outside the call: a gradient-checkpointing recompute gets the same keywords back, and ``torch.compile``
traces the hook like any other code (inside a trace the boundaries are
:class:`~hybrid_pack.boundaries.static.StaticBoundaries`, read from shapes only). The module's ``forward``
itself is never replaced, so its signature is the unpatched one.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from hybrid_pack.boundaries import PackedBoundaries
from hybrid_pack.boundaries.static import StaticBoundaries
from hybrid_pack.errors import BoundaryError, InputError
from hybrid_pack.integrations.transformers.mask import mark_packed_call, unmark_packed_call
from hybrid_pack.parallel.boundaries import ShardedBoundaries
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

__all__ = ["EXPLICIT_BOUNDARY_KEYS", "install_entry", "is_entry", "entry_modules", "explicit_keys_in",
           "stray_keys_error", "packed_call_boundaries", "hand_off", "handed_off"]

EXPLICIT_BOUNDARY_KEYS = tuple(key for key in BOUNDARY_KEYS if key != POSITION_IDS)
"""Keys that only a packed call carries (``position_ids`` alone is packed only when it restarts)."""

OUTPUT_ATTENTIONS = "output_attentions"
_HIDDEN_STATES = "hidden_states"
_ENTRY_FLAG = "_hybrid_pack_entry"
_HANDED_OFF = "_hybrid_pack_boundaries"


def explicit_keys_in(kwargs: dict[str, Any]) -> list[str]:
    """The explicit boundary keys given a value in ``kwargs``."""
    return [key for key in EXPLICIT_BOUNDARY_KEYS if kwargs.get(key) is not None]


def stray_keys_error(layer: str, keys: list[str]) -> BoundaryError:
    """The error of a patched layer that receives the collator's packed keys instead of ``boundaries``."""
    return BoundaryError(
        f"{layer}: received {', '.join(keys)} but no boundaries, so it would run the packed row as one document. "
        "The keys reached this layer without passing through a patched entry (the model, its backbone or a "
        "decoder layer). Fix: pass the batch to the patched model, model.base_model or a decoder layer, or call "
        "the layer with boundaries=hybrid_pack.PackedBoundaries.from_batch(batch)")


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
    keys = {key: arguments[key] for key in (*BOUNDARY_KEYS, INPUT_IDS) if arguments.get(key) is not None}
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
    explicit = explicit_keys_in(arguments)
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
                             "training and scoring; generate from unpacked inputs")
    if arguments.get(USE_CACHE):
        raise InputError(f"{USE_CACHE}: must be False (or unset) with a packed batch; a cache would mix documents")
    if given is None:
        return _build(arguments)
    if not isinstance(given, (PackedBoundaries, StaticBoundaries, ShardedBoundaries)):
        raise BoundaryError(f"{BOUNDARIES}: expected a hybrid_pack.PackedBoundaries (or a context-parallel shard's "
                            f"ShardedBoundaries from shard_batch); got {type(given).__name__}")
    return given


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
    tokens = _tokens(arguments)   # input_ids, inputs_embeds or hidden_states, given by name or position
    if tokens is not None and boundaries.device != tokens.device:
        boundaries = boundaries.to(tokens.device)
    kwargs = {key: value for key, value in kwargs.items() if key not in (*EXPLICIT_BOUNDARY_KEYS, ATTENTION_MASK)}
    kwargs[BOUNDARIES] = boundaries
    if signature.takes_position_ids and POSITION_IDS not in given_positionally:
        kwargs[POSITION_IDS] = boundaries.document_positions
    if signature.takes_use_cache and USE_CACHE not in given_positionally:
        kwargs[USE_CACHE] = False
    return args, kwargs


class _EntryHook:
    """The hooks of one entry (a class, not a closure: a patched model deep-copies and pickles). A Hugging Face
    model entry also marks its config for the duration of the call (:mod:`.mask`: no mask for a packed row)."""

    def __init__(self, signature: _Signature) -> None:
        self.signature = signature

    def __call__(self, module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        call = _enter(self.signature, module, args, kwargs)
        if self.signature.by_positions:
            if call is not None:   # an implementation registered after patch_model is served too
                from hybrid_pack.integrations.transformers.attention import wrap_attention

                wrap_attention(module.config._attn_implementation)
            mark_packed_call(module.config, call is not None)
        return call

    def after(self, module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> None:
        unmark_packed_call(module.config)


def handed_off(module: torch.nn.Module) -> PackedBoundaries | StaticBoundaries | None:
    """The boundaries a parent handed to ``module`` for the parent's current call (:func:`hand_off`), or None."""
    return getattr(module, _HANDED_OFF, None)


class _HandOff:
    """Pre- and post-hook of a module whose forward does not pass its keywords on to its child ``name`` (Jamba's
    Mamba decoder layer, Mamba2's causal LM): the module's ``boundaries`` are set on the child for the duration
    of the module's call, and of every gradient-checkpointing recompute of it (transformers checkpoints the
    forward inside the hooks, with the call's keywords: :meth:`_recompute_with` reads them from there)."""

    def __init__(self, name: str) -> None:
        self.name = name

    def before(self, module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        checkpoint = getattr(module, "_gradient_checkpointing_func", None)
        if checkpoint is not None and not getattr(checkpoint, _HANDED_OFF, False):
            module._gradient_checkpointing_func = self._recompute_with(module, checkpoint)
        setattr(getattr(module, self.name), _HANDED_OFF, kwargs.get(BOUNDARIES))

    def after(self, module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> None:
        setattr(getattr(module, self.name), _HANDED_OFF, None)

    def _recompute_with(self, module: torch.nn.Module, checkpoint: Callable[..., Any]) -> Callable[..., Any]:
        def checkpoint_handing_off(function: functools.partial, *args: Any, **kwargs: Any) -> Any:
            def run(*inner: Any, **inner_kwargs: Any) -> Any:
                child = getattr(module, self.name)
                handed, restore = function.keywords.get(BOUNDARIES), handed_off(child)
                setattr(child, _HANDED_OFF, handed)
                try:
                    return function(*inner, **inner_kwargs)
                finally:
                    setattr(child, _HANDED_OFF, restore)

            return checkpoint(run, *args, **kwargs)

        setattr(checkpoint_handing_off, _HANDED_OFF, True)
        return checkpoint_handing_off


def hand_off(module: torch.nn.Module, child: str) -> None:
    """Hand ``module``'s ``boundaries`` keyword to ``module.<child>`` during every call of ``module``."""
    setattr(getattr(module, child), _HANDED_OFF, None)
    hook = _HandOff(child)
    module.register_forward_pre_hook(hook.before, with_kwargs=True)
    module.register_forward_hook(hook.after, with_kwargs=True, always_call=True)


def install_entry(module: torch.nn.Module) -> None:
    """Give ``module`` the packed-call pre-hook (idempotent); its ``forward`` is left as it is."""
    if is_entry(module):
        return
    hook = _EntryHook(_Signature.of(module))
    module.register_forward_pre_hook(hook, with_kwargs=True, prepend=True)
    if hook.signature.by_positions:
        module.register_forward_hook(hook.after, with_kwargs=True, always_call=True)
    setattr(module, _ENTRY_FLAG, True)
