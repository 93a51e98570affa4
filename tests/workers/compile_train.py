"""One rank of tests/training/test_compile_training.py's composed runs (launched by torchrun, gloo, 2 ranks).

``hybrid-pack train``'s own entry (:func:`hybrid_pack.training.train`) runs each case of ``sys.argv[2:]`` eagerly
and with ``--compile`` on the same data, the blocks compiled with ``aot_eager`` (dynamo's graphs and guards are
what is proved; inductor is proved in tests/modeling/test_compile.py and tests/parallel/test_compile_sharded.py):

- ``fsdp``: FSDP2 over both ranks, the runtime guard checking every step (it hooks the model whose blocks are
  compiled: it must read the static batch's boundaries outside the graphs); compiled with activation checkpointing.
- ``context_parallel``: one row split across both ranks in the zigzag layout (static rows of ``--capacity``
  tokens, sharded).

Rank 0 writes ``{case: {"eager": metrics, "compiled": metrics}}`` as JSON to ``sys.argv[1]``.
"""

from __future__ import annotations

import functools
import importlib
import json
import sys
import tempfile
from pathlib import Path

import torch.distributed as dist

from hybrid_pack.distributed import end_process_group
from hybrid_pack.parallel.compile import compile_blocks
from hybrid_pack.training import TrainConfig, train

CASES = {
    "fsdp": {"fsdp": True, "guard_every": 1},
    "context_parallel": {"context_parallel": 2, "cp_layout": "zigzag", "guard_every": 0},
}
COMPILED = {"fsdp": {"compile": True, "activation_checkpointing": True}, "context_parallel": {"compile": True}}
KEPT = ("losses", "compiles", "recompiles", "compiled", "parameters_checksum", "real_tokens", "documents_trained",
        "guard")


def main() -> None:
    dist.init_process_group("gloo")
    # the module (the package's `parallelize` is the function of the same name)
    importlib.import_module("hybrid_pack.parallel.parallelize").compile_blocks = functools.partial(
        compile_blocks, backend="aot_eager")
    out, results = Path(sys.argv[1]), {}
    root = Path(tempfile.mkdtemp()) if dist.get_rank() == 0 else None
    shared = [str(root)]
    dist.broadcast_object_list(shared, src=0)
    for case in sys.argv[2:]:
        results[case] = {}
        for kind, extra in (("eager", {}), ("compiled", COMPILED[case])):
            cfg = TrainConfig(model="bamba-tiny", capacity=128, overflow="drop", max_examples=24, max_steps=3,
                              progress=False, out=f"{shared[0]}/{case}-{kind}", **CASES[case], **extra)
            metrics = train(cfg)
            results[case][kind] = {key: metrics.get(key) for key in KEPT}
    if dist.get_rank() == 0:
        out.write_text(json.dumps(results, indent=1))
    end_process_group()


if __name__ == "__main__":
    main()
