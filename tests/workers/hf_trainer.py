"""One rank of the Hugging Face Trainer check in tests/training/test_distributed.py (run by torch.distributed.run).

Trains a token-local model for two epochs with ``hybrid_pack.integrations.transformers.trainer.PackedTrainer``
(``PackedBatchSampler(rank=None)`` under accelerate's ``BatchSamplerShard``, plus the epoch callback),
recording the example indices of every batch this rank receives; with a checkpoint path it resumes from there.
Writes ``{"lengths", "capacity", "seed", "seen"}`` to ``<out>.<full|resumed>.rank<r>.json``.

    python -m torch.distributed.run --nproc_per_node 2 tests/workers/hf_trainer.py OUT [CHECKPOINT]
"""

from __future__ import annotations

import json
import os
import sys

import numpy as np
import torch
from transformers import TrainingArguments

from hybrid_pack import packed_loss
from hybrid_pack.distributed import end_process_group
from hybrid_pack.integrations.transformers.trainer import PackedTrainer
from hybrid_pack.ops.dispatch.discovery import is_discovering
from tests.workers.launch import exit_without_finalizing

NUM_EXAMPLES = 240
CAPACITY = 256
SEED = 1


def example_lengths() -> np.ndarray:
    return np.random.default_rng(0).integers(1, 100, NUM_EXAMPLES)


class TokenLocalModel(torch.nn.Module):
    """Logits from the current token only; records which examples each batch holds (token id = example)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(NUM_EXAMPLES, 8)
        self.head = torch.nn.Linear(8, NUM_EXAMPLES)
        self.seen: list[list[int]] = []

    def forward(self, input_ids, labels=None, cu_seq_lens_q=None, **kwargs):
        if not is_discovering():  # the backends' warm-up pass before the first step trains nothing
            self.seen.append(input_ids[0, cu_seq_lens_q[:-1].long()].tolist())
        logits = self.head(self.embed(input_ids))
        return {"loss": packed_loss(logits, labels), "logits": logits}


def main(out: str, checkpoint: str | None) -> None:
    lengths = example_lengths()
    dataset = [{"input_ids": [i] * int(n)} for i, n in enumerate(lengths)]
    args = TrainingArguments(out, num_train_epochs=2, per_device_train_batch_size=1, save_strategy="steps",
                             save_steps=20, report_to=[], use_cpu=True, ddp_backend="gloo", seed=SEED,
                             disable_tqdm=True, logging_steps=1000, learning_rate=1e-3)
    model = TokenLocalModel()
    trainer = PackedTrainer(model=model, args=args, train_dataset=dataset, lengths=lengths, capacity=CAPACITY)
    trainer.train(resume_from_checkpoint=checkpoint)
    rank = int(os.environ.get("RANK", "0"))
    with open(f"{out}.{'resumed' if checkpoint else 'full'}.rank{rank}.json", "w") as f:
        json.dump({"lengths": lengths.tolist(), "capacity": CAPACITY, "seed": SEED, "seen": model.seen}, f)
    end_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else None)
    exit_without_finalizing(0)
