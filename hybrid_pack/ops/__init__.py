"""Boundary-safe ops (docs/api.md §4): every op takes a packed ``[1, T, ...]`` row and its
:class:`~hybrid_pack.PackedBoundaries`, and never lets one document see another.

One folder per op (``attention/``, ``conv/``, ``gated_delta/``, ``ssd/``) holds its public function,
its pure-torch backend (exact, CPU and GPU: the oracle), its kernel adapters, their registration and
the op's self-check contract; ``selfcheck/`` proves a backend and ``dispatch/`` chooses the backend of each
call (docs/api.md §5, §5a).
"""

from hybrid_pack.ops.attention import varlen_attention
from hybrid_pack.ops.conv import causal_conv1d
from hybrid_pack.ops.decay_linear_attention import decay_linear_attention
from hybrid_pack.ops.gated_delta import gated_delta_rule
from hybrid_pack.ops.kda import kda
from hybrid_pack.ops.linear_cross_entropy import linear_cross_entropy
from hybrid_pack.ops.selective_scan import selective_scan
from hybrid_pack.ops.ssd import mamba2_ssd

__all__ = ["varlen_attention", "causal_conv1d", "gated_delta_rule", "mamba2_ssd", "linear_cross_entropy", "kda",
           "decay_linear_attention", "selective_scan"]
