"""causal_conv1d (torch backend): taps never cross a document start, forward and backward."""

from __future__ import annotations


import pytest
import torch
import torch.nn.functional as F

from hybrid_pack.boundaries import PackedBoundaries
from hybrid_pack.ops import causal_conv1d
from tests.reference.conv import causal_conv1d_ref

LAYOUTS = {
    "one_token_docs": ([1, 1, 1, 1, 1], 0),
    "docs_shorter_than_width": ([2, 3, 1, 2, 5, 1, 3], 0),
    "long_next_to_short": ([1, 40, 2, 25, 3], 0),
    "single_doc": ([19], 0),
    "trailing_padding": ([5, 9, 3, 6], 6),
}
WIDTHS = range(1, 9)
CHANNELS = 6



def boundaries_of(name: str) -> PackedBoundaries:
    lengths, num_pad = LAYOUTS[name]
    return PackedBoundaries.from_lengths(lengths, num_pad_tokens=num_pad)


def make_inputs(total: int, width: int, dtype: torch.dtype, *, channels: int = CHANNELS, seed: int = 0
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(1, total, channels, generator=gen, dtype=dtype)
    weight = torch.randn(channels, width, generator=gen, dtype=dtype)
    bias = torch.randn(channels, generator=gen, dtype=dtype)
    return x.requires_grad_(), weight.requires_grad_(), bias.requires_grad_()


def forward_backward(fn, x, weight, bias, boundaries, d_out, **kwargs):
    """Output and the gradients of ``(out * d_out).sum()`` with respect to every input that takes one."""
    out = fn(x, weight, bias, boundaries, **kwargs)
    inputs = tuple(t for t in (x, weight, bias) if t is not None)
    return out, torch.autograd.grad((out * d_out).sum(), inputs)


@pytest.mark.parametrize("activation", [None, "silu"])
@pytest.mark.parametrize("width", WIDTHS)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_matches_per_token_reference_float64(layout: str, width: int, activation: str | None) -> None:
    boundaries = boundaries_of(layout)
    x, weight, bias = make_inputs(boundaries.total_tokens, width, torch.float64)
    d_out = torch.randn(1, boundaries.total_tokens, CHANNELS, dtype=torch.float64)
    out, grads = forward_backward(causal_conv1d, x, weight, bias, boundaries, d_out, activation=activation,
                                  backend="torch")
    ref, ref_grads = forward_backward(causal_conv1d_ref, x, weight, bias, boundaries, d_out, activation=activation)
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-12)
    for name, got, want in zip(("x", "weight", "bias"), grads, ref_grads):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-12, msg=lambda m, n=name: f"d{n}: {m}")


@pytest.mark.parametrize("with_bias", [True, False])
@pytest.mark.parametrize("width", [1, 2, 4, 8])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_packed_equals_each_document_alone(layout: str, width: int, with_bias: bool) -> None:
    boundaries = boundaries_of(layout)
    x, weight, bias = make_inputs(boundaries.total_tokens, width, torch.float64, seed=1)
    bias = bias if with_bias else None
    d_out = torch.randn(1, boundaries.total_tokens, CHANNELS, dtype=torch.float64)
    out, (dx, *d_params) = forward_backward(causal_conv1d, x, weight, bias, boundaries, d_out, activation="silu",
                                            backend="torch")
    summed_params = [torch.zeros_like(p) for p in d_params]
    for start, length in zip(boundaries.starts, boundaries.segment_lengths):
        doc = slice(start, start + length)
        doc_x = x[:, doc].detach().requires_grad_()
        doc_out, (doc_dx, *doc_params) = forward_backward(
            causal_conv1d, doc_x, weight, bias, PackedBoundaries.from_lengths([length]), d_out[:, doc],
            activation="silu", backend="torch")
        torch.testing.assert_close(out[:, doc], doc_out, rtol=0, atol=1e-12)
        torch.testing.assert_close(dx[:, doc], doc_dx, rtol=0, atol=1e-12)
        summed_params = [a + b for a, b in zip(summed_params, doc_params)]
    for got, want in zip(d_params, summed_params):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-10)


@pytest.mark.parametrize("width", [2, 4, 8])
@pytest.mark.parametrize("layout", ["docs_shorter_than_width", "long_next_to_short", "trailing_padding"])
def test_no_gradient_crosses_a_boundary(layout: str, width: int) -> None:
    boundaries = boundaries_of(layout)
    x, weight, bias = make_inputs(boundaries.total_tokens, width, torch.float64, seed=2)
    out = causal_conv1d(x, weight, bias, boundaries, activation="silu", backend="torch")
    for start, length in zip(boundaries.starts, boundaries.segment_lengths):
        inside = torch.zeros(boundaries.total_tokens, dtype=torch.bool)
        inside[start:start + length] = True
        (dx,) = torch.autograd.grad(out[0, inside].square().sum(), x, retain_graph=True)
        assert torch.count_nonzero(dx[0, ~inside]) == 0, f"dx leaks out of the document at {start}"
        assert torch.count_nonzero(dx[0, inside]) > 0


def test_non_finite_values_stay_in_their_document() -> None:
    boundaries = boundaries_of("long_next_to_short")
    x, weight, bias = (t.detach() for t in make_inputs(boundaries.total_tokens, 4, torch.float32, seed=3))
    poisoned = slice(boundaries.starts[1], boundaries.starts[2])
    x[:, poisoned] = float("inf")
    out = causal_conv1d(x, weight, bias, boundaries, backend="torch")
    assert not out[:, poisoned].isfinite().any()
    out[:, poisoned] = 0
    assert out.isfinite().all()


@pytest.mark.parametrize("width", [1, 3, 4])
def test_weight_convention_matches_causal_conv1d(width: int) -> None:
    """On one document, equals causal-conv1d's reference: depthwise F.conv1d, W - 1 zeros in front."""
    boundaries = PackedBoundaries.from_lengths([23])
    x, weight, bias = make_inputs(23, width, torch.float64, seed=4)
    out = causal_conv1d(x, weight, bias, boundaries, activation="silu", backend="torch")
    channels_first = x.transpose(1, 2)
    expected = F.conv1d(channels_first, weight.unsqueeze(1), bias, padding=width - 1, groups=CHANNELS)[..., :23]
    torch.testing.assert_close(out, F.silu(expected).transpose(1, 2), rtol=0, atol=1e-12)


def test_last_tap_is_the_current_token_and_first_tap_the_oldest() -> None:
    boundaries = PackedBoundaries.from_lengths([4, 3])
    x = torch.arange(1.0, 8.0).view(1, 7, 1)
    current = causal_conv1d(x, torch.tensor([[0.0, 0.0, 1.0]]), None, boundaries, backend="torch")
    oldest = causal_conv1d(x, torch.tensor([[1.0, 0.0, 0.0]]), None, boundaries, backend="torch")
    assert current.flatten().tolist() == [1, 2, 3, 4, 5, 6, 7]
    assert oldest.flatten().tolist() == [0, 0, 1, 2, 0, 0, 5]


def test_float32_matches_reference() -> None:
    boundaries = boundaries_of("long_next_to_short")
    x, weight, bias = make_inputs(boundaries.total_tokens, 4, torch.float32, channels=32, seed=5)
    d_out = torch.randn(1, boundaries.total_tokens, 32)
    out, grads = forward_backward(causal_conv1d, x, weight, bias, boundaries, d_out, activation="silu",
                                  backend="torch")
    ref, ref_grads = forward_backward(causal_conv1d_ref, x, weight, bias, boundaries, d_out, activation="silu")
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    for got, want in zip(grads, ref_grads):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_keeps_dtype_and_tracks_float64(dtype: torch.dtype) -> None:
    boundaries = boundaries_of("docs_shorter_than_width")
    x, weight, bias = make_inputs(boundaries.total_tokens, 4, dtype, seed=6)
    out = causal_conv1d(x, weight, bias, boundaries, activation="silu", backend="torch")
    out.float().sum().backward()
    ref = causal_conv1d_ref(x.double(), weight.double(), bias.double(), boundaries, activation="silu")
    assert out.dtype == dtype and x.grad.dtype == dtype and weight.grad.dtype == dtype
    torch.testing.assert_close(out.double(), ref, rtol=1e-2, atol=1e-2)


def test_float32_weight_on_bfloat16_input() -> None:
    boundaries = boundaries_of("trailing_padding")
    x, weight, bias = make_inputs(boundaries.total_tokens, 4, torch.float32, seed=7)
    out = causal_conv1d(x.bfloat16(), weight, bias, boundaries, backend="torch")
    ref = causal_conv1d_ref(x.bfloat16().double(), weight.double(), bias.double(), boundaries)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.double(), ref, rtol=1e-2, atol=1e-2)
