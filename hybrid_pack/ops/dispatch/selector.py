"""Choosing the backend that runs a call: priority, forcing, the environment override, and evidence.

A kernel backend serves a call only after it has passed the self-check for that call's key (op,
device, dtype, whether gradients are needed, the call's signature): results are kept for the
process and on disk (:mod:`.verdicts`), and under ``torch.distributed`` settled for the whole group by
:func:`hybrid_pack.backends.verify` (:mod:`.agreement`). Choosing is a local lookup: it never communicates.
An automatic choice skips a backend that cannot run, cannot take the inputs, or failed its check, and logs
why once; a backend forced by argument, :func:`use_backends` or ``HYBRID_PACK_BACKENDS`` raises
:class:`BackendUnavailableError` instead.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import threading
from collections.abc import Callable, Iterator, Mapping
from contextvars import ContextVar
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

import torch
import torch.distributed as dist

from hybrid_pack.distributed import distributed
from hybrid_pack.errors import BackendUnavailableError, InputError
from hybrid_pack.ops.dispatch import agreement, verdicts
from hybrid_pack.ops.dispatch.backend import Backend
from hybrid_pack.ops.dispatch.contract import Signature, dtype_name, signature_text
from hybrid_pack.ops.dispatch.registry import backends_of, contract_of, get_backend, reference_of, registered_ops
from hybrid_pack.ops.dispatch.selfcheck import run_check
from hybrid_pack.ops.dispatch.verdicts import CheckResult, VerdictKey

__all__ = ["ENV_VAR", "VERIFY_ENV", "Decision", "resolve", "resolve_sharded", "static_choice", "describe", "select",
           "use_backends", "verification_enabled", "verdict_for", "verdict_key", "local_verdict", "check_now",
           "decisions", "discovering", "is_discovering", "resolve_invariant"]

ENV_VAR = "HYBRID_PACK_BACKENDS"
VERIFY_ENV = "HYBRID_PACK_VERIFY"

logger = logging.getLogger("hybrid_pack.backends")
_logged: set[tuple[str, str, str]] = set()
_forced: ContextVar[Mapping[str, str]] = ContextVar("hybrid_pack_forced_backends", default=MappingProxyType({}))
_discovering: ContextVar[bool] = ContextVar("hybrid_pack_discovering_keys", default=False)


@dataclass(frozen=True)
class Decision:
    """Which backend serves calls of one op with one signature on one device, and why not the others before it.

    Attributes:
        op, backend: the op and the backend chosen.
        device, signature: the calls' key (the signature as text).
        requires_grad: whether the calls need a backward pass.
        skipped: ``(backend, why)`` for every backend of higher priority that was passed over.
        refused: those of them that could run here but refused these inputs or failed their self-check.
        forced: the backend was forced (argument, ``use_backends`` or ``HYBRID_PACK_BACKENDS``).
    """

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


def _log_once(op: str, name: str, why: str) -> None:
    if (op, name, why) not in _logged:
        _logged.add((op, name, why))
        logger.warning("%s: skipping backend %r: %s", op, name, why)


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
    if not raw:
        return {}
    pairs = {}
    for item in filter(None, (p.strip() for p in raw.split(","))):
        op, sep, name = item.partition("=")
        if not sep or not name.strip():
            raise InputError(f"{ENV_VAR}: expected comma-separated op=backend pairs such as "
                             f"'conv=torch,ssd=mamba_ssm'; got {raw!r}")
        pairs[op.strip()] = name.strip()
    return _check_forced(pairs, ENV_VAR)


def _forced_for(op: str) -> tuple[str | None, str]:
    ctx = _forced.get()
    if op in ctx:
        return ctx[op], "use_backends()"
    env = _parse_env(os.environ.get(ENV_VAR, "").strip())
    if op in env:
        return env[op], ENV_VAR
    return None, ""


@contextlib.contextmanager
def use_backends(**forced: str) -> Iterator[None]:
    """Force backends inside a ``with`` block, e.g. ``use_backends(conv="torch", ssd="mamba_ssm")``."""
    token = _forced.set({**_forced.get(), **_check_forced(forced, "use_backends")})
    try:
        yield
    finally:
        _forced.reset(token)


def _tracing() -> bool:
    """Inside a torch.compile trace or a CUDA graph capture: no check may run there."""
    compiling = torch.compiler.is_compiling() if hasattr(torch, "compiler") else False
    return compiling or (torch.cuda.is_available() and torch.cuda.is_current_stream_capturing())


def verdict_key(backend: Backend, signature: Signature, device: torch.device, requires_grad: bool,
                group_ranks: tuple[int, ...] = ()) -> VerdictKey:
    """What a verdict is valid for: the backend's code, the device, the signature (and a sharded call's group)."""
    text = signature_text(signature) + (f" cp_ranks={','.join(map(str, group_ranks))}" if group_ranks else "")
    return VerdictKey(backend.op, backend.name, backend.fingerprint, verdicts.device_name(device), text, requires_grad)


def _in_a_clean_thread(fn: Callable[[], CheckResult], device: torch.device) -> CheckResult:
    """``fn()`` on a thread of its own: grad and inference mode, autocast, saved-tensor hooks (activation
    checkpointing) and dispatch modes are per thread, so the caller's do not reach the check (nor the check's
    autograd graph the caller's)."""
    outcome: dict[str, Any] = {}

    def target() -> None:
        try:
            if device.type == "cuda":
                torch.cuda.set_device(device)
            outcome["result"] = fn()
        except BaseException as err:  # handed back to the caller's thread
            outcome["error"] = err

    thread = threading.Thread(target=target, name="hybrid_pack-selfcheck")
    thread.start()
    thread.join()
    if "error" in outcome:
        raise outcome["error"]
    return outcome["result"]


def check_now(backend: Backend, signature: Signature, device: torch.device, requires_grad: bool) -> CheckResult:
    """Run the self-check of ``backend`` for this key now, on this rank only, and keep the result.

    The result is kept for the process and on disk, so an environment checks each kernel once (docs/api.md §5a);
    a check that ran out of memory is kept for this process only (another process may have held the memory).
    """
    if _tracing():
        raise InputError(f"{backend.op} backend {backend.name!r}: a self-check cannot run inside a CUDA graph capture "
                         "or a torch.compile trace; run hybrid_pack.backends.verify() (or one eager step) before it")
    key = verdict_key(backend, signature, device, requires_grad)
    try:
        result = _in_a_clean_thread(lambda: run_check(backend, reference_of(backend.op), contract_of(backend.op),
                                                      signature, device, requires_grad), device)
    except torch.cuda.OutOfMemoryError as err:
        result = CheckResult(op=backend.op, backend=backend.name, ok=False,
                             reason=f"ran out of memory in its self-check ({err})", max_error=float("nan"),
                             seconds=0.0, device=key.device, signature=key.signature, requires_grad=requires_grad)
        verdicts.remember(key, result, persist=False)
        return result
    verdicts.remember(key, result)
    return result


def local_verdict(backend: Backend, signature: Signature, device: torch.device, requires_grad: bool, *,
                  check: bool = True) -> CheckResult | None:
    """This rank's own verdict for the key: kept in the process or on disk, else (``check``) checked now.

    A key checked with gradients also serves the calls that need none. None when unknown and not checked.
    """
    known = verdicts.recall(verdict_key(backend, signature, device, requires_grad))
    if known is None and not requires_grad:
        with_grad = verdicts.recall(verdict_key(backend, signature, device, True))
        known = with_grad if with_grad is not None and with_grad.ok else None
    if known is None and check:
        known = check_now(backend, signature, device, requires_grad)
    return known


def verdict_for(backend: Backend, signature: Signature, device: torch.device, dtype: torch.dtype,
                requires_grad: bool, *, check: bool = True) -> CheckResult | None:
    """The verdict that lets ``backend`` serve this key, or None (then it does not serve). Never communicates.

    The group's settled verdict (:mod:`.agreement`) comes first. Without one, a single process uses its own
    (:func:`local_verdict`); under ``torch.distributed`` (or while :func:`discovering`) the key is remembered as
    wanted for the next :func:`hybrid_pack.backends.verify` and None is returned, so every rank falls back alike.
    """
    settled = agreement.settled(verdict_key(backend, signature, device, requires_grad))
    if settled is not None:
        return settled
    if _discovering.get() or distributed():
        agreement.want(agreement.Wanted(backend.op, device.type, dtype_name(dtype), requires_grad, signature))
        return None
    return local_verdict(backend, signature, device, requires_grad, check=check and not _tracing())


def _unsettled(signature: Signature, device: torch.device) -> str:
    if distributed():
        return (f"no verdict settled by the {dist.get_world_size()} ranks yet for {signature_text(signature)} "
                "(hybrid_pack.backends.verify() settles it; train, the trainers and the CLI call it first)")
    return (f"not yet checked for {signature_text(signature)} on {verdicts.device_name(device)}, and no check runs "
            "inside a CUDA graph capture or a torch.compile trace (call hybrid_pack.backends.verify() first)")


def _why_not(candidate: Backend, device: torch.device, dtype: torch.dtype, requires_grad: bool,
             inputs: Mapping[str, Any] | None, signature: Signature | None, *, check: bool = True) -> str:
    """Why ``candidate`` may not serve this call ("" when it may): availability, inputs, then evidence."""
    why = candidate.reason(device, dtype, requires_grad)
    if not why and candidate.accepts is not None and inputs is not None:
        why = candidate.accepts(inputs)
    if why or candidate.reference or not verification_enabled():
        return why
    signature = signature if signature is not None else contract_of(candidate.op).default_signature(dtype, device.type)
    verdict = verdict_for(candidate, signature, device, dtype, requires_grad, check=check)
    return _unsettled(signature, device) if verdict is None else verdict.reason


@torch.compiler.disable  # a compiled graph asks static_choice() instead, while tracing
def resolve(op: str, *, device: torch.device, dtype: torch.dtype, requires_grad: bool = False,
            backend: str | None = None, inputs: Mapping[str, Any] | None = None,
            signature: Signature | None = None, check: bool = True) -> Backend:
    """The backend that runs ``op`` on a whole row (plain or static) with these inputs. Never communicates.

    Args:
        op: the op.
        device, dtype, requires_grad: of the call.
        backend: force this backend (else a forced one from :func:`use_backends` / ``HYBRID_PACK_BACKENDS``).
        inputs: the call's inputs by name, for the backends' ``accepts`` checks.
        signature: the call's signature (sizes, flags, dtypes) for the self-check; default: the op's typical
            signature for ``dtype``.
        check: in a single process, check a kernel with no verdict yet now (False: it does not serve).

    Raises:
        BackendUnavailableError: a forced backend cannot run, cannot take the inputs, or failed its check.
    """
    source = "backend=" if backend is not None else ""
    if backend is None:
        backend, source = _forced_for(op)
    if backend is not None:
        chosen = get_backend(op, backend)
        why = ("serves rows split across a context-parallel group only" if chosen.sharded else
               _why_not(chosen, device, dtype, requires_grad, inputs, signature, check=check))
        if why:
            raise BackendUnavailableError(f"{op} backend {backend!r} (forced by {source}) cannot run here: {why}")
        _decide(chosen, device, requires_grad, signature, [], [], forced=True)
        return chosen
    skipped, refused = [], []
    for candidate in backends_of(op):
        why = _why_not(candidate, device, dtype, requires_grad, inputs, signature, check=check)
        if not why:
            _decide(candidate, device, requires_grad, signature, skipped, refused, forced=False)
            return candidate
        skipped.append((candidate.name, why))
        if candidate.reason(device, dtype, requires_grad) == "":
            refused.append((candidate.name, why))
            if not _discovering.get():
                _log_once(op, candidate.name, why)
    raise BackendUnavailableError(f"{op}: no backend can run on {device.type} with {dtype_name(dtype)}")


def resolve_invariant(op: str, *, device: torch.device, dtype: torch.dtype, requires_grad: bool,
                      backend: str | None) -> Backend:
    """The backend that runs ``op`` inside :func:`hybrid_pack.batch_invariant`: its pure-torch backend.

    No kernel's self-check proves the mode's bitwise property yet (docs/api.md §7d), so kernels do not serve in
    the mode; the first call of each op on a device where a kernel could run says so once (logged).

    Raises:
        BackendUnavailableError: a kernel backend is forced (argument, :func:`use_backends`,
            ``HYBRID_PACK_BACKENDS``), or the pure-torch backend cannot run here.
    """
    source = "backend=" if backend is not None else ""
    if backend is None:
        backend, source = _forced_for(op)
    reference = reference_of(op)
    if backend is not None and backend != reference.name:
        raise BackendUnavailableError(f"{op} backend {backend!r} (forced by {source}) cannot serve inside "
                                      f"batch_invariant(): no self-check proves it batch-invariant; force "
                                      f"{reference.name!r} or leave the backend to the selector")
    why = reference.reason(device, dtype, requires_grad)
    if why:
        raise BackendUnavailableError(f"{op}: inside batch_invariant() only backend {reference.name!r} serves, and "
                                      f"it cannot run here: {why}")
    kernels = [b.name for b in backends_of(op) if not b.reference and not b.reason(device, dtype, requires_grad)]
    if kernels and not _discovering.get():
        _log_once(op, ", ".join(kernels), "inside batch_invariant() kernels do not serve (no self-check proves "
                  f"them batch-invariant); {reference.name!r} runs")
    return reference


def resolve_sharded(op: str, *, device: torch.device, dtype: torch.dtype, requires_grad: bool,
                    backend: str | None, inputs: Mapping[str, Any], signature: Signature,
                    group: Any, group_ranks: tuple[int, ...]) -> Backend | None:
    """The sharded backend (its own context parallelism) that runs this call on a rank's slice of a row, or None:
    then the op's pure-torch context-parallel path runs around the whole-row backends. Never communicates.

    A sharded backend serves only with the group's settled verdict of its collective self-check (unless
    ``HYBRID_PACK_VERIFY=0``); ``inputs`` includes ``boundaries`` for its ``accepts``.

    Raises:
        BackendUnavailableError: a forced sharded backend cannot serve the call.
    """
    source = "backend=" if backend is not None else ""
    if backend is None:
        backend, source = _forced_for(op)
    candidates = backends_of(op, sharded=True)
    if backend is not None:
        candidates = [b for b in candidates if b.name == backend]
    for candidate in candidates:
        why = candidate.reason(device, dtype, requires_grad) or (
            candidate.accepts(inputs) if candidate.accepts is not None else "")
        if not why and verification_enabled():
            key = verdict_key(candidate, signature, device, requires_grad, group_ranks)
            verdict = agreement.settled(key)
            if verdict is None:
                agreement.want(agreement.Wanted(op, device.type, dtype_name(dtype), requires_grad, signature,
                                                group_ranks), group)
            why = _unsettled(signature, device) if verdict is None else verdict.reason
        if not why:
            _decide(candidate, device, requires_grad, signature, [], [], forced=backend is not None)
            return candidate
        if backend is not None:
            raise BackendUnavailableError(f"{op} backend {backend!r} (forced by {source}) cannot run here: {why}")
        if not _discovering.get():
            _log_once(op, candidate.name, why)
    return None


@torch.compiler.assume_constant_result
def static_choice(op: str, device: str, dtype: str, requires_grad: bool, backend: str | None,
                  signature: Signature, described: tuple[tuple[str, Any], ...], check: bool) -> str:
    """The name of the backend for a call on static boundaries; inside ``torch.compile`` it runs while tracing and
    its answer is a constant of the graph.

    Arguments are plain values (``described``: :func:`describe` of the call's inputs). While tracing ``check`` is
    False: a kernel serves only with a verdict settled or kept before (:func:`hybrid_pack.backends.verify`).
    """
    inputs = {name: torch.empty(value[1], dtype=getattr(torch, value[2]), device="meta")
              if isinstance(value, tuple) and value[:1] == ("tensor",) else value for name, value in described}
    return resolve(op, device=torch.device(device), dtype=getattr(torch, dtype), requires_grad=requires_grad,
                   backend=backend, inputs=inputs, signature=signature, check=check).name


def describe(inputs: Mapping[str, Any]) -> tuple[tuple[str, Any], ...]:
    """A call's inputs as plain values for :func:`static_choice`: tensors by shape and dtype."""
    return tuple((name, ("tensor", tuple(value.shape), dtype_name(value.dtype)) if isinstance(value, torch.Tensor)
                  else value) for name, value in inputs.items())


def is_discovering() -> bool:
    """Whether this call runs inside :func:`discovering` (the backends' warm-up pass)."""
    return _discovering.get()


@contextlib.contextmanager
def discovering() -> Iterator[None]:
    """Inside the block, calls record the keys they need (for :func:`hybrid_pack.backends.verify`) and run on the
    pure-torch backends; no check runs and nothing is logged."""
    token = _discovering.set(True)
    try:
        yield
    finally:
        _discovering.reset(token)


def _decide(chosen: Backend, device: torch.device, requires_grad: bool, signature: Signature | None,
            skipped: list[tuple[str, str]], refused: list[tuple[str, str]], *, forced: bool) -> None:
    """Remember the first decision per (op, device, signature, grad, backend, why not the others):
    :func:`decisions` lists them."""
    text = signature_text(signature) if signature is not None else "typical call"
    key = (chosen.op, str(device), text, requires_grad, chosen.name, tuple(refused))
    if key not in _decisions and not _discovering.get():
        _decisions[key] = Decision(chosen.op, chosen.name, verdicts.device_name(device), text, requires_grad,
                                   tuple(skipped), tuple(refused), forced)


def decisions() -> list[Decision]:
    """Every distinct choice this process made so far: which backend ran each op's calls, and why not the others."""
    return list(_decisions.values())


def select(op: str, *, device: torch.device | str, dtype: torch.dtype, requires_grad: bool = False) -> str:
    """The name of the backend that will run ``op`` for a typical call on ``device`` with ``dtype``.

    A kernel not yet checked for that typical call is checked now. A particular call can still go to
    another backend: its own signature is checked on first use, and inputs a kernel cannot take go to
    the next backend (logged once).
    """
    return resolve(op, device=torch.device(device), dtype=dtype, requires_grad=requires_grad).name
