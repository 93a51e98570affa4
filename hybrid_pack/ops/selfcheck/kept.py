"""Self-check results kept for the process and on disk (docs/api.md §5a): one file per environment (versions of
torch, triton, the kernel packages, hybrid_pack and a hash of its source; the switches that change which kernel code
runs) under ``HYBRID_PACK_CACHE`` (default ``~/.cache/hybrid_pack``), keyed by op, backend (and its code's hash),
device, signature and gradients."""

from __future__ import annotations

import functools
import hashlib
import inspect
import json
import os
import platform
import tempfile
import types
from collections.abc import Callable
from dataclasses import asdict
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any, NamedTuple

import torch

from hybrid_pack.ops.selfcheck.result import CheckResult
from hybrid_pack.ops.triton_device import INTERPRET_ENV

__all__ = ["VerdictKey", "code_fingerprint", "lookup", "remember", "recall", "forget", "results", "environment",
           "CACHE_ENV", "cache_dir", "cache_problem"]

CACHE_ENV = "HYBRID_PACK_CACHE"
PACKAGES = ("hybrid_pack", "torch", "triton", "fla-core", "flash-linear-attention", "mamba-ssm", "causal-conv1d",
            "flash-attn", "tilelang")
SWITCHES = ("FLA_TILELANG", INTERPRET_ENV)
"""Environment variables that change which kernel code runs."""


class VerdictKey(NamedTuple):
    """What a check result is valid for, within one environment."""

    op: str
    backend: str
    fingerprint: str
    device: str
    signature: str
    requires_grad: bool

    def text(self) -> str:
        return "|".join((*self[:5], "grad" if self.requires_grad else "forward"))


def _stable_repr(value: Any) -> str:
    """A value a kernel uses, the same in every process (no memory address): a module by its file's hash, a
    function by its source."""
    if value is None or isinstance(value, (bool, int, float, str, bytes)):
        return repr(value)
    if isinstance(value, (tuple, list)):
        return "(" + ",".join(map(_stable_repr, value)) + ")"
    if isinstance(value, types.ModuleType):
        try:
            return f"{value.__name__}:{hashlib.sha1(Path(value.__file__).read_bytes()).hexdigest()[:12]}"
        except (OSError, TypeError, AttributeError):  # a built-in or namespace module
            return value.__name__
    if callable(value):
        try:
            return f"{getattr(value, '__qualname__', '')}:{inspect.getsource(value)}"
        except (OSError, TypeError):
            return getattr(value, "__qualname__", type(value).__name__)
    return type(value).__qualname__


def code_fingerprint(fn: Callable[..., Any]) -> str:
    """``module:function@hash`` of the code ``fn`` runs: its source, the values it closes over or is bound to, and
    the globals it names (a constant's value, a helper's source, a module's file), one level deep (names a kept
    result)."""
    target = getattr(fn, "func", fn)  # functools.partial
    try:
        source = inspect.getsource(target)
    except (OSError, TypeError):
        source = repr(target)
    used = [*getattr(fn, "args", ()), *getattr(fn, "keywords", {}).values()]
    for cell in getattr(target, "__closure__", None) or ():
        try:
            used.append(cell.cell_contents)
        except ValueError:  # a cell not yet filled
            used.append(None)
    scope, code = getattr(target, "__globals__", {}), getattr(target, "__code__", None)
    used += [scope[name] for name in (code.co_names if code is not None else ()) if name in scope]
    digest = hashlib.sha1((source + "".join(map(_stable_repr, used))).encode()).hexdigest()[:12]
    return f"{getattr(target, '__module__', '?')}:{getattr(target, '__qualname__', type(target).__name__)}@{digest}"


_memory: dict[VerdictKey, CheckResult] = {}
_loaded_from: tuple[str | None, str] | None = None  # (HYBRID_PACK_CACHE, environment digest) of the file read


def lookup(find: Callable[[VerdictKey], CheckResult | None], key: VerdictKey, *, failed_too: bool = True
           ) -> CheckResult | None:
    """``find(key)``; for a call without gradients with no result of its own, the check with them: passed or failed
    (a kernel refused for training serves no evaluation either), passed only without ``failed_too`` (a check
    without gradients may still run)."""
    known = find(key)
    if known is None and not key.requires_grad:
        with_grad = find(key._replace(requires_grad=True))
        known = with_grad if with_grad is not None and (failed_too or with_grad.ok) else None
    return known


@functools.cache
def environment() -> dict[str, str]:
    """The versions and switches a result depends on (a missing package is recorded as absent)."""
    root = Path(__file__).resolve().parents[2]  # an editable install keeps its version number while it changes
    source = hashlib.sha1()
    for path in sorted(root.rglob("*.py")):
        source.update(path.relative_to(root).as_posix().encode() + path.read_bytes())
    env = {"python": platform.python_version(), "cuda": str(torch.version.cuda),
           "hybrid_pack_source": source.hexdigest()[:16]}
    for package in PACKAGES:
        try:
            env[package] = version(package)
        except PackageNotFoundError:
            env[package] = "absent"
    return env | {name: os.environ.get(name, "") for name in SWITCHES}


@functools.cache
def _environment_digest() -> str:
    return hashlib.sha1(json.dumps(environment(), sort_keys=True).encode()).hexdigest()[:16]


def cache_dir() -> Path:
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "hybrid_pack")


def cache_problem() -> str:
    """Why results cannot be written under :func:`cache_dir` ("" when they can): they then stay in memory."""
    folder = cache_dir()
    if folder.exists() and not folder.is_dir():
        return "is a file, not a folder"
    existing = next(p for p in (folder, *folder.parents) if p.exists())
    return "" if os.access(existing, os.W_OK) else f"cannot be written ({existing} is read-only)"


def _file() -> Path:
    return cache_dir() / f"backend-checks-{_environment_digest()}.json"


def _read(path: Path) -> dict[str, dict]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    results = data.get("results") if isinstance(data, dict) else None
    return results if isinstance(results, dict) else {}  # another shape: written by something else, checked again


def _load() -> None:
    """Read this environment's file once (again if ``HYBRID_PACK_CACHE`` or the environment changed)."""
    global _loaded_from
    if _loaded_from == (os.environ.get(CACHE_ENV), _environment_digest()):
        return
    _loaded_from = (os.environ.get(CACHE_ENV), _environment_digest())
    for text, record in _read(_file()).items():
        try:
            op, backend, fingerprint, device, signature, grad = text.split("|")
            _memory.setdefault(VerdictKey(op, backend, fingerprint, device, signature, grad == "grad"),
                               CheckResult(**record))
        except (TypeError, ValueError):  # written by another version: checked again
            continue


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
    path = _file()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        records = _read(path) | {key.text(): asdict(result)}
        with tempfile.NamedTemporaryFile("w", dir=path.parent, delete=False, suffix=".tmp") as tmp:
            json.dump({"environment": environment(), "results": records}, tmp, indent=1, sort_keys=True)
        os.replace(tmp.name, path)
    except OSError:
        pass  # a read-only home: the result stays in memory


def forget(op: str, backend: str) -> None:
    """Drop this process's results for one backend (it was registered again or removed)."""
    for key in [k for k in _memory if k.op == op and k.backend == backend]:
        del _memory[key]


def results(op: str | None = None, backend: str | None = None, fingerprint: str | None = None) -> list[CheckResult]:
    """Every result known in this process (this environment's file included) for ``op`` / ``backend`` / code."""
    _load()
    return [r for k, r in _memory.items() if (op is None or k.op == op) and (backend is None or k.backend == backend)
            and (fingerprint is None or k.fingerprint == fingerprint)]
