"""Self-check results, kept for the process and on disk per environment: one file per environment (versions of
torch, triton, the kernel packages, hybrid_pack and a hash of its source; ``FLA_TILELANG``) under
``HYBRID_PACK_CACHE`` (default ``~/.cache/hybrid_pack``), keyed by op, backend (and its code's hash), device,
signature and gradients.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import platform
import tempfile
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

import torch

from hybrid_pack.ops.triton_device import INTERPRET_ENV, cpu_interpreter_enabled

__all__ = ["CheckResult", "VerdictKey", "remember", "recall", "forget", "results", "environment", "device_name",
           "CACHE_ENV", "cache_dir", "SETTLED", "CHOICES", "lookup", "settle", "changed", "generation"]

CACHE_ENV = "HYBRID_PACK_CACHE"
PACKAGES = ("hybrid_pack", "torch", "triton", "fla-core", "flash-linear-attention", "mamba-ssm", "causal-conv1d",
            "flash-attn", "tilelang")
SWITCHES = ("FLA_TILELANG", INTERPRET_ENV)
"""Environment variables that change which kernel code runs."""


@dataclass(frozen=True)
class CheckResult:
    """One self-check of one backend (docs/api.md §5a): ``ok``, ``reason`` ("" when ok), ``max_error`` (the largest
    relative difference measured; NaN when none), ``seconds``, the ``device`` name, the ``dtype`` that set the
    tolerance, the ``signature`` as text and ``requires_grad`` (the backward was checked)."""

    op: str
    backend: str
    ok: bool
    reason: str
    max_error: float
    seconds: float
    device: str = ""
    dtype: str = ""
    signature: str = ""
    requires_grad: bool = True


@dataclass(frozen=True)
class VerdictKey:
    """What a check result is valid for, within one environment."""

    op: str
    backend: str
    fingerprint: str
    device: str
    signature: str
    requires_grad: bool

    def text(self) -> str:
        return "|".join((self.op, self.backend, self.fingerprint, self.device, self.signature,
                         "grad" if self.requires_grad else "forward"))


def device_name(device: torch.device) -> str:
    """``"cuda NVIDIA H100 80GB HBM3"``, ``"cpu"`` or ``"cpu (Triton interpreter)"``: what a result was measured on."""
    if device.type == "cuda":
        return _cuda_name(device.index if device.index is not None else torch.cuda.current_device())
    if device.type == "cpu" and cpu_interpreter_enabled():
        return "cpu (Triton interpreter)"
    return device.type


@functools.cache
def _cuda_name(index: int) -> str:
    return f"cuda {torch.cuda.get_device_name(index)}"


def _source_digest() -> str:
    """A hash of every Python file of hybrid_pack (an editable install keeps its version number while it changes)."""
    root = Path(__file__).resolve().parents[2]
    digest = hashlib.sha1()
    for path in sorted(root.rglob("*.py")):
        digest.update(path.relative_to(root).as_posix().encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


@functools.cache
def environment() -> dict[str, str]:
    """The versions and switches a result depends on (a missing package is recorded as absent)."""
    env = {"python": platform.python_version(), "cuda": str(torch.version.cuda), "hybrid_pack_source": _source_digest()}
    for package in PACKAGES:
        try:
            env[package] = version(package)
        except PackageNotFoundError:
            env[package] = "absent"
    env.update({name: os.environ.get(name, "") for name in SWITCHES})
    return env


def cache_dir() -> Path:
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "hybrid_pack")


def _cache_file() -> Path:
    return cache_dir() / f"backend-checks-{_environment_digest()}.json"


@functools.cache
def _environment_digest() -> str:
    return hashlib.sha1(json.dumps(environment(), sort_keys=True).encode()).hexdigest()[:16]


_memory: dict[VerdictKey, CheckResult] = {}
_loaded_from: tuple[str | None, str] | None = None  # (HYBRID_PACK_CACHE, environment digest) of the file read
SETTLED: dict[VerdictKey, CheckResult] = {}
"""The verdicts in force in this process: settled by the warm-up (the group's, under ``torch.distributed``), or by
a single eager process's first call of a key."""
CHOICES: dict[tuple[Any, ...], Any] = {}
"""The ops' routes' answers per call key (cleared whenever a verdict or a registration changes)."""
generation = 0
"""Counts the changes to :data:`CHOICES`: a compiled graph reads it, so it is traced again after a change."""


def changed() -> None:
    """Forget every route's answers and re-trace compiled graphs (a verdict, a registration or a forcing changed)."""
    global generation
    CHOICES.clear()
    generation += 1


def lookup(find: Callable[[VerdictKey], CheckResult | None], key: VerdictKey, *, failed_too: bool = True
           ) -> CheckResult | None:
    """``find(key)``; for a call without gradients with no result of its own, the check with them: passed or failed
    (a kernel refused for training serves no evaluation either), passed only without ``failed_too`` (a check
    without gradients may still run)."""
    known = find(key)
    if known is None and not key.requires_grad:
        with_grad = find(replace(key, requires_grad=True))
        known = with_grad if with_grad is not None and (failed_too or with_grad.ok) else None
    return known


def settle(key: VerdictKey, result: CheckResult) -> None:
    """Put ``result`` in force for ``key`` (the warm-up: the same on every rank); compiled graphs are traced again
    unless the verdict a call of ``key`` reads stays what it was."""
    before = lookup(SETTLED.get, key)
    SETTLED[key] = result
    if before is None or (before.ok, before.reason) != (result.ok, result.reason):
        changed()


def _load() -> None:
    """Read this environment's file once (again if ``HYBRID_PACK_CACHE`` or the environment changed)."""
    global _loaded_from
    source = (os.environ.get(CACHE_ENV), _environment_digest())
    if _loaded_from == source:
        return
    _loaded_from = source
    for text, record in _read(_cache_file()).items():
        try:
            op, backend, fingerprint, device, signature, grad = text.split("|")
            result = CheckResult(**record)
        except (TypeError, ValueError):  # written by another version: checked again
            continue
        _memory.setdefault(VerdictKey(op, backend, fingerprint, device, signature, grad == "grad"), result)


def _read(path: Path) -> dict[str, dict]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data.get("results", {}) if isinstance(data, dict) else {}


def recall(key: VerdictKey) -> CheckResult | None:
    """The result for ``key`` from this process or this environment's file, or None."""
    _load()
    return _memory.get(key)


def remember(key: VerdictKey, result: CheckResult, *, persist: bool = True) -> None:
    """Keep ``result`` for the process and, with ``persist``, in this environment's file (merged, atomic)."""
    _load()
    _memory[key] = result
    if not persist:
        return
    path = _cache_file()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        records = _read(path)
        records[key.text()] = asdict(result)
        with tempfile.NamedTemporaryFile("w", dir=path.parent, delete=False, suffix=".tmp") as tmp:
            json.dump({"environment": environment(), "results": records}, tmp, indent=1, sort_keys=True)
        os.replace(tmp.name, path)
    except OSError:
        pass  # a read-only home: the result stays in memory


def forget(op: str, backend: str) -> None:
    """Drop this process's results for one backend, kept and settled (it was registered again or removed)."""
    for table in (_memory, SETTLED):
        for key in [k for k in table if k.op == op and k.backend == backend]:
            del table[key]
    changed()


def results(op: str | None = None, backend: str | None = None, fingerprint: str | None = None) -> list[CheckResult]:
    """Every result known in this process (this environment's file included) for ``op`` / ``backend`` / code."""
    _load()
    return [r for k, r in _memory.items() if (op is None or k.op == op) and (backend is None or k.backend == backend)
            and (fingerprint is None or k.fingerprint == fingerprint)]
