"""Depthwise causal convolution on a packed row, as a sum of shifted taps masked at document starts.

Tap ``i`` of a width-``W`` filter reads the token ``W - 1 - i`` places back (``weight[:, W - 1]``
multiplies the current token, the causal-conv1d convention). Token ``t`` may use that tap only if
the token read lies in its own document, i.e. ``position_ids[t] >= W - 1 - i``; masked taps read
zero, exactly as if every document were convolved alone with its own zero left padding. The mask
is a ``torch.where`` (not a multiply), so even non-finite values cannot leak across a boundary.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hybrid_pack.boundaries import PackedBoundaries


def causal_conv1d(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, boundaries: PackedBoundaries,
                  *, activation: str | None) -> torch.Tensor:
    """Depthwise causal conv whose taps stop at each document's first token.

    Args:
        x: ``[1, T, D]``.
        weight: ``[D, W]``; ``weight[:, W - 1]`` multiplies the current token.
        bias: ``[D]`` or None.
        boundaries: where the documents of the row start (``position_ids`` is used).
        activation: None or ``"silu"``.

    Returns:
        ``[1, T, D]`` in the dtype of ``x``; accumulated in at least float32.
    """
    width = weight.shape[1]
    dtype = torch.promote_types(torch.promote_types(x.dtype, weight.dtype), torch.float32)
    tokens = x[0].to(dtype)
    weight = weight.to(dtype)
    positions = boundaries.position_ids[0]
    padded = F.pad(tokens, (0, 0, width - 1, 0))
    num_tokens = tokens.shape[0]
    out = tokens * weight[:, width - 1]
    for lag in range(1, width):
        shifted = padded[width - 1 - lag: width - 1 - lag + num_tokens]
        in_document = (positions >= lag).unsqueeze(-1)
        out = out + torch.where(in_document, shifted, 0.0) * weight[:, width - 1 - lag]
    if bias is not None:
        out = out + bias.to(dtype)
    if activation == "silu":
        out = F.silu(out)
    return out.to(x.dtype).unsqueeze(0)
