"""Choosing the backend that runs a call: priority, forcing, the environment override, and evidence.

A kernel backend serves a call only after it has passed the self-check for that call's key (op,
device, dtype, whether gradients are needed, the call's signature): results are kept for the
process and on disk (:mod:`.verdicts`). An automatic choice skips a backend that cannot run,
cannot take the inputs, or failed its check, and logs why once; a backend forced by argument,
:func:`use_backends` or ``HYBRID_PACK_BACKENDS`` raises :class:`BackendUnavailableError` instead.
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

from hybrid_pack.errors import BackendUnavailableError, InputError
from hybrid_pack.ops.dispatch import agreement, verdicts
from hybrid_pack.ops.dispatch.backend import Backend
from hybrid_pack.ops.dispatch.contract import Signature, dtype_name, signature_text
from hybrid_pack.ops.dispatch.registry import backends_of, contract_of, get_backend, reference_of, registered_ops
from hybrid_pack.ops.dispatch.selfcheck import run_check
from hybrid_pack.ops.dispatch.verdicts import CheckResult, VerdictKey

__all__ = ["ENV_VAR", "VERIFY_ENV", "Decision", "resolve", "select", "use_backends", "verification_enabled",
           "verdict_for", "check_now", "decisions"]

ENV_VAR = "HYBRID_PACK_BACKENDS"
VERIFY_ENV = "HYBRID_PACK_VERIFY"

logger = logging.getLogger("hybrid_pack.backends")
_logged: set[tuple[str, str, str]] = set()
_forced: ContextVar[Mapping[str, str]] = ContextVar("hybrid_pack_forced_backends", default=MappingProxyType({}))


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


_decisions: dict[tuple[str, str, str, bool, str], Decision] = {}


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
    """Inside a torch.compile trace or a CUDA graph capture: no check may run there.

    :func:`resolve` itself never runs inside a trace (torch.compile breaks the graph around it); a CUDA
    graph captured by hand (``torch.cuda.graph``) is what this mostly catches.
    """
    compiling = torch.compiler.is_compiling() if hasattr(torch, "compiler") else False
    return compiling or (torch.cuda.is_available() and torch.cuda.is_current_stream_capturing())


def _key(backend: Backend, signature: Signature, device: torch.device, requires_grad: bool) -> VerdictKey:
    return VerdictKey(backend.op, backend.name, backend.fingerprint, verdicts.device_name(device),
                      signature_text(signature), requires_grad)


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
    """Run the self-check of ``backend`` for this key now and keep the result.

    The result is kept for the process and on disk, so an environment checks each kernel once (SPEC §5a); a
    check that ran out of memory is kept for this process only (another process may have held the memory).
    """
    if _tracing():
        raise InputError(f"{backend.op} backend {backend.name!r}: a self-check cannot run inside a CUDA graph capture "
                         "or a torch.compile trace; run hybrid_pack.backends.verify() (or one eager step) before it")
    key = _key(backend, signature, device, requires_grad)
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


def verdict_for(backend: Backend, signature: Signature, device: torch.device,
                requires_grad: bool) -> CheckResult | None:
    """The check result of ``backend`` for this key, checking now if there is none (None inside a trace).

    Under ``torch.distributed`` it is the result every rank agreed on (:mod:`.agreement`): a collective the first
    time the key is asked for (none inside :func:`~.agreement.rank_local`).
    """
    key = _key(backend, signature, device, requires_grad)
    settled = agreement.agreed(key)
    if settled is not None:
        return settled
    known = verdicts.recall(key)
    if known is None and not requires_grad:
        with_grad = verdicts.recall(_key(backend, signature, device, True))
        known = with_grad if with_grad is not None and with_grad.ok else None
    if known is None:
        if _tracing():
            return None
        known = check_now(backend, signature, device, requires_grad)
    return known if _tracing() else agreement.agree(key, known)     # no collective inside a graph capture


def _why_not(candidate: Backend, device: torch.device, dtype: torch.dtype, requires_grad: bool,
             inputs: Mapping[str, Any] | None, signature: Signature | None) -> str:
    """Why ``candidate`` may not serve this call ("" when it may): availability, inputs, then evidence."""
    why = candidate.reason(device, dtype, requires_grad)
    if not why and candidate.accepts is not None and inputs is not None:
        why = candidate.accepts(inputs)
    if why or candidate.reference or not verification_enabled():
        return why
    signature = signature if signature is not None else contract_of(candidate.op).default_signature(dtype, device.type)
    verdict = verdict_for(candidate, signature, device, requires_grad)
    if verdict is None:
        return (f"not yet checked for {signature_text(signature)} on {verdicts.device_name(device)}, and no check "
                "runs inside a CUDA graph capture or a torch.compile trace (run one step eagerly first)")
    return verdict.reason


@torch.compiler.disable  # selection runs outside compiled graphs (a graph break), eagerly, as fla's dispatch does
def resolve(op: str, *, device: torch.device, dtype: torch.dtype, requires_grad: bool = False,
            backend: str | None = None, inputs: Mapping[str, Any] | None = None,
            signature: Signature | None = None) -> Backend:
    """The backend that runs ``op`` on these inputs.

    Args:
        op: the op.
        device, dtype, requires_grad: of the call.
        backend: force this backend (else a forced one from :func:`use_backends` / ``HYBRID_PACK_BACKENDS``).
        inputs: the call's inputs by name, for the backends' ``accepts`` checks.
        signature: the call's signature (sizes, flags, dtypes) for the self-check; default: the op's typical
            signature for ``dtype``.

    Raises:
        BackendUnavailableError: a forced backend cannot run, cannot take the inputs, or failed its check.
    """
    source = "backend=" if backend is not None else ""
    if backend is None:
        backend, source = _forced_for(op)
    if backend is not None:
        chosen = get_backend(op, backend)
        why = _why_not(chosen, device, dtype, requires_grad, inputs, signature)
        if why:
            raise BackendUnavailableError(f"{op} backend {backend!r} (forced by {source}) cannot run here: {why}")
        _decide(chosen, device, requires_grad, signature, [], [], forced=True)
        return chosen
    skipped, refused = [], []
    for candidate in backends_of(op):
        why = _why_not(candidate, device, dtype, requires_grad, inputs, signature)
        if not why:
            _decide(candidate, device, requires_grad, signature, skipped, refused, forced=False)
            return candidate
        skipped.append((candidate.name, why))
        if candidate.reason(device, dtype, requires_grad) == "":
            refused.append((candidate.name, why))
            _log_once(op, candidate.name, why)
    raise BackendUnavailableError(f"{op}: no backend can run on {device.type} with {dtype_name(dtype)}")


def _decide(chosen: Backend, device: torch.device, requires_grad: bool, signature: Signature | None,
            skipped: list[tuple[str, str]], refused: list[tuple[str, str]], *, forced: bool) -> None:
    """Remember the first decision per (op, device, signature, grad, backend): :func:`decisions` lists them."""
    text = signature_text(signature) if signature is not None else "typical call"
    key = (chosen.op, str(device), text, requires_grad, chosen.name)
    if key not in _decisions:
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
