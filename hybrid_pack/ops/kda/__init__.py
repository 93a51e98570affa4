"""Kimi Delta Attention (the gated delta rule with per-key-channel decay): the public op, its pure-torch
backend, the adapter to fla's chunked kernel and its state passing on a context-parallel shard.

No static form: inside ``torch.compile`` every backend runs as the opaque node ``hybrid_pack::kda``
(:mod:`hybrid_pack.ops.library`)."""

from hybrid_pack.ops.kda import backends as _backends  # noqa: F401  (registers the backends)
from hybrid_pack.ops.kda.op import kda

__all__ = ["kda"]
