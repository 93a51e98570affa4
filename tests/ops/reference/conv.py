"""Depthwise causal conv token by token: for tests only."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hybrid_pack.boundaries import PackedBoundaries


def causal_conv1d_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, boundaries: PackedBoundaries,
                      *, activation: str | None = None) -> torch.Tensor:
    """``y[t] = act(bias + sum_i weight[:, i] * x[t - W + 1 + i])`` over the taps inside t's segment.

    x ``[1, T, D]``, weight ``[D, W]`` (``weight[:, W - 1]`` on the current token) -> ``[1, T, D]`` in x's dtype;
    computed in float64 with a Python loop over tokens and taps.
    """
    width = weight.shape[1]
    tokens, w64 = x[0].double().unbind(0), weight.double()
    rows = []
    for doc_start, doc_end in zip(boundaries.starts, [*boundaries.starts[1:], boundaries.total_tokens]):
        for t in range(doc_start, doc_end):
            acc = bias.double() if bias is not None else w64.new_zeros(w64.shape[0])
            for i in range(width):
                source = t - (width - 1 - i)
                if source >= doc_start:
                    acc = acc + w64[:, i] * tokens[source]
            rows.append(F.silu(acc) if activation == "silu" else acc)
    return torch.stack(rows).unsqueeze(0).to(x.dtype)
