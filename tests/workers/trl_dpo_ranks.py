"""One rank of tests/integrations/test_trl_ranks.py's DPO test (run by torch.distributed.run, gloo on CPU, or alone).

One step of ``PackedDPOTrainer`` on tiny Bamba, accelerate's multi-CPU data parallelism (DDP over gloo) with
``PackingGuardCallback(every=1, action="warn")``, in the default packing (``MODE`` ``default``) or in
``batch_invariant=True`` with ``packing_capacity=CAPACITY`` (``invariant``). The global batch is four pairs,
in order (a sequential sampler): on two ranks rank 0 gets the two short pairs, rank 1 the two long ones, so the
ranks' packed rows differ in length; alone, one process takes all four.

Writes ``OUT.rank<r>.pt``: ``{"world", "forwards", "shapes", "losses", "grads", "logps", "guard_records"}``:
forwards of the policy and of the reference per training step, the rows they ran on, each sequence's per-token
log-probabilities (the policy's, keyed by the sequence's token ids), the step's loss and the gradients
before the optimizer step.

    python -m torch.distributed.run --nproc_per_node 2 tests/workers/trl_dpo_ranks.py OUT MODE
"""

from __future__ import annotations

import copy
import logging
import os
import sys
from typing import Any

import torch
import trl
from datasets import Dataset
from torch.utils.data import SequentialSampler
from transformers import TrainerCallback

from hybrid_pack.distributed import end_process_group
from hybrid_pack.integrations.transformers import patch_model
from hybrid_pack.integrations.transformers.guard import PackingGuardCallback
from hybrid_pack.integrations.transformers.tiny import tiny_model, tiny_tokenizer
from hybrid_pack.integrations.trl import PackedDPOTrainer
from tests.support.torch_path import pure_torch_transformers
from tests.workers.launch import exit_without_finalizing

CAPACITY = 128
SHORT = [("w3", "w4", "w5 w6"), ("w7", "w8 w9", "w10")]
LONG = [(" ".join(f"w{i}" for i in range(20, 30)), " ".join(f"w{i}" for i in range(30, 38)),
         " ".join(f"w{i}" for i in range(40, 46))),
        (" ".join(f"w{i}" for i in range(50, 58)), " ".join(f"w{i}" for i in range(60, 66)),
         " ".join(f"w{i}" for i in range(70, 84)))]


class Steps(TrainerCallback):
    """Forwards of the policy and of the reference that are not nested in another (the guard's replays run inside
    the checked call), the rows they ran on and the policy's per-token log-probabilities by sequence; the gradients
    before the optimizer step."""

    def __init__(self, reference: torch.nn.Module) -> None:
        self.reference = reference
        self.forwards = {"policy": 0, "reference": 0}
        self.shapes: list[list[int]] = []
        self.logps: dict[str, torch.Tensor] = {}
        self.grads: dict[str, torch.Tensor] = {}
        self.depth = 0
        self._call: tuple[torch.Tensor, torch.Tensor] | None = None

    def attach_before_packing(self, policy: torch.nn.Module) -> None:
        """Before the trainer's packing hooks: the policy's padded call as TRL makes it."""
        policy.register_forward_pre_hook(self._record_call, with_kwargs=True)

    def attach(self, policy: torch.nn.Module, reference: torch.nn.Module) -> None:
        """After the packing hooks and the guard's (so the guard's replays run nested): the packed rows, and the
        policy's output back in TRL's padded layout."""
        for name, model in (("policy", policy), ("reference", reference)):
            model.register_forward_pre_hook(self._before(name), with_kwargs=True)
            model.register_forward_hook(self._after, with_kwargs=True, always_call=True)

    def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
        self.attach(model, self.reference)

    def _record_call(self, module: torch.nn.Module, args: Any, kwargs: dict[str, Any]) -> None:
        if self.depth == 0 and kwargs.get("fused_lm_head"):
            self._call = (kwargs["input_ids"], kwargs["attention_mask"])

    def _before(self, name: str) -> Any:
        def hook(module: torch.nn.Module, args: Any, kwargs: dict[str, Any]) -> None:
            if self.depth == 0:
                self.forwards[name] += 1
                self.shapes.append(list(kwargs["input_ids"].shape))
            self.depth += 1
        return hook

    def _after(self, module: torch.nn.Module, args: Any, kwargs: dict[str, Any], output: Any) -> None:
        self.depth -= 1
        if self.depth or self._call is None or output is None:
            return
        (ids, mask), self._call = self._call, None
        for row, keep, scores in zip(ids, mask.bool(), output.log_probs, strict=True):
            n = int(keep.sum())
            self.logps[str(row[:n].tolist())] = scores[: n - 1].detach().clone()

    def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
        self.grads = {name: p.grad.detach().clone() for name, p in model.named_parameters() if p.grad is not None}


def main(out: str, mode: str) -> None:
    os.environ["TRL_EXPERIMENTAL_SILENCE"] = "1"
    logging.disable(logging.WARNING)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    invariant = mode == "invariant"
    torch.manual_seed(0)
    model = patch_model(tiny_model("bamba")).train()
    reference = copy.deepcopy(model)
    pairs = [{"prompt": p, "chosen": f" {c}", "rejected": f" {r}"} for p, c, r in SHORT + LONG]  # TRL joins p + c
    config = trl.DPOConfig(output_dir=f"{out}.trainer", per_device_train_batch_size=4 // world, max_steps=1,
                           learning_rate=1e-2, optim="sgd", max_grad_norm=0.0, beta=0.5,
                           use_cpu=True, bf16=False, ddp_backend="gloo", ddp_timeout=120, report_to=[],
                           save_strategy="no", disable_tqdm=True, logging_steps=1, seed=0)
    guard = PackingGuardCallback(every=1, action="warn")
    steps = Steps(reference)
    steps.attach_before_packing(model)
    trainer = PackedDPOTrainer(model=model, ref_model=reference, args=config, train_dataset=Dataset.from_list(pairs),
                               processing_class=tiny_tokenizer(), callbacks=[guard, steps],
                               **({"batch_invariant": True, "packing_capacity": CAPACITY} if invariant else {}))
    trainer._get_train_sampler = lambda *_: SequentialSampler(trainer.train_dataset)   # rank 0 short, rank 1 long
    losses: list[torch.Tensor] = []
    compute_loss = trainer.compute_loss

    def loss(*args: Any, **kwargs: Any) -> Any:
        value = compute_loss(*args, **kwargs)
        losses.append((value[0] if isinstance(value, tuple) else value).detach().clone())
        return value

    trainer.compute_loss = loss
    with pure_torch_transformers(model), pure_torch_transformers(reference):
        trainer.train()
    torch.save({"world": world, "forwards": steps.forwards, "shapes": steps.shapes, "losses": losses,
                "grads": steps.grads, "logps": steps.logps,
                "guard_records": [r.to_dict() for r in guard.guard.records]}, f"{out}.rank{rank}.pt")
    end_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:3])
    exit_without_finalizing(0)
