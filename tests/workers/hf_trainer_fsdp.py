"""One rank of the PackedTrainer-with-FSDP check in tests/training/test_distributed.py (torch.distributed.run).

``PackedTrainer`` with ``TrainingArguments(fsdp=True, fsdp_config={"fsdp_version": 2, ...})`` on CPU (gloo):
accelerate does not shard there, and the trainer must say so instead of training with DDP. Writes the error
(or None) to ``OUT.rank<r>.json``.

    python -m torch.distributed.run --nproc_per_node 2 tests/workers/hf_trainer_fsdp.py OUT
"""

from __future__ import annotations

import json
import os
import sys

from transformers import TrainingArguments

from hybrid_pack.distributed import end_process_group
from hybrid_pack.errors import InputError
from hybrid_pack.integrations.transformers.trainer import PackedTrainer
from hybrid_pack.modeling import from_preset
from tests.workers.launch import exit_without_finalizing


def main(out: str) -> None:
    dataset = [{"input_ids": list(range(1, n))} for n in (20, 30, 40, 50)]
    args = TrainingArguments(out, max_steps=1, per_device_train_batch_size=1, report_to=[], use_cpu=True,
                             ddp_backend="gloo", save_strategy="no", disable_tqdm=True, fsdp=True,
                             fsdp_config={"fsdp_version": 2, "transformer_layer_cls_to_wrap": ["HybridDecoderLayer"]})
    error = None
    try:
        PackedTrainer(model=from_preset("qwen3-next-tiny"), args=args, train_dataset=dataset,
                      lengths=[len(d["input_ids"]) for d in dataset], capacity=64)
    except InputError as err:
        error = str(err)
    with open(f"{out}.rank{os.environ['RANK']}.json", "w") as f:
        json.dump({"error": error}, f)
    end_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
    exit_without_finalizing(0)
