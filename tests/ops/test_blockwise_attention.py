"""Blockwise lower-right causal attention (the context-parallel attention's kernel): equal to SDPA with
``causal_lower_right`` and to a plain float64 softmax, forward and backward, for every block size; it saves
only ``q, k, v, out, lse`` and never builds a ``[Tq, Tk]`` tensor."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right
from torch.utils._python_dispatch import TorchDispatchMode

from hybrid_pack.errors import InputError
from hybrid_pack.ops.attention.blockwise import (
    lower_right_causal_attention,
    lower_right_causal_attention_with_lse,
)
from tests import kit

SCALE = 0.3
HEAD_DIM = 8

# name: (Tq, Tk, H, Hkv, block)
SHAPES = {
    "equal_lengths": (37, 37, 4, 4, 8),
    "fewer_queries": (21, 50, 4, 4, 8),
    "one_query": (1, 29, 4, 2, 8),
    "one_query_one_key": (1, 1, 2, 1, 4),
    "lengths_not_block_multiples": (45, 67, 4, 2, 16),
    "block_longer_than_both": (13, 30, 4, 2, 64),
    "block_of_one": (9, 14, 2, 1, 1),
    "four_queries_per_kv_head": (40, 40, 8, 2, 7),
    "offset_a_block_multiple": (32, 64, 4, 4, 16),
}


def make_inputs(num_queries: int, num_keys: int, heads: int, kv_heads: int, *, dtype: torch.dtype = torch.float64,
                seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q ``[Tq, H, D]``, k and v ``[Tk, Hkv, D]``, leaves that require grad."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(num_queries, heads, HEAD_DIM, generator=gen, dtype=torch.float64)
    k, v = (torch.randn(num_keys, kv_heads, HEAD_DIM, generator=gen, dtype=torch.float64) for _ in range(2))
    return tuple(x.to(dtype).requires_grad_() for x in (q, k, v))


def softmax_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out [Tq, H, D], lse [Tq, H])`` from dense ``[H, Tq, Tk]`` scores in q's dtype: for tests only."""
    groups = q.shape[1] // k.shape[1]
    k, v = (x.repeat_interleave(groups, dim=1) for x in (k, v))
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    num_queries, num_keys = q.shape[0], k.shape[0]
    above = torch.arange(num_keys)[None, :] > torch.arange(num_queries)[:, None] + (num_keys - num_queries)
    scores = scores.masked_fill(above, float("-inf"))
    out = torch.einsum("hqk,khd->qhd", torch.softmax(scores, dim=-1), v)
    return out, scores.logsumexp(dim=-1).transpose(0, 1)


def sdpa_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """torch SDPA with ``causal_lower_right`` and GQA: ``[Tq, H, D]``."""
    q, k, v = (x.transpose(0, 1)[None] for x in (q, k, v))
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=causal_lower_right(q.shape[2], k.shape[2]),
                                         scale=scale, enable_gqa=q.shape[1] != k.shape[1])
    return out[0].transpose(0, 1)


def output_and_grads(fn, inputs: tuple[torch.Tensor, ...], *, seed: int = 1) -> dict[str, torch.Tensor]:
    """``fn(q, k, v)`` and the q, k, v gradients of ``sum(out * weight)`` for a fixed random weight."""
    out = fn(*inputs)
    weight = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    grads = torch.autograd.grad((out * weight.to(out.dtype)).sum(), inputs)
    return {"output": out.detach(), "dq": grads[0], "dk": grads[1], "dv": grads[2]}


def blockwise(block: int):
    return lambda q, k, v: lower_right_causal_attention(q, k, v, scale=SCALE, block=block)


REFERENCES = {
    "sdpa_causal_lower_right": lambda q, k, v: sdpa_reference(q, k, v, SCALE),
    "plain_softmax": lambda q, k, v: softmax_reference(q, k, v, SCALE)[0],
}


@pytest.mark.parametrize("reference", REFERENCES)
@pytest.mark.parametrize("shape", SHAPES)
def test_float64_equals_references(shape: str, reference: str) -> None:
    num_queries, num_keys, heads, kv_heads, block = SHAPES[shape]
    inputs = make_inputs(num_queries, num_keys, heads, kv_heads)
    got = output_and_grads(blockwise(block), inputs)
    want = output_and_grads(REFERENCES[reference], inputs)
    for name in ("output", "dq", "dk", "dv"):
        kit.assert_close(got[name], want[name], name, tol=1e-10)


@pytest.mark.parametrize("block", [1, 2, 5, 16, 41, 512])
def test_every_block_size_gives_the_same_result(block: int) -> None:
    inputs = make_inputs(23, 41, 6, 2, seed=2)
    got = output_and_grads(blockwise(block), inputs)
    want = output_and_grads(REFERENCES["plain_softmax"], inputs)
    for name in ("output", "dq", "dk", "dv"):
        kit.assert_close(got[name], want[name], f"{name} (block {block})", tol=1e-10)


@pytest.mark.parametrize("shape", ["equal_lengths", "fewer_queries", "one_query", "four_queries_per_kv_head"])
def test_float32_tracks_float64(shape: str) -> None:
    num_queries, num_keys, heads, kv_heads, block = SHAPES[shape]
    inputs = make_inputs(num_queries, num_keys, heads, kv_heads, dtype=torch.float32, seed=3)
    got = output_and_grads(blockwise(block), inputs)
    want = output_and_grads(REFERENCES["plain_softmax"], tuple(x.detach().double().requires_grad_() for x in inputs))
    for name in ("output", "dq", "dk", "dv"):
        assert got[name].dtype == torch.float32
        kit.assert_close(got[name].double(), want[name], name, tol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_keeps_dtype_and_tracks_float64(dtype: torch.dtype) -> None:
    inputs = make_inputs(45, 67, 4, 2, dtype=dtype, seed=4)
    got = output_and_grads(blockwise(16), inputs)
    want = output_and_grads(REFERENCES["plain_softmax"], tuple(x.detach().double().requires_grad_() for x in inputs))
    tol = 2e-2 if dtype == torch.bfloat16 else 4e-3
    for name in ("output", "dq", "dk", "dv"):
        assert got[name].dtype == dtype
        kit.assert_close(got[name].double(), want[name], name, tol=tol)


def test_strided_views_equal_contiguous_inputs() -> None:
    """Keys and values as ``ops/attention/cp.py`` holds them: views into one ``[Tk, 2, Hkv, D]`` tensor."""
    q, k, v = make_inputs(30, 52, 4, 2, seed=11)
    keys_values = torch.stack([k, v], dim=1)
    q_strided = torch.cat([q, q], dim=2)[..., :HEAD_DIM]
    got = output_and_grads(blockwise(16), (q_strided, keys_values[:, 0], keys_values[:, 1]))
    want = output_and_grads(blockwise(16), (q, k, v))
    assert not keys_values[:, 0].is_contiguous() and not q_strided.is_contiguous()
    for name in ("output", "dq", "dk", "dv"):
        kit.assert_close(got[name], want[name], name, tol=0)


def test_lse_and_its_gradient_equal_the_dense_logsumexp() -> None:
    inputs = make_inputs(45, 67, 4, 2, seed=5)
    weight = torch.randn(45, 4, generator=torch.Generator().manual_seed(6), dtype=torch.float64)

    def loss(out: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
        return out.sum() + (lse * weight).sum()

    out, lse = lower_right_causal_attention_with_lse(*inputs, scale=SCALE, block=16)
    got = (lse.detach(), *torch.autograd.grad(loss(out, lse), inputs))
    ref_out, ref_lse = softmax_reference(*inputs, SCALE)
    want = (ref_lse.detach(), *torch.autograd.grad(loss(ref_out, ref_lse), inputs))
    assert lse.shape == (45, 4) and lse.dtype == torch.float64
    for name, a, b in zip(("lse", "dq", "dk", "dv"), got, want):
        kit.assert_close(a, b, name, tol=1e-10)
    # Only the log-sum-exp reaches the loss: the output's gradient is absent, not a required input.
    only_lse = torch.autograd.grad(lower_right_causal_attention_with_lse(*inputs, scale=SCALE, block=16)[1].sum(),
                                   inputs)
    ref_only_lse = torch.autograd.grad(softmax_reference(*inputs, SCALE)[1].sum(), inputs[:2])
    for name, a, b in zip(("dq", "dk"), only_lse, ref_only_lse):
        kit.assert_close(a, b, f"{name} (lse only)", tol=1e-10)
    assert not only_lse[2].any(), "dv (lse only): the log-sum-exp does not depend on v"


def test_gradcheck_tiny_float64() -> None:
    inputs = make_inputs(3, 5, 4, 2, seed=7)
    assert torch.autograd.gradcheck(
        lambda q, k, v: lower_right_causal_attention_with_lse(q, k, v, scale=SCALE, block=2), inputs)


def test_key_blocks_beyond_the_diagonal_are_never_read() -> None:
    """Keys past the first query block's last diagonal hold NaN: a block computed and then masked would
    carry it into that block's output (``0 * NaN``), a skipped block cannot. (Backward walks the same
    blocks; a NaN there would reach every key through the later queries, so only forward can show it.)"""
    block, num_queries, num_keys = 4, 12, 20
    q, k, v = (x.detach() for x in make_inputs(num_queries, num_keys, 2, 1, seed=8))
    first_unseen = num_keys - num_queries + block  # the first query block sees keys [0, offset + block)
    k[first_unseen:], v[first_unseen:] = float("nan"), float("nan")
    out = lower_right_causal_attention(q, k, v, scale=SCALE, block=block)
    assert out[block:].isnan().all()
    want = softmax_reference(q[:block], k[:first_unseen], v[:first_unseen], SCALE)[0]
    kit.assert_close(out[:block], want, "output of the first query block", tol=1e-10)


def saved_bytes(fn, inputs: tuple[torch.Tensor, ...]) -> int:
    """Bytes of every tensor ``fn(*inputs)`` saves for its backward (counted once per save)."""
    total = 0

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        nonlocal total
        total += tensor.numel() * tensor.element_size()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        out = fn(*inputs)
    out.sum().backward()
    return total


def test_saves_only_inputs_output_and_lse() -> None:
    num_tokens, heads, kv_heads = 2048, 4, 2
    inputs = make_inputs(num_tokens, num_tokens, heads, kv_heads, dtype=torch.float32, seed=9)
    got = saved_bytes(lambda q, k, v: lower_right_causal_attention(q, k, v, scale=SCALE), inputs)
    q_bytes = num_tokens * heads * HEAD_DIM * 4
    kv_bytes = num_tokens * kv_heads * HEAD_DIM * 4
    lse_bytes = num_tokens * heads * 4
    assert got == 2 * q_bytes + 2 * kv_bytes + lse_bytes, "saved more than q, k, v, out and lse"
    # The dense path saves [H, Tq, Tk] probabilities: the same measure sees them.
    dense = saved_bytes(lambda q, k, v: softmax_reference(q, k, v, SCALE)[0], inputs)
    scores_bytes = heads * num_tokens * num_tokens * 4
    assert dense >= scores_bytes > 50 * got


class LargestTensor(TorchDispatchMode):
    """Records the element count of the largest tensor any op returns."""

    def __init__(self) -> None:
        super().__init__()
        self.numel = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(tensor, torch.Tensor):
                self.numel = max(self.numel, tensor.numel())
        return out


def test_no_intermediate_larger_than_a_block_of_scores() -> None:
    num_queries, num_keys, heads, kv_heads, block = 1024, 2048, 4, 2, 128
    inputs = make_inputs(num_queries, num_keys, heads, kv_heads, dtype=torch.float32, seed=10)
    with LargestTensor() as largest:
        lower_right_causal_attention(*inputs, scale=SCALE, block=block).sum().backward()
    bound = max(num_queries * heads * HEAD_DIM, num_keys * kv_heads * HEAD_DIM, heads * block * block)
    assert largest.numel <= bound < num_queries * num_keys, f"an intermediate of {largest.numel} elements"
    with LargestTensor() as dense:
        softmax_reference(*inputs, SCALE)[0].sum().backward()
    assert dense.numel >= heads * num_queries * num_keys  # the measure sees a dense path's scores


def test_empty_queries_give_empty_output() -> None:
    q, k, v = make_inputs(0, 5, 2, 2)
    out = lower_right_causal_attention(q, k, v, scale=SCALE)
    out.sum().backward()
    assert out.shape == (0, 2, HEAD_DIM) and not k.grad.any()


def bad(**changes):
    """Valid float64 arguments with ``changes`` applied."""
    q, k, v = (x.detach() for x in make_inputs(4, 6, 4, 2))
    arguments = {"q": q, "k": k, "v": v, "scale": SCALE, "block": 2}
    arguments.update({name: change(arguments[name]) if callable(change) else change
                      for name, change in changes.items()})
    return arguments


@pytest.mark.parametrize(("arguments", "field"), [
    (bad(q=lambda q: q[None]), "q"),
    (bad(k=lambda k: k[:, 0]), "k"),
    (bad(v=lambda v: v[:5]), "v"),
    (bad(q=lambda q: q.float()), "q, k, v"),
    (bad(q=lambda q: q.long(), k=lambda k: k.long(), v=lambda v: v.long()), "q"),
    (bad(k=lambda k: k[..., :4], v=lambda v: v[..., :4]), "k"),
    (bad(q=lambda q: q[:, :3]), "k"),
    (bad(q=lambda q: torch.cat([q, q])), "k"),
    (bad(scale=float("nan")), "scale"),
    (bad(block=0), "block"),
    (bad(block=2.0), "block"),
], ids=["q_4d", "k_2d", "v_shape", "dtypes_differ", "integer_dtype", "head_dim_differs", "heads_not_divisible",
        "more_queries_than_keys", "scale_nan", "block_zero", "block_float"])
def test_bad_input_raises_input_error_naming_the_field(arguments: dict, field: str) -> None:
    with pytest.raises(InputError, match=f"^{field}:"):
        lower_right_causal_attention(**arguments)
