"""Probing a model for where documents meet: one packed row run, every submodule's per-token calls recorded,
and the first module whose output (forward) or gradient input (backward) differs while its inputs do not.

The harness (``testing/isolation.py``) and the training-step check (``testing/training_step.py``) localise a leak
with these.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from hybrid_pack.boundaries import PackedBoundaries
from hybrid_pack.errors import InputError
from hybrid_pack.isolation.compare import relative_error
from hybrid_pack.isolation.tolerance import tolerance_for

__all__ = ["dtype_tolerance", "output_logits", "run_row", "output_head_skipped", "first_tensor", "Call",
           "per_token_inputs", "record_calls", "recorded_calls", "leak_origin", "first_backward_leak"]


def dtype_tolerance(model: torch.nn.Module, output_dtype: torch.dtype, device: torch.device) -> float:
    """The tolerance (:data:`hybrid_pack.isolation.TOLERANCE`) of the least precise dtype among the parameters',
    the output's and autocast's."""
    dtypes = {output_dtype}
    param = next((p for p in model.parameters() if p.is_floating_point()), None)
    if param is not None:
        dtypes.add(param.dtype)
    if torch.is_autocast_enabled(device.type):
        dtypes.add(torch.get_autocast_dtype(device.type))
    return tolerance_for(dtypes)


def output_logits(output: Any) -> torch.Tensor:
    if isinstance(output, torch.Tensor):
        return output
    if getattr(output, "logits", None) is not None:
        return output.logits
    # a tuple (``return_dict=False``): its first per-token tensor (after the 0-d loss when labels were given)
    found = [t for t in output if isinstance(t, torch.Tensor) and t.dim() >= 2] if isinstance(output, (tuple, list)) \
        else []
    if found:
        return found[0]
    raise InputError(f"model: expected an output with .logits (or a tensor); got {type(output).__name__}")


def run_row(model: torch.nn.Module, boundaries: PackedBoundaries, *, ids: torch.Tensor | None = None,
         embeds: torch.Tensor | None = None) -> torch.Tensor:
    """Logits ``[T, V]`` of one packed row given as token ids ``[T]`` or embeddings ``[T, E]``."""
    if embeds is not None:
        out = model(inputs_embeds=embeds.unsqueeze(0), **boundaries.batch_kwargs())
    else:
        out = model(input_ids=ids.unsqueeze(0), **boundaries.batch_kwargs())
    return output_logits(out)[0]


@contextlib.contextmanager
def output_head_skipped(model: torch.nn.Module) -> Iterator[bool]:
    """While inside, the output head returns its input: the model's output is its last hidden states.

    Yields whether it did: only for an ``nn.Linear`` head that ``get_output_embeddings()`` names.
    """
    head = model.get_output_embeddings() if callable(getattr(model, "get_output_embeddings", None)) else None
    if not isinstance(head, torch.nn.Linear):
        yield False
        return
    head.forward = _identity  # an instance attribute shadows the class's forward; hooks still run
    try:
        yield True
    finally:
        del head.forward


def _identity(hidden_states: torch.Tensor) -> torch.Tensor:
    return hidden_states


def first_tensor(value: Any, t_len: int) -> torch.Tensor | None:
    """The first tensor of a module's output that is per token, as ``[1, T, ...]``.

    Token-major ``[1, T, ...]`` is taken as is; channels-first ``[1, C, L]`` (``nn.Conv1d``), whose
    first ``T`` of ``L >= T`` steps are the tokens (a causal conv's output before its tail is cut),
    is moved to token-major.
    """
    items = value if isinstance(value, (tuple, list)) else (value,)
    for item in items:
        if not isinstance(item, torch.Tensor) or item.dim() < 2 or item.shape[0] != 1:
            continue
        if item.shape[1] == t_len:
            return item
        if item.dim() == 3 and t_len <= item.shape[2] < t_len + 16:
            return item[:, :, :t_len].transpose(1, 2)
    return None


@dataclass
class Call:
    """One submodule call: its per-token inputs and output, as float64 ``[1, T, ...]`` copies."""

    name: str
    inputs: list[torch.Tensor]
    output: torch.Tensor


def per_token_inputs(values: Any, t_len: int) -> list[torch.Tensor]:
    found = (first_tensor(v, t_len) for v in values)
    return [t.detach().double().clone() for t in found if t is not None]


@contextlib.contextmanager
def record_calls(model: torch.nn.Module, t_len: int) -> Iterator[list[Call]]:
    """Record every submodule call with a per-token output, in completion order (children first)."""
    calls: list[Call] = []
    handles = []
    for name, module in model.named_modules():
        if not name:
            continue

        def hook(mod: torch.nn.Module, args: Any, kwargs: Any, output: Any, name: str = name) -> None:
            out = first_tensor(output, t_len)
            if out is not None:
                inputs = per_token_inputs(list(args) + list(kwargs.values()), t_len)
                calls.append(Call(name, inputs, out.detach().double().clone()))

        handles.append(module.register_forward_hook(hook, with_kwargs=True))
    try:
        yield calls
    finally:
        for h in handles:
            h.remove()


def recorded_calls(model: torch.nn.Module, boundaries: PackedBoundaries, ids: torch.Tensor) -> list[Call]:
    """Every submodule call of one forward run, for localising a leak (only run once one was found)."""
    with torch.no_grad(), record_calls(model, boundaries.total_tokens) as calls:
        run_row(model, boundaries, ids=ids)
    return calls


def leak_origin(first: list[Call], second: list[Call], pick_first: Any, pick_second: Any, atol: float) -> str | None:
    """The first module whose output differs between two runs while none of its inputs does.

    ``pick_first`` / ``pick_second`` select the compared tokens of a ``[1, T, ...]`` tensor of each run.
    Differences are judged relative to each tensor's own magnitude (:func:`~hybrid_pack.isolation.relative_error`:
    activations of small random models are tiny, and a later norm can blow a small leak up). Falls back to the
    first module whose output differs when every such module had a differing input.
    """

    def differs(a: torch.Tensor, b: torch.Tensor) -> bool:
        return not relative_error(pick_first(a), pick_second(b)) <= atol

    def keyed(calls: list[Call]) -> dict[tuple[str, int], Call]:
        seen: dict[str, int] = {}
        out = {}
        for call in calls:
            seen[call.name] = seen.get(call.name, -1) + 1
            out[(call.name, seen[call.name])] = call
        return out

    others = keyed(second)
    dirty = None
    for key, a in keyed(first).items():
        b = others.get(key)
        if b is None or not differs(a.output, b.output):
            continue
        dirty = dirty or a.name
        if len(a.inputs) == len(b.inputs) and not any(differs(x, y) for x, y in zip(a.inputs, b.inputs)):
            return a.name
    return dirty


def first_backward_leak(model: torch.nn.Module, loss_fn: Any, others: torch.Tensor, t_len: int) -> str | None:
    """Innermost module whose gradient output is clean on other documents but whose gradient input is not."""
    flagged: list[str] = []
    handles = []
    for name, module in model.named_modules():
        if not name:
            continue

        def hook(mod: torch.nn.Module, grad_in: Any, grad_out: Any, name: str = name) -> None:
            go, gi = first_tensor(grad_out, t_len), first_tensor(grad_in, t_len)
            if go is not None and gi is not None and go[0, others].abs().max() == 0 and gi[0, others].abs().max() > 0:
                flagged.append(name)

        handles.append(module.register_full_backward_hook(hook))
    try:
        loss_fn().backward()
    except RuntimeError:
        return None
    finally:
        for h in handles:
            h.remove()
        model.zero_grad(set_to_none=True)
    innermost = [n for n in flagged if not any(o.startswith(n + ".") for o in flagged)]
    return innermost[-1] if innermost else None
