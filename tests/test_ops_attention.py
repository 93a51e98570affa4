"""varlen_attention (torch backend): packed equals every document alone, forward and backward."""

from __future__ import annotations


import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from hybrid_pack.boundaries import PackedBoundaries
from hybrid_pack.ops import varlen_attention
from hybrid_pack.boundaries.buckets import MAX_PAD_FRACTION, MAX_PAD_TOKENS
from tests.reference.attention import varlen_attention_ref

LAYOUTS = {
    "one_token_docs": ([1, 1, 1, 1, 1], 0),
    "many_tiny_docs": ([1, 2, 3, 1, 5, 2, 1, 4, 3, 2, 1, 1, 6], 0),
    "long_next_to_short": ([1, 61, 2, 40, 3], 0),
    "single_doc": ([37], 0),
    "trailing_padding": ([5, 9, 3, 7], 7),
    "several_buckets": ([50, 20, 18, 9, 3, 1, 33, 48], 0),
}
KV_HEADS = [4, 2, 1]  # with H = 4: plain, 2 and 4 query heads per key/value head



def boundaries_of(name: str) -> PackedBoundaries:
    lengths, num_pad = LAYOUTS[name]
    return PackedBoundaries.from_lengths(lengths, num_pad_tokens=num_pad)


def make_inputs(total: int, num_kv_heads: int, dtype: torch.dtype, *, heads: int = 4, dim: int = 8, seed: int = 0
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(1, total, heads, dim, generator=gen, dtype=dtype)
    k = torch.randn(1, total, num_kv_heads, dim, generator=gen, dtype=dtype)
    v = torch.randn(1, total, num_kv_heads, dim, generator=gen, dtype=dtype)
    return q.requires_grad_(), k.requires_grad_(), v.requires_grad_()


def forward_backward(fn, q, k, v, boundaries, d_out, **kwargs):
    """Output and the gradients of ``(out * d_out).sum()`` with respect to q, k, v."""
    out = fn(q, k, v, boundaries, **kwargs)
    grads = torch.autograd.grad((out * d_out).sum(), (q, k, v))
    return out, grads


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("num_kv_heads", KV_HEADS)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_matches_dense_masked_reference_float64(layout: str, num_kv_heads: int, causal: bool) -> None:
    boundaries = boundaries_of(layout)
    q, k, v = make_inputs(boundaries.total_tokens, num_kv_heads, torch.float64)
    d_out = torch.randn(1, boundaries.total_tokens, 4, 8, dtype=torch.float64)
    out, grads = forward_backward(varlen_attention, q, k, v, boundaries, d_out, causal=causal, backend="torch")
    ref, ref_grads = forward_backward(varlen_attention_ref, q, k, v, boundaries, d_out, causal=causal)
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-10)
    for name, got, want in zip("qkv", grads, ref_grads):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-10, msg=lambda m, n=name: f"d{n}: {m}")


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("num_kv_heads", KV_HEADS)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_packed_equals_each_document_alone(layout: str, num_kv_heads: int, causal: bool) -> None:
    boundaries = boundaries_of(layout)
    q, k, v = make_inputs(boundaries.total_tokens, num_kv_heads, torch.float64, seed=1)
    d_out = torch.randn(1, boundaries.total_tokens, 4, 8, dtype=torch.float64)
    out, grads = forward_backward(varlen_attention, q, k, v, boundaries, d_out, causal=causal, backend="torch")
    for start, length in zip(boundaries.starts, boundaries.segment_lengths):
        doc = slice(start, start + length)
        alone = [t[:, doc].detach().requires_grad_() for t in (q, k, v)]
        doc_out, doc_grads = forward_backward(varlen_attention, *alone, PackedBoundaries.from_lengths([length]),
                                              d_out[:, doc], causal=causal, backend="torch")
        torch.testing.assert_close(out[:, doc], doc_out, rtol=0, atol=1e-10)
        for got, want in zip(grads, doc_grads):
            torch.testing.assert_close(got[:, doc], want, rtol=0, atol=1e-10)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("layout", ["long_next_to_short", "trailing_padding", "several_buckets"])
def test_no_gradient_crosses_a_boundary(layout: str, causal: bool) -> None:
    boundaries = boundaries_of(layout)
    q, k, v = make_inputs(boundaries.total_tokens, 2, torch.float64, seed=2)
    out = varlen_attention(q, k, v, boundaries, causal=causal, backend="torch")
    for start, length in zip(boundaries.starts, boundaries.segment_lengths):
        inside = torch.zeros(boundaries.total_tokens, dtype=torch.bool)
        inside[start:start + length] = True
        grads = torch.autograd.grad(out[0, inside].square().sum(), (q, k, v), retain_graph=True)
        for name, grad in zip("qkv", grads):
            assert torch.count_nonzero(grad[0, ~inside]) == 0, f"d{name} leaks out of the document at {start}"
            if length > 1 or name == "v":  # a one-token softmax has no gradient with respect to q or k
                assert torch.count_nonzero(grad[0, inside]) > 0, f"d{name} is zero inside the document at {start}"


@pytest.mark.parametrize("causal", [True, False])
def test_non_finite_values_stay_in_their_document(causal: bool) -> None:
    boundaries = boundaries_of("long_next_to_short")
    q, k, v = (t.detach() for t in make_inputs(boundaries.total_tokens, 2, torch.float32, seed=3))
    poisoned = slice(boundaries.starts[1], boundaries.starts[2])
    for t in (q, k, v):
        t[:, poisoned] = float("nan")
    out = varlen_attention(q, k, v, boundaries, causal=causal, backend="torch")
    assert out[:, poisoned].isnan().all()
    out[:, poisoned] = 0
    assert out.isfinite().all()


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("num_kv_heads", [4, 1])
def test_float32_with_custom_scale(num_kv_heads: int, causal: bool) -> None:
    boundaries = boundaries_of("several_buckets")
    q, k, v = make_inputs(boundaries.total_tokens, num_kv_heads, torch.float32, dim=16, seed=4)
    d_out = torch.randn(1, boundaries.total_tokens, 4, 16)
    out, grads = forward_backward(varlen_attention, q, k, v, boundaries, d_out, causal=causal,
                                  softmax_scale=0.7, backend="torch")
    ref, ref_grads = forward_backward(varlen_attention_ref, q, k, v, boundaries, d_out, causal=causal,
                                      softmax_scale=0.7)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    for got, want in zip(grads, ref_grads):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_default_scale_is_inverse_sqrt_head_dim() -> None:
    boundaries = boundaries_of("long_next_to_short")
    q, k, v = make_inputs(boundaries.total_tokens, 2, torch.float64, dim=16, seed=5)
    default = varlen_attention(q, k, v, boundaries, backend="torch")
    explicit = varlen_attention(q, k, v, boundaries, softmax_scale=0.25, backend="torch")
    other = varlen_attention(q, k, v, boundaries, softmax_scale=0.5, backend="torch")
    torch.testing.assert_close(default, explicit, rtol=0, atol=0)
    assert (default - other).abs().max() > 1e-3


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_keeps_dtype_and_tracks_float64(dtype: torch.dtype) -> None:
    boundaries = boundaries_of("several_buckets")
    q, k, v = make_inputs(boundaries.total_tokens, 2, dtype, dim=16, seed=6)
    out = varlen_attention(q, k, v, boundaries, backend="torch")
    out.float().sum().backward()
    ref = varlen_attention_ref(*(t.double() for t in (q, k, v)), boundaries)
    assert out.dtype == dtype and q.grad.dtype == dtype
    torch.testing.assert_close(out.double(), ref, rtol=0, atol=2e-2)


def test_buckets_bound_padding_and_cover_every_token() -> None:
    lengths = [3000, 2900, 1, 1, 2, 700, 650, 17, 4, 1200, 9]
    boundaries = PackedBoundaries.from_lengths(lengths)
    layout = boundaries.bucket_layout()
    assert layout is boundaries.bucket_layout()
    slots = layout.slot_of_token.tolist()
    assert len(set(slots)) == len(slots) and max(slots) < layout.num_slots
    assert sum(bucket.num_slots for bucket in layout.buckets) == layout.num_slots
    assert [bucket.length for bucket in layout.buckets] == sorted({b.length for b in layout.buckets}, reverse=True)
    allowed_padding = sum(max(MAX_PAD_FRACTION * length / (1 - MAX_PAD_FRACTION), MAX_PAD_TOKENS) for length in lengths)
    assert layout.num_slots - boundaries.total_tokens <= allowed_padding
    assert len(layout.buckets) < len(lengths)


class LargestTensor(TorchDispatchMode):
    """Records the element count of the largest tensor any op returns."""

    def __init__(self) -> None:
        super().__init__()
        self.numel = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.numel = max(self.numel, t.numel())
        return out


def test_long_row_memory_stays_linear_in_tokens() -> None:
    boundaries = PackedBoundaries.from_lengths([6000, 5000, 4000, 1000, 300, 84])
    total, heads, dim = boundaries.total_tokens, 1, 8
    q, k, v = make_inputs(total, heads, torch.float32, heads=heads, dim=dim, seed=7)
    with LargestTensor() as largest:
        out = varlen_attention(q, k, v, boundaries, backend="torch")
        out.sum().backward()
    assert total == 16384
    assert largest.numel <= 2 * total * heads * dim, f"an intermediate of {largest.numel} elements (T^2 = {total ** 2})"
    assert q.grad.isfinite().all()
