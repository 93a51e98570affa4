"""varlen_attention (torch backend): packed equals every document alone and the dense masked reference,
forward and backward; memory stays linear in tokens."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from hybrid_pack.boundaries import PackedBoundaries
from hybrid_pack.errors import InputError
from hybrid_pack.ops import varlen_attention
from tests import kit
from tests.kit import ATTENTION_LAYOUTS as LAYOUTS
from tests.ops.reference.attention import varlen_attention_ref

OP = "attention"
TORCH = kit.public_op(OP)
KV_HEADS = [4, 2, 1]  # with H = 4: plain, 2 and 4 query heads per key/value head
FLOAT64_TOL = 1e-12


def one_token_softmax(name: str, length: int) -> bool:
    """A one-token document's softmax is constant: no gradient reaches its q or k."""
    return length == 1 and name in ("q", "k")


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("num_kv_heads", KV_HEADS)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_matches_dense_masked_reference_float64(layout: str, num_kv_heads: int, causal: bool) -> None:
    boundaries = LAYOUTS[layout].boundaries()
    case = kit.op_inputs(OP, kit.attention_signature(kv_heads=num_kv_heads, causal=causal), boundaries)
    got = kit.forward_backward(OP, TORCH, case, boundaries)
    want = kit.forward_backward(OP, varlen_attention_ref, case, boundaries)
    for name in ("output", "dq", "dk", "dv"):
        kit.assert_close(got[name], want[name], name, tol=FLOAT64_TOL)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("num_kv_heads", KV_HEADS)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_packed_equals_each_document_alone(layout: str, num_kv_heads: int, causal: bool) -> None:
    boundaries = LAYOUTS[layout].boundaries()
    case = kit.op_inputs(OP, kit.attention_signature(kv_heads=num_kv_heads, causal=causal), boundaries, seed=1)
    kit.assert_packed_equals_segments_alone(OP, TORCH, case, boundaries, tol=FLOAT64_TOL)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("layout", ["long_next_to_short", "trailing_padding", "several_buckets"])
def test_no_gradient_crosses_a_boundary(layout: str, causal: bool) -> None:
    boundaries = LAYOUTS[layout].boundaries()
    case = kit.op_inputs(OP, kit.attention_signature(kv_heads=2, causal=causal), boundaries, seed=2)
    kit.assert_no_gradient_crosses_segments(OP, TORCH, case, boundaries, may_vanish=one_token_softmax)


@pytest.mark.parametrize("causal", [True, False])
def test_non_finite_values_stay_in_their_document(causal: bool) -> None:
    boundaries = LAYOUTS["long_next_to_short"].boundaries()
    signature = kit.attention_signature(kv_heads=2, causal=causal, dtype=torch.float32)
    case = kit.op_inputs(OP, signature, boundaries, seed=3, requires_grad=False)
    poisoned = kit.segment_spans(boundaries)[1]
    for name in ("q", "k", "v"):
        case.arguments[name][:, poisoned] = float("nan")
    out = case.call(TORCH, boundaries)
    assert out[:, poisoned].isnan().all()
    out[:, poisoned] = 0
    assert out.isfinite().all()


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("num_kv_heads", [4, 1])
def test_float32_with_custom_scale(num_kv_heads: int, causal: bool) -> None:
    boundaries = LAYOUTS["several_buckets"].boundaries()
    signature = kit.attention_signature(kv_heads=num_kv_heads, dim=16, causal=causal, dtype=torch.float32)
    case = kit.op_inputs(OP, signature, boundaries, seed=4)
    arguments = {**case.arguments, "softmax_scale": 0.7}
    got = kit.forward_backward(OP, TORCH, case, boundaries, arguments=arguments)
    want = kit.forward_backward(OP, varlen_attention_ref, case, boundaries, arguments=arguments)
    assert got["output"].dtype == torch.float32
    for name in ("output", "dq", "dk", "dv"):
        kit.assert_close(got[name], want[name], name, tol=1e-5)


def test_default_scale_is_inverse_sqrt_head_dim() -> None:
    boundaries = LAYOUTS["long_next_to_short"].boundaries()
    case = kit.op_inputs(OP, kit.attention_signature(kv_heads=2, dim=16), boundaries, seed=5, requires_grad=False)
    q, k, v = (case.arguments[name] for name in ("q", "k", "v"))
    default = varlen_attention(q, k, v, boundaries, backend="torch")
    explicit = varlen_attention(q, k, v, boundaries, softmax_scale=0.25, backend="torch")
    other = varlen_attention(q, k, v, boundaries, softmax_scale=0.5, backend="torch")
    assert torch.equal(default, explicit)
    assert (default - other).abs().max() > 1e-3


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_keeps_dtype_and_tracks_float64(dtype: torch.dtype) -> None:
    boundaries = LAYOUTS["several_buckets"].boundaries()
    case = kit.op_inputs(OP, kit.attention_signature(kv_heads=2, dim=16, dtype=dtype), boundaries, seed=6)
    out = case.call(TORCH, boundaries)
    out.float().sum().backward()
    ref = varlen_attention_ref(*(case.arguments[name].double() for name in ("q", "k", "v")), boundaries,
                               softmax_scale=case.arguments["softmax_scale"])
    assert out.dtype == dtype and case.arguments["q"].grad.dtype == dtype
    kit.assert_close(out.double(), ref, "output", tol=4e-3)


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
    signature = kit.attention_signature(heads=heads, kv_heads=heads, dim=dim, dtype=torch.float32)
    case = kit.op_inputs(OP, signature, boundaries, seed=7)
    with LargestTensor() as largest:
        out = case.call(TORCH, boundaries)
        out.sum().backward()
    assert total == 16384
    assert largest.numel <= 2 * total * heads * dim, f"an intermediate of {largest.numel} elements (T^2 = {total ** 2})"
    assert case.arguments["q"].grad.isfinite().all()


def test_mixed_dtypes_are_named_or_cast_by_autocast() -> None:
    """q in bfloat16 with float32 k, v raised SDPA's RuntimeError naming no argument; inside torch.autocast, which
    casts all three, the call is served."""
    boundaries = PackedBoundaries.from_lengths([3, 5])
    q = torch.randn(1, 8, 2, 4, dtype=torch.bfloat16)
    k, v = torch.randn(1, 8, 2, 4), torch.randn(1, 8, 2, 4)
    with pytest.raises(InputError, match="^k, v: expected q's dtype torch.bfloat16"):
        varlen_attention(q, k, v, boundaries)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = varlen_attention(q, k, v, boundaries)
    expected = varlen_attention(q, k.bfloat16(), v.bfloat16(), boundaries)
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
