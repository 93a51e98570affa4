"""``hybrid-pack bench``: packed against padded training throughput on bundled GSM8K.

The padded baseline trains the same example groups, in the same order, padded to their longest
(what ``DataCollatorWithPadding`` does), so both runs do the same optimisation and only the
padding differs. Target: packed real tokens/s / padded real tokens/s >= 0.9 x (padded tokens /
real tokens).
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
    target = 0.9 * m["padded_tokens_ratio"]
    return {"model": model, "device": m["device"], "dtype": m["dtype"], "steps": m["steps"],
            "packed_tokens_per_second": m["tokens_per_second"],
            "padded_tokens_per_second": m["padded_tokens_per_second"],
            "padded_tokens_per_real_token": m["padded_tokens_ratio"], "speedup": m["speedup"],
            "target_speedup": target, "meets_target": m["speedup"] >= target,
            "losses_agree": m["losses_agree"], "max_loss_rel_diff": m["max_loss_rel_diff"]}
