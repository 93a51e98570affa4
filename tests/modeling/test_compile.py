"""``torch.compile(model, fullgraph=True)`` of the native presets on static batches (docs/api.md §9): one inductor graph
(forward and backward) for every layout of one ``(L, M)``, results equal to eager on the plain batches of the same
documents, and no gradient across documents.

One compiled model per preset serves every test of this file (compiling is what costs here). The embedding runs
outside the compiled call (``inputs_embeds``) so the same graph also gives the gradient per token.
"""

from __future__ import annotations

import pytest
import torch
import torch._dynamo
from torch._dynamo.utils import counters

from hybrid_pack import PackingCollator
from hybrid_pack.modeling import from_preset
from hybrid_pack.schema import IGNORE_INDEX, INPUT_IDS, LABELS
from tests import kit

PACK_LENGTH, MAX_DOCUMENTS = 64, 8
LAYOUTS = [(64,), (30, 34), (7, 20, 30), (16, 16, 16, 16), (1, 2, 3, 4, 5), (9, 9, 9, 9, 9, 9),
           (1, 10, 1, 10, 1, 10, 1), (8, 8, 8, 8, 8, 8, 8, 1)]
"""1 to M documents; some fill the row, others leave a padding segment."""
TOLERANCE = 1e-5  # fp32: inductor fuses what eager runs op by op

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module", params=["qwen3-next-tiny", "bamba-tiny"])
def models(request: pytest.FixtureRequest) -> tuple[torch.nn.Module, torch.nn.Module]:
    """The preset and its compiled form (reset between presets, so the counters count one preset)."""
    torch.manual_seed(0)
    model = from_preset(request.param)
    torch._dynamo.reset()
    counters.clear()
    return model, torch.compile(model, fullgraph=True)


def _documents(lengths: tuple[int, ...], seed: int) -> list[dict[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(seed)
    return [{INPUT_IDS: torch.randint(1, 8192, (n,), generator=generator)} for n in lengths]


def _step(model: torch.nn.Module, call: torch.nn.Module, batch: dict) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Loss and parameter gradients of one packed step (the embedding looked up outside ``call``)."""
    model.zero_grad(set_to_none=True)
    embeds = model.get_input_embeddings()(batch[INPUT_IDS])
    loss = call(inputs_embeds=embeds, **{k: v for k, v in batch.items() if k != INPUT_IDS}).loss
    loss.backward()
    return loss.detach(), {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


def test_one_graph_equal_to_eager_on_every_layout(models: tuple[torch.nn.Module, torch.nn.Module]) -> None:
    model, compiled = models
    plain, static = PackingCollator(pack_length=PACK_LENGTH), PackingCollator(pack_length=PACK_LENGTH,
                                                                              max_documents=MAX_DOCUMENTS)
    with torch._dynamo.config.patch(error_on_recompile=True):
        for seed, lengths in enumerate(LAYOUTS):
            documents = _documents(lengths, seed)
            expected_loss, expected = _step(model, model, plain(documents))
            loss, grads = _step(model, compiled, static(documents))
            kit.assert_close(loss, expected_loss, f"loss {lengths}", tol=TOLERANCE)
            assert grads.keys() == expected.keys()
            for name, grad in grads.items():
                kit.assert_close(grad, expected[name], f"d{name} {lengths}", tol=TOLERANCE)
    assert counters["stats"]["unique_graphs"] == 1, "one graph for every layout"
    assert not counters["graph_break"], dict(counters["graph_break"])


def test_no_gradient_crosses_documents_compiled(models: tuple[torch.nn.Module, torch.nn.Module]) -> None:
    """The loss of one document's targets has an exactly zero gradient on every other token of the row."""
    model, compiled = models
    lengths = (9, 9, 9, 9, 9, 9)
    batch = PackingCollator(pack_length=PACK_LENGTH, max_documents=MAX_DOCUMENTS)(_documents(lengths, seed=7))
    starts = batch["cu_seq_lens_q"].tolist()
    for doc in range(len(lengths)):
        inside = torch.zeros(PACK_LENGTH, dtype=torch.bool)
        inside[starts[doc]:starts[doc + 1]] = True
        labels = batch[LABELS].masked_fill(~inside, IGNORE_INDEX)
        embeds = model.get_input_embeddings()(batch[INPUT_IDS]).detach().requires_grad_()
        with torch._dynamo.config.patch(error_on_recompile=True):
            loss = compiled(inputs_embeds=embeds, **{k: v for k, v in batch.items() if k not in (INPUT_IDS, LABELS)},
                            labels=labels).loss
        (grad,) = torch.autograd.grad(loss, embeds)
        assert grad[0, inside].abs().sum() > 0
        assert torch.equal(grad[0, ~inside], torch.zeros_like(grad[0, ~inside])), f"document {doc} leaks"


@pytest.mark.parametrize("preset, other_sizes", [("qwen3-next-tiny", {"head_dim": 16, "gdn_head_k_dim": 16}),
                                                 ("bamba-tiny", {"head_dim": 16, "mamba_head_dim": 32})])
def test_another_pack_length_or_model_compiles_whole_with_dynamic_sizes(preset: str, other_sizes: dict) -> None:
    """A graph compiled before for another pack length, or for a model of other sizes (the same forward code),
    makes torch.compile trace the next one with symbolic sizes (automatic dynamic shapes): the ops specialise what
    their backend's choice reads (sizes, the default scale), so each is one whole graph again (``fullgraph=True``
    raises on a graph break), equal to eager."""
    torch.manual_seed(0)
    torch._dynamo.reset()
    counters.clear()
    runs = [(from_preset(preset), PACK_LENGTH, (30, 34)), (None, 48, (7, 20, 21)),
            (from_preset(preset, **other_sizes), 48, (9, 39))]
    for model, pack_length, lengths in runs:
        if model is not None:
            compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
            current = model
        documents = _documents(lengths, seed=pack_length)
        expected_loss, expected = _step(current, current, PackingCollator(pack_length=pack_length)(documents))
        batch = PackingCollator(pack_length=pack_length, max_documents=MAX_DOCUMENTS)(documents)
        loss, grads = _step(current, compiled, batch)
        kit.assert_close(loss, expected_loss, f"loss {lengths}", tol=TOLERANCE)
        for name, grad in grads.items():
            kit.assert_close(grad, expected[name], f"d{name} {lengths}", tol=TOLERANCE)
    assert counters["stats"]["unique_graphs"] == 3 and not counters["graph_break"], dict(counters["graph_break"])
