"""GLM-5-Next on packed text rows: KDA, DSA-indexed MLA (own and shared top-k), hyper-connections.

The layer-level tests hold the packed forwards against the module itself run on each document alone (float64,
the indexer's float32 scores included as the module computes them); the model-level tests hold the patched
tiny ``Glm5NextForConditionalGeneration`` to each document alone (logits and gradients, float32) and to the
unpatched model on a row of one document, and show the unpatched model leaks on the same packed row.
"""

from __future__ import annotations

import math
import pickle
import warnings
from collections.abc import Iterator
from copy import deepcopy

import pytest
import torch

pytest.importorskip("transformers")

from transformers.models.glm5_next.modeling_glm5_next import (
    Glm5NextTextAttention,
    Glm5NextTextLinearAttention,
)

from hybrid_pack.boundaries import PackedBoundaries
from hybrid_pack.boundaries.static import StaticBoundaries
from hybrid_pack.errors import InputError, UnsupportedModelError
from hybrid_pack.integrations.transformers import patch_model
from hybrid_pack.integrations.transformers.families import FAMILIES
from hybrid_pack.integrations.transformers.glm5_next import dsa_indexer_forward, indexed_mla_forward
from hybrid_pack.integrations.transformers.tiny import (
    VOCAB,
    _glm5_next,
    tiny_vlm_model,
)
from hybrid_pack.testing import check_isolation
from tests.support.torch_path import pure_torch_transformers

# With 4-token pools and 2 pools chosen: 1-token documents, documents shorter than a pool, exactly one pool, and
# documents with more pools than are chosen (23 is also longer than a KDA chunk of 16).
LENGTHS = [1, 23, 3, 4, 9, 2, 14]


@pytest.fixture(autouse=True)
def _quiet() -> Iterator[None]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def _config(implementation: str = "eager", index_heads: int | None = None):
    config = _glm5_next()
    config._attn_implementation = implementation
    if index_heads is not None:
        config.index_n_heads = index_heads
    return config


def _randomized(module: torch.nn.Module, seed: int) -> torch.nn.Module:
    """``module`` in float64 with every parameter drawn from N(0, 0.2) (the pool gate and position bias included,
    which the model initialises to constants); norms' weights around 1; the forget gate's ``A_log`` and ``dt_bias``
    drawn as the model's ``_init_weights`` draws them (a module built alone leaves them as uninitialised memory)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in module.named_parameters():
            if name.endswith(("norm.weight", "layernorm.weight")):
                param.copy_(1 + 0.2 * torch.randn(param.shape, generator=generator))
            elif name.endswith("A_log"):
                param.copy_(torch.empty(param.shape).uniform_(1.0, 16.0, generator=generator).log())
            elif name.endswith("dt_bias"):  # the inverse softplus of a step drawn log-uniformly in [1e-3, 1e-1]
                dt = torch.empty(param.shape).uniform_(math.log(1e-3), math.log(1e-1), generator=generator).exp()
                param.copy_(dt + torch.log(-torch.expm1(-dt)))
            else:
                param.copy_(0.2 * torch.randn(param.shape, generator=generator))
    return module.double().eval()


def _hidden(lengths: list[int], seed: int) -> torch.Tensor:
    return torch.randn(1, sum(lengths), 32, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))


def _documents(lengths: list[int]) -> Iterator[tuple[int, int]]:
    start = 0
    for length in lengths:
        yield start, start + length
        start += length


def _selected_sets(indices: torch.Tensor, offset: int = 0) -> list[set[int]]:
    """Per query, the set of selected row positions (``-1`` dropped), shifted by ``offset``."""
    return [{int(i) + offset for i in row if i >= 0} for row in indices[0]]


def _module_alone(attention: torch.nn.Module, x: torch.Tensor, prev: torch.Tensor | None = None):
    return attention(hidden_states=x, attention_mask=torch.ones(x.shape[:2], dtype=torch.bool),
                     prev_topk_indices=prev)


def _module_pool_scores(indexer: torch.nn.Module, x: torch.Tensor, q_resid: torch.Tensor) -> torch.Tensor:
    """The module's own pool scores ``[n, P]`` on one document alone (its forward's steps, its pooling)."""
    n = x.shape[1]
    k = indexer.k_norm(indexer.wk(x))
    gate = torch.nn.functional.linear(x, indexer.index_kpool_compress_gate)
    pool_keys, _, _ = indexer.get_pooled_states(torch.cat([k, gate, x.new_ones(1, n, 1)], dim=-1))
    q = indexer.wq_b(q_resid).view(1, n, -1, indexer.head_dim)
    scores = torch.relu(q.float() @ pool_keys.transpose(-1, -2).float().unsqueeze(1) * indexer.softmax_scale)
    weights = indexer.weights_proj(x).float() * indexer.n_heads ** -0.5
    return (weights.unsqueeze(-2) @ scores).squeeze(-2)[0]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_indexer_selects_as_the_module_on_each_document(seed: int) -> None:
    """Per query: the same tail, and pools of the same scores (a best ``k`` of the document's visible pools). Pools
    of equal score (relu makes exact zeros common) may differ: the module leaves their order to ``torch.topk``,
    the packed selection takes the earlier pool."""
    attention = _randomized(Glm5NextTextAttention(_config(), layer_idx=1), seed)
    indexer, size = attention.indexer, attention.indexer.index_kpool
    x = _hidden(LENGTHS, seed)
    boundaries = PackedBoundaries.from_lengths(LENGTHS)
    exact = ties = 0
    with torch.no_grad():
        q_resid = attention.q_a_layernorm(attention.q_a_proj(x))
        packed = dsa_indexer_forward(indexer, x, q_resid, boundaries)
        assert packed.dtype == torch.int32
        assert packed.shape == (1, sum(LENGTHS), indexer.index_topk + size - 1)
        for start, end in _documents(LENGTHS):
            alone = indexer(hidden_states=x[:, start:end], q_resid=q_resid[:, start:end],
                            attention_mask=torch.ones(1, end - start, dtype=torch.bool), cache=None)
            scores = _module_pool_scores(indexer, x[:, start:end], q_resid[:, start:end])
            for t, (got, want) in enumerate(zip(_selected_sets(packed[:, start:end], -start),
                                                _selected_sets(alone), strict=True)):
                full_pools = (t + 1) // size * size
                assert {i for i in got if i >= full_pools} == {i for i in want if i >= full_pools}   # the tail
                got_pools = sorted(scores[t, i // size].item() for i in got if i < full_pools and i % size == 0)
                want_pools = sorted(scores[t, i // size].item() for i in want if i < full_pools and i % size == 0)
                assert got_pools == pytest.approx(want_pools, rel=1e-6, abs=1e-7)
                assert all(i // size * size + size - 1 in got for i in got if i < full_pools)  # whole pools
                exact += got == want
                ties += got != want
    assert exact > 10 * ties
    # The selection is a real choice: queries late in the 23-token document see 5 pools and keep 2 (+ tail).
    assert max(len(s) for s in _selected_sets(packed[:, 1:24])) <= 2 * size + size - 1 < 20


def test_indexer_on_rows_with_no_complete_pool() -> None:
    attention = _randomized(Glm5NextTextAttention(_config(), layer_idx=1), 0)
    lengths = [1, 3, 2]
    x = _hidden(lengths, 0)
    boundaries = PackedBoundaries.from_lengths(lengths)
    with torch.no_grad():
        q_resid = attention.q_a_layernorm(attention.q_a_proj(x))
        packed = dsa_indexer_forward(attention.indexer, x, q_resid, boundaries)
    # Each query sees only its own document's tokens up to itself (all in its tail).
    expected = [set(range(start, t + 1)) for start, end in _documents(lengths) for t in range(start, end)]
    assert _selected_sets(packed) == expected


# The module's eager attention takes its softmax in float32, whatever the inputs' dtype.
@pytest.mark.parametrize(("implementation", "tol"), [("sdpa", 1e-10), ("eager", 1e-6)])
def test_indexed_layers_match_the_module_on_each_document(implementation: str, tol: float) -> None:
    """The full-indexer layer and the layer sharing its top-k, forward and backward, float64."""
    config = _config(implementation, index_heads=16)   # 16 heads: no two pools tie at 0 (see above)
    full = _randomized(Glm5NextTextAttention(config, layer_idx=1), 3)
    shared = _randomized(Glm5NextTextAttention(config, layer_idx=2), 4)
    assert full.next_skip_topk and shared.indexer is None
    boundaries = PackedBoundaries.from_lengths(LENGTHS)
    x = _hidden(LENGTHS, 5).requires_grad_()
    cotangent = torch.randn(x.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(6))

    out_full, weights, indices = indexed_mla_forward(full, boundaries, x)
    out_shared, _, passed_on = indexed_mla_forward(shared, boundaries, x, prev_topk_indices=indices)
    assert weights is None and passed_on is None
    ((out_full + out_shared) * cotangent).sum().backward()
    packed_grad, x.grad = x.grad, None

    for start, end in _documents(LENGTHS):
        alone_full, _, alone_indices = _module_alone(full, x[:, start:end])
        alone_shared, _, _ = _module_alone(shared, x[:, start:end], alone_indices)
        torch.testing.assert_close(out_full[:, start:end], alone_full, rtol=tol, atol=tol)
        torch.testing.assert_close(out_shared[:, start:end], alone_shared, rtol=tol, atol=tol)
        ((alone_full + alone_shared) * cotangent[:, start:end]).sum().backward()
    torch.testing.assert_close(packed_grad, x.grad, rtol=tol, atol=tol)


def test_kda_layer_matches_the_module_on_each_document() -> None:
    """The module's KDA runs in float32 whatever its inputs, so the two agree to float32 precision."""
    mixer = _randomized(Glm5NextTextLinearAttention(_config(), layer_idx=0), 7).float()
    x = _hidden(LENGTHS, 8).float()
    boundaries = PackedBoundaries.from_lengths(LENGTHS)
    layer = next(f for f in FAMILIES if "glm5_next" in f.model_types).layers["Glm5NextTextLinearAttention"]
    with torch.no_grad(), pure_torch_transformers(Glm5NextTextLinearAttention):
        packed = layer.forward(mixer, x, boundaries)
        for start, end in _documents(LENGTHS):
            alone = mixer(hidden_states=x[:, start:end])
            torch.testing.assert_close(packed[:, start:end], alone, rtol=1e-5, atol=1e-5)


def test_refusals() -> None:
    attention = _randomized(Glm5NextTextAttention(_config(), layer_idx=1), 0)
    shared = _randomized(Glm5NextTextAttention(_config(), layer_idx=2), 0)
    boundaries = PackedBoundaries.from_lengths([5, 3])
    x = _hidden([5, 3], 0)
    with pytest.raises(InputError, match="prev_topk_indices"):
        indexed_mla_forward(shared, boundaries, x)
    with pytest.raises(UnsupportedModelError, match="PackedBoundaries"):
        indexed_mla_forward(attention, StaticBoundaries.from_boundaries(boundaries, 4), x)
    attention.indexer.index_kpool_always_select_tail = False
    with pytest.raises(UnsupportedModelError, match="index_kpool_always_select_tail"):
        indexed_mla_forward(attention, boundaries, x)


def test_patched_model_is_isolated() -> None:
    model = patch_model(tiny_vlm_model("glm5_next"))
    report = check_isolation(model, lengths=LENGTHS, num_pad_tokens=3, grads=True, atol=1e-5, vocab_size=VOCAB)
    assert report.ok, str(report)


@pytest.mark.parametrize("implementation", ["sdpa", "eager"])
def test_packed_row_of_one_document_matches_unpatched(implementation: str) -> None:
    reference = tiny_vlm_model("glm5_next")
    reference.set_attn_implementation(implementation)
    model = patch_model(deepcopy(reference))
    for length in (37, 3):
        ids = torch.randint(0, VOCAB, (1, length), generator=torch.Generator().manual_seed(length))
        with torch.no_grad(), pure_torch_transformers(reference):
            expected = reference(input_ids=ids).logits
            packed = model(input_ids=ids, **PackedBoundaries.from_lengths([length]).hf_kwargs()).logits
            ordinary = model(input_ids=ids).logits
        torch.testing.assert_close(packed, expected, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(ordinary, expected, rtol=0, atol=0)


def test_unpatched_model_leaks() -> None:
    model = tiny_vlm_model("glm5_next")
    with pure_torch_transformers(model):
        report = check_isolation(model, lengths=LENGTHS, grads=False, per_layer=False, atol=1e-5,
                                 vocab_size=VOCAB)
    assert report.error is None and not report.ok, str(report)


def test_patched_model_pickles_patched() -> None:
    model = pickle.loads(pickle.dumps(patch_model(tiny_vlm_model("glm5_next"))))
    report = check_isolation(model, lengths=[6, 9], grads=False, per_layer=False, atol=1e-5, vocab_size=VOCAB)
    assert report.ok, str(report)


def test_text_model_class_is_served() -> None:
    """``Glm5NextTextModel`` (model_type ``glm5_next_text``, no LM head): packed rows equal each document alone."""
    from transformers import Glm5NextTextModel

    torch.manual_seed(0)
    reference = Glm5NextTextModel(_glm5_next()).eval()
    model = patch_model(deepcopy(reference))
    lengths = [9, 1, 21]
    ids = torch.randint(0, VOCAB, (1, sum(lengths)), generator=torch.Generator().manual_seed(0))
    with torch.no_grad(), pure_torch_transformers(reference):
        packed = model(input_ids=ids, **PackedBoundaries.from_lengths(lengths).hf_kwargs()).last_hidden_state
        for start, end in _documents(lengths):
            alone = reference(input_ids=ids[:, start:end]).last_hidden_state
            torch.testing.assert_close(packed[:, start:end], alone, rtol=1e-5, atol=1e-5)


def test_patch_model_refuses_what_packed_calls_cannot_serve() -> None:
    """Refused by patch_model itself, never at the first packed call (docs/api.md §6a)."""
    model = tiny_vlm_model("glm5_next")
    next(m for m in model.modules() if type(m).__name__ == "Glm5NextTextAttention"
         and m.indexer is not None).indexer.index_kpool_always_select_tail = False
    with pytest.raises(UnsupportedModelError, match="index_kpool_always_select_tail"):
        patch_model(model)
    model = tiny_vlm_model("glm5_next")
    for module in model.modules():
        if type(module).__name__ == "Glm5NextTextAttention":
            module.attention_dropout = 0.5
    with pytest.raises(UnsupportedModelError, match=r"config\.attention_dropout: 0\.5 .*Glm5NextTextAttention"):
        patch_model(model)


def test_packed_attention_weights_are_refused_by_name() -> None:
    model = patch_model(tiny_vlm_model("glm5_next"))
    model.set_attn_implementation("eager")
    batch = PackedBoundaries.from_lengths([5, 3]).hf_kwargs()
    with pytest.raises(InputError, match="^output_attentions: Glm5NextTextAttention forms no attention weights"):
        model(input_ids=torch.randint(0, VOCAB, (1, 8)), **batch, output_attentions=True)
