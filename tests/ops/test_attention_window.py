"""Sliding-window varlen_attention: query ``i`` sees keys ``j`` of its own document with ``0 <= i - j < window``,
transformers' ``sliding_window`` convention (its mask function is the oracle's mask here).

Every backend that runs on CPU (torch, its static form, flex eagerly, the blockwise form the context-parallel
path uses) equals each document attended alone by a dense float64 oracle, forward and backward, with windows
shorter and longer than the documents; no gradient crosses a document; the flex block tables skip exactly the
blocks the window hides; the self-check catches a backend that drops the window.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from transformers.masking_utils import sliding_window_causal_mask_function

from hybrid_pack import PackedBoundaries
from hybrid_pack.boundaries import StaticBoundaries
from hybrid_pack.errors import InputError
from hybrid_pack.ops import varlen_attention
from hybrid_pack.ops.attention import kernel_flex, kernel_torch_varlen
from hybrid_pack.ops.attention import torch_static as attention_static
from hybrid_pack.ops.attention.blockwise import lower_right_causal_attention
from hybrid_pack.ops.attention.check import CONTRACT, signature_of
from hybrid_pack.ops.dispatch.backend import Backend
from hybrid_pack.ops.dispatch.registry import get_backend, reference_of
from hybrid_pack.ops.selfcheck.contract import make_signature
from hybrid_pack.ops.selfcheck.whole_row import run_check
from tests import kit

OP = "attention"
TOL = 1e-10
WINDOWS = [1, 3, 16, 1000]  # one token; shorter than most documents; about the long ones; longer than all
LAYOUTS = kit.named(
    kit.Layout("long_next_to_short", (1, 61, 2, 40, 3)),
    kit.Layout("trailing_padding", (5, 9, 3), num_pad_tokens=7),
    kit.Layout("one_token_docs", (1, 1, 1, 1, 1)),
    kit.Layout("single_doc", (37,)),
)
FLEX_WINDOWS = [1, 100, 128, 129, 200, 300]  # within a 128-token block, on its edge, across two or three


def window_signature(window: int | None, *, kv_heads: int = 2, dtype: torch.dtype = torch.float64) -> kit.Signature:
    windowed = {} if window is None else {"window": window}
    return make_signature(H=4, Hkv=kv_heads, D=8, causal=True, q=dtype, k=dtype, v=dtype, **windowed)


def transformers_mask(length: int, window: int) -> torch.Tensor:
    """bool ``[length, length]`` from transformers' own sliding-window causal mask function."""
    position = torch.arange(length)
    return sliding_window_causal_mask_function(window)(0, 0, position[:, None], position[None, :])


def dense_document(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int, scale: float) -> torch.Tensor:
    """One document ``[1, L, H, D]`` attended densely in float64 under transformers' mask."""
    group = q.shape[2] // k.shape[2]
    q64, k64, v64 = (t[0].double().transpose(0, 1) for t in (q, k, v))
    k64, v64 = k64.repeat_interleave(group, dim=0), v64.repeat_interleave(group, dim=0)
    scores = (q64 @ k64.transpose(1, 2) * scale).masked_fill(~transformers_mask(q.shape[1], window), float("-inf"))
    return (torch.softmax(scores, dim=-1) @ v64).transpose(0, 1)[None]


def dense_oracle(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, boundaries: PackedBoundaries, *,
                 causal: bool, softmax_scale: float, window: int) -> torch.Tensor:
    """Every segment alone, densely: the definition."""
    assert causal
    pieces = [dense_document(q[:, span], k[:, span], v[:, span], window, softmax_scale)
              for span in kit.segment_spans(boundaries)]
    return torch.cat(pieces, dim=1)


def static_form(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, boundaries: PackedBoundaries, **options: Any
                ) -> torch.Tensor:
    return attention_static.varlen_attention(q, k, v, StaticBoundaries.from_boundaries(boundaries, 8), **options)


def blockwise(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, boundaries: PackedBoundaries, *, causal: bool,
              softmax_scale: float, window: int | None) -> torch.Tensor:
    """The context-parallel path's blockwise attention, per segment, with 4-row blocks (many skipped blocks)."""
    pieces = [lower_right_causal_attention(q[0, span], k[0, span], v[0, span], scale=softmax_scale, block=4,
                                           window=window) for span in kit.segment_spans(boundaries)]
    return torch.cat(pieces)[None]


BACKENDS = {
    "torch": kit.public_op(OP),
    "static": static_form,
    "flex": kernel_flex.varlen_attention,
    "blockwise": blockwise,
}
FORWARD_ONLY = {"flex"}  # flex attention has no backward on CPU (torch 2.13 raises)


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("backend", BACKENDS)
def test_matches_each_document_alone_under_transformers_mask(backend: str, layout: str, window: int) -> None:
    boundaries = LAYOUTS[layout].boundaries()
    case = kit.op_inputs(OP, window_signature(window), boundaries, seed=window,
                         requires_grad=backend not in FORWARD_ONLY)
    got = kit.forward_backward(OP, BACKENDS[backend], case, boundaries)
    want = kit.forward_backward(OP, dense_oracle, case, boundaries)
    assert set(got) == set(want) == ({"output"} if backend in FORWARD_ONLY else {"output", "dq", "dk", "dv"})
    for name in got:
        kit.assert_close(got[name], want[name], f"{backend} window={window}: {name}", tol=TOL)


@pytest.mark.parametrize("window", [3, 16])
@pytest.mark.parametrize("backend", sorted(set(BACKENDS) - FORWARD_ONLY))
def test_packed_equals_each_document_alone(backend: str, window: int) -> None:
    boundaries = LAYOUTS["long_next_to_short"].boundaries()
    case = kit.op_inputs(OP, window_signature(window, kv_heads=1), boundaries, seed=5)
    kit.assert_packed_equals_segments_alone(OP, BACKENDS[backend], case, boundaries, tol=TOL)


@pytest.mark.parametrize("window", [1, 3, 16])
def test_no_gradient_crosses_a_boundary(window: int) -> None:
    boundaries = LAYOUTS["trailing_padding"].boundaries()
    case = kit.op_inputs(OP, window_signature(window), boundaries, seed=6)
    kit.assert_no_gradient_crosses_segments(
        OP, BACKENDS["torch"], case, boundaries,
        may_vanish=lambda name, length: name in ("q", "k") and (length == 1 or window == 1))


def test_a_window_longer_than_every_document_is_no_window() -> None:
    boundaries = LAYOUTS["long_next_to_short"].boundaries()
    case = kit.op_inputs(OP, window_signature(None), boundaries, seed=7)
    plain = kit.forward_backward(OP, BACKENDS["torch"], case, boundaries)
    windowed = kit.forward_backward(OP, BACKENDS["torch"], case, boundaries,
                                    arguments={**case.arguments, "window": 61})
    shorter = kit.run(OP, BACKENDS["torch"], case, boundaries, {**case.arguments, "window": 60})
    for name in ("output", "dq", "dk", "dv"):
        kit.assert_close(windowed[name], plain[name], name, tol=TOL)
    assert not torch.allclose(shorter["output"], plain["output"])  # the window does cut the 61-token document


@pytest.mark.parametrize("window", [1, 2, 5, 9, 23])
@pytest.mark.parametrize("offset", [0, 1, 6, 40])
def test_blockwise_lower_right_window_matches_dense(offset: int, window: int) -> None:
    """Queries are the last Tq of Tk positions (a continuing document under context parallelism)."""
    generator = torch.Generator().manual_seed(offset * 31 + window)
    num_queries = 13
    q = torch.randn(num_queries, 4, 8, generator=generator, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(num_queries + offset, 2, 8, generator=generator, dtype=torch.float64,
                        requires_grad=True) for _ in range(2))
    got = lower_right_causal_attention(q, k, v, scale=0.3, block=4, window=window)
    want = dense_document(torch.cat([q.new_zeros(offset, 4, 8), q])[None], k[None], v[None], window, 0.3)[0, offset:]
    kit.assert_close(got, want, "output", tol=TOL)
    weight = torch.randn(got.shape, generator=generator, dtype=torch.float64)
    for grad, expected, name in zip(torch.autograd.grad((got * weight).sum(), (q, k, v)),
                                    torch.autograd.grad((want * weight).sum(), (q, k, v)), "qkv", strict=True):
        kit.assert_close(grad, expected, f"d{name}", tol=TOL)


def dense_block_tables(segment_lengths: tuple[int, ...], length: int, window: int) -> tuple[np.ndarray, np.ndarray]:
    """(meets, full) per (query block, key block) from the windowed per-token mask: the definition."""
    block = kernel_flex.BLOCK
    ids = kernel_flex.padded_segment_ids(segment_lengths, length)
    mask = (ids[:, None] == ids[None, :]) & transformers_mask(length, window).numpy()
    blocks = mask.reshape(length // block, block, length // block, block)
    return blocks.any(axis=(1, 3)), blocks.all(axis=(1, 3))


@pytest.mark.parametrize("window", FLEX_WINDOWS)
@pytest.mark.parametrize("layout", kit.FLEX_BLOCK_LAYOUTS)
def test_flex_block_tables_skip_the_blocks_the_window_hides(layout: str, window: int) -> None:
    boundaries = kit.FLEX_BLOCK_LAYOUTS[layout].boundaries()
    length = kernel_flex.bucket_length(boundaries.total_tokens)
    counts, indices, full_counts, full_indices = kernel_flex._block_tables(boundaries.segment_lengths, length, True,
                                                                           window)
    meets, full = dense_block_tables(boundaries.segment_lengths, length, window)
    for row in range(meets.shape[0]):
        assert sorted(indices[row, :counts[row]]) == np.flatnonzero(meets[row] & ~full[row]).tolist()
        assert sorted(full_indices[row, :full_counts[row]]) == np.flatnonzero(full[row]).tolist()


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize("window", [100, 129, 300])
def test_flex_matches_torch_across_blocks(window: int) -> None:
    boundaries = kit.FLEX_BLOCK_LAYOUTS["block_edges_and_padding"].boundaries()
    case = kit.op_inputs(OP, window_signature(window), boundaries, seed=8, requires_grad=False)
    got = kit.run(OP, BACKENDS["flex"], case, boundaries)["output"]
    kit.assert_close(got, kit.run(OP, BACKENDS["torch"], case, boundaries)["output"], "output", tol=TOL)


def test_flash_layouts_of_the_window_are_inclusive_reaches() -> None:
    """flash-attn and torch's varlen_attn read ``(left, right)`` as keys seen before and after, inclusive."""
    assert kernel_torch_varlen.window_size(True, 4) == (3, 0)
    assert kernel_torch_varlen.window_size(True, 1) == (0, 0)
    assert kernel_torch_varlen.window_size(True, None) == (-1, 0)
    assert kernel_torch_varlen.window_size(False, None) == (-1, -1)


def test_the_window_is_part_of_the_signature() -> None:
    q = torch.zeros(1, 4, 4, 8)
    assert signature_of(q, q, q, True) == window_signature(None, kv_heads=4, dtype=torch.float32)
    assert dict(signature_of(q, q, q, True, 7))["window"] == 7


def test_the_self_check_catches_a_backend_that_drops_the_window() -> None:
    signature = window_signature(5, kv_heads=1, dtype=torch.float32)
    reference = reference_of(OP)

    def without_window(*args: Any, window: int | None, **options: Any) -> torch.Tensor:
        return reference.fn(*args, **options)

    honest = run_check(get_backend(OP, "flex"), reference, CONTRACT, signature, torch.device("cpu"), False)
    dropped = Backend(op=OP, name="drops_window", impl=without_window, priority=1, devices=("cpu",))
    failed = run_check(dropped, reference, CONTRACT, signature, torch.device("cpu"), True)
    assert honest.ok, honest.reason
    assert not failed.ok and "failed its self-check" in failed.reason


@pytest.mark.parametrize(("window", "causal", "match"), [
    (0, True, "^window: expected None or a positive int"),
    (-3, True, "^window: expected None or a positive int"),
    (True, True, "^window: expected None or a positive int"),
    (2.0, True, "^window: expected None or a positive int"),
    (4, False, "^window: 4 is sliding-window causal attention; pass causal=True"),
])
def test_bad_windows_are_refused(window: Any, causal: bool, match: str) -> None:
    q = torch.zeros(1, 5, 2, 4)
    with pytest.raises(InputError, match=match):
        varlen_attention(q, q, q, PackedBoundaries.from_lengths([5]), causal=causal, window=window)
