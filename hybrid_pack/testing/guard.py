"""The runtime guard (docs/api.md §7a): check the real model on the real packed batch while it trains.

The harness (:mod:`hybrid_pack.testing.isolation`) proves a model isolated before training, on
random tokens. The guard watches training itself. Attached to a model, it sees every packed call
made in training mode (from any trainer or loop) and checks the first one and every ``every``-th
after it: a few documents of the row (the shortest, the longest, random others) run alone through
the same model, in eval mode and without gradient, and each must give the output of its slice of
the packed call. A relative error (:func:`hybrid_pack.isolation.relative_error`) beyond the tolerance of the
precision the call ran in (:data:`hybrid_pack.isolation.TOLERANCE`) is a leak.

The packed output compared is the call's logits. A model whose forward returns no logits (TRL's
fused LM head returns per-token log-probabilities) is compared on the last hidden states of its
backbone (``model.base_model``), which the guard reads with a forward hook. A model with active
dropout is run again on the packed batch in eval mode, so both sides are dropout-free.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import os
import random
import sys
import time
import warnings
from collections.abc import Iterator, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from typing_extensions import Self

from hybrid_pack.boundaries import PackedBoundaries, StaticBoundaries
from hybrid_pack.boundaries.sharded import ShardedBoundaries
from hybrid_pack.distributed import Group, agree_max, gather_rows, share_objects
from hybrid_pack.errors import InputError, IsolationError, UncheckedError, UnsupportedModelError
from hybrid_pack.isolation import relative_error
from hybrid_pack.isolation.probe import dtype_tolerance, leak_origin, output_logits, record_calls
from hybrid_pack.isolation.vision import VISION_INPUT_KEYS, document_vision_inputs
from hybrid_pack.ops.dispatch.discovery import is_discovering
from hybrid_pack.ops.invariant import is_batch_invariant
from hybrid_pack.schema import (
    ATTENTION_MASK,
    BOUNDARIES,
    BOUNDARY_KEYS,
    CACHE_KEYS,
    CU_SEQ_LENS_K,
    CU_SEQ_LENS_Q,
    HOST_BOUNDARIES,
    INPUT_IDS,
    INPUTS_EMBEDS,
    LABELS,
    NUM_ITEMS_IN_BATCH,
    NUM_PAD_TOKENS,
    POSITION_IDS,
    SEQ_IDX,
    USE_CACHE,
)
from hybrid_pack.testing.ranks import model_group

__all__ = ["ACTIONS", "GuardRecord", "IsolationWarning", "PackingGuard"]

logger = logging.getLogger("hybrid_pack.guard")

ACTIONS = ("raise", "warn")
LOGITS, HIDDEN_STATES = "logits", "hidden states"
_DROPOUT_MODULES = (nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.AlphaDropout, nn.FeatureAlphaDropout)
_RANDOM_RATES = ("dropout", "pdrop", "jitter")


class IsolationWarning(UserWarning):
    """A leak the guard found with ``action="warn"`` (turn it into an error with ``warnings.simplefilter``)."""


@dataclass
class GuardRecord:
    """One check of one packed call.

    Attributes:
        step: the training step (``guard.step`` as the trainer set it, else the packed call's index).
        ok: every checked document gave, alone, its output in the packed call within ``atol``.
        max_diff: the largest relative error (:func:`hybrid_pack.isolation.relative_error`) of a checked
            document's packed output against its output alone.
        documents: indices in the row of the checked documents: the shortest, the longest, then random ones.
        seconds: wall time of the check (localisation included).
        call: index of the packed training call among those the attached guard saw (None: a direct ``check``).
        lengths: token count of each checked document.
        diffs: each checked document's difference.
        atol: the tolerance applied.
        compared: ``"logits"``, or ``"hidden states"`` for a model whose output has no logits.
        first_leaking_module: with ``localize=True``, the first module whose output for the worst document
            differs from its run alone while its inputs do not (None when not asked or not found).
        rank: under a process group (docs/api.md §7b), this process's rank (None: the check ran on one process).
        leak_rank: the rank whose row showed the leak (the lowest when several did); ``ok`` is then False on every
            rank, while ``max_diff``, ``documents`` and ``diffs`` stay this rank's own.
    """

    step: int | None
    ok: bool
    max_diff: float
    documents: list[int]
    seconds: float
    call: int | None = None
    lengths: list[int] = field(default_factory=list)
    diffs: list[float] = field(default_factory=list)
    atol: float = 0.0
    compared: str = LOGITS
    first_leaking_module: str | None = None
    rank: int | None = None
    leak_rank: int | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class PackingGuard:
    """Check, while a model trains, that its packed calls never let one document see another.

    Args:
        model: takes the docs/api.md §3 batch (``input_ids`` plus boundary keys) or ``boundaries=`` and returns
            logits (a tensor, or an object with ``.logits``); Hugging Face models, patched or not.
        every: check the first packed training call and every ``every``-th after it (each micro-batch is a call).
        documents: documents checked per call (>= 2): the shortest and the longest always, then random ones.
        action: ``"raise"`` an :class:`~hybrid_pack.errors.IsolationError` on a leak, or ``"warn"``
            (an :class:`IsolationWarning`) and go on.
        atol: tolerance on the relative error (default: :data:`hybrid_pack.isolation.TOLERANCE` of the least
            precise of the parameters', the output's and the autocast dtype).
        localize: on a leak, also name the first leaking module (reruns the worst document with hooks).
        seed: seeds the choice of the random documents.
        group: the process group whose ranks check together (docs/api.md §7b). None: the model's own, found at
            the first check (an FSDP2 module's mesh, an FSDP1 or DDP wrapper's group, the world for DeepSpeed
            ZeRO-3), or no group for an unsharded model. Every rank of the group runs the same forwards, whatever
            its row holds (a rank with fewer documents replays one of its own), and a leak found on any rank
            raises (or warns) on every rank, naming the rank that found it.
        invariance_every: also certify every ``invariance_every``-th packed training call (calls 0, N, 2N, ...):
            :func:`~hybrid_pack.testing.check_invariance` on the call's documents, in rows of the call's length;
            each ``(step, report)`` goes to :attr:`invariance`. A call made inside
            :func:`hybrid_pack.batch_invariant` whose documents are not bitwise invariant is a failure (raised as
            :class:`~hybrid_pack.errors.IsolationError`, or warned); outside the mode the report only measures.
            One process only (the certifier's forwards follow the local documents). None: never.

    The guard's own calls run in eval mode under ``torch.no_grad()`` and leave the model's modes, the
    CPU and CUDA random states and the gradients as they were. Boundary keys must be passed by keyword
    (``model(**batch)``), as every trainer does. Generation is no training call: a call without gradient that
    carries a cache or ``use_cache=True``, or runs inside transformers' ``generate``, is neither checked nor
    counted (packed scoring under ``no_grad``, with no cache, is checked). A ``DistributedDataParallel`` model is
    guarded through its ``module``; each rank checks its own rows. A sharded model costs each check two small
    collectives (the run count, the verdict) beside the forwards' own.
    """

    def __init__(self, model: nn.Module, *, every: int = 100, documents: int = 3, action: str = "raise",
                 atol: float | None = None, localize: bool = False, seed: int = 0, group: Group | None = None,
                 invariance_every: int | None = None) -> None:
        if not isinstance(model, nn.Module):
            raise InputError(f"model: expected a torch.nn.Module; got {type(model).__name__}")
        self._wrapped, self._group_given, self._group_found = model, group, False
        self._group: Group | None = None
        if isinstance(model, nn.parallel.DistributedDataParallel):
            model = model.module    # the guard's own calls must not run DDP's collectives on one rank
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise InputError(f"every: expected an int >= 1 (check every N-th packed call); got {every!r}")
        if isinstance(documents, bool) or not isinstance(documents, int) or documents < 2:
            raise InputError(f"documents: expected an int >= 2 (the shortest and the longest are always checked); "
                             f"got {documents!r}")
        if action not in ACTIONS:
            raise InputError(f"action: expected one of {ACTIONS}; got {action!r}")
        if invariance_every is not None and (isinstance(invariance_every, bool) or not isinstance(invariance_every, int)
                                             or invariance_every < 1):
            raise InputError(f"invariance_every: expected an int >= 1 (certify every N-th packed call) or None; got "
                             f"{invariance_every!r}")
        if atol is not None and not atol > 0:
            raise InputError(f"atol: expected a positive float or None (the dtype's tolerance); got {atol!r}")
        self.model = model
        self.every, self.documents, self.action, self.atol, self.localize = every, documents, action, atol, localize
        self.records: list[GuardRecord] = []
        self.invariance_every = invariance_every
        self.invariance: list[tuple[int | None, Any]] = []
        """``(step, InvarianceReport)`` for every certified call (``invariance_every``)."""
        self._certify_due: int | None = None
        self.step: int | None = None
        """The training step the next calls belong to; trainers set it. None: records name the call index."""
        self.calls = 0
        """Packed training calls seen since :meth:`attach`."""
        self.unpacked_calls = 0
        """Training calls seen since :meth:`attach` that carried no packed row (nothing to check)."""
        self._first_unpacked: str | None = None
        self._silence_reported = False
        self._random = random.Random(seed)
        self._handles: list[torch.utils.hooks.RemovableHandle] = []
        self._due: int | None = None          # index of the call being run, when it is to be checked
        self._checking = False                # inside the guard's own calls
        self._capture = False                 # keep the backbone's output of the current call
        self._hidden: torch.Tensor | None = None

    # ------------------------------------------------------------------ hooks
    def attach(self) -> PackingGuard:
        """Hook the model: from now on every packed call in training mode is counted, and checked when due."""
        if self._handles:
            return self
        self.calls = self.unpacked_calls = 0
        self._first_unpacked, self._silence_reported = None, False
        eager = torch.compiler.disable  # a model compiled in place (the Trainer's torch_compile): between its graphs
        self._handles = [self.model.register_forward_pre_hook(eager(self._before_call), with_kwargs=True),
                         self.model.register_forward_hook(eager(self._after_call), with_kwargs=True)]
        backbone = _backbone(self.model)
        if backbone is not None:
            self._handles.append(backbone.register_forward_hook(eager(self._keep_hidden)))
        return self

    def detach(self) -> PackingGuard:
        """Remove the hooks; the records stay. A guard that saw training calls but no packed one says so here
        (a warning; ``action="raise"``: :class:`~hybrid_pack.errors.UncheckedError`), if it has not yet."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self._due = None
        if self.unpacked_calls and not self.calls:
            self._report_silence()
        return self

    def __enter__(self) -> Self:
        return self.attach()

    def __exit__(self, *exc: object) -> None:
        self.detach()

    def _before_call(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """Count a packed training call and mark it when due; reads shapes only (no host sync). The backends'
        warm-up pass (``backends.verify(model=...)``) is no training call."""
        if self._checking or is_discovering():
            self._due = None
            return
        _refuse_context_parallel(kwargs.get(BOUNDARIES))
        if not module.training or _is_generation(kwargs):
            self._due, self._capture = None, False
            return
        if not _is_packed(args, kwargs):
            self._due, self._capture = None, False
            self._count_unpacked(args, kwargs)
            return
        self._due = self.calls if self.calls % self.every == 0 else None
        self._certify_due = (self.calls if self.invariance_every is not None
                             and self.calls % self.invariance_every == 0 else None)
        self._capture = self._due is not None
        self._hidden = None
        self.calls += 1

    def _after_call(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> None:
        certify, self._certify_due = self._certify_due, None
        self._check_call(module, args, kwargs, output)
        if certify is not None:
            self._certify({**_positional(module, args), **kwargs},
                          step=self.step if self.step is not None else certify)

    def _check_call(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> None:
        call, self._due = self._due, None
        if call is None:
            return
        self._capture = False
        hidden, self._hidden = self._hidden, None
        batch = {**_positional(module, args), **kwargs}
        if _randomised(module):
            packed, compared = None, None     # run the packed batch again, without dropout
        else:
            packed, compared = self._packed_output(output, hidden)
        self._check(batch, packed, compared, step=self.step if self.step is not None else call, call=call)

    def _count_unpacked(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """A training call with no packed row: nothing to check. After ``every`` of them with no packed call yet,
        the guard says so (once), naming what it saw."""
        self.unpacked_calls += 1
        if self._first_unpacked is None:
            shapes = {name: list(value.shape) for name, value in {**dict(enumerate(args)), **kwargs}.items()
                      if isinstance(value, torch.Tensor)}
            self._first_unpacked = ", ".join(f"{name} {shape}" for name, shape in shapes.items()) or "no tensors"
        if not self.calls and self.unpacked_calls >= self.every:
            self._report_silence()

    def _report_silence(self) -> None:
        if self._silence_reported:
            return
        self._silence_reported = True
        message = (f"PackingGuard: {self.unpacked_calls} training calls, none of them a packed row, so nothing was "
                   f"checked (the first call: {self._first_unpacked}). The trainer pads its batches (or flattens "
                   "them without boundary keys) instead of packing: feed the model PackingCollator batches (for "
                   "TRL's SFT: PackedSFTTrainer), or check padded rows with "
                   "hybrid_pack.testing.check_isolation(model) before training.")
        if self.action == "warn":
            warnings.warn(message, IsolationWarning, stacklevel=3)
        else:
            raise UncheckedError(message)

    def _keep_hidden(self, module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        if self._capture:
            self._hidden = _hidden_states(output)

    # ------------------------------------------------------------------ check
    def check(self, batch: Mapping[str, Any], logits: torch.Tensor | None = None,
              step: int | None = None) -> GuardRecord:
        """Check one packed call now.

        Args:
            batch: the docs/api.md §3 dict given to the model (``input_ids`` ``[1, T]`` and boundary keys, or
                ``boundaries=``; other keys such as ``labels`` are passed on as given).
            logits: the output's logits ``[1, T, V]`` (any float dtype). None: the guard runs the packed
                batch itself (eval mode, no gradient) and compares against that.
            step: named in the record and in the error.

        Returns:
            The :class:`GuardRecord` (also appended to :attr:`records`).

        Raises:
            IsolationError: on a leak with ``action="raise"``.
        """
        return self._check(dict(batch), logits, LOGITS if logits is not None else None, step=step, call=None)

    def _check(self, batch: dict[str, Any], packed: torch.Tensor | None, compared: str | None, *,
               step: int | None, call: int | None) -> GuardRecord:
        boundaries = _boundaries(batch)
        _synchronize(boundaries.device)
        began = time.perf_counter()
        lengths, starts = boundaries.lengths, boundaries.starts
        chosen = self._choose(lengths)
        group = self.group
        runs, rerun = len(chosen), packed is None
        if group is not None:       # the same forwards on every rank: as many lone runs as the rank with most
            runs, rerun = (int(v) for v in agree_max([runs, rerun], group))
        diffs: list[float] = []
        with self._own_calls():
            if rerun:
                output = self.model(**batch)
                if packed is None:
                    packed, compared = self._packed_output(output, self._hidden)
            packed = _rows(packed, boundaries.total_tokens, compared)
            atol = self.atol if self.atol is not None else dtype_tolerance(self.model, packed.dtype, boundaries.device)
            for run in range(runs):
                doc = chosen[run % len(chosen)]     # past this rank's own documents: a replay, not compared
                start, length = starts[doc], lengths[doc]
                output = self.model(**_document_batch(batch, boundaries, start, length,
                                                      with_labels=compared == HIDDEN_STATES))
                alone, _ = self._packed_output(output, self._hidden, expected=compared)
                if run < len(chosen):
                    diffs.append(relative_error(packed[start:start + length], _rows(alone, length, compared)))
            worst = chosen[max(range(len(diffs)), key=diffs.__getitem__)]
            leak = _Leak(rank=None, doc=worst, start=starts[worst], length=lengths[worst], diff=max(diffs),
                         atol=atol) if not all(d <= atol for d in diffs) else None
            if group is not None:
                leak = _agree_on_leak(leak, group)
            module = None
            if leak is not None and self.localize:    # every rank reruns its worst document; the finder's names it
                module = self._first_leaking_module(batch, boundaries, worst, atol,
                                                    with_labels=compared == HIDDEN_STATES)
                if group is not None:
                    module = share_objects(module, group)[leak.group_rank]
        _synchronize(boundaries.device)
        record = GuardRecord(step=step, ok=leak is None, max_diff=max(diffs), documents=chosen,
                             seconds=time.perf_counter() - began, call=call, lengths=[lengths[d] for d in chosen],
                             diffs=diffs, atol=atol, compared=compared or LOGITS, first_leaking_module=module,
                             rank=None if group is None else dist.get_rank(),
                             leak_rank=None if leak is None else leak.rank)
        self.records.append(record)
        if leak is None:
            logger.info("PackingGuard: step %s: documents %s (lengths %s) match their runs alone; max diff %.2g "
                        "(tolerance %.2g), %.3f s", step, chosen, record.lengths, record.max_diff, atol, record.seconds)
        else:
            self._report(record, leak)
        return record

    def _certify(self, batch: dict[str, Any], *, step: int | None) -> Any:
        """:func:`~hybrid_pack.testing.check_invariance` on the documents of one packed call (``invariance_every``)."""
        from hybrid_pack.testing.invariance import check_invariance

        if self.group is not None:
            raise InputError("invariance_every: certifies on one process only (its forwards follow the rank's own "
                             "documents and would not pair up across ranks); leave it None under torch.distributed")
        boundaries = _boundaries(batch)
        ids = batch[INPUT_IDS][0]
        sequences = [ids[start:start + length] for start, length in zip(boundaries.starts, boundaries.lengths,
                                                                          strict=False)]
        required = is_batch_invariant()
        with self._own_calls():
            report = check_invariance(self.model, sequences, row_length=boundaries.total_tokens, packings=2,
                                      seed=len(self.invariance))
        self.invariance.append((step, report))
        logger.info("PackingGuard: step %s: %s", step, report)
        if required and not report.ok:
            message = (f"PackingGuard: step {step}: inside batch_invariant(), the call's documents are not bitwise "
                       f"invariant to their packing: {report}")
            if self.action == "warn":
                warnings.warn(message, IsolationWarning, stacklevel=2)
            else:
                raise IsolationError(message, report)
        return report

    @property
    def group(self) -> Group | None:
        """The process group checking together (docs/api.md §7b), found at the first check; None on one process."""
        if not self._group_found:
            self._group, self._group_found = model_group(self._wrapped, self._group_given), True
        return self._group

    def _packed_output(self, output: Any, hidden: torch.Tensor | None,
                       expected: str | None = None) -> tuple[torch.Tensor, str]:
        """The per-token output a check compares: the logits, else the backbone's last hidden states."""
        logits = _output_logits(output)
        if logits is not None and expected != HIDDEN_STATES:
            return logits, LOGITS
        if hidden is not None and expected != LOGITS:
            return hidden, HIDDEN_STATES
        raise UnsupportedModelError(
            f"model: its output ({type(output).__name__}) has no logits and the guard found no backbone "
            "(model.base_model) whose hidden states it could compare; call guard.check(batch, logits) with logits "
            "you compute, or let the model return logits")

    def _choose(self, lengths: list[int]) -> list[int]:
        """The shortest and the longest document, then random others, up to ``documents``."""
        order = range(len(lengths))
        chosen = list(dict.fromkeys([min(order, key=lengths.__getitem__), max(order, key=lengths.__getitem__)]))
        others = [i for i in order if i not in chosen]
        return chosen + self._random.sample(others, min(len(others), self.documents - len(chosen)))

    def _first_leaking_module(self, batch: dict[str, Any], boundaries: PackedBoundaries, doc: int, atol: float, *,
                              with_labels: bool) -> str | None:
        """The harness's localisation: record every submodule in the packed run and the document's run alone."""
        start, length = boundaries.starts[doc], boundaries.lengths[doc]
        with record_calls(self.model, boundaries.total_tokens) as packed_calls:
            self.model(**batch)
        with record_calls(self.model, length) as alone_calls:
            self.model(**_document_batch(batch, boundaries, start, length, with_labels=with_labels))
        return leak_origin(packed_calls, alone_calls, lambda t: t[0, start:start + length], lambda t: t[0], atol)

    def _report(self, record: GuardRecord, leak: _Leak) -> None:
        where = f"step {record.step}" + (f" (packed call {record.call})" if record.call is not None else "")
        row = "the packed row" if leak.rank is None else f"rank {leak.rank}'s packed row"
        last = leak.start + leak.length - 1
        message = (f"PackingGuard: {where}: document {leak.doc} of {row} (tokens {leak.start}..{last}, "
                   f"{leak.length} tokens) differs from the same document run alone by {leak.diff:.3g} "
                   f"(tolerance {leak.atol:.3g}, {record.compared}): the model mixes the documents of a packed "
                   "row. ")
        if leak.rank is not None:
            stops = "warns" if self.action == "warn" else "stops"
            message = f"[rank {record.rank}] " + message + f"Found on rank {leak.rank}; every rank {stops}. "
        if record.first_leaking_module is not None:
            message += f"First leaking module: {record.first_leaking_module}. "
        elif not self.localize:
            message += "PackingGuard(..., localize=True) names the first leaking module. "
        message += "hybrid_pack.testing.check_isolation(model) reproduces it on random documents."
        if self.action == "warn":
            warnings.warn(message, IsolationWarning, stacklevel=2)
        else:
            raise IsolationError(message, record)

    @contextlib.contextmanager
    def _own_calls(self) -> Iterator[None]:
        """Eval mode, no gradient, eager (a compiled forward is not recompiled for the documents' own shapes), the
        CPU and CUDA random states forked; modes restored module by module after."""
        modes = [(module, module.training) for module in self.model.modules()]
        cuda = sorted({p.device.index or 0 for p in self.model.parameters() if p.device.type == "cuda"})
        self._checking = self._capture = True
        try:
            with torch.random.fork_rng(devices=cuda), torch.no_grad(), torch.compiler.set_stance("force_eager"):
                self.model.eval()
                yield
        finally:
            self._checking = self._capture = False
            self._hidden = None
            for module, training in modes:
                module.training = training

    # ----------------------------------------------------------------- report
    def to_dict(self) -> dict[str, Any]:
        """Settings, totals and every record, for ``metrics.json`` and logs."""
        return {"every": self.every, "documents": self.documents, "action": self.action, "calls": self.calls,
                "invariance_every": self.invariance_every,
                "invariance": [{"step": step, **report.to_dict()} for step, report in self.invariance],
                "checks": len(self.records), "failures": sum(not r.ok for r in self.records),
                "max_diff": max((r.max_diff for r in self.records), default=None),
                "seconds": sum(r.seconds for r in self.records), "records": [r.to_dict() for r in self.records]}


@dataclass(frozen=True)
class _Leak:
    """Where a check found a leak: the rank (None on one process) and its group rank, the document, its figures."""

    rank: int | None
    doc: int
    start: int
    length: int
    diff: float
    atol: float
    group_rank: int = 0


def _agree_on_leak(leak: _Leak | None, group: Group) -> _Leak | None:
    """The leak found by the lowest rank of ``group`` that found one (the same on every rank), else None."""
    mine = [0.0] * 6 if leak is None else [
        1.0, leak.diff, leak.atol, float(leak.start), float(leak.length), float(leak.doc)]
    for group_rank, (found, diff, atol, start, length, doc) in enumerate(gather_rows(mine, group)):
        if found:
            return _Leak(rank=dist.get_global_rank(group, group_rank), doc=int(doc), start=int(start),
                         length=int(length), diff=diff, atol=atol, group_rank=group_rank)
    return None


# ---------------------------------------------------------------------------- helpers
def _is_packed(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Whether a call carries one packed row: ``boundaries=``, a boundary key, or ``position_ids`` ``[1, T]``
    without ``attention_mask`` (a flattened batch). Reads shapes only."""
    for tokens in (kwargs.get(INPUT_IDS), kwargs.get(INPUTS_EMBEDS), *args[:1]):
        if isinstance(tokens, torch.Tensor) and (tokens.dim() < 2 or tokens.shape[0] != 1):
            return False
    if kwargs.get(BOUNDARIES) is not None or any(kwargs.get(k) is not None for k in (CU_SEQ_LENS_Q, CU_SEQ_LENS_K,
                                                                                       SEQ_IDX)):
        return True
    positions = kwargs.get(POSITION_IDS)
    return (isinstance(positions, torch.Tensor) and positions.dim() == 2 and positions.shape[0] == 1
            and kwargs.get(ATTENTION_MASK) is None)


def _is_generation(kwargs: dict[str, Any]) -> bool:
    """Whether a call decodes rather than trains: it runs without gradient and carries a cache (``past_key_values``,
    ``cache_params``, ``cache``) or ``use_cache=True``, or it runs without gradient inside transformers' generation
    code (``generate``, ``generate_batch``: also their calls without a cache). Without gradient and without a cache,
    outside generation (an RL trainer's log-probability scoring), a call trains; with gradient, a cache is a training
    input (prefix tuning) and the call trains too. Reads flags only; walks the stack only for calls without gradient."""
    if torch.is_grad_enabled():
        return False
    if kwargs.get(USE_CACHE) is True or any(kwargs.get(key) is not None for key in CACHE_KEYS):
        return True
    generation = sys.modules.get("transformers.generation")
    if generation is None or generation.__file__ is None:
        return False
    folder = os.path.dirname(generation.__file__) + os.sep
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_filename.startswith(folder):
            return True
        frame = frame.f_back
    return False


def _positional(module: nn.Module, args: tuple[Any, ...]) -> dict[str, Any]:
    """Positional arguments of a call, by the names of ``module.forward``'s parameters."""
    if not args:
        return {}
    signature = inspect.signature(module.forward)
    bound = signature.bind_partial(*args).arguments
    return {name: value for name, value in bound.items()
            if signature.parameters[name].kind is not inspect.Parameter.VAR_POSITIONAL}


# --- context parallelism (docs/parallel.md): the guard checks whole rows only -------------------------
def _refuse_context_parallel(boundaries: Any) -> None:
    """Raise on a context-parallel shard, before any collective (every rank of the group gets one: none hangs)."""
    if isinstance(boundaries, ShardedBoundaries):
        raise InputError("boundaries: this call is one rank's shard of a context-parallel row; the guard checks "
                         "whole rows, so detach it for context-parallel training and check the model unsharded "
                         "(check_isolation(model) runs whole rows on one rank)")
# --- end context parallelism ----------------------------------------------------------------------------


def _boundaries(batch: Mapping[str, Any]) -> PackedBoundaries:
    given = batch.get(BOUNDARIES)
    _refuse_context_parallel(given)
    if isinstance(given, StaticBoundaries):  # a static batch handed to compiled blocks: read here, outside a graph
        given = PackedBoundaries.from_batch({CU_SEQ_LENS_Q: given.cu_seqlens, SEQ_IDX: given.seq_idx,
                                             POSITION_IDS: given.position_ids})
    if given is not None:
        if not isinstance(given, PackedBoundaries):
            raise InputError(f"boundaries: expected a hybrid_pack.PackedBoundaries; got {type(given).__name__}")
        return given
    return PackedBoundaries.from_batch(batch)


def _document_batch(batch: Mapping[str, Any], boundaries: PackedBoundaries, start: int, length: int, *,
                    with_labels: bool) -> dict[str, Any]:
    """The same call for one document alone: per-token tensors ``[1, T, ...]`` sliced, one-document boundaries.

    Without ``with_labels`` the labels (and ``num_items_in_batch``) are left out: the loss is not compared, and
    on a small model the LM head's cross-entropy costs as much as the layers. A forward that returns no logits
    (TRL's fused LM head) needs them.
    """
    lone = PackedBoundaries.from_lengths([length], device=boundaries.device)
    lone_keys = {**lone.hf_kwargs(), HOST_BOUNDARIES: lone.host()}
    tokens = boundaries.total_tokens
    skipped = {NUM_PAD_TOKENS} if with_labels else {NUM_PAD_TOKENS, LABELS, NUM_ITEMS_IN_BATCH}
    out: dict[str, Any] = {}
    for key, value in batch.items():
        if key in skipped or key in VISION_INPUT_KEYS:   # pixels and grids: the document's own, below
            continue
        if key == BOUNDARIES:
            out[key] = lone
        elif key in BOUNDARY_KEYS or key == HOST_BOUNDARIES:
            out[key] = None if value is None else lone_keys[key]
        elif isinstance(value, torch.Tensor) and value.dim() >= 2 and tuple(value.shape[:2]) == (1, tokens):
            out[key] = value[:, start:start + length]
        else:
            out[key] = value
    return {**out, **document_vision_inputs(batch, start, length)}   # its pixels, grids, M-RoPE positions


def _output_logits(output: Any) -> torch.Tensor | None:
    """The logits of a model's output (a tensor, a tuple, a mapping or an object with ``.logits``), or None."""
    if isinstance(output, Mapping):
        logits = output.get(LOGITS)
    elif isinstance(output, (torch.Tensor, tuple, list)):
        logits = output_logits(output)
    else:
        logits = getattr(output, LOGITS, None)
    return logits if isinstance(logits, torch.Tensor) else None


def _hidden_states(output: Any) -> torch.Tensor | None:
    """The last hidden states ``[1, T, H]`` of a backbone's output."""
    hidden = getattr(output, "last_hidden_state", None)
    if hidden is None and isinstance(output, (tuple, list)) and output:
        hidden = output[0]
    if hidden is None and isinstance(output, torch.Tensor):
        hidden = output
    return hidden if isinstance(hidden, torch.Tensor) else None


def _backbone(model: nn.Module) -> nn.Module | None:
    """The decoder under the LM head (``base_model`` of a Hugging Face causal LM, through PEFT), if distinct."""
    inner = model.get_base_model() if callable(getattr(model, "get_base_model", None)) else model
    backbone = getattr(inner, "base_model", None)
    return backbone if isinstance(backbone, nn.Module) and backbone is not inner else None


def _rows(output: torch.Tensor, tokens: int, compared: str | None) -> torch.Tensor:
    """``[1, T, ...]`` (or ``[T, ...]``) -> ``[T, ...]``, checking the token count."""
    if output.dim() >= 3 and output.shape[0] == 1:
        output = output[0]
    if output.dim() < 2 or output.shape[0] != tokens:
        raise InputError(f"{compared or LOGITS}: expected shape [1, {tokens}, ...] for the {tokens} tokens of the "
                         f"batch; got {list(output.shape)}")
    return output.detach()


def _randomised(model: nn.Module) -> bool:
    """Whether a training-mode forward of ``model`` is random: dropout modules, NEFTune's noise on the embeddings
    (transformers' and hybrid_pack's mark the module with ``neftune_noise_alpha``), or config rates such as
    ``attention_dropout`` or ``router_jitter_noise`` that models apply in training mode only."""
    if any(isinstance(m, _DROPOUT_MODULES) and m.p > 0 and m.training for m in model.modules()):
        return True
    if model.training and any(getattr(m, "neftune_noise_alpha", None) for m in model.modules()):
        return True
    config = getattr(model, "config", None)
    rates = vars(config) if hasattr(config, "__dict__") else {}
    return model.training and any(any(word in name for word in _RANDOM_RATES) and isinstance(rate, float) and rate > 0
                                  for name, rate in rates.items())


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
