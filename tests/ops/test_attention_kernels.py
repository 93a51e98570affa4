"""The attention kernel adapters' root fixes, on CPU with stand-ins for the CUDA kernels.

* torch 2.11's ``varlen_attn`` has no ``enable_gqa``: the adapter must not pass it, and repeat the
  key/value heads instead (torch 2.13's has it: the adapter passes it there).
* compiled flex attention: packed rows are padded to a few static, block-aligned lengths, so a
  new row length does not compile a fresh dynamic-shape kernel; the block mask is built on the
  host, block by block, and agrees with the per-token document mask.
"""

from __future__ import annotations

import importlib.util
from typing import Any

import numpy as np
import pytest
import torch
import torch._dynamo.utils as dynamo_utils
from torch.nn.attention.flex_attention import flex_attention

from hybrid_pack import PackedBoundaries
from hybrid_pack.ops.attention import kernel_flex, kernel_torch_varlen
from hybrid_pack.ops.attention.torch_backend import varlen_attention as torch_attention
from tests import kit
from tests.kit import FLEX_BLOCK_LAYOUTS as LAYOUTS


def attention_inputs(boundaries: PackedBoundaries, kv_heads: int = 2, dtype: torch.dtype = torch.float64
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q ``[1, T, 4, 16]``, k and v ``[1, T, kv_heads, 16]`` from the op's own make_inputs."""
    signature = kit.attention_signature(kv_heads=kv_heads, dim=16, dtype=dtype)
    case = kit.op_inputs("attention", signature, boundaries, requires_grad=False)
    return case.arguments["q"], case.arguments["k"], case.arguments["v"]


def varlen_attn_2_11(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cu_seq_q: torch.Tensor,
                     cu_seq_k: torch.Tensor, max_q: int, max_k: int, *, return_aux: Any = None,
                     scale: float | None = None, window_size: tuple[int, int] = (-1, -1)) -> torch.Tensor:
    """torch 2.11's ``varlen_attn`` signature (no ``enable_gqa``; q, k and v share their head count)."""
    if query.shape[1] != key.shape[1]:
        raise RuntimeError("varlen_attn (2.11): query and key must have the same number of heads")
    boundaries = PackedBoundaries.from_cu_seqlens(cu_seq_q)
    out = torch_attention(query[None], key[None], value[None], boundaries, causal=window_size == (-1, 0),
                          softmax_scale=scale)
    return out[0]


def varlen_attn_2_13(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cu_seq_q: torch.Tensor,
                     cu_seq_k: torch.Tensor, max_q: int, max_k: int, *, return_aux: Any = None,
                     scale: float | None = None, window_size: tuple[int, int] = (-1, -1),
                     enable_gqa: bool = False) -> torch.Tensor:
    """torch 2.13's signature: grouped-query attention only with ``enable_gqa=True``."""
    if query.shape[1] != key.shape[1] and not enable_gqa:
        raise ValueError("varlen_attn (2.13): different head counts need enable_gqa=True")
    varlen_attn_2_13.grouped_calls += int(enable_gqa)
    boundaries = PackedBoundaries.from_cu_seqlens(cu_seq_q)
    return torch_attention(query[None], key[None], value[None], boundaries, causal=window_size == (-1, 0),
                           softmax_scale=scale)[0]


varlen_attn_2_13.grouped_calls = 0


@pytest.mark.parametrize("stand_in", [varlen_attn_2_11, varlen_attn_2_13])
@pytest.mark.parametrize(("kv_heads", "causal"), [(2, True), (1, False), (4, True)])
def test_varlen_attn_adapter_takes_grouped_heads_on_every_torch(stand_in: Any, kv_heads: int, causal: bool,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kernel_torch_varlen, "_varlen_attn", lambda: stand_in)
    boundaries = kit.Layout("short_long_and_padding", (3, 1, 40, 9), num_pad_tokens=4).boundaries()
    q, k, v = attention_inputs(boundaries, kv_heads=kv_heads)
    grouped_before = varlen_attn_2_13.grouped_calls
    out = kernel_torch_varlen.varlen_attention(q, k, v, boundaries, causal=causal, softmax_scale=0.3)
    expected = torch_attention(q, k, v, boundaries, causal=causal, softmax_scale=0.3)
    kit.assert_close(out, expected, "output", tol=1e-12)
    uses_gqa_flag = stand_in is varlen_attn_2_13 and kv_heads != 4
    assert varlen_attn_2_13.grouped_calls - grouped_before == int(uses_gqa_flag)


def test_enable_gqa_is_read_from_the_signature() -> None:
    assert not kernel_torch_varlen.takes_enable_gqa(varlen_attn_2_11)
    assert kernel_torch_varlen.takes_enable_gqa(varlen_attn_2_13)


def varlen_attn_2_10(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cu_seq_q: torch.Tensor,
                     cu_seq_k: torch.Tensor, max_q: int, max_k: int, is_causal: bool = False) -> torch.Tensor:
    """torch 2.10's signature: causal as a flag, no scale, no window."""
    raise AssertionError("never called: the probe refuses this torch")


@pytest.mark.parametrize(("stand_in", "reason"), [
    (varlen_attn_2_10, "takes no scale, window_size (needs torch >= 2.11)"), (varlen_attn_2_11, ""),
    (varlen_attn_2_13, "")])
def test_the_probe_reads_the_arguments_the_adapter_passes(stand_in: Any, reason: str,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kernel_torch_varlen, "_varlen_attn", lambda: stand_in)
    if importlib.util.find_spec("torch.nn.attention.varlen") is None:
        pytest.skip(f"torch {torch.__version__} has no torch.nn.attention.varlen")
    probed = kernel_torch_varlen.varlen_attn_probe()
    assert (reason in probed) if reason else probed == ""


def dense_block_tables(segment_lengths: tuple[int, ...], length: int, causal: bool) -> tuple[np.ndarray, np.ndarray]:
    """(meets, full) per (query block, key block), from the per-token mask: the definition."""
    real = np.repeat(np.arange(len(segment_lengths)), segment_lengths)
    padding = len(segment_lengths) + np.arange(sum(segment_lengths), length) // kernel_flex.BLOCK
    ids = np.concatenate([real, padding])  # the bucket padding: one segment per 128-token block
    mask = ids[:, None] == ids[None, :]
    if causal:
        mask &= np.tril(np.ones((length, length), dtype=bool))
    blocks = mask.reshape(length // kernel_flex.BLOCK, kernel_flex.BLOCK, length // kernel_flex.BLOCK,
                          kernel_flex.BLOCK)
    return blocks.any(axis=(1, 3)), blocks.all(axis=(1, 3))


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("causal", [True, False])
def test_flex_block_tables_match_the_token_mask(layout: str, causal: bool) -> None:
    boundaries = LAYOUTS[layout].boundaries()
    length = kernel_flex.bucket_length(boundaries.total_tokens)
    counts, indices, full_counts, full_indices = kernel_flex._block_tables(boundaries.segment_lengths, length, causal)
    meets, full = dense_block_tables(boundaries.segment_lengths, length, causal)
    for row in range(meets.shape[0]):
        assert sorted(indices[row, :counts[row]]) == np.flatnonzero(meets[row] & ~full[row]).tolist()
        assert sorted(full_indices[row, :full_counts[row]]) == np.flatnonzero(full[row]).tolist()


def test_bucket_lengths_are_few_static_and_block_aligned() -> None:
    buckets = {kernel_flex.bucket_length(t) for t in range(1, 65_537, 7)}
    assert buckets == {128 * 2**i for i in range(10)}
    assert all(kernel_flex.bucket_length(t) >= t for t in (1, 127, 128, 129, 4095, 4096, 4097))


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("causal", [True, False])
def test_flex_adapter_matches_torch_on_padded_rows(layout: str, causal: bool) -> None:
    boundaries = LAYOUTS[layout].boundaries()
    q, k, v = attention_inputs(boundaries)
    out = kernel_flex.varlen_attention(q, k, v, boundaries, causal=causal, softmax_scale=0.25)
    expected = torch_attention(q, k, v, boundaries, causal=causal, softmax_scale=0.25)
    kit.assert_close(out, expected, "output", tol=1e-10)
    assert boundaries.view(("flex_block_mask", causal, kernel_flex.bucket_length(boundaries.total_tokens), None),
                           lambda: None) is not None  # the mask is kept on the boundaries


@pytest.mark.slow
def test_compiled_flex_compiles_once_per_bucket(monkeypatch: pytest.MonkeyPatch) -> None:
    """Rows of 123 and 122 tokens share the 128-token bucket: one graph, where a dynamic length would recompile."""
    compiled = torch.compile(flex_attention, dynamic=False)
    monkeypatch.setattr(kernel_flex, "_attend", lambda device: compiled)
    dynamo_utils.counters.clear()
    for lengths in ([100, 3, 20], [70, 1, 1, 50]):
        boundaries = PackedBoundaries.from_lengths(lengths)
        q, k, v = attention_inputs(boundaries, dtype=torch.float32)
        out = kernel_flex.varlen_attention(q, k, v, boundaries, causal=True, softmax_scale=0.25)
        expected = torch_attention(q, k, v, boundaries, causal=True, softmax_scale=0.25)
        kit.assert_close(out, expected, "output", tol=1e-5)
    assert dynamo_utils.counters["stats"]["unique_graphs"] == 1
