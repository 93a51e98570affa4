"""One rank of tests/parallel/test_cp_families.py: every patched Hugging Face family and both native presets on a
row split across the group against the unsharded row, and a layer without a context-parallel path refusing it.

    python -m torch.distributed.run --nproc_per_node 2 tests/workers/cp_families.py OUT

Every rank builds the same float64 model (a tiny config of every family in
:data:`~hybrid_pack.integrations.transformers.tiny.TINY_CONFIGS`, patched; ``qwen3-next-tiny``, ``bamba-tiny``)
and the same packed batch of each row of :data:`ROWS` (and of :data:`ZIGZAG_ROW` in the zigzag layout), runs
the unsharded row, then its :func:`shard_batch` share on a copy of the model. Rank 0 writes ``OUT`` as JSON,
per ``model/row[/zigzag]``: the :func:`relative_error` of the gathered logits and token-embedding gradients, of
the summed float64 loss (:func:`packed_loss` of the logits) and of the loss the model returns itself, and of
the summed parameter gradients: those the model computes in float64 and, apart, those it rounds to float32
(named); with the contiguous layout, of the row cut into documents at the rank edges (what the comparison
must tell apart from the right answer). A family with a layer of a kind that refuses a shard (``Kind.context_parallel``)
(Qwen4-Exp) has, instead of those, ``refused/<family>``: the error its sharded forward raised. Per patched family
with softmax attention served by :mod:`~hybrid_pack.integrations.transformers.attention` (the rest),
``eager/<family>``: the error a sharded forward with ``attn_implementation="eager"`` raised (eager attention masks
whole documents: it has no context-parallel path). A case that raises records ``{"raised": ...}`` instead.
"""

from __future__ import annotations

import copy
import functools
import sys
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from hybrid_pack import PackedBoundaries, PackingCollator, packed_loss
from hybrid_pack.distributed import end_process_group
from hybrid_pack.integrations.transformers import patch_model
from hybrid_pack.integrations.transformers.attention import is_packed_attention
from hybrid_pack.integrations.transformers.families import family_of
from hybrid_pack.integrations.transformers.tiny import TINY_CONFIGS, VOCAB, tiny_config, tiny_model
from hybrid_pack.isolation import Layout, relative_error
from hybrid_pack.modeling import from_preset
from hybrid_pack.parallel import ShardedBoundaries, shard_batch
from hybrid_pack.schema import BOUNDARIES, LABELS, NUM_ITEMS_IN_BATCH, SHIFT_LABELS
from tests.workers.gathered import gather_tokens, summed
from tests.workers.launch import exit_without_finalizing, write_on_rank0

ROWS = (Layout("crossing", (10, 40, 14)), Layout("padded", (10, 40, 8), num_pad_tokens=6))
"""64 tokens: on 2 ranks the 40-token document crosses the rank edge at token 32; ``padded`` ends in padding."""
ZIGZAG_ROW = ROWS[0]
"""Also split in the zigzag layout (chunks of 16 tokens: rank 0 holds tokens 0-15 and 48-63)."""
PRESETS = ("qwen3-next-tiny", "bamba-tiny")

@functools.cache
def _patched_on_meta(family: str) -> torch.nn.Module:
    """The tiny model of ``family``, patched, with no storage (for what its layers are)."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return patch_model(AutoModelForCausalLM.from_config(tiny_config(family)))


def layers_without_context_parallel(family: str) -> list[str]:
    """The module classes of ``family``'s tiny model whose layer kind refuses a context-parallel shard
    (``Kind.context_parallel`` false: their look-backs select or read earlier tokens of whole documents)."""
    model = _patched_on_meta(family)
    present = {type(module).__name__ for module in model.modules()}
    return [name for name, layer in family_of(model).layers.items()
            if not layer.kind.context_parallel and name in present]


def attention_layers(family: str) -> list[str]:
    """The module classes of ``family``'s tiny model that the patch serves as softmax attention (through
    transformers' attention interface, so ``attn_implementation`` picks their kernel)."""
    return sorted({type(module).__name__ for module in _patched_on_meta(family).modules()
                   if is_packed_attention(module)})


def hf_model(family: str) -> torch.nn.Module:
    """The tiny model of ``family``, patched, float64, in training mode (eager experts: they run in float64)."""
    model = tiny_model(family)
    if getattr(model.config, "num_experts", 0) or getattr(model.config, "num_local_experts", 0):
        model.set_experts_implementation("eager")
    return patch_model(model).double().train()


def preset_model(name: str) -> torch.nn.Module:
    torch.manual_seed(0)
    return from_preset(name, vocab_size=VOCAB).double().train()


MODELS: dict[str, Callable[[], torch.nn.Module]] = (
    {f"hf_{family}": lambda family=family: hf_model(family) for family in TINY_CONFIGS}
    | {name: lambda name=name: preset_model(name) for name in PRESETS})


def packed_batch(layout: Layout, seed: int = 2) -> dict:
    generator = torch.Generator().manual_seed(seed)
    features = [{"input_ids": torch.randint(3, VOCAB, (n,), generator=generator).tolist()} for n in layout.lengths]
    return PackingCollator(pack_length=layout.total_tokens)(features)


def forward_backward(model: torch.nn.Module, batch: dict, loss_of: Callable[[torch.Tensor], torch.Tensor]
                     ) -> tuple[Any, torch.Tensor, torch.Tensor]:
    """``model(**batch)``, the float64 loss of its logits (backpropagated) and the gradient of the token
    embeddings (the input embedding layer's output, ``[1, T, hidden]``)."""
    embedded: list[torch.Tensor] = []

    def keep(module: torch.nn.Module, args: tuple, output: torch.Tensor) -> None:
        output.retain_grad()
        embedded.append(output)

    hook = model.get_input_embeddings().register_forward_hook(keep)
    try:
        out = model(**batch)
    finally:
        hook.remove()
    loss = loss_of(out.logits)
    loss.backward()
    return out, loss, embedded[0].grad


def sharded_against_unsharded(make: Callable[[], torch.nn.Module], layout: Layout, token_layout: str) -> dict:
    """Relative errors of the sharded run's gathered logits and embedding gradients, summed losses and summed
    parameter gradients; on the contiguous layout, also of the row cut at the rank edges."""
    model = make()
    sharded_model = copy.deepcopy(model)
    batch = packed_batch(layout)
    row = PackedBoundaries.from_batch(batch)
    out, loss, embedding_grad = forward_backward(
        model, batch, lambda logits: packed_loss(logits, batch[LABELS], boundaries=row))
    shard = shard_batch(batch, layout=token_layout)
    local, local_loss, local_embedding_grad = forward_backward(
        sharded_model, shard, lambda logits: packed_loss(logits, shard[SHIFT_LABELS], shifted=True,
                                                         num_items_in_batch=shard[NUM_ITEMS_IN_BATCH]))
    bounds = shard[BOUNDARIES]
    errors = {"logits": relative_error(gather_tokens(local.logits, bounds), out.logits),
              "embedding gradient": relative_error(gather_tokens(local_embedding_grad, bounds), embedding_grad),
              "loss": relative_error(summed(local_loss), loss),
              "model loss": relative_error(summed(local.loss), out.loss)}
    # A parameter the model casts to float32 (RMSNorm weights, A_log, D) gets its gradient rounded to float32 on
    # every rank before the group's sum, so it agrees to float32's rounding only; the others to float64's.
    grads: dict[bool, tuple[list[torch.Tensor], list[torch.Tensor], list[str]]] = {True: ([], [], []),
                                                                                   False: ([], [], [])}
    for (name, want), mine in zip(model.named_parameters(), sharded_model.parameters(), strict=True):
        if want.grad is None and mine.grad is None:
            continue
        local_grad = torch.zeros_like(mine) if mine.grad is None else mine.grad
        rounded = torch.tensor(float(torch.equal(local_grad, local_grad.float().double())))
        dist.all_reduce(rounded, op=dist.ReduceOp.MIN)
        got, expected, names = grads[bool(rounded)]
        got.append(summed(local_grad).flatten())
        expected.append((torch.zeros_like(want) if want.grad is None else want.grad).flatten())
        names.append(name)
    for rounded, key in ((False, "gradients"), (True, "gradients rounded to float32")):
        got, expected, names = grads[rounded]
        errors[key] = relative_error(torch.cat(got), torch.cat(expected)) if names else 0.0
    errors["parameters rounded to float32"] = grads[True][2]
    errors["logits dtype"] = str(out.logits.dtype).removeprefix("torch.")
    if token_layout != "contiguous":
        return errors

    cut = PackedBoundaries.from_lengths([n for r in range(bounds.world_size) for n in ShardedBoundaries.from_row(
        row, group=None, rank=r, world_size=bounds.world_size).local.segment_lengths],
        num_pad_tokens=row.num_pad_tokens)
    with torch.no_grad():
        errors["cut at rank edges"] = relative_error(model(input_ids=batch["input_ids"], boundaries=cut).logits,
                                                     out.logits)
    return errors


def sharded_forward_refusal(model: torch.nn.Module) -> dict:
    """The error ``model``'s forward on this rank's share of the first row raises (``{"raised": None}`` if none)."""
    try:
        model(**shard_batch(packed_batch(ROWS[0])))
    except Exception as error:  # the kind and the message are the verdict
        return {"raised": type(error).__name__, "message": str(error)}
    return {"raised": None}


def eager_attention_refuses(family: str) -> dict:
    """The error a sharded forward of ``family`` with eager attention raises."""
    model = hf_model(family)
    model.set_attn_implementation("eager")
    return sharded_forward_refusal(model)


def cases() -> dict[str, Callable[[], dict]]:
    """Every case by name: ``model/row`` (contiguous layout), ``model/row/zigzag``, ``refused/family`` (a family
    without a context-parallel path), ``eager/family`` (a family with one and with served softmax attention)."""
    out: dict[str, Callable[[], dict]] = {}
    refused = [family for family in TINY_CONFIGS if layers_without_context_parallel(family)]
    for name, make in MODELS.items():
        if name.removeprefix("hf_") in refused:
            out[f"refused/{name.removeprefix('hf_')}"] = lambda make=make: sharded_forward_refusal(make())
            continue
        for layout in ROWS:
            out[f"{name}/{layout.name}"] = lambda make=make, layout=layout: sharded_against_unsharded(
                make, layout, "contiguous")
        out[f"{name}/{ZIGZAG_ROW.name}/zigzag"] = lambda make=make: sharded_against_unsharded(
            make, ZIGZAG_ROW, "zigzag")
    for family in TINY_CONFIGS:
        if family not in refused and attention_layers(family):
            out[f"eager/{family}"] = lambda family=family: eager_attention_refuses(family)
    return out


def main(out_path: str) -> None:
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))  # a case that hangs fails instead
    rank, world = dist.get_rank(), dist.get_world_size()
    results = {}
    for name, case in cases().items():
        print(f"rank {rank}: {name}", file=sys.stderr, flush=True)
        try:
            result = case()
        except Exception as error:  # every failure becomes the case's result
            result = {"raised": f"rank {rank}: {type(error).__name__}: {error}\n{traceback.format_exc(limit=-3)}"}
        every = [None] * world
        dist.all_gather_object(every, result)
        results[name] = every[0] if all(r == every[0] for r in every) else {"raised": f"the ranks differ: {every}"}
    write_on_rank0(out_path, results)
    end_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
    exit_without_finalizing(0)
