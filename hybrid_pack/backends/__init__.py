"""Backend selection for the boundary-safe ops (docs/api.md §5, §5a, docs/backends.md).

A kernel serves a call only after passing the self-check for that call's key. ``verify()`` is the one warm-up
(collective under ``torch.distributed``); where it was skipped and no check may run, a kernel that could serve
raises ``WarmUpError``. ``available()`` says what can run, ``select()`` what will, ``report()`` prints it, and
``register()`` adds a user's own kernel.
"""

from hybrid_pack.backends.available import BackendStatus, available
from hybrid_pack.backends.report import report
from hybrid_pack.ops import dispatch as _dispatch  # noqa: F401  (importing the ops registers their backends)
from hybrid_pack.ops.dispatch.backend import Backend
from hybrid_pack.ops.dispatch.discovery import discovering
from hybrid_pack.ops.dispatch.registry import (
    backends_of,
    get_backend,
    register,
    registered_ops,
    unregister,
)
from hybrid_pack.ops.dispatch.selector import (
    ENV_VAR,
    VERIFY_ENV,
    Decision,
    WarmUpError,
    decisions,
    resolve,
    select,
    use_backends,
)
from hybrid_pack.ops.dispatch.warmup import verify
from hybrid_pack.ops.selfcheck.kept import CACHE_ENV
from hybrid_pack.ops.selfcheck.result import CheckResult

OPS = registered_ops()
"""The ops: ``"attention"``, ``"conv"``, ``"gated_delta"``, ``"ssd"``."""

__all__ = ["OPS", "ENV_VAR", "VERIFY_ENV", "CACHE_ENV", "Backend", "BackendStatus", "CheckResult", "Decision",
           "WarmUpError", "available", "backends_of", "decisions", "discovering", "get_backend", "register",
           "unregister", "report", "resolve", "select", "use_backends", "verify"]
