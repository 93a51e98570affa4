"""Compiled Hugging Face training on static batches (docs/api.md §9): a patched model compiles once and never
recompiles across static batches, with the loss eager gives on the plain batch; ``PackedTrainer`` under
``TrainingArguments(torch_compile=True)`` trains a native preset on one graph.

The patched mixers and attention run eagerly between compiled graphs (``torch.compiler.disable``: their
boundaries are Python-level state), so a patched model has graph breaks there, by design; what is proved here
is that none of its graphs recompiles for a new layout. ``aot_eager`` keeps these tests fast: what they
prove is in dynamo (graphs, guards), which every backend shares.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch._dynamo
from torch._dynamo.utils import counters

from hybrid_pack import PackingCollator
from hybrid_pack.integrations.transformers import patch_model
from hybrid_pack.integrations.transformers.tiny import VOCAB, tiny_model
from tests import kit

pytestmark = pytest.mark.slow

LAYOUTS = [(30, 20), (10, 10, 10, 10, 10, 10), (64,), (1, 2, 3), (5, 50)]


@pytest.mark.parametrize("family", ["qwen3_next", "bamba"])
def test_patched_model_never_recompiles_across_static_batches(family: str) -> None:
    model = patch_model(tiny_model(family)).train()
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="aot_eager")
    static, plain = PackingCollator(pack_length=64, max_documents=6), PackingCollator(pack_length=64)
    generator = torch.Generator().manual_seed(0)
    for i, lengths in enumerate(LAYOUTS):
        documents = [{"input_ids": torch.randint(3, VOCAB, (n,), generator=generator)} for n in lengths]
        # The first call compiles (transformers' own code may compile a frame twice, for two classes).
        with torch._dynamo.config.patch(error_on_recompile=i > 0):
            loss = compiled(**static(documents)).loss
        loss.backward()
        kit.assert_close(loss.detach(), model(**plain(documents)).loss.detach(), f"loss {lengths}", tol=1e-5)


def test_packed_trainer_with_torch_compile(tmp_path) -> None:
    from transformers import TrainingArguments

    from hybrid_pack.integrations.transformers.trainer import PackedTrainer
    from hybrid_pack.modeling import from_preset

    torch.manual_seed(0)
    lengths = np.random.default_rng(0).integers(4, 40, 24)
    dataset = [{"input_ids": torch.randint(1, 8192, (int(n),)).tolist()} for n in lengths]
    args = TrainingArguments(str(tmp_path), max_steps=4, per_device_train_batch_size=1, report_to=[], use_cpu=True,
                             torch_compile=True, torch_compile_backend="aot_eager", save_strategy="no",
                             disable_tqdm=True, logging_steps=1, learning_rate=1e-3)
    torch._dynamo.reset()
    counters.clear()
    trainer = PackedTrainer(model=from_preset("qwen3-next-tiny"), args=args, train_dataset=dataset,
                            lengths=lengths, capacity=64)
    assert trainer.packing_collator.max_documents == int(trainer.packed_sampler.plan.pack_num_documents.max())
    trainer.train()
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    assert len(losses) == 4 and all(np.isfinite(losses))
    assert counters["stats"]["unique_graphs"] == 1 and not counters["graph_break"]
