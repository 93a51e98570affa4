"""The runtime leak guard in a plain PyTorch loop: qwen3-next-tiny on bundled GSM8K, packed.

    python examples/guard_plain_loop.py [--examples 200] [--capacity 2048] [--guard-every 10]

``PackingGuard(model).attach()`` hooks the model: the first packed training call and every N-th after
it are checked against their documents run alone (eval mode, no gradient). A leak raises
``hybrid_pack.errors.IsolationError`` naming the step and the document; nothing else in the loop changes.
"""

from __future__ import annotations

import argparse

import torch
from torch.utils.data import DataLoader

from hybrid_pack import PackedBatchSampler, PackingCollator
from hybrid_pack.modeling import from_preset
from hybrid_pack.schema import INPUT_IDS
from hybrid_pack.testing import PackingGuard
from hybrid_pack.training.data import build_features, load_chats


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--examples", type=int, default=200)
    parser.add_argument("--capacity", type=int, default=2048)
    parser.add_argument("--guard-every", type=int, default=10)
    args = parser.parse_args(argv)

    torch.manual_seed(0)
    model = from_preset("qwen3-next-tiny").train()
    features, _ = build_features(load_chats("gsm8k", args.examples), model.config.vocab_size,
                                 max_length=args.capacity)
    sampler = PackedBatchSampler([len(f[INPUT_IDS]) for f in features], args.capacity, seed=0)
    loader = DataLoader(features, batch_sampler=sampler, collate_fn=PackingCollator())
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)

    guard = PackingGuard(model, every=args.guard_every).attach()
    losses = []
    for step, batch in enumerate(loader):
        guard.step = step                  # optional: records and errors then name the optimizer step
        loss = model(**batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
    guard.detach()

    for record in guard.records:
        print(f"step {record.step}: documents {record.documents} (lengths {record.lengths}) "
              f"max diff {record.max_diff:.1e}, {record.seconds:.3f} s")
    print(f"trained {len(losses)} packed steps; loss {losses[0]:.3f} -> {losses[-1]:.3f}; "
          f"{len(guard.records)} guard checks, no leak")
    return {"losses": losses, "records": [r.to_dict() for r in guard.records]}


if __name__ == "__main__":
    main()
