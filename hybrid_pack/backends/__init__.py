"""Backend selection for the boundary-safe ops (docs/api.md §5, §5a).

Every registered backend keeps documents apart; a kernel serves a call only after it has passed the
self-check for that call's key here. ``verify()`` is the one warm-up that checks them and settles one verdict per
key, for every rank under ``torch.distributed`` (collective: every rank calls it before the first forward;
``train``, the trainers and the CLI do); where it was skipped and no check may run (``torch.distributed``, a
compiled graph), a kernel that could serve raises ``WarmUpError`` naming it. ``available()`` says what can run
and why not, ``select()`` what will run, ``report()`` prints it all, and ``register()`` adds a user's own kernel,
which is checked like the others before it serves.
"""

from hybrid_pack.backends.report import report
from hybrid_pack.ops import dispatch as _dispatch  # noqa: F401  (importing the ops registers their backends)
from hybrid_pack.ops.dispatch.backend import Backend
from hybrid_pack.ops.dispatch.registry import backends_of, get_backend, register, registered_ops, unregister
from hybrid_pack.ops.dispatch.selector import (
    ENV_VAR,
    VERIFY_ENV,
    Decision,
    WarmUpError,
    decisions,
    discovering,
    resolve,
    select,
    use_backends,
)
from hybrid_pack.ops.dispatch.status import BackendStatus, available
from hybrid_pack.ops.dispatch.verdicts import CACHE_ENV, CheckResult
from hybrid_pack.ops.dispatch.warmup import verify

OPS = registered_ops()
"""The ops: ``"attention"``, ``"conv"``, ``"gated_delta"``, ``"ssd"``."""

__all__ = ["OPS", "ENV_VAR", "VERIFY_ENV", "CACHE_ENV", "Backend", "BackendStatus", "CheckResult", "Decision",
           "WarmUpError", "available", "backends_of", "decisions", "discovering", "get_backend", "register",
           "unregister", "report", "resolve", "select", "use_backends", "verify"]
