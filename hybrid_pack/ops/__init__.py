"""Boundary-safe ops (SPEC §4): every op takes a packed ``[1, T, ...]`` row and its
:class:`~hybrid_pack.PackedBoundaries`, and never lets one document see another.

Backends: ``hybrid_pack.ops.torch`` (pure torch, exact, CPU and GPU, the oracles) and
``hybrid_pack.ops.kernels`` (adapters to flash-attn, flash-linear-attention, causal-conv1d,
mamba-ssm), chosen by :mod:`hybrid_pack.backends`.
"""

from hybrid_pack.ops.attention import varlen_attention
from hybrid_pack.ops.conv import causal_conv1d
from hybrid_pack.ops.gated_delta import gated_delta_rule
from hybrid_pack.ops.ssd import mamba2_ssd

__all__ = ["varlen_attention", "causal_conv1d", "gated_delta_rule", "mamba2_ssd"]
