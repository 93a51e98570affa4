"""GRPO: a training step of PackedGRPOTrainer against trl.GRPOTrainer's padded step, on the same generations.

    python benchmarks/bench_grpo.py                    # both families, 1 warm-up + 8 timed steps each (1 to 2 min)
    python benchmarks/bench_grpo.py --steps 2 --out /tmp/grpo.json      # a quicker look

For each family (the patched tiny Qwen3-Next, a MoE, and Bamba: vocabulary 128, float32, CPU), the same
TRL run is made twice from the same initial weights and seed: once with ``trl.GRPOTrainer`` (every
log-probability forward on TRL's padded batch: prompts left-padded, completions right-padded to the longest
of the generation batch) and once with ``hybrid_pack.integrations.trl.PackedGRPOTrainer`` (the same forwards
on packed rows of the real tokens; default ``packing_capacity``: each micro-batch in one row).

Generations are fixed by TRL's ``rollout_func``, so both trainers see the same prompts and completions.
Lengths follow the bundled Arena-Hard v2 / Sky-T1-32B table (Qwen3 tokens): each prompt's length is drawn
from ``last_turn_prompt`` and each of its ``--num-generations`` completions' independently from
``last_turn_response``, every length scaled down as ``clip(ceil(n / DIVISOR), 1, 256)`` (``--divisor``,
default 8), so that a step takes seconds on CPU. The bundled tables hold lengths, not token ids, so the
token ids are drawn uniformly from the tiny vocabulary's words (3 to 127); every completion shorter than
256 ends with EOS, a 256-token one is truncated (TRL's ``max_completion_length``), and TRL does not mask it.

A step is one optimizer step as the Hugging Face trainer runs it, timed from ``on_step_begin`` to
``on_step_end`` (wall and process CPU time): the rollout (a table look-up here), the rewards, the advantages,
forward + backward of every micro-batch of the generation batch, clipping and AdamW. Defaults:
``per_device_train_batch_size=16``, ``gradient_accumulation_steps=2`` (TRL's ``steps_per_generation``
follows it: 32 sequences, 4 prompts x 8 generations, generated once per optimizer step, so the old policy's
log-probabilities are not recomputed), ``beta=0`` (TRL's default: no reference model; ``--beta 0.04`` adds its
forward). The first ``--warmup`` steps are not timed; the ratio is the median packed step over the
median padded step. Real-token fractions come from a forward pre-hook on the policy (and the reference
model): real tokens over the tokens of the batch the model receives (TRL's ``attention_mask`` for the padded
trainer; the packed rows' length minus their ``num_pad_tokens``). The steps' losses and entropies from both
trainers are compared (same generations, same weights: they agree to float32 round-off).

Writes ``benchmarks/results/grpo.json`` (``--out``) and prints a markdown table.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import platform
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

import transformers
import trl
from datasets import Dataset

from hybrid_pack.data import load_lengths
from hybrid_pack.integrations.transformers.tiny import (
    VOCAB,
    tiny_model,
    tiny_tokenizer,
)
from hybrid_pack.integrations.trl import PackedGRPOTrainer
from hybrid_pack.schema import ATTENTION_MASK, INPUT_IDS, NUM_PAD_TOKENS
from tests.support.torch_path import pure_torch_transformers

RESULTS = Path(__file__).resolve().parent / "results" / "grpo.json"
FAMILIES = {"qwen3_next": "Qwen3-Next (tiny, MoE)", "bamba": "Bamba (tiny)"}
LENGTH_TABLE = "arena_hard_v2_sky_t1_32b"
MAX_LENGTH = 256
EOS = 1
FIRST_WORD = 3            # tiny_tokenizer: <pad> 0, <eos> 1, <unk> 2, then the words w3 ... w127


def scaled(lengths: np.ndarray, divisor: int) -> np.ndarray:
    """``clip(ceil(n / divisor), 1, MAX_LENGTH)``: Qwen3 lengths scaled down to the benchmark's."""
    return np.clip(np.ceil(lengths / divisor), 1, MAX_LENGTH).astype(np.int64)


def make_rollouts(num_prompts: int, num_generations: int, divisor: int, seed: int,
                  ) -> tuple[list[str], dict[str, list[list[int]]]]:
    """``num_prompts`` prompts (texts of tiny-vocabulary words, distinct) and, for each, its ``num_generations``
    completions (token ids), with Arena-Hard lengths scaled by ``divisor``."""
    table = load_lengths(LENGTH_TABLE)
    rng = np.random.default_rng(seed)
    prompt_lengths = scaled(rng.choice(table["last_turn_prompt"], num_prompts), divisor)
    completion_lengths = scaled(rng.choice(table["last_turn_response"], (num_prompts, num_generations)), divisor)
    prompts, completions = [], {}
    for i, n in enumerate(prompt_lengths):
        while True:                                         # distinct texts: the rollout looks completions up by text
            text = " ".join(f"w{t}" for t in rng.integers(FIRST_WORD, VOCAB, n))
            if text not in completions:
                break
        prompts.append(text)
        completions[text] = []
        for m in completion_lengths[i]:
            ids = rng.integers(FIRST_WORD, VOCAB, m).tolist()
            if m < MAX_LENGTH:
                ids[-1] = EOS                               # finished; a MAX_LENGTH one is truncated
            completions[text].append(ids)
    return prompts, completions


def rollout_func(completions: dict[str, list[list[int]]]) -> Any:
    """TRL's ``rollout_func``: the k-th occurrence of a prompt in the generation batch gets its k-th completion."""

    def rollouts(prompts: list[str], trainer: Any) -> dict[str, Any]:
        tokenizer, seen = trainer.processing_class, {}
        prompt_ids, completion_ids = [], []
        for prompt in prompts:
            k = seen[prompt] = seen.get(prompt, -1) + 1
            prompt_ids.append(tokenizer(prompt)[INPUT_IDS])
            completion_ids.append(completions[prompt][k])
        return {"prompt_ids": prompt_ids, "completion_ids": completion_ids, "logprobs": None}

    return rollouts


def length_reward(completions: list[str], **_: Any) -> list[float]:
    """Any reward that differs within a group (so the advantages are not all zero)."""
    return [float(len(c.split())) for c in completions]


class StepTimer(transformers.TrainerCallback):
    """Wall and CPU seconds of every optimizer step; the token counts of its forwards; progress printed."""

    def __init__(self, label: str, total: int, warmup: int) -> None:
        self.label, self.total, self.warmup = label, total, warmup
        self.steps: list[dict[str, Any]] = []
        self.forwards: list[dict[str, int]] = []

    def record_forward(self, _module: torch.nn.Module, _args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        ids = kwargs[INPUT_IDS]
        if ATTENTION_MASK in kwargs and kwargs[ATTENTION_MASK] is not None:
            real = int(kwargs[ATTENTION_MASK].sum())
        else:
            real = ids.numel() - int(kwargs.get(NUM_PAD_TOKENS) or 0)
        self.forwards.append({"rows": int(ids.shape[0]), "width": int(ids.shape[1]), "tokens": ids.numel(),
                              "real": real})

    def on_step_begin(self, *_: Any, **__: Any) -> None:
        self.forwards_before = len(self.forwards)
        self.wall, self.cpu = time.perf_counter(), time.process_time()

    def on_step_end(self, *_: Any, **__: Any) -> None:
        wall, cpu = time.perf_counter() - self.wall, time.process_time() - self.cpu
        forwards = self.forwards[self.forwards_before:]
        step = len(self.steps)
        self.steps.append({"wall_s": wall, "cpu_s": cpu, "timed": step >= self.warmup, "forwards": forwards})
        kind = "warm-up" if step < self.warmup else "timed"
        print(f"  {self.label}: step {step + 1}/{self.total} ({kind}) {wall:.2f} s wall, {cpu:.2f} s CPU, "
              f"{len(forwards)} forwards, {sum(f['real'] for f in forwards):,} real of "
              f"{sum(f['tokens'] for f in forwards):,} tokens", flush=True)


def run_trainer(trainer_class: type, family: str, prompts: list[str], completions: dict[str, list[list[int]]],
                args: argparse.Namespace, folder: Path) -> dict[str, Any]:
    """One run of ``trainer_class``: ``warmup + steps`` optimizer steps; its timings, tokens, losses, entropies."""
    label = f"{family} {'packed' if trainer_class is PackedGRPOTrainer else 'padded'}"
    saved = folder / f"{family}_init"
    if not (saved / "config.json").exists():
        tiny_model(family).save_pretrained(saved)              # the reference model (beta > 0) loads from here
    model = tiny_model(family).train()
    model.config._name_or_path = str(saved)
    config = trl.GRPOConfig(
        output_dir=str(folder / "out"), per_device_train_batch_size=args.batch_size,
        gradient_accumulation_steps=args.grad_accum, num_generations=args.num_generations,
        max_completion_length=MAX_LENGTH, max_steps=args.warmup + args.steps, learning_rate=args.learning_rate,
        beta=args.beta, use_cpu=True, bf16=False, report_to=[], save_strategy="no", disable_tqdm=True,
        logging_steps=1, seed=args.seed)
    extra = {} if trainer_class is trl.GRPOTrainer else {"packing_capacity": args.capacity}
    trainer = trainer_class(model=model, reward_funcs=length_reward, args=config,
                            train_dataset=Dataset.from_dict({"prompt": prompts}), processing_class=tiny_tokenizer(),
                            rollout_func=rollout_func(completions), **extra)
    timer = StepTimer(label, args.warmup + args.steps, args.warmup)
    trainer.remove_callback(transformers.PrinterCallback)     # TRL's metrics every step: StepTimer prints instead
    trainer.add_callback(timer)
    trainer.model.register_forward_pre_hook(timer.record_forward, with_kwargs=True, prepend=True)
    if trainer.ref_model is not None:
        trainer.ref_model.register_forward_pre_hook(timer.record_forward, with_kwargs=True, prepend=True)
    with pure_torch_transformers(model):
        trainer.train()
    logs = [entry for entry in trainer.state.log_history if "loss" in entry]
    timed = [s for s in timer.steps if s["timed"]]
    forwards = [f for s in timed for f in s["forwards"]]
    return {
        "trainer": trainer_class.__name__,
        "step_wall_s": [s["wall_s"] for s in timed],
        "step_cpu_s": [s["cpu_s"] for s in timed],
        "warmup_wall_s": [s["wall_s"] for s in timer.steps if not s["timed"]],
        "median_step_wall_s": statistics.median(s["wall_s"] for s in timed),
        "median_step_cpu_s": statistics.median(s["cpu_s"] for s in timed),
        "forwards_per_step": len(forwards) / len(timed),
        "real_tokens": sum(f["real"] for f in forwards),
        "batch_tokens": sum(f["tokens"] for f in forwards),
        "real_token_fraction": sum(f["real"] for f in forwards) / sum(f["tokens"] for f in forwards),
        "forward_shapes": [[f["rows"], f["width"]] for f in forwards],
        "losses": [entry["loss"] for entry in logs],
        "entropies": [entry.get("entropy") for entry in logs],
    }


def run_family(family: str, args: argparse.Namespace, folder: Path) -> dict[str, Any]:
    steps = args.warmup + args.steps
    generation_batch = args.batch_size * args.grad_accum
    prompts, completions = make_rollouts(steps * generation_batch // args.num_generations, args.num_generations,
                                         args.divisor, args.seed)
    print(f"{FAMILIES[family]}: {len(prompts)} prompts x {args.num_generations} generations", flush=True)
    padded = run_trainer(trl.GRPOTrainer, family, prompts, completions, args, folder)
    packed = run_trainer(PackedGRPOTrainer, family, prompts, completions, args, folder)
    prompt_lengths = [len(p.split()) for p in prompts]
    completion_lengths = [len(c) for p in prompts for c in completions[p]]
    entropy_diffs = [abs(a - b) for a, b in zip(padded["entropies"], packed["entropies"], strict=True)
                     if a is not None and b is not None]
    return {
        "family": family, "name": FAMILIES[family],
        "prompt_tokens": {"mean": float(np.mean(prompt_lengths)), "max": max(prompt_lengths)},
        "completion_tokens": {"mean": float(np.mean(completion_lengths)), "max": max(completion_lengths),
                              "truncated": sum(n == MAX_LENGTH for n in completion_lengths)},
        "padded": padded, "packed": packed,
        "step_time_ratio_wall": packed["median_step_wall_s"] / padded["median_step_wall_s"],
        "step_time_ratio_cpu": packed["median_step_cpu_s"] / padded["median_step_cpu_s"],
        "median_per_step_ratio_wall": statistics.median(
            a / b for a, b in zip(packed["step_wall_s"], padded["step_wall_s"], strict=True)),
        "max_loss_diff": max(abs(a - b) for a, b in zip(padded["losses"], packed["losses"], strict=True)),
        "max_entropy_diff": max(entropy_diffs) if entropy_diffs else math.nan,
    }


def markdown(results: dict[str, Any]) -> str:
    lines = ["| family | real tokens / padded tokens (TRL) | real / packed-row tokens | padded step s (wall / CPU) "
             "| packed step s (wall / CPU) | packed / padded (wall) | packed / padded (CPU) | loss diff |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in results["families"]:
        pad, pack = r["padded"], r["packed"]
        lines.append(f"| {r['name']} | {pad['real_token_fraction']:.3f} | {pack['real_token_fraction']:.3f} | "
                     f"{pad['median_step_wall_s']:.2f} / {pad['median_step_cpu_s']:.2f} | "
                     f"{pack['median_step_wall_s']:.2f} / {pack['median_step_cpu_s']:.2f} | "
                     f"**{r['step_time_ratio_wall']:.2f}** | {r['step_time_ratio_cpu']:.2f} | "
                     f"{r['max_loss_diff']:.1e} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--families", nargs="+", default=list(FAMILIES), choices=list(FAMILIES))
    parser.add_argument("--steps", type=int, default=8, help="timed optimizer steps per trainer (default 8)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed optimizer steps first (default 1)")
    parser.add_argument("--divisor", type=int, default=8,
                        help="Arena-Hard lengths scaled as clip(ceil(n / DIVISOR), 1, 256) (default 8)")
    parser.add_argument("--batch-size", type=int, default=16, help="per_device_train_batch_size (default 16)")
    parser.add_argument("--grad-accum", type=int, default=2,
                        help="gradient_accumulation_steps = TRL's steps_per_generation (default 2)")
    parser.add_argument("--num-generations", type=int, default=8, help="completions per prompt (default 8)")
    parser.add_argument("--beta", type=float, default=0.0, help="KL coefficient; > 0 adds a reference model")
    parser.add_argument("--capacity", type=int, default=None,
                        help="PackedGRPOTrainer's packing_capacity (default: each micro-batch in one row)")
    parser.add_argument("--learning-rate", type=float, default=1e-5)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    if (args.batch_size * args.grad_accum) % args.num_generations:
        parser.error("--batch-size x --grad-accum must be a multiple of --num-generations")

    torch.set_num_threads(args.threads)
    logging.disable(logging.WARNING)
    warnings.simplefilter("ignore")
    transformers.utils.logging.disable_progress_bar()
    load_before = os.getloadavg()[0]
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as folder:
        families = [run_family(family, args, Path(folder)) for family in args.families]
    results = {
        "benchmark": "GRPO optimizer step: PackedGRPOTrainer (packed rows) against trl.GRPOTrainer (padded), "
                     "same generations",
        "command": "python benchmarks/bench_grpo.py " + " ".join(sys.argv[1:]),
        "timing": "median over the timed steps of one optimizer step (on_step_begin to on_step_end), wall and "
                  "process CPU seconds; the warm-up steps are not timed",
        "lengths": f"{LENGTH_TABLE}: last_turn_prompt / last_turn_response, clip(ceil(n / {args.divisor}), 1, "
                   f"{MAX_LENGTH})",
        "settings": {"per_device_train_batch_size": args.batch_size, "gradient_accumulation_steps": args.grad_accum,
                     "num_generations": args.num_generations, "max_completion_length": MAX_LENGTH,
                     "beta": args.beta, "packing_capacity": args.capacity, "learning_rate": args.learning_rate,
                     "steps": args.steps, "warmup": args.warmup, "divisor": args.divisor, "threads": args.threads,
                     "seed": args.seed, "dtype": "float32"},
        "machine": {"platform": platform.platform(), "processor": platform.processor() or platform.machine(),
                    "cpus": os.cpu_count(), "python": platform.python_version(), "torch": torch.__version__,
                    "transformers": transformers.__version__, "trl": trl.__version__,
                    "load_average": [load_before, os.getloadavg()[0]]},
        "seconds": time.perf_counter() - started,
        "families": families,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=1) + "\n")
    print(markdown(results))
    print(f"wrote {args.out} in {results['seconds']:.0f} s")


if __name__ == "__main__":
    main()
