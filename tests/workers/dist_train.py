"""Worker of tests/training/test_training.py: one rank of a torchrun training run; writes its parameter checksum."""

import json
import os
import sys

from hybrid_pack.training import TrainConfig, train

out = sys.argv[1]
metrics = train(TrainConfig(out=out, max_examples=48, capacity=1024, max_steps=3, progress=False))
with open(os.path.join(out, f"rank{os.environ['RANK']}.json"), "w") as f:
    json.dump({"checksum": metrics["parameters_checksum"], "losses": metrics["losses"]}, f)
