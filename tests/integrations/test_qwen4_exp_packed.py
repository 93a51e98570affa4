"""Qwen4-Exp's token-mixing layers, packed vs each document alone (the module's own forward).

The hashed n-gram embedding and the dilated PLE convolution look back at earlier tokens: packed, they must stop
at every document start exactly as a document run alone stops at the sequence start. The layout has one-token
documents, a document longer than the convolution's reach (``(W - 1) * ngram_size`` tokens) and a trailing
padding segment; EOS tokens inside documents exercise the n-gram restart the module already has. The QSA
attention's blocks, top-k and attention must restart at every document too: its 21-token document holds ten
index blocks of which each query keeps two, so the selection is sparse.
"""

from __future__ import annotations

import copy
import math
import warnings
from functools import partial

import pytest
import torch

pytest.importorskip("transformers")

from transformers.models.qwen4_exp.modeling_qwen4_exp import apply_rotary_pos_emb as transformers_rope

from hybrid_pack.boundaries import PackedBoundaries
from hybrid_pack.integrations.transformers import patch_model
from hybrid_pack.integrations.transformers import qwen4_exp as qwen4_exp_module
from hybrid_pack.integrations.transformers.gated_deltanet import gated_deltanet_forward, qwen3_5_projections
from hybrid_pack.integrations.transformers.qsa import qsa_attention_forward
from hybrid_pack.integrations.transformers.qwen4_exp import ngram_embedding_forward, ple_forward
from hybrid_pack.integrations.transformers.tiny import VOCAB, tiny_model
from hybrid_pack.testing import check_isolation
from tests.support.torch_path import pure_torch_transformers

LENGTHS = [1, 21, 2, 4]
NUM_PAD = 3
EOS = 1


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return tiny_model("qwen4_exp")


def _layout() -> tuple[PackedBoundaries, torch.Tensor]:
    boundaries = PackedBoundaries.from_document_lengths(LENGTHS, num_pad_tokens=NUM_PAD)
    ids = torch.randint(2, VOCAB, (1, boundaries.total_tokens), generator=torch.Generator().manual_seed(0))
    ids[0, [5, 9, 10, 23]] = EOS   # EOS mid-document, twice in a row, and at the last token of a document
    return boundaries, ids


def _documents(boundaries: PackedBoundaries) -> list[slice]:
    return [slice(start, start + length) for start, length in zip(boundaries.starts, LENGTHS, strict=False)]


def _ple(model: torch.nn.Module) -> torch.nn.Module:
    """The first PLE layer in float64, with a random convolution (the family initialises it to zero)."""
    ple = model.model.layers[0].ple
    with torch.no_grad():
        ple.conv1d.weight.normal_(0.0, 0.5, generator=torch.Generator().manual_seed(1))
    return ple.double()


def test_ngram_embedding_restarts_at_every_document(model: torch.nn.Module) -> None:
    embedding = model.model.layers[0].ple.ple_embedding
    boundaries, ids = _layout()
    with torch.no_grad():
        packed = ngram_embedding_forward(embedding, ids, boundaries)
        alone = [embedding(ids[:, doc], None) for doc in _documents(boundaries)]
        whole_row = embedding(ids, None)
    for doc, expected in zip(_documents(boundaries), alone, strict=True):
        torch.testing.assert_close(packed[:, doc], expected, rtol=0, atol=0)
    assert not torch.equal(whole_row[:, _documents(boundaries)[1]][:, :2], alone[1][:, :2])


def test_ple_layer_keeps_documents_apart(model: torch.nn.Module) -> None:
    ple = _ple(model)
    boundaries, ids = _layout()
    documents = _documents(boundaries)
    hidden = torch.randn(1, boundaries.total_tokens, ple.hc_count * ple.hidden_size, dtype=torch.float64,
                         generator=torch.Generator().manual_seed(2), requires_grad=True)
    packed = ple_forward(ple, hidden, boundaries, ids)
    for n, doc in enumerate(documents):
        alone_hidden = hidden[:, doc].detach().requires_grad_(True)
        alone = ple(alone_hidden, ids[:, doc], None)
        torch.testing.assert_close(packed[:, doc], alone, rtol=1e-10, atol=1e-10)
        weights = torch.randn(alone.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(3 + n))
        (grad,) = torch.autograd.grad((packed[:, doc] * weights).sum(), hidden, retain_graph=True)
        (alone_grad,) = torch.autograd.grad((alone * weights).sum(), alone_hidden)
        # the family's grouped RMSNorms compute in float32, so gradients agree to float32 rounding
        torch.testing.assert_close(grad[:, doc], alone_grad, rtol=1e-5, atol=1e-5)
        outside = torch.ones(boundaries.total_tokens, dtype=torch.bool)
        outside[doc] = False
        assert grad[:, outside].abs().max() == 0


def test_unpatched_ple_layer_leaks(model: torch.nn.Module) -> None:
    """The module's own forward on the packed row mixes documents: the layout above can catch a leak."""
    ple = _ple(model)
    boundaries, ids = _layout()
    hidden = torch.randn(1, boundaries.total_tokens, ple.hc_count * ple.hidden_size, dtype=torch.float64)
    doc = _documents(boundaries)[1]
    with torch.no_grad():
        whole_row = ple(hidden, ids, None)[:, doc]
        alone = ple(hidden[:, doc], ids[:, doc], None)
    assert (whole_row - alone).abs().max() > 1e-3


def test_gated_deltanet_with_sigmoid_output_gate(model: torch.nn.Module) -> None:
    """Qwen4-Exp's Gated DeltaNet is Qwen3.5's with its own gated norm (``output_gate_type``)."""
    mixer = model.model.layers[0].linear_attn
    assert mixer.norm.activation == "sigmoid"
    forward = partial(gated_deltanet_forward, projections=qwen3_5_projections)
    boundaries, _ = _layout()
    hidden = torch.randn(1, boundaries.total_tokens, mixer.hidden_size, generator=torch.Generator().manual_seed(4))
    with torch.no_grad(), pure_torch_transformers(model):
        packed = forward(mixer, hidden, boundaries)
        for doc in _documents(boundaries):
            torch.testing.assert_close(packed[:, doc], mixer(hidden[:, doc]), rtol=1e-5, atol=1e-5)


def _attention(model: torch.nn.Module) -> torch.nn.Module:
    """A float64 copy of the QSA attention layer."""
    return copy.deepcopy(model.model.layers[1].self_attn).double()


def _attention_inputs(model: torch.nn.Module, boundaries: PackedBoundaries, seed: int,
                      ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """float64 hidden states ``[1, T, hidden]`` and the RoPE the layer receives on a packed call (per-document
    positions)."""
    hidden = torch.randn(1, boundaries.total_tokens, model.config.hidden_size, dtype=torch.float64,
                         generator=torch.Generator().manual_seed(seed), requires_grad=True)
    return hidden, model.model.rotary_emb(hidden.detach(), boundaries.document_positions)


def _alone(attention: torch.nn.Module, hidden: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
           allowed: torch.Tensor | None = None) -> torch.Tensor:
    """The module's own forward on one document (``allowed [n, n]``: its attention mask, causal by default)."""
    length = hidden.shape[1]
    mask = torch.ones(length, length, dtype=torch.bool).tril() if allowed is None else allowed
    return attention(hidden, rope, attention_mask=mask[None, None])[0]


def _tied_selections(attention: torch.nn.Module, hidden: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                     ) -> int:
    """How many queries of one document see a tie between the last block kept and the first block dropped (where
    the module's ``torch.topk`` may keep either)."""
    indexer, ratio = attention.indexer, attention.indexer.compress_ratio
    heads, dim = indexer.index_n_heads, indexer.index_head_dim
    cos, sin = rope
    with torch.no_grad():
        query, keys = indexer.index_qk_proj(hidden).split([heads * dim, dim], dim=-1)
        query = indexer.q_layernorm(query.unflatten(-1, (heads, dim)))
        query = transformers_rope(query, cos=cos, sin=sin, unsqueeze_dim=2)[0]
        ties = 0
        for position in range(hidden.shape[1]):
            count = (position + 1) // ratio
            if count <= indexer.block_topk:
                continue
            blocks = torch.arange(count * ratio).view(count, ratio)
            pooled = indexer.k_layernorm(keys[0][blocks].mean(dim=1))
            pooled = transformers_rope(pooled[:, None], cos=cos[0][blocks[:, 0]], sin=sin[0][blocks[:, 0]])[:, 0]
            scores = (query[position] @ pooled.T).relu().sum(dim=0) / math.sqrt(dim)
            ranked = scores.sort(descending=True).values
            ties += int(ranked[indexer.block_topk - 1] == ranked[indexer.block_topk])
    return ties


def test_qsa_attention_matches_each_document_alone(model: torch.nn.Module) -> None:
    attention = _attention(model)
    boundaries = PackedBoundaries.from_document_lengths(LENGTHS, num_pad_tokens=NUM_PAD)
    hidden, rope = _attention_inputs(model, boundaries, seed=4)
    packed, attention_weights = qsa_attention_forward(attention, boundaries, hidden, rope)
    assert attention_weights is None
    packed_loss, alone_loss = 0.0, 0.0
    for n, doc in enumerate(_documents(boundaries)):
        doc_rope = tuple(x[:, doc] for x in rope)
        alone_hidden = hidden[:, doc].detach().requires_grad_(True)
        # a tie at the top-k cut is left to torch.topk by the module (order unspecified): this input has none
        assert _tied_selections(attention, alone_hidden, doc_rope) == 0
        alone = _alone(attention, alone_hidden, doc_rope)
        torch.testing.assert_close(packed[:, doc], alone, rtol=1e-10, atol=1e-10)
        weights = torch.randn(alone.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(6 + n))
        (grad,) = torch.autograd.grad((packed[:, doc] * weights).sum(), hidden, retain_graph=True)
        (alone_grad,) = torch.autograd.grad((alone * weights).sum(), alone_hidden, retain_graph=True)
        torch.testing.assert_close(grad[:, doc], alone_grad, rtol=1e-10, atol=1e-10)
        outside = torch.ones(boundaries.total_tokens, dtype=torch.bool)
        outside[doc] = False
        assert grad[:, outside].abs().max() == 0
        packed_loss = packed_loss + (packed[:, doc] * weights).sum()
        alone_loss = alone_loss + (alone * weights).sum()
    # the layer's weights get the gradient of the documents run one by one, the indexer none (it only selects);
    # the RMSNorms compute in float32 and their weight gradients sum over tokens, so they agree to float32 rounding
    names, parameters = zip(*attention.named_parameters(), strict=True)
    packed_grads = torch.autograd.grad(packed_loss, parameters, allow_unused=True)
    alone_grads = torch.autograd.grad(alone_loss, parameters, allow_unused=True)
    for name, got, expected in zip(names, packed_grads, alone_grads, strict=True):
        if name.startswith("indexer."):
            assert got is None and expected is None, name
        else:
            torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5, msg=name)


def test_qsa_ties_keep_the_earlier_blocks(model: torch.nn.Module) -> None:
    """A zero index projection scores every block 0: each query keeps the first ``block_topk`` blocks of its own
    document and its tail, the same packed as alone."""
    attention = _attention(model)
    with torch.no_grad():
        attention.indexer.index_qk_proj.weight.zero_()
    boundaries = PackedBoundaries.from_document_lengths(LENGTHS, num_pad_tokens=NUM_PAD)
    hidden, rope = _attention_inputs(model, boundaries, seed=7)
    with torch.no_grad():
        packed, _ = qsa_attention_forward(attention, boundaries, hidden, rope)
    ratio, kept = attention.indexer.compress_ratio, attention.indexer.block_topk
    for doc, length in zip(_documents(boundaries), LENGTHS, strict=True):
        position = torch.arange(length)
        tail_start = ((position + 1) // ratio * ratio)[:, None]
        kept_or_tail = (position[None] < kept * ratio) | (position[None] >= tail_start)
        allowed = kept_or_tail & (position[None] <= position[:, None])
        with torch.no_grad():
            expected = _alone(attention, hidden[:, doc], tuple(x[:, doc] for x in rope), allowed)
        torch.testing.assert_close(packed[:, doc], expected, rtol=1e-10, atol=1e-10)


def test_unpatched_qsa_attention_leaks(model: torch.nn.Module) -> None:
    attention = _attention(model)
    boundaries = PackedBoundaries.from_document_lengths(LENGTHS, num_pad_tokens=NUM_PAD)
    hidden, _ = _attention_inputs(model, boundaries, seed=5)
    row_rope = model.model.rotary_emb(hidden.detach(), torch.arange(boundaries.total_tokens)[None])
    doc = _documents(boundaries)[2]
    with torch.no_grad():
        whole_row = _alone(attention, hidden, row_rope)[:, doc]
        alone = _alone(attention, hidden[:, doc], tuple(x[:, doc] for x in row_rope))
    assert (whole_row - alone).abs().max() > 1e-3


def _random_ple_convolutions(model: torch.nn.Module) -> torch.nn.Module:
    """``model`` with every PLE convolution random (the family initialises them to zero, a no-op)."""
    generator = torch.Generator().manual_seed(8)
    with torch.no_grad():
        for layer in model.model.layers:
            if layer.ple is not None:
                layer.ple.conv1d.weight.normal_(0.0, 0.5, generator=generator)
    return model


def _quiet_model(seed: int = 0) -> torch.nn.Module:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return _random_ple_convolutions(tiny_model("qwen4_exp", seed=seed))


def test_patched_model_with_random_ple_convolutions_is_isolated() -> None:
    model = patch_model(_quiet_model())
    report = check_isolation(model, lengths=LENGTHS, num_pad_tokens=NUM_PAD, grads=True, atol=1e-5)
    assert report.ok, str(report)


def test_patched_model_with_random_ple_convolutions_matches_unpatched() -> None:
    reference, model = _quiet_model(), patch_model(_quiet_model())
    ids = torch.randint(0, VOCAB, (1, 35), generator=torch.Generator().manual_seed(9))
    with torch.no_grad(), pure_torch_transformers(reference):
        expected = reference(input_ids=ids).logits
        packed = model(input_ids=ids, **PackedBoundaries.from_lengths([ids.shape[1]]).hf_kwargs()).logits
    torch.testing.assert_close(packed, expected, rtol=1e-5, atol=1e-5)


def test_a_convolution_reading_across_documents_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """The model-level check above can fail on the convolution alone: one that reads the whole row leaks."""
    whole_row_conv = qwen4_exp_module.dilated_causal_conv

    def leaking_conv(x: torch.Tensor, conv: torch.nn.Conv1d, boundaries: PackedBoundaries) -> torch.Tensor:
        return whole_row_conv(x, conv, PackedBoundaries.from_lengths([x.shape[1]]))

    monkeypatch.setattr(qwen4_exp_module, "dilated_causal_conv", leaking_conv)
    model = patch_model(_quiet_model())
    report = check_isolation(model, lengths=LENGTHS, num_pad_tokens=NUM_PAD, grads=False, per_layer=False, atol=1e-5)
    assert not report.ok, str(report)
