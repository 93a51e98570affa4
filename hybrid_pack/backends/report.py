"""The table a person reads: per op, the backend chosen here and why not each other one."""

from __future__ import annotations

import torch
import torch.distributed as dist

from hybrid_pack.distributed import distributed
from hybrid_pack.ops.dispatch import verdicts
from hybrid_pack.ops.dispatch.backend import Backend
from hybrid_pack.ops.dispatch.registry import backends_of, contract_of, default_device, registered_ops
from hybrid_pack.ops.dispatch.selector import forcing, local_verdict, resolve, verdict_key, verification_enabled
from hybrid_pack.ops.selfcheck import kept
from hybrid_pack.ops.selfcheck.contract import dtype_name, signature_text
from hybrid_pack.ops.selfcheck.kept import cache_dir
from hybrid_pack.ops.selfcheck.result import device_name

__all__ = ["report"]


def _status(backend: Backend, chosen: Backend | None, device: torch.device, dtype: torch.dtype) -> str:
    """The status column: whether ``backend`` serves here, and why not (``chosen``: None for a sharded backend)."""
    why = backend.reason(device, dtype, True)
    if why:
        return f"no: {why}"
    if backend.sharded:
        if verification_enabled():
            return "ok: serves sharded calls after its collective self-check on the group"
        return "ok: serves sharded calls (unchecked: HYBRID_PACK_VERIFY=0)"
    if backend.reference:
        return "CHOSEN (pure torch)" if backend is chosen else "ok (pure torch, the fallback)"
    signature = contract_of(backend.op).default_signature(dtype, device.type)
    key = verdict_key(backend, signature, device, True)
    verdict = verdicts.SETTLED.get(key) or kept.recall(key)
    if verdict is not None and not verdict.ok:
        return f"no: {verdict.reason}"
    if not verification_enabled():
        return f"{'CHOSEN' if backend is chosen else 'ok'} (unchecked: HYBRID_PACK_VERIFY=0)"
    if verdict is None and backend is not chosen and backend.priority < chosen.priority:
        return "ok (lower priority; not checked)"
    if verdict is None and not distributed():
        verdict = local_verdict(backend, signature, device, True)
    if verdict is None or not verdict.ok:
        return f"no: {verdict.reason if verdict is not None else 'not checked'}"
    passed = f"self-check passed: max error {verdict.max_error:.1e}, {verdict.seconds:.2f} s"
    if backend is chosen:
        return f"CHOSEN ({passed})"
    forced, source = forcing(backend.op, None)
    return f"ok ({passed}; {f'{forced!r} forced by {source}' if forced else 'lower priority'})"


def report(device: torch.device | str | None = None, dtype: torch.dtype = torch.float32) -> str:
    """Per op: the backend chosen for a typical call with backward and why not each other; then the sharded
    backends. It checks the kernels it would pick (lower-priority ones stay unchecked); under
    ``torch.distributed`` it shows the settled verdicts and starts no collective."""
    device = torch.device(device) if device is not None else default_device()
    problem = kept.cache_problem()
    kept_in = f"results kept in memory only: {cache_dir()} {problem}" if problem else f"results kept in {cache_dir()}"
    check = f"self-check on, {kept_in}" if verification_enabled() else "self-check OFF"
    if distributed():
        check += f"; verdicts settled for the {dist.get_world_size()} ranks by hybrid_pack.backends.verify()"
    lines = [f"hybrid_pack backends on {device_name(device)}, {dtype_name(dtype)}, with backward ({check})", ""]
    every = [b for op in registered_ops() for b in backends_of(op, sharded=None)]
    widths = [max(len(text) for text in column) for column in (
        ["op", *registered_ops()], ["backend", *(b.name for b in every)],
        ["boundaries via", "ShardedBoundaries", *(b.boundary_arg for b in every if not b.sharded)])]

    def row(op: str, backend: str, via: str, status: str) -> str:
        return f"{op:<{widths[0]}} {backend:<{widths[1]}} {via:<{widths[2]}} {status}"

    header = row("op", "backend", "boundaries via", "status")
    lines += [header, "-" * len(header)]
    for op in registered_ops():
        chosen = resolve(op, device=device, dtype=dtype, requires_grad=True, strict=False)
        lines += [row(op, backend.name, backend.boundary_arg, _status(backend, chosen, device, dtype))
                  for backend in backends_of(op)]
        typical = signature_text(contract_of(op).default_signature(dtype, device.type))
        forced, source = forcing(op, None)
        lines.append(f"{'':<{widths[0]}} (typical call: {typical}"
                     + (f"; {forced!r} forced by {source})" if forced else ")"))
        lines += [f"{'':<{widths[0]}} {r.backend} refused for {r.signature}"
                  f"{'' if r.requires_grad else ' (without gradients)'}: {r.reason}"
                  for b in backends_of(op) if not b.reference and not b.environment_reason
                  for r in kept.results(op, b.name, b.fingerprint)
                  if not r.ok and r.device == device_name(device) and r.signature != typical]
    lines += ["", "context parallelism (a row split across ranks, docs/parallel.md; the pure-torch path always serves)",
              header, "-" * len(header)]
    for op in registered_ops():
        lines += [row(op, backend.name, "ShardedBoundaries", _status(backend, None, device, dtype))
                  for backend in backends_of(op, sharded=True)]
    return "\n".join(lines)
