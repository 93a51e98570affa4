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

import functools
from collections.abc import Mapping, Sequence
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
)
from hybrid_pack.isolation.probe import (
    Call,
    dtype_tolerance,
    first_backward_leak,
    leak_origin,
    output_head_skipped,
    output_logits,
    record_calls,
    recorded_calls,
    run_row,
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
        return output_logits(model(**batch))[0].float()
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

    def recorded(batch: Mapping[str, Any]) -> list[Call]:
        with torch.no_grad(), record_calls(model, batch["input_ids"].shape[1]) as calls:
            _run_batch(model, batch)
        return [call for call in calls if not (towers and f"{call.name}.".startswith(towers))]

    return {"forward": lambda first, second, pick_first, pick_second: leak_origin(
                recorded(first), recorded(second), pick_first, pick_second, atol),
            "backward": lambda loss_fn, others: first_backward_leak(model, loss_fn, others, others.shape[0])}


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
        packed = run_row(model, boundaries, ids=ids).float()
    bar.update()
    with torch.no_grad():
        for doc in result.documents:
            s, e = starts[doc.index], starts[doc.index] + doc.length
            lone = PackedBoundaries.from_lengths([doc.length], device=device)
            alone = run_row(model, lone, ids=ids[s:e]).float()
            doc.alone_diff = relative_error(packed[s:e], alone)
            bar.update()
    for doc in result.documents:
        s, e = starts[doc.index], starts[doc.index] + doc.length
        others = (positions < s) | (positions >= e)
        moved_ids = ids.clone()
        shift = torch.randint(1, vocab_size, (e - s,), generator=generator).to(device)
        moved_ids[s:e] = (ids[s:e] + shift) % vocab_size
        with torch.no_grad():
            moved = run_row(model, boundaries, ids=moved_ids).float()
        doc.perturbation_leak = relative_error(moved[others], packed[others])
        bar.update()
        if doc.perturbation_leak > atol and result.first_leaking_module is None and per_layer:
            result.first_leaking_module = leak_origin(recorded_calls(model, boundaries, ids),
                                                  recorded_calls(model, boundaries, moved_ids),
                                                  lambda t, m=others: t[0, m], lambda t, m=others: t[0, m], atol)
            result.leak_kind = "forward"

    mismatched = [d for d in result.documents if not d.alone_diff <= atol]
    if mismatched and result.first_leaking_module is None and per_layer:
        doc = max(mismatched, key=lambda d: d.length)
        s, e = starts[doc.index], starts[doc.index] + doc.length
        alone_calls = recorded_calls(model, PackedBoundaries.from_lengths([doc.length], device=device), ids[s:e])
        result.first_leaking_module = leak_origin(recorded_calls(model, boundaries, ids), alone_calls,
                                              lambda t: t[0, s:e], lambda t: t[0], atol)
        result.leak_kind = "packed differs from alone"

    embed = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    if grads and embed is not None:
        embeds = embed(ids.unsqueeze(0))[0].detach().to(dtype).requires_grad_(True)
        weights = torch.randn(packed.shape, generator=generator).to(device)
        logits = run_row(model, boundaries, embeds=embeds).float()
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
                    return (run_row(model, boundaries, embeds=x).float()[s:e] * weights[s:e]).sum()

                result.first_leaking_module = first_backward_leak(model, loss_of_doc, others, t_len)
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
        documents: token ids of the documents to pack (not with ``lengths``); or, for a vision-language model,
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

    for name, value in (("atol", atol), ("grad_atol", grad_atol)):
        if value is not None and not value >= 0:  # NaN fails too
            raise InputError(f"{name}: expected a tolerance >= 0 (None: the dtype's); got {value!r}")
    if batch is not None or is_trainer(model):
        return check_training_step(model, batch, grads=grads, per_layer=per_layer, atol=atol, grad_atol=grad_atol,
                                   seed=seed)
    if not isinstance(model, torch.nn.Module):
        raise InputError(f"model: expected a torch.nn.Module, or a transformers / TRL trainer; got "
                         f"{type(model).__name__}")
    if lengths is not None and documents is not None:
        raise InputError("lengths, documents: give one of them (documents are packed as given, lengths draw random "
                         "tokens)")
    if isinstance(documents, torch.Tensor):
        raise InputError("documents: expected a list of token-id lists (or of 1-D tensors); got one tensor: pass "
                         "list(tensor) or tensor.tolist()")
    if vocab_size is not None and (isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < 1):
        raise InputError(f"vocab_size: expected a positive int; got {vocab_size!r}")
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
        low, high = min(int(min(d)) for d in documents), max(int(max(d)) for d in documents)
        if low < 0 or (vocab_size is not None and high >= vocab_size):
            raise InputError(f"documents: token ids {low}..{high} fall outside the model's vocabulary "
                             f"[0, {vocab_size if vocab_size is not None else 'inf'}); pass ids the model embeds")
        vocab_size = vocab_size or high + 1
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
    if not grads:
        report.skipped.append("gradients: not checked (grads=False; hybrid-pack check --no-grads)")
    was_training = model.training
    runs = sum(1 + 2 * len(lay.lengths) + (1 + len(lay.lengths) if grads and has_embeddings else 0)
               for lay in layouts)
    runs += sum(1 + 2 * len(row) + (1 + len(row) if grads and has_embeddings else 0) for _, row, _ in vision_rows)
    model.eval()
    try:
        with (output_head_skipped(model) as skipped, tqdm(total=runs, desc="isolation check", unit="run",
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
