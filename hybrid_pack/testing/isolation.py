"""The cross-contamination harness: does any document of a packed row see another one?

For each layout, three checks run on the model as a black box that takes the docs/api.md §3 batch and
returns logits:

* packed against alone: each document's outputs in the packed row equal its outputs run by itself;
* perturbation: changing one document's tokens moves no other document's outputs;
* gradients: one document's outputs have exactly zero gradient on other documents' input embeddings.

Differences are relative errors (:func:`hybrid_pack.isolation.relative_error`) judged against the one
tolerance table (:data:`hybrid_pack.isolation.TOLERANCE`), as in the guard and the backends' self-check.

The outputs compared are the hidden states that enter the output head when the model has one
(``get_output_embeddings()`` is an ``nn.Linear``), else the logits. The head maps each token's
hidden state to its logits on its own (``logits[t] = W h[t]``), so a document's logits can depend
on another document only through its hidden states: a leak in the logits is a leak in the hidden
states, forward and backward, and comparing the hidden states is at least as strict (it also sees a
leak the head would project away). It spares a ``[T, vocab]`` matmul, its backward and its copies
per run: at a 151,680-token vocabulary that was most of the check's time.

When a check fails, hooks name the first module whose output for one document depends on
another (forward leaks), or whose backward sends gradient across documents (backward leaks).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from tqdm.auto import tqdm

from hybrid_pack.boundaries import PackedBoundaries
from hybrid_pack.errors import InputError, IsolationError, UnsupportedModelError
from hybrid_pack.isolation import (
    Layout,
    adversarial_layouts,
    leaked_gradient,
    model_geometry,
    relative_error,
    tolerance_for,
)
from hybrid_pack.multimodal import PositionIdsFn
from hybrid_pack.testing.multimodal import (
    check_vision_layout,
    given_vision_documents,
    text_vocab_size,
    vision_config,
    vision_layouts,
    vision_position_rule,
    vision_samples,
)
from hybrid_pack.testing.report import DocumentResult, IsolationReport, LayoutResult

__all__ = ["check_isolation", "assert_isolated", "IsolationError"]


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


def _logits(output: Any) -> torch.Tensor:
    if isinstance(output, torch.Tensor):
        return output
    if getattr(output, "logits", None) is not None:
        return output.logits
    if isinstance(output, (tuple, list)) and output and isinstance(output[0], torch.Tensor):
        return output[0]
    raise InputError(f"model: expected an output with .logits (or a tensor); got {type(output).__name__}")


def _run_batch(model: torch.nn.Module, batch: Mapping[str, Any], embeds_leaf: list[torch.Tensor] | None = None,
               ) -> torch.Tensor:
    """Outputs ``[T, D]`` (float) of one packed row given as a whole batch (a vision-language row: pixels, grids,
    M-RoPE positions). With ``embeds_leaf``, the input embeddings ``[1, T, E]`` are made a leaf tensor that takes
    gradient and appended to it."""

    def leaf(module: torch.nn.Module, args: Any, output: torch.Tensor) -> torch.Tensor:
        embeds = output.detach().requires_grad_(True)
        embeds_leaf.append(embeds)
        return embeds

    handle = None if embeds_leaf is None else model.get_input_embeddings().register_forward_hook(leaf)
    try:
        return _logits(model(**batch))[0].float()
    finally:
        if handle is not None:
            handle.remove()


def _vision_localisers(model: torch.nn.Module, atol: float) -> dict[str, Any]:
    """The localisations of a vision-language row: forward (two batches, the tokens compared in each) and
    backward (a loss and the other documents' tokens). Forward, the vision tower (the submodule whose config is
    ``config.vision_config``) is left out: its outputs are per patch, not per token of the row, and a perturbed
    document's new pixels change them by design."""
    vision = getattr(getattr(model, "config", None), "vision_config", None)
    towers = tuple(f"{name}." for name, module in model.named_modules()
                   if vision is not None and getattr(module, "config", None) is vision)

    def recorded(batch: Mapping[str, Any]) -> list[_Call]:
        with torch.no_grad(), _record_calls(model, batch["input_ids"].shape[1]) as calls:
            _run_batch(model, batch)
        return [call for call in calls if not (towers and f"{call.name}.".startswith(towers))]

    return {"forward": lambda first, second, pick_first, pick_second: _origin(
                recorded(first), recorded(second), pick_first, pick_second, atol),
            "backward": lambda loss_fn, others: _first_backward_leak(model, loss_fn, others, others.shape[0])}


def _run(model: torch.nn.Module, boundaries: PackedBoundaries, *, ids: torch.Tensor | None = None,
         embeds: torch.Tensor | None = None) -> torch.Tensor:
    """Logits ``[T, V]`` of one packed row given as token ids ``[T]`` or embeddings ``[T, E]``."""
    if embeds is not None:
        out = model(inputs_embeds=embeds.unsqueeze(0), **boundaries.batch_kwargs())
    else:
        out = model(input_ids=ids.unsqueeze(0), **boundaries.batch_kwargs())
    return _logits(out)[0]


@contextlib.contextmanager
def _output_head_skipped(model: torch.nn.Module) -> Iterator[bool]:
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


def _first_tensor(value: Any, t_len: int) -> torch.Tensor | None:
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
class _Call:
    """One submodule call: its per-token inputs and output, as float64 ``[1, T, ...]`` copies."""

    name: str
    inputs: list[torch.Tensor]
    output: torch.Tensor


def _per_token(values: Any, t_len: int) -> list[torch.Tensor]:
    found = (_first_tensor(v, t_len) for v in values)
    return [t.detach().double().clone() for t in found if t is not None]


@contextlib.contextmanager
def _record_calls(model: torch.nn.Module, t_len: int) -> Iterator[list[_Call]]:
    """Record every submodule call with a per-token output, in completion order (children first)."""
    calls: list[_Call] = []
    handles = []
    for name, module in model.named_modules():
        if not name:
            continue

        def hook(mod: torch.nn.Module, args: Any, kwargs: Any, output: Any, name: str = name) -> None:
            out = _first_tensor(output, t_len)
            if out is not None:
                inputs = _per_token(list(args) + list(kwargs.values()), t_len)
                calls.append(_Call(name, inputs, out.detach().double().clone()))

        handles.append(module.register_forward_hook(hook, with_kwargs=True))
    try:
        yield calls
    finally:
        for h in handles:
            h.remove()


def _recorded_calls(model: torch.nn.Module, boundaries: PackedBoundaries, ids: torch.Tensor) -> list[_Call]:
    """Every submodule call of one forward run, for localising a leak (only run once one was found)."""
    with torch.no_grad(), _record_calls(model, boundaries.total_tokens) as calls:
        _run(model, boundaries, ids=ids)
    return calls


def _origin(first: list[_Call], second: list[_Call], pick_first: Any, pick_second: Any, atol: float) -> str | None:
    """The first module whose output differs between two runs while none of its inputs does.

    ``pick_first`` / ``pick_second`` select the compared tokens of a ``[1, T, ...]`` tensor of each run.
    Differences are judged relative to each tensor's own magnitude (:func:`~hybrid_pack.isolation.relative_error`:
    activations of small random models are tiny, and a later norm can blow a small leak up). Falls back to the
    first module whose output differs when every such module had a differing input.
    """

    def differs(a: torch.Tensor, b: torch.Tensor) -> bool:
        return not relative_error(pick_first(a), pick_second(b)) <= atol

    def keyed(calls: list[_Call]) -> dict[tuple[str, int], _Call]:
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


def _first_backward_leak(model: torch.nn.Module, loss_fn: Any, others: torch.Tensor, t_len: int) -> str | None:
    """Innermost module whose gradient output is clean on other documents but whose gradient input is not."""
    flagged: list[str] = []
    handles = []
    for name, module in model.named_modules():
        if not name:
            continue

        def hook(mod: torch.nn.Module, grad_in: Any, grad_out: Any, name: str = name) -> None:
            go, gi = _first_tensor(grad_out, t_len), _first_tensor(grad_in, t_len)
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


def _check_layout(model: torch.nn.Module, layout: Layout, vocab_size: int, generator: torch.Generator,
                  device: torch.device, dtype: torch.dtype, *, documents: Sequence[Sequence[int]] | None,
                  grads: bool, per_layer: bool, atol: float, grad_atol: float, bar: tqdm) -> LayoutResult:
    boundaries = layout.boundaries(device)
    t_len = boundaries.total_tokens
    if documents is not None:
        ids = torch.cat([torch.as_tensor(d, dtype=torch.long) for d in documents]).to(device)
        if layout.num_pad_tokens:
            ids = torch.cat([ids, ids.new_zeros(layout.num_pad_tokens)])
    else:
        ids = torch.randint(0, vocab_size, (t_len,), generator=generator).to(device)
    starts = boundaries.starts
    result = LayoutResult(layout.name, list(layout.lengths), layout.num_pad_tokens,
                          [DocumentResult(i, n) for i, n in enumerate(layout.lengths)])
    positions = torch.arange(t_len, device=device)

    with torch.no_grad():
        packed = _run(model, boundaries, ids=ids).float()
    bar.update()
    with torch.no_grad():
        for doc in result.documents:
            s, e = starts[doc.index], starts[doc.index] + doc.length
            lone = PackedBoundaries.from_lengths([doc.length], device=device)
            alone = _run(model, lone, ids=ids[s:e]).float()
            doc.alone_diff = relative_error(packed[s:e], alone)
            bar.update()
    for doc in result.documents:
        s, e = starts[doc.index], starts[doc.index] + doc.length
        others = (positions < s) | (positions >= e)
        moved_ids = ids.clone()
        shift = torch.randint(1, vocab_size, (e - s,), generator=generator).to(device)
        moved_ids[s:e] = (ids[s:e] + shift) % vocab_size
        with torch.no_grad():
            moved = _run(model, boundaries, ids=moved_ids).float()
        doc.perturbation_leak = relative_error(moved[others], packed[others])
        bar.update()
        if doc.perturbation_leak > atol and result.first_leaking_module is None and per_layer:
            result.first_leaking_module = _origin(_recorded_calls(model, boundaries, ids),
                                                  _recorded_calls(model, boundaries, moved_ids),
                                                  lambda t, m=others: t[0, m], lambda t, m=others: t[0, m], atol)
            result.leak_kind = "forward"

    mismatched = [d for d in result.documents if not d.alone_diff <= atol]
    if mismatched and result.first_leaking_module is None and per_layer:
        doc = max(mismatched, key=lambda d: d.length)
        s, e = starts[doc.index], starts[doc.index] + doc.length
        alone_calls = _recorded_calls(model, PackedBoundaries.from_lengths([doc.length], device=device), ids[s:e])
        result.first_leaking_module = _origin(_recorded_calls(model, boundaries, ids), alone_calls,
                                              lambda t: t[0, s:e], lambda t: t[0], atol)
        result.leak_kind = "packed differs from alone"

    embed = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    if grads and embed is not None:
        embeds = embed(ids.unsqueeze(0))[0].detach().to(dtype).requires_grad_(True)
        weights = torch.randn(packed.shape, generator=generator).to(device)
        logits = _run(model, boundaries, embeds=embeds).float()
        bar.update()
        for doc in result.documents:
            s, e = starts[doc.index], starts[doc.index] + doc.length
            others = (positions < s) | (positions >= e)
            (grad,) = torch.autograd.grad((logits[s:e] * weights[s:e]).sum(), embeds, retain_graph=True)
            doc.gradient_leak = leaked_gradient(grad, slice(s, e))
            bar.update()
            if doc.gradient_leak > grad_atol and result.first_leaking_module is None and per_layer:

                def loss_of_doc(s: int = s, e: int = e) -> torch.Tensor:
                    x = embeds.detach().requires_grad_(True)
                    return (_run(model, boundaries, embeds=x).float()[s:e] * weights[s:e]).sum()

                result.first_leaking_module = _first_backward_leak(model, loss_of_doc, others, t_len)
                result.leak_kind = "backward"
    result.ok = all(d.alone_diff <= atol and (d.perturbation_leak or 0.0) <= atol
                    and (d.gradient_leak or 0.0) <= grad_atol for d in result.documents)
    return result


def check_isolation(model: Any, *, batch: Mapping[str, Any] | None = None, lengths: Sequence[int] | None = None,
                    documents: Sequence[Sequence[int] | Mapping[str, Any]] | None = None,
                    vocab_size: int | None = None, grads: bool = True, per_layer: bool = True, seed: int = 0,
                    atol: float | None = None, grad_atol: float = 0.0, num_pad_tokens: int = 0,
                    max_tokens: int = 512, progress: bool | None = None, multimodal: bool | None = None,
                    position_ids_fn: PositionIdsFn | None = None) -> IsolationReport:
    """Check that ``model`` keeps the documents of a packed row apart.

    Given a ``transformers.Trainer`` (``trl.SFTTrainer`` included), or a model together with a real ``batch``,
    the check runs on the path that trains instead: :func:`~hybrid_pack.testing.check_training_step` (the
    trainer's ``compute_loss`` on its first training batch, or on ``batch``), and the layout arguments below
    do not apply.

    Args:
        model: takes the docs/api.md §3 batch (``input_ids`` or ``inputs_embeds`` plus boundary keys) and returns
            logits (a tensor, or an object with ``.logits``). Run in eval mode; its mode is restored. Or a
            ``transformers.Trainer``.
        batch: a real packed batch to run through the model (or the trainer) instead of random layouts.
        lengths: one layout of random documents with these lengths. Default: the adversarial layouts
            for the chunk sizes and conv widths the model uses.
        documents: token ids of the documents to pack (overrides ``lengths``); or, for a vision-language model,
            processor-style samples (dicts of ``input_ids``, ``mm_token_type_ids``, ``pixel_values``,
            ``image_grid_thw``, ``pixel_values_videos``, ``video_grid_thw``; docs/api.md §3b), packed with
            :class:`~hybrid_pack.PackingCollator` and ``position_ids_fn``, each checked against itself packed alone.
        vocab_size: range of random token ids (default: ``model.config.vocab_size``; for a vision-language model, the
            text vocabulary below its smallest vision token id).
        grads: run the gradient check (needs ``get_input_embeddings`` and ``inputs_embeds``).
        per_layer: localise a leak to the first leaking module.
        seed: seeds the random tokens and gradient weights.
        atol: tolerance on the relative error of the outputs (:func:`~hybrid_pack.isolation.relative_error`); default:
            :data:`~hybrid_pack.isolation.TOLERANCE` of the least precise of the parameters' and autocast's dtype.
        grad_atol: tolerance on cross-document gradients (default exactly zero).
        num_pad_tokens: add a trailing padding segment to the ``lengths`` / ``documents`` layout.
        max_tokens: longest default layout.
        progress: a progress bar on stderr, one step per model run; default: when stderr is a terminal.
        multimodal: also check the vision-language layouts (:func:`~hybrid_pack.testing.multimodal.vision_layouts`:
            images at the row start, an image document across the middle, a text-only document between two image
            documents), with random pixel values of valid grid sizes. Default: when the model's config names vision
            tokens and a ``vision_config``; True on another model raises ``UnsupportedModelError``.
        position_ids_fn: the per-sample position rule the vision-language rows are packed with (docs/api.md §3b);
            default: the model's own M-RoPE rule when it has ``get_rope_index``, else restarting 1-D positions.

    Returns:
        An :class:`IsolationReport`; ``report.ok`` is the verdict.
    """
    from hybrid_pack.testing.training_step import check_training_step, is_trainer

    if batch is not None or is_trainer(model):
        return check_training_step(model, batch, grads=grads, per_layer=per_layer, atol=atol, grad_atol=grad_atol,
                                   seed=seed)
    param = next((p for p in model.parameters() if p.is_floating_point()), None)
    device = param.device if param is not None else torch.device("cpu")
    dtype = param.dtype if param is not None else torch.float32
    atol = dtype_tolerance(model, dtype, device) if atol is None else float(atol)
    vision = vision_config(model) if multimodal is not False else None
    if multimodal and vision is None:
        raise UnsupportedModelError(f"multimodal: {type(model).__name__}'s config names no image_token_id, "
                                    "vision_start_token_id, vision_end_token_id and vision_config (patch_size, "
                                    "temporal_patch_size, spatial_merge_size, in_channels) to build samples from; "
                                    "check your own samples with check_isolation(model, documents=[...])")
    if vocab_size is None:
        config = getattr(model, "config", None)
        text_config = config.get_text_config() if callable(getattr(config, "get_text_config", None)) else config
        vocab_size = getattr(text_config, "vocab_size", None)
        if vision is not None:
            vocab_size = text_vocab_size(vision)
    if vocab_size is None and documents is None:
        raise InputError("vocab_size: the model has no config.vocab_size; pass vocab_size= (or documents=)")
    samples = None if documents is None else given_vision_documents(documents)
    vision_rows: list[tuple[str, list[dict[str, Any]], int | None]] = []
    generator = torch.Generator().manual_seed(seed)
    if samples is not None:
        vision_rows, layouts = [("given documents", samples, None)], []
    elif documents is not None:
        if not documents or any(len(d) == 0 for d in documents):
            raise InputError("documents: expected a non-empty list of non-empty token-id lists")
        layouts = [Layout("given documents", tuple(len(d) for d in documents), num_pad_tokens)]
        vocab_size = vocab_size or max(max(d) for d in documents) + 1
    elif lengths is not None:
        if not lengths or any(int(n) < 1 for n in lengths):
            raise InputError("lengths: expected a non-empty list of document lengths >= 1")
        layouts = [Layout("given lengths", tuple(int(n) for n in lengths), num_pad_tokens)]
    else:
        chunks, widths = model_geometry(model)
        layouts = adversarial_layouts(chunks, widths, max_tokens=max_tokens)
    if vision is not None and samples is None:
        vision_rows = [(lay.name, vision_samples(vision, lay, generator), lay.pad_to_multiple_of)
                       for lay in vision_layouts(vision)]
    report = IsolationReport(model=type(model).__name__, dtype=str(dtype).removeprefix("torch."), atol=atol,
                             grad_atol=grad_atol, layouts=[])
    has_embeddings = hasattr(model, "get_input_embeddings")
    if grads and not has_embeddings:
        report.skipped.append("gradients: the model has no get_input_embeddings()")
    was_training = model.training
    runs = sum(1 + 2 * len(lay.lengths) + (1 + len(lay.lengths) if grads and has_embeddings else 0)
               for lay in layouts)
    runs += sum(1 + 2 * len(row) + (1 + len(row) if grads and has_embeddings else 0) for _, row, _ in vision_rows)
    model.eval()
    try:
        with (_output_head_skipped(model) as skipped, tqdm(total=runs, desc="isolation check", unit="run",
                                                          disable=None if progress is None else not progress,
                                                          leave=False) as bar):
            report.compared = "hidden states entering the output head" if skipped else "logits"
            for layout in layouts:
                bar.set_postfix_str(layout.name)
                report.layouts.append(_check_layout(model, layout, int(vocab_size), generator, device, dtype,
                                                    documents=documents, grads=grads, per_layer=per_layer,
                                                    atol=atol, grad_atol=grad_atol, bar=bar))
            if vision_rows:
                rule = vision_position_rule(model, position_ids_fn)
                text_vocab = text_vocab_size(vision) if vision is not None else int(vocab_size)
                for name, row, pad_to_multiple_of in vision_rows:
                    bar.set_postfix_str(name)
                    report.layouts.append(check_vision_layout(
                        model, name, row, pad_to_multiple_of=pad_to_multiple_of, position_ids_fn=rule,
                        text_vocab=text_vocab, generator=generator, device=device, dtype=dtype,
                        grads=grads and has_embeddings, per_layer=per_layer, atol=atol, grad_atol=grad_atol,
                        run=functools.partial(_run_batch, model), localise=_vision_localisers(model, atol),
                        step=bar.update))
    except Exception as err:  # a model that cannot take a packed batch is reported, not hidden
        report.error = f"{type(err).__name__}: {err}"
    finally:
        model.train(was_training)
    return report


def assert_isolated(model: Any, **kwargs: Any) -> IsolationReport:
    """:func:`check_isolation`, raising :class:`~hybrid_pack.errors.IsolationError` (an AssertionError) with the
    report on a leak."""
    report = check_isolation(model, **kwargs)
    if not report.ok:
        raise IsolationError(report)
    return report
