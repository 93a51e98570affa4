"""Backend selection for the boundary-safe ops (SPEC §5).

Every registered backend keeps documents apart; the selector picks the fastest one that can run
on the inputs, and refuses loudly when a forced one cannot.
"""

from hybrid_pack.backends import catalog as _catalog  # noqa: F401  (registers the backends)
from hybrid_pack.backends.registry import OPS, Backend, backends_of, get_backend, register
from hybrid_pack.backends.selector import ENV_VAR, BackendStatus, available, report, resolve, select, use_backends

__all__ = ["OPS", "ENV_VAR", "Backend", "BackendStatus", "available", "backends_of", "get_backend", "register",
           "report", "resolve", "select", "use_backends"]
