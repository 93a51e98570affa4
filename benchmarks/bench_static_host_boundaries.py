"""What a static batch's host entry saves (docs/api.md §9, §9b): boundaries built from ``host_boundaries`` against
read from the batch's tensors.

    python benchmarks/bench_static_host_boundaries.py [--documents 64] [--calls 2000] [--repeats 5]
        [--out benchmarks/results/static_host_boundaries.json]

One static row (``PackingCollator(pack_length=L, max_documents=M)``) of ``--documents`` documents of 1 to 255
tokens. Timed on the host, best of ``--repeats`` runs of ``--calls`` calls:

- an eager step's ``PackedBoundaries.from_batch`` with the batch's ``StaticHostBoundaries`` and without it;
- a kernel's compiled node building its layout (``hybrid_pack.ops.library._packed_boundaries``, its per-row cache
  cleared before each call) from the host copy and from ``cu_seqlens``.

Each way's reads of tensor values are counted too (``tests/test_host_reads.py``'s counter): on an accelerator every
read of a batch tensor is a device-to-host copy that waits for the queue, which no CPU timing shows.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import timeit
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # tests: the host-read counter

from hybrid_pack import PackedBoundaries, PackingCollator
from hybrid_pack.ops import library
from hybrid_pack.schema import CU_SEQ_LENS_Q, HOST_BOUNDARIES
from tests.test_host_reads import host_reads

RESULTS = Path(__file__).parent / "results"


def _microseconds(fn, calls: int, repeats: int) -> float:
    return min(timeit.repeat(fn, number=calls, repeat=repeats)) / calls * 1e6


def _node(cu_seqlens: torch.Tensor, host: torch.Tensor | None) -> PackedBoundaries:
    library._last.entry = None
    return library._packed_boundaries("bench", cu_seqlens, host)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--documents", type=int, default=64)
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=Path, default=RESULTS / "static_host_boundaries.json")
    args = parser.parse_args()
    torch.manual_seed(0)
    lengths = torch.randint(1, 256, (args.documents,)).tolist()
    pack_length = sum(lengths) + 64
    batch = PackingCollator(pack_length=pack_length, max_documents=args.documents)(
        [{"input_ids": [1] * n} for n in lengths])
    without = {key: value for key, value in batch.items() if key != HOST_BOUNDARIES}
    host, cu_seqlens = batch[HOST_BOUNDARIES], batch[CU_SEQ_LENS_Q]
    ways = {"from_batch, host entry": lambda: PackedBoundaries.from_batch(batch),
            "from_batch, tensors": lambda: PackedBoundaries.from_batch(without),
            "compiled node, host copy": lambda: _node(cu_seqlens, host.cu_seqlens),
            "compiled node, cu_seqlens": lambda: _node(cu_seqlens, None)}
    rows = {}
    for name, fn in ways.items():
        with host_reads(host) as reads:
            fn()
        rows[name] = {"us": round(_microseconds(fn, args.calls, args.repeats), 1),
                      "reads_of_batch_tensors": len([read for read in reads if not read.startswith("host ")]),
                      "reads_of_the_host_entry": len([read for read in reads if read.startswith("host ")])}
        print(f"{name:28s} {rows[name]['us']:8.1f} us   reads: {rows[name]['reads_of_batch_tensors']} of batch "
              f"tensors, {rows[name]['reads_of_the_host_entry']} of the host entry")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"documents": args.documents, "pack_length": pack_length, "torch": torch.__version__,
                                    "machine": platform.processor() or platform.machine(), "results": rows},
                                   indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
