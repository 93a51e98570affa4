"""One rank of the two-process check in tests/training/test_distributed.py (launched with torch.distributed.run).

Every rank feeds a DDP model from ``DataLoader(batch_sampler=PackedBatchSampler(...),
collate_fn=PackingCollator())`` for two epochs, recovers the example indices from the collated
batches (token ids encode the example index), checks an interrupted-and-resumed epoch, and
all-gathers what it saw; rank 0 writes the gathered record as JSON to ``sys.argv[1]``.
"""

from __future__ import annotations

import json
import os
import sys

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader

from hybrid_pack import PackedBoundaries, PackingCollator, packed_loss
from hybrid_pack.distributed import end_process_group
from hybrid_pack.packing import PackedBatchSampler
from tests.workers.launch import exit_without_finalizing

NUM_EXAMPLES = 400
CAPACITY = 256
PACKS_PER_STEP = 2
SEED = 3


def example_indices(batch: dict) -> list[int]:
    """Token ids are the example index, so the first token of every document names it."""
    starts = batch["cu_seq_lens_q"][:-1].long()
    return batch["input_ids"][0, starts].tolist()


def make_sampler(lengths: np.ndarray, rank: int, world_size: int) -> PackedBatchSampler:
    return PackedBatchSampler(lengths, CAPACITY, num_replicas=world_size, rank=rank, seed=SEED,
                              packs_per_step=PACKS_PER_STEP)


def main(out_path: str) -> None:
    dist.init_process_group("gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    lengths = np.random.default_rng(0).integers(1, 200, NUM_EXAMPLES)
    dataset = [{"input_ids": [i] * int(n)} for i, n in enumerate(lengths)]

    torch.manual_seed(0)
    model = DistributedDataParallel(torch.nn.Sequential(torch.nn.Embedding(NUM_EXAMPLES, 8),
                                                        torch.nn.Linear(8, NUM_EXAMPLES)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    sampler = make_sampler(lengths, rank, world_size)
    loader = DataLoader(dataset, batch_sampler=sampler, collate_fn=PackingCollator())

    record: dict = {"epochs": [], "losses_finite": True, "len": len(loader)}
    for epoch in range(2):
        sampler.set_epoch(epoch)
        seen = []
        for batch in loader:
            seen.append(example_indices(batch))
            loss = packed_loss(model(batch["input_ids"]), batch["labels"],
                               boundaries=PackedBoundaries.from_batch(batch))
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            record["losses_finite"] &= bool(torch.isfinite(loss))
        record["epochs"].append(seen)

    interrupted = make_sampler(lengths, rank, world_size)
    interrupted.set_epoch(1)
    head = [example_indices(b) for _, b in zip(range(3), DataLoader(dataset, batch_sampler=interrupted,
                                                                     collate_fn=PackingCollator()))]
    resumed = make_sampler(lengths, rank, world_size)
    resumed.load_state_dict(json.loads(json.dumps(interrupted.state_dict())))
    resumed.set_epoch(1)
    tail = [example_indices(b) for b in DataLoader(dataset, batch_sampler=resumed, collate_fn=PackingCollator())]
    record["resumed_matches"] = head + tail == record["epochs"][1]

    gathered = [None] * world_size
    dist.all_gather_object(gathered, record)
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump({"world_size": world_size, "num_examples": NUM_EXAMPLES, "ranks": gathered}, f)
    end_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main(sys.argv[1])
    exit_without_finalizing(0)
