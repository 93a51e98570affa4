"""Choosing the backend that runs a call (docs/api.md §5, §5a).

A kernel serves a call only with a *settled* verdict for the call's key (op, backend, device, signature, gradients):
settled by the warm-up :func:`hybrid_pack.backends.verify`, or in a single eager process by the key's first call.
Where no check may run (``torch.distributed``, a trace, a CUDA graph capture) an unsettled kernel raises
:class:`WarmUpError`. An automatic choice skips a backend that cannot run, refuses the inputs or failed its check
(logged once); a forced one raises :class:`BackendUnavailableError` instead."""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import threading
from collections.abc import Iterator, Mapping
from contextvars import ContextVar
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

import torch

from hybrid_pack.distributed import distributed
from hybrid_pack.errors import BackendUnavailableError, InputError
from hybrid_pack.ops.dispatch import discovery, verdicts
from hybrid_pack.ops.dispatch.backend import Backend
from hybrid_pack.ops.dispatch.registry import backends_of, contract_of, get_backend, reference_of, registered_ops
from hybrid_pack.ops.selfcheck import kept
from hybrid_pack.ops.selfcheck.contract import Signature, dtype_name, signature_text
from hybrid_pack.ops.selfcheck.kept import VerdictKey
from hybrid_pack.ops.selfcheck.result import CheckResult, device_name
from hybrid_pack.ops.selfcheck.whole_row import run_check_apart

__all__ = ["ENV_VAR", "VERIFY_ENV", "Decision", "WarmUpError", "resolve", "select", "use_backends", "forcing",
           "verification_enabled", "verdict_key", "local_verdict", "decisions", "forced_context", "tracing",
           "resolve_invariant"]

ENV_VAR = "HYBRID_PACK_BACKENDS"
VERIFY_ENV = "HYBRID_PACK_VERIFY"
WARM_UP = "hybrid_pack.backends.verify(model=model, batch=batch)"

logger = logging.getLogger("hybrid_pack.backends")
_logged: set[tuple[str, str, str]] = set()
_forced: ContextVar[Mapping[str, str]] = ContextVar("hybrid_pack_forced_backends", default=MappingProxyType({}))


class WarmUpError(BackendUnavailableError):
    """A kernel could serve a call whose verdict was not settled by the warm-up, where no check may run."""


@dataclass(frozen=True)
class Decision:
    """Which backend serves one op's calls of one signature on one device; ``skipped``: ``(backend, why)`` for each
    higher-priority backend passed over; ``refused``: those of them that could run here but refused the inputs or
    failed their check; ``forced``: by argument, ``use_backends`` or ``HYBRID_PACK_BACKENDS``."""

    op: str
    backend: str
    device: str
    signature: str
    requires_grad: bool
    skipped: tuple[tuple[str, str], ...] = ()
    refused: tuple[tuple[str, str], ...] = ()
    forced: bool = False


_decisions: dict[tuple[Any, ...], Decision] = {}


def verification_enabled() -> bool:
    """False when ``HYBRID_PACK_VERIFY`` is ``0`` (kernels are then trusted without a check)."""
    return os.environ.get(VERIFY_ENV, "1").strip().lower() not in ("0", "false", "no", "off")


def tracing() -> bool:
    """Inside a torch.compile trace or a CUDA graph capture: no check may run there."""
    return torch.compiler.is_compiling() or (torch.cuda.is_available() and torch.cuda.is_current_stream_capturing())


def _log_once(op: str, name: str, why: str) -> None:
    if (op, name, why) not in _logged and not discovery.recording_keys():
        _logged.add((op, name, why))
        logger.warning("%s: skipping backend %r: %s", op, name, why)


# -- forcing a backend

def _check_forced(mapping: Mapping[str, str], source: str) -> dict[str, str]:
    for op, name in mapping.items():
        if op not in registered_ops():
            raise InputError(f"{source}: unknown op {op!r}; ops are {list(registered_ops())}")
        try:
            get_backend(op, name)
        except InputError as err:
            raise InputError(f"{source}: {err}") from None
    return dict(mapping)


@functools.lru_cache(maxsize=8)
def _parse_env(raw: str) -> dict[str, str]:
    pairs = {}
    for item in filter(None, (p.strip() for p in raw.split(","))):
        op, sep, name = item.partition("=")
        if not sep or not name.strip():
            raise InputError(f"{ENV_VAR}: expected comma-separated op=backend pairs such as "
                             f"'conv=torch,ssd=mamba_ssm'; got {raw!r}")
        if pairs.get(op.strip(), name.strip()) != name.strip():
            raise InputError(f"{ENV_VAR}: op {op.strip()!r} forced twice ({pairs[op.strip()]!r} and "
                             f"{name.strip()!r}); keep one pair")
        pairs[op.strip()] = name.strip()
    return _check_forced(pairs, ENV_VAR)


def forcing(op: str, backend: str | None) -> tuple[str | None, str]:
    """``(backend, source)`` forced for ``op``: by argument, :func:`use_backends` (this thread's blocks; in a
    compiled graph, every thread's: the graph is the process's) or ``HYBRID_PACK_BACKENDS``."""
    if backend is not None:
        return backend, "backend="
    blocks = _process_forcing() if torch.compiler.is_compiling() else _forced.get()
    if op in blocks:
        return blocks[op], "use_backends()"
    env = _parse_env(os.environ.get(ENV_VAR, "").strip())
    return (env[op], ENV_VAR) if op in env else (None, "")


_open_blocks: dict[int, Mapping[str, str]] = {}
"""Every thread's open :func:`use_backends` blocks, in the order they were opened (what compiled graphs follow)."""
_blocks_lock = threading.Lock()  # a block's change and the forcing it publishes, one at a time


def _process_forcing() -> dict[str, str]:
    merged: dict[str, str] = {}
    for block in list(_open_blocks.values()):
        merged.update(block)
    return merged


@contextlib.contextmanager
def use_backends(**forced: str) -> Iterator[None]:
    """Force backends inside a ``with`` block, e.g. ``use_backends(conv="torch", ssd="mamba_ssm")``: this thread's
    eager calls, and every compiled graph while the block is open (a graph is the process's: it follows the
    blocks open in any thread, the latest opened first). A compiled graph is traced again for each forcing it
    meets (the choice is one of its constants) and used again when the forcing returns: after the block, the graph
    from before it."""
    checked = _check_forced(forced, "use_backends")
    token, block = _forced.set(MappingProxyType({**_forced.get(), **checked})), object()
    with _blocks_lock:
        _open_blocks[id(block)] = checked
        verdicts.forced(frozenset(_process_forcing().items()))
    try:
        yield
    finally:
        _forced.reset(token)
        with _blocks_lock:
            del _open_blocks[id(block)]
            verdicts.forced(frozenset(_process_forcing().items()))


forced_context = _forced.get  # the backends use_backends() forces here (one ContextVar read per call)


# -- the evidence a kernel serves on

def verdict_key(backend: Backend, signature: Signature, device: torch.device, requires_grad: bool,
                group_ranks: tuple[int, ...] = ()) -> VerdictKey:
    """What a verdict is valid for: the backend's code, the device, the signature (and a sharded call's group)."""
    text = signature_text(signature) + (f" cp_ranks={','.join(map(str, group_ranks))}" if group_ranks else "")
    return VerdictKey(backend.op, backend.name, backend.fingerprint, device_name(device), text, requires_grad)


def local_verdict(backend: Backend, signature: Signature, device: torch.device, requires_grad: bool, *,
                  check: bool = True) -> CheckResult | None:
    """This rank's own verdict for the key: kept in the process or on disk (for a call without gradients, a passed
    check with them), else (``check``) checked now on this rank only, apart from the caller, and kept."""
    key = verdict_key(backend, signature, device, requires_grad)
    known = kept.lookup(kept.recall, key, failed_too=False)
    if known is not None or not check:
        return known
    if tracing():
        raise WarmUpError(f"{backend.op} backend {backend.name!r}: a self-check cannot run inside a CUDA graph "
                          f"capture or a torch.compile trace; call {WARM_UP} before it")
    result, persist = run_check_apart(backend, reference_of(backend.op), contract_of(backend.op), signature, device,
                                      requires_grad)
    kept.remember(key, result, persist=persist)
    return result


def _evidence(backend: Backend, signature: Signature, device: torch.device, dtype: torch.dtype,
              requires_grad: bool, group_ranks: tuple[int, ...], group: Any, strict: bool, traced: bool) -> str:
    """Why ``backend`` may not serve for want of evidence ("" when its settled verdict passed). An unsettled key is
    settled now in a single eager process, recorded while discovering, else (``strict``) raises WarmUpError."""
    known = kept.lookup(verdicts.SETTLED.get, verdict_key(backend, signature, device, requires_grad, group_ranks))
    if known is not None:
        return known.reason
    if discovery.recording_keys():
        discovery.record(discovery.Wanted(backend.op, device.type, dtype_name(dtype), requires_grad, signature,
                                          group_ranks), group)
        return "not settled yet (the warm-up's discovery pass)"
    traced = traced or tracing()
    if not distributed() and not group_ranks:
        known = local_verdict(backend, signature, device, requires_grad, check=not traced)
    if known is None:
        where = ("a compiled graph or a CUDA graph capture" if traced else "a call on a sharded row" if group_ranks
                 else "a run under torch.distributed")
        again = ("; the warm-up that ran met no call of this key (another dtype or sizes, or a call without "
                 "gradients before any with them): run it on a batch like this one too" if verdicts.SETTLED else "")
        why = (f"no verdict settled for {signature_text(signature)} on {device_name(device)}, and none may be taken "
               f"in {where}: call {WARM_UP} (every rank, before the first forward{again})")
        if strict:
            raise WarmUpError(f"{backend.op}: backend {backend.name!r} could serve this call but {why}")
        return why
    # settled without a change to any choice made before (none was made for this key): compiled graphs stand
    verdicts.SETTLED[verdict_key(backend, signature, device, requires_grad)] = known
    return known.reason


# -- the choice

def resolve(op: str, *, device: torch.device | str, dtype: torch.dtype, requires_grad: bool = False,
            backend: str | None = None, inputs: Mapping[str, Any] | None = None, signature: Signature | None = None,
            traced: bool = False, static_only: bool = False, sharded: tuple[tuple[int, ...], Any] | None = None,
            strict: bool = True) -> Backend | None:
    """The backend that runs ``op`` with these inputs (made once per call key; never communicates).

    ``backend`` forces one; ``inputs`` feed ``accepts``; ``signature`` defaults to the typical one; ``traced``: no
    check may run; ``static_only``: backends with a static form; ``sharded``: ``(group ranks, group)`` of a call on a
    rank's slice, choosing a sharded backend (None: the pure-torch CP path); ``strict``: an unsettled kernel that
    could serve raises :class:`WarmUpError` (else it is skipped). Raises BackendUnavailableError.
    """
    device = torch.device(device)
    forced, source = forcing(op, backend)
    signature = signature if signature is not None else contract_of(op).default_signature(dtype, device.type)
    ranks, group = sharded if sharded is not None else ((), None)

    def why_not(candidate: Backend, strict: bool) -> str:
        why = candidate.reason(device, dtype, requires_grad)
        if not why and candidate.accepts is not None and inputs is not None:
            why = candidate.accepts(inputs)
        if why or candidate.reference:
            return why
        if not verification_enabled():  # no check runs; one kept failed stands (an environment verified before)
            known = kept.lookup(kept.recall, verdict_key(candidate, signature, device, requires_grad))
            return known.reason if known is not None and not known.ok else ""
        return _evidence(candidate, signature, device, dtype, requires_grad, ranks, group, strict, traced)

    if forced is not None:
        chosen = get_backend(op, forced)
        if sharded is not None and not chosen.sharded:
            return None
        why = ("serves rows split across a context-parallel group only" if chosen.sharded and sharded is None
               else "has no static form to trace in torch.compile (the pure-torch backend is traced there)"
               if static_only and chosen.static_fn is None else why_not(chosen, True))
        if why:
            raise BackendUnavailableError(f"{op} backend {forced!r} (forced by {source}) cannot run here: {why}")
        return _decide(chosen, device, requires_grad, signature, [], [], forced=True)
    if sharded is not None and discovery.recording_keys():  # met by every rank of the group, kernel or not there:
        # the warm-up then runs each sharded key's collective check on all of them alike
        discovery.record(discovery.Wanted(op, device.type, dtype_name(dtype), requires_grad, signature, ranks), group)
    skipped, refused = [], []
    for candidate in backends_of(op, sharded=sharded is not None):
        if static_only and candidate.static_fn is None:
            continue
        why = why_not(candidate, strict)
        if not why:
            return _decide(candidate, device, requires_grad, signature, skipped, refused, forced=False)
        skipped.append((candidate.name, why))
        if candidate.reason(device, dtype, requires_grad) == "":
            refused.append((candidate.name, why))
            _log_once(op, candidate.name, why)
    if sharded is not None:
        return None
    raise BackendUnavailableError(f"{op}: no backend can run on {device.type} with {dtype_name(dtype)}")


def _decide(chosen: Backend, device: torch.device, requires_grad: bool, signature: Signature,
            skipped: list[tuple[str, str]], refused: list[tuple[str, str]], *, forced: bool) -> Backend:
    text = signature_text(signature)
    key = (chosen.op, str(device), text, requires_grad, chosen.name, tuple(refused))
    if key not in _decisions and not discovery.recording_keys():
        _decisions[key] = Decision(chosen.op, chosen.name, device_name(device), text, requires_grad, tuple(skipped),
                                   tuple(refused), forced)
    return chosen


def resolve_invariant(op: str, *, device: torch.device, dtype: torch.dtype, requires_grad: bool,
                      backend: str | None) -> Backend:
    """Inside :func:`hybrid_pack.batch_invariant`: the pure-torch backend (no check proves a kernel batch-invariant,
    docs/api.md §7e; a usable kernel is logged once). Raises BackendUnavailableError for a forced kernel."""
    forced, source = forcing(op, backend)
    reference = reference_of(op)
    if forced is not None and forced != reference.name:
        raise BackendUnavailableError(f"{op} backend {forced!r} (forced by {source}) cannot serve inside "
                                      f"batch_invariant(): no self-check proves it batch-invariant; force "
                                      f"{reference.name!r} or leave the backend to the selector")
    why = reference.reason(device, dtype, requires_grad)
    if why:
        raise BackendUnavailableError(f"{op}: inside batch_invariant() only backend {reference.name!r} serves, and "
                                      f"it cannot run here: {why}")
    kernels = [b.name for b in backends_of(op) if not b.reference and not b.reason(device, dtype, requires_grad)]
    if kernels:
        _log_once(op, ", ".join(kernels), "inside batch_invariant() kernels do not serve (no self-check proves "
                  f"them batch-invariant); {reference.name!r} runs")
    return reference


def decisions() -> list[Decision]:
    """Every distinct choice this process made so far: which backend ran each op's calls, and why not the others."""
    return list(_decisions.values())


def select(op: str, *, device: torch.device | str, dtype: torch.dtype, requires_grad: bool = False) -> str:
    """The name of the backend that will run ``op`` for a typical call on ``device`` with ``dtype``."""
    return resolve(op, device=device, dtype=dtype, requires_grad=requires_grad).name
