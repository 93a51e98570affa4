"""One rank of the sharded-guard checks in tests/testing/test_guard_distributed.py (run by torch.distributed.run).

``qwen3-next-tiny`` sharded with FSDP2 (``apply_fsdp``: every decoder block and the root), the guard attached
with ``every=1, documents=3``, a few optimizer steps on packed rows whose document count depends on the rank.
Then the harness on the same model (``check_training_step``), rank 0's batch holding one document, rank 1's
six. Writes ``{"records": [...], "error": ..., "harness": {"ok", "leak_rank", ...}}`` to ``OUT.rank<r>.json``.

    python -m torch.distributed.run --nproc_per_node 2 tests/workers/dist_guard.py OUT SCENARIO

Scenarios:
    uneven: rank r's rows hold ``DOCUMENTS[r]`` documents each (1, 2 and 6 over three steps, rotated per rank).
    leak: every layer's input gets a little of the previous token (across documents): a leak that only a row
        with two documents or more can show; rank 0's rows hold one document, rank 1's several. After the
        error, one more call with a guard that warns (``action="warn"``).
"""

from __future__ import annotations

import datetime
import json
import sys
import time
import warnings

import torch
import torch.distributed as dist

from hybrid_pack import PackedBoundaries
from hybrid_pack.distributed import end_process_group
from hybrid_pack.errors import IsolationError
from hybrid_pack.modeling import from_preset
from hybrid_pack.parallel.fsdp import apply_fsdp
from hybrid_pack.testing import IsolationWarning, PackingGuard, check_training_step
from tests.workers.launch import exit_without_finalizing

TOKENS = 48
STEPS = 3
DOCUMENTS = {"uneven": [[1, 2, 6], [6, 1, 2]], "leak": [[1, 1, 1], [4, 4, 4]]}


def row(documents: int, step: int, vocab: int) -> dict:
    """A packed row of ``TOKENS`` tokens split into ``documents`` documents of uneven lengths."""
    generator = torch.Generator().manual_seed(100 * step + documents)
    cuts = sorted(torch.randperm(TOKENS - 1, generator=generator)[:documents - 1].add(1).tolist())
    lengths = [b - a for a, b in zip([0, *cuts], [*cuts, TOKENS], strict=True)]
    ids = torch.randint(0, vocab, (1, TOKENS), generator=generator)
    return {"input_ids": ids, "labels": ids.clone(), **PackedBoundaries.from_lengths(lengths).hf_kwargs()}


def previous_token_leak(module: torch.nn.Module, args: tuple) -> tuple:
    hidden, *rest = args
    return (hidden + 0.5 * hidden.roll(1, dims=1), *rest)


def main(out: str, scenario: str) -> None:
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = from_preset("qwen3-next-tiny")
    if scenario == "leak":
        for layer in model.model.layers:
            layer.register_forward_pre_hook(previous_token_leak)
    apply_fsdp(model, torch.distributed.device_mesh.init_device_mesh("cpu", (dist.get_world_size(),)))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    guard = PackingGuard(model, every=1, documents=3, localize=scenario == "leak").attach()
    result: dict = {"error": None}
    began = time.perf_counter()
    try:
        for step in range(STEPS):
            guard.step = step
            loss = model(**row(DOCUMENTS[scenario][rank][step], step, model.config.vocab_size)).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
    except IsolationError as error:
        result["error"] = str(error)
    result["seconds"] = time.perf_counter() - began
    result["records"] = [r.to_dict() for r in guard.records]
    guard.detach()
    if scenario == "leak":
        with PackingGuard(model, every=1, action="warn"), warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            model(**row(DOCUMENTS[scenario][rank][0], 0, model.config.vocab_size))
        result["warnings"] = [str(w.message) for w in caught if issubclass(w.category, IsolationWarning)]
    report = check_training_step(model, row(1 + 5 * rank, STEPS, model.config.vocab_size))
    result["harness"] = {"ok": report.ok, "error": report.error, "documents": len(report.documents),
                         "leak_rank": report.layouts[0].leak_rank, "module": report.first_leaking_module}
    with open(f"{out}.rank{rank}.json", "w") as f:
        json.dump(result, f)
    end_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
    exit_without_finalizing(0)
