"""``hybrid-pack bench``: packed against padded training throughput on bundled GSM8K.

The padded baseline trains the same examples from the same initial weights, shuffled in dataset
order, in batches of the mean pack's example count padded to their longest (what
``DataCollatorWithPadding`` does). Target: packed real tokens/s / padded real tokens/s >= 0.9 x (padded
tokens / real tokens) on CPU, 0.95 x on CUDA (bf16), where peak memory is also reported
(:func:`~hybrid_pack.training.comparison.target_factor`); the verdict says when the run was too short to judge.
"""

from __future__ import annotations

import tempfile
from typing import Any

from hybrid_pack.training.config import TrainConfig
from hybrid_pack.training.trainer import train


def run_benchmark(model: str = "qwen3-next-tiny", steps: int = 5, capacity: int = 2048,
                  device: str | None = None) -> dict[str, Any]:
    """Train ``steps`` packed steps and the same examples padded; return the throughput comparison."""
    examples = steps * capacity // 180 + 8
    with tempfile.TemporaryDirectory() as out:
        m = train(TrainConfig(model=model, out=out, capacity=capacity, max_examples=examples, max_steps=steps,
                              compare_padded=True, progress=False, device=device))
    return {"model": model, "device": m["device"], "dtype": m["dtype"], "steps": m["steps"],
            "timed_steps": m["timed_steps"],
            "packed_tokens_per_second": m["tokens_per_second"],
            "padded_tokens_per_second": m["padded_tokens_per_second"],
            "padded_tokens_per_real_token": m["padded_tokens_ratio"], "speedup": m["speedup"],
            "target_speedup": m["target_speedup"], "meets_target": m["speedup_meets_target"],
            "verdict": m["speedup_verdict"],
            "peak_memory_bytes": m["peak_memory_bytes"], "padded_peak_memory_bytes": m["padded_peak_memory_bytes"],
            "losses_agree": m["losses_agree"], "same_batch_loss_rel_diff": m["same_batch_loss_rel_diff"],
            "final_loss_rel_diff": m["final_loss_rel_diff"]}
