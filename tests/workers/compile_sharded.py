"""One rank of the compiled-blocks proofs in tests/parallel/test_compile_sharded.py (launched by torchrun, gloo).

Each case trains two copies of one model for a few SGD steps on static batches of one ``(L, M)`` and a new
document layout at every step: one copy with its decoder blocks compiled (:func:`compile_blocks`, inductor), the
other eager. Losses, this rank's parameter gradients and the parameters after each step must agree (fp32, 1e-5),
and everything must compile in the first step: later steps run under ``error_on_recompile`` and the count of
graphs (``counters["stats"]["unique_graphs"]``) may not grow after the first step.

- ``fsdp``: ``qwen3-next-tiny`` sharded with FSDP2 over the ranks (blocks compiled before ``fully_shard``), each
  rank its own rows;
- ``context_parallel``: a ``"GMA"`` model (all four ops) on the same row split across the ranks by
  ``shard_batch``, with documents crossing the rank edge.

Rank 0 writes ``{"verdicts": {case: "ok" or the failure}, "graphs": {case: count}}`` as JSON to ``sys.argv[1]``;
``sys.argv[2:]`` names the cases to run (default all).

    python -m torch.distributed.run --nproc_per_node 2 tests/workers/compile_sharded.py OUT.json [CASE ...]
"""

from __future__ import annotations

import copy
import sys
from collections.abc import Callable, Iterator
from datetime import timedelta

import torch
import torch._dynamo
import torch.distributed as dist
from torch import nn
from torch._dynamo.utils import counters
from torch.distributed.device_mesh import init_device_mesh

from hybrid_pack import PackingCollator
from hybrid_pack.distributed import end_process_group
from hybrid_pack.modeling import HybridConfig, HybridForCausalLM, from_preset
from hybrid_pack.parallel import shard_batch
from hybrid_pack.parallel.compile import compile_blocks
from hybrid_pack.parallel.fsdp import apply_fsdp
from hybrid_pack.schema import INPUT_IDS
from tests.kit import assert_close
from tests.workers.launch import exit_without_finalizing, run_cases, write_on_rank0

PACK_LENGTH, MAX_DOCUMENTS = 64, 8
TOLERANCE = 1e-5  # fp32: inductor fuses what eager runs op by op
LR = 0.05
FSDP_LAYOUTS = [(64,), (30, 34), (7, 20, 30), (1, 2, 3, 4, 5), (9, 9, 9, 9, 9, 9)]
"""Rank r's row at step s is ``FSDP_LAYOUTS[(s + r) % 5]``: 1 to 6 documents, with and without padding."""
CP_LAYOUTS = [(64,), (30, 34), (7, 20, 30), (1, 31, 1, 31), (3, 40, 2, 5), (32, 32)]
"""One row on every rank, split at token 32: a document crosses the edge in all but the last."""
CP_CONFIG = HybridConfig(vocab_size=512, hidden_size=64, layer_pattern="GMA", intermediate_size=128,
                         mamba_head_dim=32, mamba_state_size=16, mamba_chunk_size=16)


def documents(lengths: tuple[int, ...], vocab_size: int, seed: int) -> list[dict[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(seed)
    return [{INPUT_IDS: torch.randint(1, vocab_size, (n,), generator=generator)} for n in lengths]


def local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of a parameter or gradient (an FSDP2 DTensor's shard, a plain tensor itself)."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def train_and_compare(compiled: nn.Module, eager: nn.Module, batches: Iterator[tuple[str, dict]]) -> int:
    """SGD steps of both models on each ``(name, batch)``; raise on a difference or a compilation after the first
    step; return the graphs compiled."""
    torch._dynamo.reset()
    counters.clear()
    optimizers = [torch.optim.SGD(model.parameters(), lr=LR) for model in (compiled, eager)]
    graphs = None
    for step, (name, batch) in enumerate(batches):
        results = []
        with torch._dynamo.config.patch(error_on_recompile=step > 0):
            for model, optimizer in zip((compiled, eager), optimizers):
                optimizer.zero_grad(set_to_none=True)
                loss = model(**batch).loss
                loss.backward()
                grads = {key: local(p.grad).clone() for key, p in model.named_parameters() if p.grad is not None}
                optimizer.step()
                results.append((loss.detach(), grads, {key: local(p).detach().clone()
                                                       for key, p in model.named_parameters()}))
        (loss, grads, params), (expected_loss, expected_grads, expected_params) = results
        assert_close(loss, expected_loss, f"loss {name}", tol=TOLERANCE)
        assert grads.keys() == expected_grads.keys(), f"{name}: gradients of {sorted(grads.keys() ^ expected_grads)}"
        for key, grad in grads.items():
            assert_close(grad, expected_grads[key], f"d{key} {name}", tol=TOLERANCE)
        for key, param in params.items():
            assert_close(param, expected_params[key], f"{key} after {name}", tol=TOLERANCE)
        if graphs is None:
            graphs = counters["stats"]["unique_graphs"]
            assert graphs > 0, "the first step compiled nothing"
    assert counters["stats"]["unique_graphs"] == graphs, (
        f"{counters['stats']['unique_graphs'] - graphs} graphs compiled after the first step")
    return graphs


def fsdp(rank: int, world: int) -> int:
    torch.manual_seed(0)
    eager = from_preset("qwen3-next-tiny")
    compiled = compile_blocks(copy.deepcopy(eager))
    mesh = init_device_mesh("cpu", (world,))
    for model in (compiled, eager):
        apply_fsdp(model, mesh)
    collator = PackingCollator(pack_length=PACK_LENGTH, max_documents=MAX_DOCUMENTS)
    lengths = [FSDP_LAYOUTS[(step + rank) % len(FSDP_LAYOUTS)] for step in range(len(FSDP_LAYOUTS))]
    vocab = eager.config.vocab_size
    return train_and_compare(compiled, eager, ((f"step {step} {row}", collator(documents(row, vocab, 10 * step + rank)))
                                               for step, row in enumerate(lengths)))


def context_parallel(rank: int, world: int) -> int:
    torch.manual_seed(0)
    eager = HybridForCausalLM(CP_CONFIG)
    compiled = compile_blocks(copy.deepcopy(eager))
    collator = PackingCollator(pack_length=PACK_LENGTH, max_documents=MAX_DOCUMENTS)
    return train_and_compare(compiled, eager, ((f"{row}", shard_batch(collator(documents(row, 512, step))))
                                               for step, row in enumerate(CP_LAYOUTS)))


CASES: dict[str, Callable[[int, int], int]] = {"fsdp": fsdp, "context_parallel": context_parallel}


def main(out_path: str, names: list[str]) -> None:
    dist.init_process_group("gloo", timeout=timedelta(seconds=120))  # a case that hangs fails instead
    world = dist.get_world_size()
    graphs: dict[str, int] = {}  # a passed case's count of graphs on this rank

    def counted(name: str) -> Callable[[int], None]:
        return lambda rank: graphs.update({name: CASES[name](rank, world)})

    verdicts = run_cases({name: counted(name) for name in CASES if not names or name in names})
    write_on_rank0(out_path, {"verdicts": verdicts, "graphs": graphs})
    end_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
    exit_without_finalizing(0)
