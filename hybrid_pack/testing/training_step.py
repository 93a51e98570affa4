"""The harness on the path that trains: a training step and its real packed batch, document by document.

:func:`~hybrid_pack.testing.check_isolation` on a model calls its plain forward. A trainer may call
something else: TRL's ``SFTTrainer`` replaces ``model.forward`` with a fused LM head that calls the
backbone directly and returns per-token log-probabilities instead of logits; PEFT, compiled or
checkpointed models add their own layers of calls. :func:`check_training_step` runs the step itself
(``trainer.compute_loss`` for a ``transformers.Trainer``) on the packed batch and on each document
alone, and compares, per document:

* forward: the per-token values the step's model returns (``log_probs`` of a fused head, else
  ``logits``; or the step's own per-token result) against the document's lone run; for a step whose
  per-token values cannot be seen, its loss with every other document's labels masked against its
  loss alone;
* gradient: the same per-document objective must have exactly zero gradient on every other
  document's input embeddings.

Batch-level terms of a loss, such as a Mixture-of-Experts load-balancing loss, couple the documents
of a batch by design; they are left out when the per-token values can be seen (docs/trl.md).
"""

from __future__ import annotations

import contextlib
import copy
import warnings
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from hybrid_pack.boundaries import PackedBoundaries
from hybrid_pack.distributed import Group, agree_max, gather_rows, share_objects
from hybrid_pack.errors import InputError
from hybrid_pack.isolation import leaked_gradient, relative_error
from hybrid_pack.isolation.probe import dtype_tolerance, first_backward_leak, leak_origin, record_calls
from hybrid_pack.isolation.vision import VISION_INPUT_KEYS, document_vision_inputs
from hybrid_pack.schema import (
    BOUNDARY_KEYS,
    HOST_BOUNDARIES,
    IGNORE_INDEX,
    INPUT_IDS,
    INPUTS_EMBEDS,
    LABELS,
    NUM_PAD_TOKENS,
)
from hybrid_pack.testing.ranks import model_group
from hybrid_pack.testing.report import DocumentResult, IsolationReport, LayoutResult

__all__ = ["check_training_step", "is_trainer"]

Step = Callable[[dict[str, Any]], Any]
"""A training step: takes a batch (a dict of the collator's keys) and returns its loss (a scalar tensor,
an output with ``.loss``, or a ``(loss, outputs)`` tuple) or its per-token values."""

_PER_TOKEN_OUTPUTS = ("log_probs", "logits")


def is_trainer(value: Any) -> bool:
    """Whether ``value`` looks like a ``transformers.Trainer`` (it has ``compute_loss`` and ``model``)."""
    return not isinstance(value, torch.nn.Module) and callable(getattr(value, "compute_loss", None)) \
        and isinstance(getattr(value, "model", None), torch.nn.Module)


def _trainer_step(trainer: Any) -> Step:
    """``trainer.compute_loss`` on the model its training step runs (``model_wrapped``: compiled or distributed
    once training has started), the batch prepared (moved to the device) as the training step prepares it."""

    def step(batch: dict[str, Any]) -> Any:
        inputs = trainer._prepare_inputs(batch)
        wrapped = getattr(trainer, "model_wrapped", None)
        with trainer.compute_loss_context_manager():
            return trainer.compute_loss(trainer.model if wrapped is None else wrapped, inputs)

    return step


_PLAIN = (bool, int, float, str, type(None))


def _is_plain(value: Any, depth: int = 0) -> bool:
    """Plain data: scalars, and lists / dicts of them a few levels deep (a trainer's counters and metric lists)."""
    if isinstance(value, _PLAIN):
        return True
    if depth < 3 and isinstance(value, (list, tuple)):
        return all(_is_plain(v, depth + 1) for v in value)
    if depth < 3 and isinstance(value, dict):
        return all(isinstance(k, _PLAIN) and _is_plain(v, depth + 1) for k, v in value.items())
    return False


@contextlib.contextmanager
def _bookkeeping_kept(trainer: Any) -> Iterator[None]:
    """Put back the trainer's plain-data attributes (TRL's token counter and metric lists) after the block, so
    the checks leave no trace in what it logs."""
    saved = {name: copy.deepcopy(value) for name, value in vars(trainer).items() if _is_plain(value)}
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(trainer, name, value)


def _refuse_undrivable(trainer: Any) -> None:
    """A trainer whose ``compute_loss`` is a TRL trainer's own (GRPO, DPO, RLOO, ...) takes its trainer's batch
    layout (prompts, completions, chosen / rejected), not a packed row: it cannot be driven on one."""
    owner = next(klass for klass in type(trainer).__mro__ if "compute_loss" in vars(klass))
    if owner.__module__.split(".")[0] == "trl" and owner.__name__ != "SFTTrainer":
        raise InputError(f"{type(trainer).__name__}: its compute_loss ({owner.__module__}.{owner.__name__}) takes "
                         "that trainer's own batches, not a packed row, so the harness cannot drive it. Supported: "
                         "transformers.Trainer and subclasses keeping a compute_loss that calls the model on the batch "
                         "(hybrid_pack's PackedTrainer), trl.SFTTrainer (PackedSFTTrainer). Check the model instead: "
                         "check_isolation(trainer.model), or attach a PackingGuard while it trains")


def _first_batch(trainer: Any) -> dict[str, Any]:
    return dict(next(iter(trainer.get_train_dataloader())))


@dataclass
class _Run:
    """What one call of the step produced."""

    loss: torch.Tensor | None = None
    values: torch.Tensor | None = None   # per-token output [1, T or T - 1, ...] of the model's first call
    quantity: str | None = None          # what ``values`` is: "log_probs", "logits" or "values"
    embeds: torch.Tensor | None = None   # input embeddings [1, T, E] as a leaf that takes gradient


def _loss_of(result: Any) -> torch.Tensor | None:
    """The scalar loss a step returned (a tensor, ``.loss``, or the first item of a tuple), or None."""
    if isinstance(result, (tuple, list)) and result:
        result = result[0]
    loss = result if isinstance(result, torch.Tensor) else getattr(result, "loss", None)
    return loss if isinstance(loss, torch.Tensor) and loss.numel() == 1 else None


def _per_token_output(output: Any) -> tuple[str, torch.Tensor] | None:
    """The per-token tensor of an output and what it is: ``log_probs`` (a fused LM head), else ``logits``; a bare
    tensor is taken as ``logits`` ``[1, T, V]`` or as per-token ``values`` ``[1, T]`` (log-probs, losses)."""
    for name in _PER_TOKEN_OUTPUTS:
        value = output.get(name) if isinstance(output, Mapping) else getattr(output, name, None)
        if isinstance(value, torch.Tensor):
            return name, value
    if isinstance(output, torch.Tensor) and output.is_floating_point() and output.dim() in (2, 3):
        return ("logits" if output.dim() == 3 else "values"), output
    return None


def _run(step: Step, batch: dict[str, Any], model: torch.nn.Module, *, grad: bool) -> _Run:
    """Call ``step`` on a copy of ``batch``, capturing the model's first output (else the step's own result, when
    it is per-token) and, with ``grad``, the input embeddings as a leaf tensor."""
    run = _Run()

    def capture_output(module: torch.nn.Module, args: Any, output: Any) -> None:
        found = _per_token_output(output)
        if run.values is None and found is not None:
            run.quantity, run.values = found

    def embeddings_leaf(module: torch.nn.Module, args: Any, output: torch.Tensor) -> torch.Tensor | None:
        if run.embeds is not None or not grad:
            return None
        run.embeds = output.detach().requires_grad_(True)
        return run.embeds

    handles = [model.register_forward_hook(capture_output)]
    embeddings = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    if isinstance(embeddings, torch.nn.Module):
        handles.append(embeddings.register_forward_hook(embeddings_leaf))
    try:
        with torch.set_grad_enabled(grad):
            result = step(dict(batch))
    finally:
        for handle in handles:
            handle.remove()
    run.loss = _loss_of(result)
    found = _per_token_output(result) if run.values is None else None
    if found is not None:
        run.quantity, run.values = found
    return run


@contextlib.contextmanager
def _training_mode(model: torch.nn.Module, train: bool) -> Iterator[None]:
    """``model.train(train)`` with every dropout module off; each module's own mode is restored afterwards."""
    modes = [(module, module.training) for module in model.modules()]
    model.train(train)
    for module in model.modules():
        if isinstance(module, torch.nn.modules.dropout._DropoutNd):
            module.eval()
    try:
        yield
    finally:
        for module, mode in modes:
            module.training = mode


@contextlib.contextmanager
def _parameter_grads_kept(model: torch.nn.Module) -> Iterator[None]:
    """Leave every parameter's ``.grad`` as it was, whatever backward passes run inside the block."""
    saved = [(p, p.grad) for p in model.parameters()]
    for p, _ in saved:
        p.grad = None
    try:
        yield
    finally:
        for p, g in saved:
            p.grad = g


def _document_batch(batch: Mapping[str, Any], start: int, length: int, t_len: int) -> dict[str, Any]:
    """One document of a packed batch as a batch of its own: every per-token ``[1, T, ...]`` tensor sliced,
    the boundary keys the batch has rebuilt for a single document, no padding; a vision-language row's pixels,
    grids and 3-D positions the document's own (:func:`~hybrid_pack.isolation.vision.document_vision_inputs`)."""
    tokens = batch.get(INPUT_IDS, batch.get(INPUTS_EMBEDS))
    lone = PackedBoundaries.from_lengths([length], device=tokens.device)
    alone = {**lone.hf_kwargs(), HOST_BOUNDARIES: lone.host()}
    out: dict[str, Any] = {}
    for key, value in batch.items():
        if key == NUM_PAD_TOKENS or key in VISION_INPUT_KEYS:   # pixels and grids: the document's own, below
            continue
        if key in BOUNDARY_KEYS or key == HOST_BOUNDARIES:
            out[key] = alone[key]
        elif isinstance(value, torch.Tensor) and value.dim() >= 2 and tuple(value.shape[:2]) == (1, t_len):
            out[key] = value[:, start:start + length]
        else:
            out[key] = value
    return {**out, **document_vision_inputs(batch, start, length)}   # its pixels, grids, M-RoPE positions


def _labels_of_document(batch: Mapping[str, Any], start: int, length: int) -> dict[str, Any]:
    """``batch`` with every label outside ``[start, start + length)`` set to ``IGNORE_INDEX``."""
    labels = torch.full_like(batch[LABELS], IGNORE_INDEX)
    labels[:, start:start + length] = batch[LABELS][:, start:start + length]
    return {**batch, LABELS: labels}


@dataclass
class _Document:
    """One document of the packed batch: where it sits and how many per-token values it owns."""

    result: DocumentResult
    start: int
    count: int = 0           # per-token values compared (its length, or one less for shifted log-probs)

    @property
    def stop(self) -> int:
        return self.start + self.result.length


@dataclass
class _Probe:
    """The step under test, its batch, and how each run is reduced to one document's objective."""

    step: Step
    model: torch.nn.Module
    batch: dict[str, Any]
    per_token: bool          # judge per-token outputs (else per-document losses, the other labels masked)
    t_len: int
    generator: torch.Generator

    def run(self, doc: _Document | None = None, *, grad: bool = False) -> _Run:
        """The packed batch (with only ``doc``'s labels when judging losses)."""
        batch = self.batch if self.per_token or doc is None else _labels_of_document(self.batch, doc.start,
                                                                                     doc.result.length)
        return _run(self.step, batch, self.model, grad=grad)

    def run_alone(self, doc: _Document) -> _Run:
        alone = _document_batch(self.batch, doc.start, doc.result.length, self.t_len)
        return _run(self.step, alone, self.model, grad=False)

    def objective(self, run: _Run, doc: _Document) -> torch.Tensor:
        """A random weighting of ``doc``'s per-token values (or its loss) in ``run``."""
        if not self.per_token:
            return run.loss
        values = run.values[0, doc.start:doc.start + doc.count].float()
        return (values * torch.randn(values.shape, generator=self.generator).to(values.device)).sum()

    def others(self, doc: _Document, device: torch.device | str = "cpu") -> torch.Tensor:
        """bool ``[T]``: the tokens outside ``doc``."""
        mask = torch.ones(self.t_len, dtype=torch.bool, device=device)
        mask[doc.start:doc.stop] = False
        return mask


def _check_document(probe: _Probe, doc: _Document, packed: _Run, *, grads: bool) -> None:
    """Fill ``doc.result.alone_diff`` and, with ``grads``, ``doc.result.gradient_leak``."""
    alone = probe.run_alone(doc)
    if probe.per_token:
        doc.count = alone.values.shape[1]
        in_row, by_itself = packed.values[0, doc.start:doc.start + doc.count], alone.values[0]
        if in_row.shape != by_itself.shape:     # two different quantities: no verdict either way
            raise InputError(f"step: on the packed batch it returned {packed.quantity} {list(packed.values.shape)}, "
                             f"on document {doc.result.index} alone {alone.quantity} {list(alone.values.shape)}; "
                             "the step must return the same per-token values for both (or pass per_token=False)")
        doc.result.alone_diff = relative_error(in_row, by_itself)
    else:
        doc.count = doc.result.length
        doc.result.alone_diff = relative_error(probe.run(doc).loss, alone.loss)
    if grads:
        run = probe.run(doc, grad=True)
        if run.embeds is None:
            return
        with _parameter_grads_kept(probe.model):
            probe.objective(run, doc).backward()
        doc.result.gradient_leak = leaked_gradient(run.embeds.grad[0], slice(doc.start, doc.stop))


def _localise(probe: _Probe, layout: LayoutResult, docs: list[_Document], atol: float, grad_atol: float,
              group: Group | None) -> None:
    """Name the first leaking module: forward (packed against alone) first, else backward. Under a process group
    every rank runs the same kind of localisation (on its own worst document) and takes the finding rank's."""
    mismatched = [d for d in docs if not d.result.alone_diff <= atol]
    leaking = [d for d in docs if (d.result.gradient_leak or 0.0) > grad_atol]
    kind = 2 if mismatched else 1 if leaking else 0
    if group is not None:
        kind = int(agree_max([kind], group)[0])
    if kind == 2:
        doc = max(mismatched or docs, key=lambda d: d.result.length)
        with torch.no_grad(), record_calls(probe.model, probe.t_len) as packed_calls:
            probe.run(doc)
        with torch.no_grad(), record_calls(probe.model, doc.result.length) as alone_calls:
            probe.run_alone(doc)
        layout.first_leaking_module = leak_origin(packed_calls, alone_calls, lambda t: t[0, doc.start:doc.stop],
                                              lambda t: t[0], atol)
        layout.leak_kind = "packed differs from alone"
    elif kind == 1:
        doc = (max(leaking, key=lambda d: d.result.gradient_leak) if leaking
               else max(docs, key=lambda d: d.result.length))
        with _parameter_grads_kept(probe.model), warnings.catch_warnings():
            # the embedding module's inputs are token ids: its full backward hook only sees its output
            warnings.filterwarnings("ignore", message="Full backward hook is firing")
            layout.first_leaking_module = first_backward_leak(
                probe.model, lambda: probe.objective(probe.run(doc, grad=True), doc),
                probe.others(doc, next(probe.model.parameters()).device), probe.t_len)
        layout.leak_kind = "backward"
    if group is not None:
        layout.first_leaking_module, layout.leak_kind = share_objects(
            (layout.first_leaking_module, layout.leak_kind), group)[_group_rank(group, layout.leak_rank)]


def _group_rank(group: Group, rank: int | None) -> int:
    """The group rank of world rank ``rank`` (0 when None)."""
    return 0 if rank is None else dist.get_group_rank(group, rank)


def _agree_on_layout(layout: LayoutResult, group: Group) -> None:
    """``layout.ok`` on every rank: False wherever any rank's batch leaked, ``leak_rank`` naming the first."""
    finders = [r for r, (leaked,) in enumerate(gather_rows([float(not layout.ok)], group)) if leaked]
    if finders:
        layout.ok, layout.leak_rank = False, dist.get_global_rank(group, finders[0])


def _model_dtype(model: torch.nn.Module) -> torch.dtype:
    param = next((p for p in model.parameters() if p.is_floating_point()), None)
    return param.dtype if param is not None else torch.float32


def _as_step(target: Any, batch: Mapping[str, Any] | None, model: torch.nn.Module | None,
             ) -> tuple[Step, dict[str, Any], torch.nn.Module, str]:
    """(step, batch, model, name) for a trainer, a module or a callable."""
    name = type(target).__name__
    if is_trainer(target):
        _refuse_undrivable(target)
        model = target.model if model is None else model
        batch = _first_batch(target) if batch is None else batch
        warm_up = getattr(target, "warm_up_backends", None)
        if callable(warm_up):  # hybrid_pack's trainers: their backends' warm-ups run now, not inside a checked step
            wrapped = getattr(target, "model_wrapped", None)
            prepared = target._prepare_inputs(dict(batch))
            for grad in (True, False):  # the checked steps run with gradients and without
                with torch.set_grad_enabled(grad):
                    warm_up(target.model if wrapped is None else wrapped, prepared)
        return _trainer_step(target), dict(batch), model, f"{name}({type(model).__name__})"
    if isinstance(target, torch.nn.Module):
        model = target if model is None else model
        step: Step = lambda b: target(**b)  # noqa: E731
    else:
        step = target
    if batch is None:
        raise InputError("batch: a training step is checked on its real packed batch; pass batch=")
    if not isinstance(model, torch.nn.Module):
        raise InputError("model: pass the module the step runs (model=), so its outputs and embeddings can be read")
    return step, dict(batch), model, name


def check_training_step(step: Any, batch: Mapping[str, Any] | None = None, *, model: torch.nn.Module | None = None,
                        per_token: bool | None = None, grads: bool = True, per_layer: bool = True, train: bool = True,
                        atol: float | None = None, grad_atol: float = 0.0, seed: int = 0,
                        group: Group | None = None) -> IsolationReport:
    """Check that a training step keeps the documents of its real packed batch apart.

    Args:
        step: a ``transformers.Trainer`` (``trl.SFTTrainer`` included: its ``compute_loss`` is the step), a model
            (its forward is the step), or a callable taking a batch dict and returning the loss (a scalar tensor,
            an output with ``.loss``, or ``(loss, outputs)``) or per-token values (``logits [1, T, V]``, or an
            output with ``.log_probs`` / ``.logits``).
        batch: one packed batch as the step receives it: ``input_ids [1, T]``, the boundary keys
            (``cu_seq_lens_q`` / ``seq_idx`` / restarting ``position_ids``, ...), ``labels``, any other keys.
            Default for a trainer: the first batch of ``trainer.get_train_dataloader()``. A trainer whose loss is a
            TRL RL or preference trainer's own (GRPO, DPO, ...) is refused (``InputError``), not guessed at.
        model: the module the step runs (default: the trainer's ``model``, or the model given as ``step``). Its
            top-level output is read for per-token values; its input embeddings take the gradient.
        per_token: judge per-token outputs (True) or per-document losses, every other document's labels masked
            (False: batch-level loss terms such as a router's load-balancing loss count too). Default: per-token
            when the model's output (or the step's result) has per-token values.
        grads: run the gradient check (needs the step to call ``model.get_input_embeddings()``).
        per_layer: name the first leaking module on a leak.
        train: run in training mode (gradient checkpointing and other training-only paths active), with every
            dropout module off; each module's mode is restored afterwards.
        atol: tolerance on the relative error (:func:`~hybrid_pack.isolation.relative_error`) of each document's
            values against its lone run; default: :data:`~hybrid_pack.isolation.TOLERANCE` of the least precise of
            the parameters', the values' and autocast's dtype.
        grad_atol: tolerance on cross-document gradients (default exactly zero).
        seed: seeds the random weighting of each document's values in the gradient check.
        group: the process group whose ranks check together (docs/api.md §7b); None: the model's own (a trainer's
            ``model_wrapped``: FSDP2's mesh, FSDP1's or DDP's group; the world for DeepSpeed ZeRO-3), or none for
            an unsharded model. Every rank then runs the step as many times as the rank with most documents
            (replaying one of its own), and a leak on any rank fails the report on every rank (``leak_rank``).

    Returns:
        An :class:`~hybrid_pack.testing.IsolationReport` with one layout, the batch's documents. A step that
        raises is reported in ``report.error``, never passed.

    Raises:
        InputError: no batch for a callable step, a batch that is not one packed row, no model, or neither a
            per-token model output nor ``labels`` to judge documents by.

    The step runs ``1 + 2N`` times for ``N`` documents (``1 + 3N`` when only losses can be judged). A trainer's
    plain-data attributes (TRL's token counter and metric lists) and torch's random state are put back
    afterwards, so the check leaves no trace in its logs or in its data order.
    """
    kept = _bookkeeping_kept(step) if is_trainer(step) else contextlib.nullcontext()
    cuda = [torch.cuda.current_device()] if torch.cuda.is_available() and torch.cuda.is_initialized() else []
    with kept, torch.random.fork_rng(devices=cuda):      # drawing the first batch may consume random numbers
        run, batch, model, name = _as_step(step, batch, model)
        wrapped = getattr(step, "model_wrapped", None) if is_trainer(step) else None
        group = model_group(wrapped if isinstance(wrapped, torch.nn.Module) else model, group)
        return _check(run, batch, model, name, per_token=per_token, grads=grads, per_layer=per_layer,
                      train=train, atol=atol, grad_atol=grad_atol, seed=seed, group=group)


def _check(step: Step, batch: dict[str, Any], model: torch.nn.Module, name: str, *, per_token: bool | None,
           grads: bool, per_layer: bool, train: bool, atol: float | None, grad_atol: float,
           seed: int, group: Group | None) -> IsolationReport:
    ids = batch.get(INPUT_IDS, batch.get(INPUTS_EMBEDS))
    if not isinstance(ids, torch.Tensor) or ids.dim() < 2 or ids.shape[0] != 1:
        raise InputError(f"batch: expected one packed row ({INPUT_IDS} [1, T]) with its boundary keys; got "
                         f"{INPUT_IDS} {list(ids.shape) if isinstance(ids, torch.Tensor) else ids!r}")
    boundaries = PackedBoundaries.from_batch(batch)
    dtype = _model_dtype(model)
    given_atol = atol
    atol = dtype_tolerance(model, dtype, boundaries.device) if atol is None else float(atol)
    docs = [_Document(DocumentResult(i, n), start) for i, (n, start) in
            enumerate(zip(boundaries.lengths, boundaries.starts, strict=False))]
    layout = LayoutResult("training step", boundaries.lengths, boundaries.num_pad_tokens, [d.result for d in docs])
    report = IsolationReport(model=name, dtype=str(dtype).removeprefix("torch."), atol=atol, grad_atol=grad_atol,
                             layouts=[layout])
    t_len = boundaries.total_tokens
    with _training_mode(model, train):
        try:
            packed = _run(step, batch, model, grad=False)
        except Exception as err:  # a step that cannot take a packed batch is reported, not hidden
            report.error = f"{type(err).__name__}: {err}"
            layout.ok = False
            return report
        if given_atol is None and packed.values is not None:  # a step under autocast returns its lower precision
            atol = report.atol = dtype_tolerance(model, packed.values.dtype, boundaries.device)
        seen = packed.values is not None and packed.values.shape[1] in (t_len, t_len - 1)
        if per_token and not seen:
            raise InputError("per_token: the step's model returned no per-token log_probs / logits of the batch's "
                             f"{t_len} tokens; pass per_token=False to judge per-document losses")
        per_token = seen if per_token is None else per_token
        if not per_token and (packed.loss is None or LABELS not in batch):
            raise InputError(f"batch: judging per-document losses needs {LABELS} in the batch and a loss from the "
                             f"step; add {LABELS}, or return the model output so per-token values can be judged")
        layout.name = f"training step: per-token {packed.quantity}" if per_token else "training step: per-document loss"
        probe = _Probe(step, model, batch, per_token, t_len, torch.Generator().manual_seed(seed))
        try:
            runs = len(docs) if group is None else int(agree_max([len(docs)], group)[0])
            for run in range(runs):     # past this rank's own documents: a replay, its figures dropped
                doc = docs[run % len(docs)]
                _check_document(probe, doc if run < len(docs) else copy.deepcopy(doc), packed, grads=grads)
            layout.ok = all(d.result.alone_diff <= atol and (d.result.gradient_leak or 0.0) <= grad_atol for d in docs)
            if group is not None:
                _agree_on_layout(layout, group)
            if not layout.ok and per_layer:
                _localise(probe, layout, docs, atol, grad_atol, group)
        except Exception as err:
            report.error = f"{type(err).__name__}: {err}"
            layout.ok = False
    if grads and all(d.result.gradient_leak is None for d in docs):
        report.skipped.append("gradients: the step never called model.get_input_embeddings()")
    return report
