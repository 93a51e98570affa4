"""Packed training inside Hugging Face ``Trainer``: the qwen3-next-tiny preset on bundled GSM8K.

    python examples/hf_trainer.py [--examples 64] [--max-steps 4] [--out runs/hf_trainer]

``PackedTrainer`` feeds ``Trainer`` packed rows (``PackedBatchSampler`` + ``PackingCollator``); the
model reads the boundary keys of each row, so no document sees another. Works unchanged under
``torchrun``.
"""

from __future__ import annotations

import argparse

from transformers import TrainingArguments

from hybrid_pack.integrations.transformers.trainer import PackedTrainer
from hybrid_pack.modeling import from_preset
from hybrid_pack.training.data import build_features, load_chats


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--examples", type=int, default=64)
    parser.add_argument("--max-steps", type=int, default=4)
    parser.add_argument("--capacity", type=int, default=2048)
    parser.add_argument("--out", default="runs/hf_trainer")
    args = parser.parse_args(argv)

    model = from_preset("qwen3-next-tiny")
    features, _ = build_features(load_chats("gsm8k", args.examples), model.config.vocab_size,
                                 max_length=args.capacity)
    training_args = TrainingArguments(args.out, max_steps=args.max_steps, per_device_train_batch_size=1,
                                      learning_rate=3e-3, report_to=[], use_cpu=True, save_strategy="no",
                                      logging_steps=1, disable_tqdm=True)
    trainer = PackedTrainer(model=model, args=training_args, train_dataset=features,
                            lengths=[len(f["input_ids"]) for f in features], capacity=args.capacity)
    result = trainer.train()
    losses = [log["loss"] for log in trainer.state.log_history if "loss" in log]
    print(f"trained {result.global_step} packed steps; loss {losses[0]:.3f} -> {losses[-1]:.3f}")
    return {"steps": result.global_step, "losses": losses}


if __name__ == "__main__":
    main()
