"""Per-rank peak memory of context-parallel attention on one long document (CPU, gloo).

    .venv/bin/python benchmarks/bench_cp_attention_memory.py [--tokens 65536] [--ranks 2 4] [--label after]

One document of ``--tokens`` tokens (float32, H = Hkv = 2 heads of 32) runs ``varlen_attention`` forward and
backward (``backend="torch"``): unsharded in one process, and sharded over R ranks (torchrun, gloo) under each
layout. Each run is a fresh process that warms up on a tiny row, reads its resident set, resets its peak (Linux:
``/proc/self/clear_refs``), builds its inputs and runs the attention forward and backward, and reads the peak
(``VmHWM``): the difference is the peak memory the step (inputs, outputs, gradients and everything the attention
held) added on that rank, whatever the process held at its height before (``ru_maxrss`` cannot be reset, so a
difference of two would start from the earlier peak, not from the memory in use).

Two unsharded baselines: the op itself (the torch backend: one dense SDPA block per document), the ratio's
denominator, and the blockwise partial form on the whole document (``attend(BLOCKWISE, ...)``, same 512 blocks):
the path a sharded rank's continuing document runs, for a like-for-like second ratio. Beside each rank's figure,
the keys and values it holds from other ranks (tokens): the ring's largest piece times two (the one computed on
and the next in flight), against the whole-earlier-document halo the path fetched before (read from
``halo_plan(shard, limit=None)``). Results go to ``benchmarks/results/cp_attention_memory.json`` under
``--label`` (rows of other labels are kept, so a run on the code before a change can sit beside one after).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

RESULTS = Path(__file__).resolve().parent / "results" / "cp_attention_memory.json"
HEADS, DIM = 2, 32


def _status_bytes(field: str) -> int:
    """``field`` (``VmRSS``: resident now, ``VmHWM``: its peak since the last reset) of this process, in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024  # kB
    raise RuntimeError(f"/proc/self/status has no {field}: this benchmark reads Linux's process status")


def _reset_peak() -> None:
    """Set ``VmHWM`` to the resident set now."""
    Path("/proc/self/clear_refs").write_text("5")


def _measure(tokens: int, layout: str | None) -> dict:
    """One process's (or rank's) run: peak memory added by attention forward + backward (``layout``: a CP
    layout, None: the unsharded op, ``"blockwise"``: the unsharded blockwise partial form)."""
    from hybrid_pack import PackedBoundaries
    from hybrid_pack.ops import varlen_attention
    from hybrid_pack.ops.attention.partial import BLOCKWISE, attend

    torch.manual_seed(0)
    rank, world = 0, 1
    sharded = layout not in (None, "blockwise")
    if sharded:
        import torch.distributed as dist

        from hybrid_pack.parallel import ShardedBoundaries

        dist.init_process_group("gloo")
        rank, world = dist.get_rank(), dist.get_world_size()

    def step(total: int) -> tuple[float, dict]:
        row = boundaries = PackedBoundaries.from_lengths([total])
        if sharded:
            boundaries = ShardedBoundaries.from_row(row, group=None, rank=rank, world_size=world, layout=layout)
        q, k, v = (torch.randn(1, total // world, HEADS, DIM).requires_grad_() for _ in range(3))
        weight = torch.randn(1, total // world, HEADS, DIM)
        began = time.perf_counter()
        if layout == "blockwise":
            out = attend(BLOCKWISE, *(t.squeeze(0) for t in (q, k, v)), scale=DIM ** -0.5, causal=True)[None]
        else:
            out = varlen_attention(q, k, v, boundaries, backend="torch")
        (out * weight).sum().backward()
        return time.perf_counter() - began, _held_tokens(boundaries) if sharded else {}

    step(64 * world)  # warm-up: libraries, thread pools and the allocator's first arenas are not the step's memory
    before = _status_bytes("VmRSS")
    _reset_peak()
    seconds, held = step(tokens)
    local = tokens // world
    name = layout if sharded else ("unsharded" if layout is None else "unsharded, blockwise form")
    record = {"rank": rank, "ranks": world, "layout": name, "tokens": tokens,
              "peak_added_mib": round((_status_bytes("VmHWM") - before) / 2**20, 1), "seconds": round(seconds, 2),
              "inputs_mib": round(4 * local * HEADS * DIM * 4 / 2**20, 1), **held}
    if sharded:
        import torch.distributed as dist

        every = [None] * world
        dist.all_gather_object(every, record)
        dist.destroy_process_group()
        return {"ranks": every}
    return {"ranks": [record]}


def _held_tokens(boundaries) -> dict:
    """Other ranks' key/value tokens the path holds at once: the ring's (if this code has one) and the old halo's."""
    from hybrid_pack.ops.cp.exchange import halo_plan

    out = {"whole_document_halo_tokens": halo_plan(boundaries, None).halo_tokens}
    try:
        from hybrid_pack.ops.attention.ring import ring_plan
    except ImportError:
        return out
    plan = ring_plan(boundaries)
    received = sum(head is not None for _, head in plan.passes)
    out["ring_tokens_held"] = min(2, received) * plan.piece_tokens  # the piece computed on and the next in flight
    return out


def _run(tokens: int, layout: str | None, ranks: int) -> dict:
    out = Path(os.environ.get("TMPDIR", "/tmp")) / f"cp_attention_memory_{os.getpid()}_{layout}_{ranks}.json"
    child = [str(Path(__file__).resolve()), "--child", str(out), "--tokens", str(tokens),
             "--layout", layout or "unsharded"]
    # Blocks of 64 KiB and up come from mmap and go back to the system when freed, so the peak resident set follows
    # the tensors alive (glibc's heap would otherwise keep freed blocks and count them to the next peak).
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo", "MALLOC_MMAP_THRESHOLD_": "65536",
           "MALLOC_ARENA_MAX": "2"}
    if layout in (None, "blockwise"):
        command = [sys.executable, *child]
    else:
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(ranks),
                   *child]
    subprocess.run(command, check=True, env=env)
    result = json.loads(out.read_text())
    out.unlink()
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=65536)
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--layouts", nargs="+", default=["contiguous", "zigzag"])
    parser.add_argument("--label", default="after")
    parser.add_argument("--child")
    parser.add_argument("--layout")
    args = parser.parse_args()
    if args.child:
        result = _measure(args.tokens, None if args.layout == "unsharded" else args.layout)
        if int(os.environ.get("RANK", "0")) == 0:
            Path(args.child).write_text(json.dumps(result))
        return
    runs = [_run(args.tokens, None, 1), _run(args.tokens, "blockwise", 1)]
    runs += [_run(args.tokens, layout, ranks) for ranks in args.ranks for layout in args.layouts]
    unsharded, blockwise = (run["ranks"][0]["peak_added_mib"] for run in runs[:2])
    rows = []
    for run in runs:
        peak = max(record["peak_added_mib"] for record in run["ranks"])
        first = run["ranks"][0]
        rows.append({"label": args.label, "layout": first["layout"], "ranks": first["ranks"], "tokens": args.tokens,
                     "peak_measure": "VmHWM", "max_rank_peak_added_mib": peak,
                     "fraction_of_unsharded": round(peak / unsharded, 3),
                     "fraction_of_unsharded_blockwise": round(peak / blockwise, 3), "per_rank": run["ranks"]})
    results = json.loads(RESULTS.read_text()) if RESULTS.exists() else {"rows": []}
    results["what"] = ("one document, float32, H = Hkv = 2, D = 32, varlen_attention forward + backward (backend "
                       "torch; sharded: its partial form, the blockwise oracle on CPU); peak_added_mib: the step's "
                       "peak resident set over the one at its start, per process (peak_measure VmHWM: reset before "
                       "the step; rows without it: ru_maxrss after minus before, which starts from the process's "
                       "earlier peak); fraction_of_unsharded: of the unsharded op (torch backend); "
                       "fraction_of_unsharded_blockwise: of the blockwise form on the whole document; "
                       "ring_tokens_held: other ranks' key/value tokens held at once; whole_document_halo_tokens: "
                       "what a whole-earlier-document halo holds")
    results["device"] = "cpu, gloo, one torch thread per rank"
    results["rows"] = [row for row in results["rows"] if row["label"] != args.label] + rows
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text(json.dumps(results, indent=1) + "\n")
    print("| label | layout | ranks | max rank peak added (MiB) | of unsharded (torch) | of unsharded blockwise |")
    print("|---|---|---|---|---|---|")
    for row in rows:
        print(f"| {row['label']} | {row['layout']} | {row['ranks']} | {row['max_rank_peak_added_mib']} | "
              f"{row['fraction_of_unsharded']} | {row['fraction_of_unsharded_blockwise']} |")


if __name__ == "__main__":
    main()
