"""The figures of docs/trl.md's "What TRL alone does with a packed hybrid" table: TRL's SFTTrainer unpatched, with
transformers' own guard bypassed, and PackedSFTTrainer, on tiny random Qwen3-Next, Bamba and Jamba (about a minute on
CPU). transformers' kernel functions run on their torch originals here (tests/support/torch_path.py): on this CPU
the kernel packages installed beside fla need a GPU.

Run from the repository root: ``python benchmarks/trl_sft_unpatched.py``.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
from datasets import Dataset
from trl import SFTConfig, SFTTrainer

from hybrid_pack.integrations.transformers.tiny import tiny_model, tiny_tokenizer
from hybrid_pack.integrations.trl import PackedRowsCollator, PackedSFTTrainer
from hybrid_pack.schema import CU_SEQ_LENS_K, CU_SEQ_LENS_Q, INPUT_IDS, LABELS, MAX_LENGTH_K, MAX_LENGTH_Q, SEQ_IDX
from hybrid_pack.testing import check_isolation
from tests.support.torch_path import pure_torch_transformers

texts = [" ".join(f"w{3 + (7 * i + j) % 125}" for j in range(n))
         for i, n in enumerate([5, 9, 3, 12, 7, 4, 6, 2, 20, 11, 8, 1])]
data = Dataset.from_dict({"text": texts})


def config(**changes):
    return SFTConfig(**{"output_dir": "out", "packing": True, "max_length": 32, "per_device_train_batch_size": 2,
                        "use_cpu": True, "report_to": [], **changes})


def leak(report):
    if report.error:
        return "raises " + report.error.split(":")[0]
    return (f"log-probs differ by {max(d.alone_diff for d in report.documents):.2g}, "
            f"gradient {max(d.gradient_leak for d in report.documents):.2g}")


for family in ("qwen3_next", "bamba", "jamba"):
    unpatched = SFTTrainer(model=tiny_model(family), args=config(), train_dataset=data,
                           processing_class=tiny_tokenizer())
    batch = next(iter(unpatched.get_train_dataloader()))
    positions_only = {k: v for k, v in batch.items() if k not in (SEQ_IDX, CU_SEQ_LENS_Q, CU_SEQ_LENS_K,
                                                                  MAX_LENGTH_Q, MAX_LENGTH_K)}
    with pure_torch_transformers(unpatched.model):
        bypassed = check_isolation(unpatched, batch=batch if family == "qwen3_next" else positions_only)
    packed = PackedSFTTrainer(model=tiny_model(family), args=config(), train_dataset=data,
                              processing_class=tiny_tokenizer())
    print(f"{family}: unpatched: {leak(check_isolation(unpatched))}; guard bypassed: {leak(bypassed)}; "
          f"PackedSFTTrainer: {leak(check_isolation(packed))}")
    if family == "jamba":
        continue
    padded = SFTTrainer(model=tiny_model(family), args=config(packing=False), train_dataset=data,
                        processing_class=tiny_tokenizer())
    rows = list(packed.train_dataset)
    documents = [{k: d[k] for k in (INPUT_IDS, LABELS)} for row in rows for d in PackedRowsCollator().documents(row)]
    results = []
    for trainer, inputs in ((packed, packed.data_collator(rows)), (padded, padded.data_collator(documents))):
        trainer.current_gradient_accumulation_steps = 1          # set by train(); read by the MoE aux loss
        with pure_torch_transformers(trainer.model):
            loss = trainer.compute_loss(trainer.model, trainer._prepare_inputs(inputs))
            loss.backward()
        results.append((loss.item(), torch.cat([p.grad.flatten() for p in trainer.model.parameters()]),
                        list(inputs[INPUT_IDS].shape)))
    (packed_loss, packed_grad, packed_shape), (padded_loss, padded_grad, padded_shape) = results
    print(f"{family}: packed {packed_shape} loss {packed_loss:.7f}, padded {padded_shape} loss {padded_loss:.7f}, "
          f"largest gradient difference {(packed_grad - padded_grad).abs().max():.2g} "
          f"(gradients up to {padded_grad.abs().max():.2g})")
