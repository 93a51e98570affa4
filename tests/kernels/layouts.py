"""Packed layouts that stress the kernels' boundary handling, and tolerances for float32 checks."""

from __future__ import annotations

import torch

from hybrid_pack.boundaries import PackedBoundaries

# fla and mamba-ssm cut rows into 64-token chunks; conv taps reach W - 1 tokens back. With
# ``num_pad > 0`` the last length is the trailing padding segment.
LAYOUTS = {
    "one_token_docs_and_chunk_edges": ([1, 63, 1, 65, 2, 7], 7),
    "long_next_to_short": ([130, 1, 3], 0),
    "chunk_aligned": ([64, 64, 1], 0),
}


def boundaries_of(name: str) -> PackedBoundaries:
    lengths, num_pad = LAYOUTS[name]
    return PackedBoundaries.from_lengths(lengths, num_pad_tokens=num_pad)


def assert_close(actual: torch.Tensor, expected: torch.Tensor, name: str, *, tol: float = 1e-4) -> None:
    """``|actual - expected| <= tol * (1 + |expected|)`` elementwise."""
    assert actual.shape == expected.shape, f"{name}: shape {list(actual.shape)} != {list(expected.shape)}"
    torch.testing.assert_close(actual, expected, rtol=tol, atol=tol, msg=lambda m: f"{name}: {m}")
