"""One rank of tests/integrations/test_trl_ranks.py (run by torch.distributed.run, gloo on CPU, or alone).

One step of ``PackedGRPOTrainer(packing_capacity=64)`` on tiny Bamba, accelerate's multi-CPU data parallelism
(DDP over gloo) with ``PackingGuardCallback(every=1, action="warn")``. The global batch is two prompts with four
generations each (fixed completions, TRL's ``rollout_func``), unshuffled: on two ranks rank 0 gets the short
prompt with short completions (one packed row per call), rank 1 the long one (three rows), so without agreeing
on the row count the ranks make different numbers of forwards. ``num_iterations=2`` makes TRL compute the old
policy's log-probabilities (a call under ``no_grad``) before the policy's in the loss. Alone, one process takes the
whole global batch.

Then, on two ranks, direct calls of the log-probability method with a different number of sequences per rank:
rank 0's include a sequence without a real token (a chunk of its own) and, in a second call, nothing but such
sequences; rank 1's are long. The first call runs under autograd and is backpropagated (DDP's all-reduce).

Writes ``OUT.rank<r>.pt``: ``{"world", "step_forwards", "direct_forwards", "losses", "grads", "empty_logps",
"guard_records", "guard_warnings"}``; forwards are counted per call of the log-probability method, the guard's own
replays left out.

    python -m torch.distributed.run --nproc_per_node 2 tests/workers/trl_rl_ranks.py OUT
"""

from __future__ import annotations

import logging
import os
import sys
import warnings
from typing import Any

import torch
from datasets import Dataset
from transformers import TrainerCallback
from trl import GRPOConfig

from hybrid_pack.distributed import end_process_group
from hybrid_pack.integrations.transformers.guard import PackingGuardCallback
from hybrid_pack.integrations.transformers.tiny import tiny_model, tiny_tokenizer
from hybrid_pack.integrations.trl import PackedGRPOTrainer
from hybrid_pack.testing import IsolationWarning
from tests.support.torch_path import pure_torch_transformers
from tests.workers.launch import exit_without_finalizing

EOS = 1
CAPACITY = 64
GENERATIONS = 4
SHORT = "w3 w4"                                              # 2 tokens
LONG = " ".join(f"w{i}" for i in range(10, 30))              # 20 tokens
COMPLETIONS = {                                             # the k-th generation of each prompt
    SHORT: [[5, EOS], [6], [7, 8, EOS], [9, 10, 11]],
    LONG: [[40 + j for j in range(12)] + [EOS], list(range(60, 76)), [80, 81, 82, 83, 84, 85, EOS],
           list(range(90, 108))],
}
MAX_COMPLETION = 18


def rollouts(prompts: list[str], trainer: Any) -> dict[str, Any]:
    """Fixed completions: the k-th occurrence of a prompt in this rank's batch gets its k-th completion."""
    seen: dict[str, int] = {}
    completions = []
    for prompt in prompts:
        completions.append(COMPLETIONS[prompt][seen.get(prompt, 0) % GENERATIONS])
        seen[prompt] = seen.get(prompt, 0) + 1
    tokenizer = trainer.processing_class
    return {"prompt_ids": [tokenizer(p)["input_ids"] for p in prompts], "completion_ids": completions,
            "logprobs": None}


def reward(completions: list[str], **_: Any) -> list[float]:
    return [float(len(c)) for c in completions]


class Forwards(TrainerCallback):
    """Counts the model's forwards that are not nested in another (the guard's replays run inside the checked
    call's forward hook, so they are left out); grads before the optimizer step. Attached at ``on_train_begin``
    after the guard's callback, so its post-hook runs after the guard's checks."""

    def __init__(self) -> None:
        self.count, self.depth = 0, 0
        self.grads: dict[str, torch.Tensor] = {}

    def attach(self, model: torch.nn.Module) -> None:
        def before(*_: Any) -> None:
            self.count += self.depth == 0
            self.depth += 1

        def after(*_: Any) -> None:
            self.depth -= 1

        model.register_forward_pre_hook(before)
        model.register_forward_hook(after, always_call=True)

    def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
        self.attach(model)

    def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
        self.grads = {name: p.grad.detach().clone() for name, p in model.named_parameters() if p.grad is not None}


def record_calls(trainer: Any, counter: Forwards) -> tuple[list[int], list[torch.Tensor]]:
    """Forwards per call of the trainer's log-probability method, and every loss."""
    forwards: list[int] = []
    losses: list[torch.Tensor] = []
    logps_method, loss_method = trainer._get_per_token_logps_and_entropies, trainer.compute_loss

    def logps(*args: Any, **kwargs: Any) -> Any:
        before = counter.count
        out = logps_method(*args, **kwargs)
        forwards.append(counter.count - before)
        return out

    def loss(*args: Any, **kwargs: Any) -> Any:
        out = loss_method(*args, **kwargs)
        losses.append(out.detach().clone())
        return out

    trainer._get_per_token_logps_and_entropies, trainer.compute_loss = logps, loss
    return forwards, losses


def direct_calls(trainer: Any, rank: int, counter: Forwards) -> tuple[list[int], torch.Tensor]:
    """The log-probability method on rank-dependent batches (see the module docstring); forwards per call and
    rank 0's log-probabilities of the call whose every sequence is empty."""
    g = torch.Generator().manual_seed(rank)
    width, keep = 30, 12
    if rank == 0:
        ids = torch.randint(3, 128, (3, width), generator=g)
        mask = torch.zeros(3, width, dtype=torch.long)
        mask[0, 14:22] = 1                                   # TRL's layout: prompt left-, completion right-padded
        mask[2, 13:18] = 1                                   # a prompt without completion; sequence 1: no real token
        calls = [(ids, mask, 1), (ids[:2], torch.zeros(2, width, dtype=torch.long), 1)]
    else:
        ids = torch.randint(3, 128, (6, width), generator=g)
        mask = torch.ones(6, width, dtype=torch.long)
        calls = [(ids, mask, 2), (ids[:4], mask[:4], 2)]
    forwards, empty = [], torch.empty(0)
    model, method = trainer.model_wrapped, type(trainer)._get_per_token_logps_and_entropies   # not recorded
    for i, (call_ids, call_mask, batch_size) in enumerate(calls):
        before = counter.count
        with torch.set_grad_enabled(i == 0):
            logps, _, _ = method(trainer, model, call_ids, call_mask, keep, batch_size)
        if i == 0:
            logps.sum().backward()
        else:
            empty = logps.detach()
        forwards.append(counter.count - before)
    return forwards, empty


def main(out: str) -> None:
    os.environ["TRL_EXPERIMENTAL_SILENCE"] = "1"
    logging.disable(logging.WARNING)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    torch.manual_seed(0)
    model = tiny_model("bamba").train()
    counter = Forwards()
    guard = PackingGuardCallback(every=1, action="warn")
    config = GRPOConfig(output_dir=f"{out}.trainer", per_device_train_batch_size=2 * GENERATIONS // world,
                        num_generations=GENERATIONS, max_completion_length=MAX_COMPLETION, max_steps=1,
                        learning_rate=0.1, optim="sgd", max_grad_norm=0.0, beta=0.0, num_iterations=2,
                        shuffle_dataset=False, use_cpu=True, bf16=False, ddp_backend="gloo", ddp_timeout=120,
                        report_to=[], save_strategy="no", disable_tqdm=True, logging_steps=1, seed=0)
    trainer = PackedGRPOTrainer(model=model, reward_funcs=reward, args=config,
                                train_dataset=Dataset.from_dict({"prompt": [SHORT, LONG]}),
                                processing_class=tiny_tokenizer(), rollout_func=rollouts,
                                packing_capacity=CAPACITY, callbacks=[guard, counter])
    step_forwards, losses = record_calls(trainer, counter)
    with warnings.catch_warnings(record=True) as caught, pure_torch_transformers(model):
        warnings.simplefilter("always")
        trainer.train()
        direct_forwards, empty = direct_calls(trainer, rank, counter) if world > 1 else ([], torch.empty(0))
    torch.save({"world": world, "step_forwards": step_forwards, "direct_forwards": direct_forwards,
                "losses": losses, "grads": counter.grads, "empty_logps": empty,
                "guard_records": [r.to_dict() for r in guard.guard.records],
                "guard_warnings": [str(w.message) for w in caught if issubclass(w.category, IsolationWarning)]},
               f"{out}.rank{rank}.pt")
    end_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
    exit_without_finalizing(0)
