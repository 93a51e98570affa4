"""Backend selection for the boundary-safe ops (docs/api.md §5, §5a).

Every registered backend keeps documents apart; a kernel serves a call only after it has passed the
self-check for that call's key here. ``verify()`` is the warm-up that checks them and, under
``torch.distributed``, settles one verdict per key for every rank (collective: every rank calls it before the
first step; ``train``, the trainers and the CLI do). ``available()`` says what can run and why not,
``select()`` what will run, ``report()`` prints it all, and ``register()`` adds a user's own kernel, which is
checked like the others before it serves.
"""

from hybrid_pack.backends.report import report
from hybrid_pack.ops import dispatch as _dispatch  # noqa: F401  (importing the ops registers their backends)
from hybrid_pack.ops.dispatch.backend import Backend
from hybrid_pack.ops.dispatch.registry import backends_of, get_backend, register, registered_ops, unregister
from hybrid_pack.ops.dispatch.selector import ENV_VAR, VERIFY_ENV, Decision, decisions, resolve, select, use_backends
from hybrid_pack.ops.dispatch.status import BackendStatus, available
from hybrid_pack.ops.dispatch.verdicts import CACHE_ENV, CheckResult
from hybrid_pack.ops.dispatch.warmup import verify

OPS = registered_ops()
"""The ops: ``"attention"``, ``"conv"``, ``"gated_delta"``, ``"ssd"``."""

__all__ = ["OPS", "ENV_VAR", "VERIFY_ENV", "CACHE_ENV", "Backend", "BackendStatus", "CheckResult", "Decision",
           "available", "backends_of", "decisions", "get_backend", "register", "unregister", "report",
           "resolve", "select", "use_backends", "verify"]
