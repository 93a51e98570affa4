"""The one warm-up, :func:`verify`: every rank checks every key any rank met and a backend serves a key only where
it passed on every rank (docs/api.md §5a, §9b); calls then look their backend up and never communicate."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from tqdm.auto import tqdm

from hybrid_pack.distributed import distributed, share_objects
from hybrid_pack.errors import InputError
from hybrid_pack.ops.dispatch import discovery, verdicts
from hybrid_pack.ops.dispatch.discovery import Wanted
from hybrid_pack.ops.dispatch.registry import (
    backends_of,
    contract_of,
    default_device,
    get_backend,
    reference_of,
    registered_ops,
)
from hybrid_pack.ops.dispatch.route import route_of
from hybrid_pack.ops.dispatch.selector import VERIFY_ENV, local_verdict, verdict_key, verification_enabled
from hybrid_pack.ops.selfcheck.contract import dtype_name
from hybrid_pack.ops.selfcheck.kept import VerdictKey
from hybrid_pack.ops.selfcheck.result import CheckResult, device_name
from hybrid_pack.ops.selfcheck.sharded_row import cp_check

__all__ = ["verify"]


def verify(op: str | None = None, *, model: torch.nn.Module | None = None, batch: Mapping[str, Any] | None = None,
           device: torch.device | str | None = None, dtype: torch.dtype | None = None, requires_grad: bool = True,
           progress: bool | None = None) -> list[CheckResult]:
    """The warm-up that settles which backend serves each op and call key, for every rank (docs/api.md §5a).

    Call it once before the first forward; under ``torch.distributed`` every rank calls it (collective). The keys:
    those one eager pass of ``model(**batch)`` on the pure-torch backends meets (with its backward; under
    ``torch.no_grad()`` the calls without gradients, as an evaluation makes them), and those met inside
    :func:`~.discovery.discovering`; with no such pass, each op's typical signature per ``dtype`` (default: bfloat16
    and float32 on CUDA, float32 on CPU) on ``device``, the pure-torch backends included. ``op``: only its keys;
    ``progress``: a progress bar (default: when stderr is a terminal). The model's gradients and the random
    stream are left as they were. Returns the verdicts this rank settled.
    """
    device = default_device() if device is None else torch.device(device)
    if model is not None:  # one eager pass on the pure-torch backends records the keys; gradients, random reset
        cuda = [torch.cuda.current_device()] if torch.cuda.is_available() and torch.cuda.is_initialized() else []
        parameters = list(model.parameters())
        accumulated = [p.grad for p in parameters]  # a step's micro-batches so far: put back as they were
        for p in parameters:
            p.grad = None
        try:
            with discovery.discovering(), torch.compiler.set_stance("force_eager"), \
                    torch.random.fork_rng(devices=cuda):
                loss = _scalar(model(**(batch or {})))
                if loss.requires_grad:
                    loss.backward()
        finally:
            for p, grad in zip(parameters, accumulated, strict=True):
                p.grad = grad
    discovered, met = discovery.take()
    groups = {c.group_ranks: group for c, group in met.items() if c.group_ranks}
    calls = [c for c in met if op is None or c.op == op]
    sharded_here = {c for c in calls if c.group_ranks}
    if distributed():
        everyone = share_objects((calls, sharded_here, verification_enabled()))
        unchecked = [rank for rank, (*_, checks) in enumerate(everyone) if not checks]
        if unchecked and len(unchecked) < len(everyone):
            raise InputError(f"{VERIFY_ENV}: turns the self-checks off on ranks {unchecked} only; set it alike on "
                             "every rank (a rank trusting a kernel unchecked runs another backend than the others)")
        calls = [c for mine, *_ in everyone for c in mine]
        # a sharded key is checked where every rank of its group ran it (each holds the group to check it on)
        sharded_here = {c for c in calls if c.group_ranks and all(c in everyone[r][1] for r in c.group_ranks)}
    typical = not calls and model is None and not discovered
    if typical:
        dtypes = (dtype,) if dtype is not None else (torch.bfloat16, torch.float32) if device.type == "cuda" \
            else (torch.float32,)
        calls = [Wanted(name, device.type, dtype_name(dt), requires_grad,
                        contract_of(name).default_signature(dt, device.type))
                 for name in (registered_ops() if op is None else (op,)) for dt in dtypes]
    calls = sorted(set(calls), key=repr)  # the same order on every rank
    # typical calls: a backend without a backward is checked without gradients (it serves inference)
    plain = [(b, c, c.requires_grad and (b.backward or not typical)) for c in calls if not c.group_ranks
             for b in backends_of(c.op) if typical or not b.reference]
    plain = [(b, c, grad) for b, c, grad in plain if not b.reason(device, getattr(torch, c.dtype), grad)]
    checked = []
    with tqdm(plain, desc="self-checks", unit="check", leave=False,
              disable=None if progress is None else not progress) as bar:
        for backend, call, grad in bar:
            bar.set_postfix_str(f"{backend.op} {backend.name} {call.dtype}")
            checked.append((verdict_key(backend, call.signature, device, grad),
                            local_verdict(backend, call.signature, device, grad)))
    return _agree(checked) + _settle_sharded([c for c in calls if c in sharded_here], device, groups)


def _agree(results: list[tuple[VerdictKey, CheckResult]]) -> list[CheckResult]:
    """Settle each key's verdict: this rank's own in a single process, failed where any rank failed otherwise."""
    everyone = share_objects({key.text(): (result.ok, result.reason) for key, result in results}) if distributed() \
        else []
    settled = []
    for key, result in results:
        for rank, theirs in enumerate(everyone):
            ok, why = theirs.get(key.text(), (False, "cannot run there"))
            if result.ok and not ok:  # the first rank that failed is named
                result = dataclasses.replace(result, ok=False, reason=(
                    f"passed its self-check here but not on rank {rank} ({why}); every rank runs the same backend"))
        verdicts.settle(key, result)
        settled.append(result)
    return settled


def _settle_sharded(calls: list[Wanted], device: torch.device, groups: dict[tuple[int, ...], Any]
                    ) -> list[CheckResult]:
    """Run the sharded backends' collective checks, key by key in the same order on every rank of each group."""
    if not calls or not verification_enabled() or not distributed():
        return []
    rank = dist.get_rank()
    out = []
    for call in calls:
        if rank not in call.group_ranks:
            continue
        group, dtype = groups[call.group_ranks], getattr(torch, call.dtype)
        mine = backends_of(call.op, sharded=True)
        registered = share_objects([b.name for b in mine], group)
        everywhere = [name for name in registered[0] if all(name in names for names in registered)]
        for backend in mine:  # one registered on some ranks only never serves (its check would be theirs alone)
            if backend.name not in everywhere:
                key = verdict_key(backend, call.signature, device, call.requires_grad, call.group_ranks)
                result = CheckResult(backend.op, backend.name, False, "registered on some ranks of the "
                                     "context-parallel group only; register it on every rank", float("nan"), 0.0,
                                     device_name(device), call.dtype, key.text(), call.requires_grad)
                verdicts.settle(key, result)
                out.append(result)
        for backend in (get_backend(call.op, name) for name in everywhere):  # the same order on every rank
            key = verdict_key(backend, call.signature, device, call.requires_grad, call.group_ranks)
            if not all(share_objects(not backend.reason(device, dtype, call.requires_grad), group)):
                continue
            result = cp_check(backend, functools.partial(route_of(call.op).public, backend=reference_of(call.op).name),
                              contract_of(call.op), call.signature, device, call.requires_grad, group,
                              dist.get_group_rank(group or dist.group.WORLD, rank), len(call.group_ranks))
            verdicts.settle(key, result)
            out.append(result)
    return out


def _scalar(output: Any) -> torch.Tensor:
    """A scalar to run the backward from: the model's loss, else the mean of its logits (or first output)."""
    if isinstance(output, Mapping):  # transformers' ModelOutput and plain dicts
        output = output["loss"] if output.get("loss") is not None else output.get("logits", next(iter(output.values())))
    elif isinstance(output, (tuple, list)):
        output = output[0]
    elif getattr(output, "loss", None) is not None:
        output = output.loss
    else:
        output = getattr(output, "logits", output)
    return output.float().mean()
