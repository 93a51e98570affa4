"""One rank of the one-backend-per-op check in tests/ops/test_backend_agreement.py (run by torch.distributed.run).

Two planted CPU backends, registered on every rank: ``conv`` is the pure-torch kernel on rank 0 but 1% off on
rank 1 (its self-check fails there only); ``attention`` is the pure-torch kernel on both (it passes on both).
Each rank keeps its self-check results in its own directory (ranks on different machines share nothing) and
runs one training step of ``qwen3-next-tiny`` sharded with FSDP2. Writes which backend each op ran and the
report to ``OUT.rank<r>.json``.

With ``cp``: a planted Gated DeltaNet kernel 1% off on rank 1, a planted sharded conv (the pure-torch
context-parallel conv) 1% off on rank 1 and a planted sharded attention (exact on both) run on a row whose second
document fills rank 1, so the ranks make different local calls (rank 1 continues the document: its delta rule
widens the values). Before the warm-up a call that a kernel could serve raises (recorded); then one step inside
``backends.discovering()`` records the keys, ``backends.verify()`` settles them, and one more step runs; writes
what ran in it.

With ``evaluation``: the calls without gradients of an evaluation. A custom loop warms up on its training batch,
where a planted conv kernel whose backward raises fails its check, then evaluates under ``torch.no_grad()``; then
``PackedSFTTrainer`` (tiny Qwen3.5, a planted exact conv kernel) evaluates before its first training step, trains
one step and evaluates again. Writes which backend each call ran per gradient mode, and any error.

With ``layouts``: exact planted kernels of the delta rules, decay linear attention and SSD, warmed up on a row
whose rank edge falls between two documents, then run on rows whose edge cuts one (where the pure-torch
context-parallel paths make other local calls: final states, widened values), and the other way round; writes
what raised and what ran.

With ``registries``: ranks whose registries differ (a sharded conv on every rank, a second one on rank 1 only,
a sharded attention on rank 0 only) warm up and step; then ``HYBRID_PACK_VERIFY=0`` on rank 1 only; writes what
ran and what ``verify()`` raised on each rank.

    python -m torch.distributed.run --nproc_per_node 2 tests/workers/dist_backends.py OUT [cp | evaluation | fsdp |
        layouts | registries]
"""

from __future__ import annotations

import copy
import datetime
import functools
import json
import os
import sys

import torch
import torch.distributed as dist

from hybrid_pack import PackedBoundaries, backends
from hybrid_pack.distributed import end_process_group
from hybrid_pack.errors import InputError
from hybrid_pack.modeling import from_preset
from hybrid_pack.ops import causal_conv1d, decay_linear_attention, gated_delta_rule, kda, mamba2_ssd, varlen_attention
from hybrid_pack.ops.dispatch import selector
from hybrid_pack.ops.dispatch.registry import reference_of
from hybrid_pack.parallel import ShardedBoundaries
from hybrid_pack.parallel.fsdp import apply_fsdp
from tests import kit
from tests.support.torch_path import pure_torch_transformers
from tests.workers.launch import exit_without_finalizing

PLANTED = "planted"
SHARDED = "planted_sharded"


def main(out: str, mode: str) -> None:
    rank = int(os.environ["RANK"])
    os.environ["HYBRID_PACK_CACHE"] = f"{out}.cache{rank}"
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    ran = {"cp": sharded_ops, "evaluation": evaluation, "fsdp": fsdp_step, "layouts": layouts,
           "registries": registries}[mode](rank)
    with open(f"{out}.rank{rank}.json", "w") as f:
        json.dump({"ran": ran, "report": backends.report(device="cpu")}, f)
    end_process_group()


def sharded_ops(rank: int) -> dict:
    """Attention, the conv and the delta rule on this rank's half of one row, before and after the warm-up; what
    each ran after it."""
    delta = reference_of("gated_delta").fn
    backends.register("gated_delta", PLANTED, kit.with_defect(delta, "one_percent_off") if rank == 1 else delta,
                      priority=100, devices=("cpu",), dtypes=(torch.float32,))
    conv_cp = functools.partial(causal_conv1d, backend="torch")  # the pure-torch context-parallel conv
    backends.register("conv", SHARDED, kit.with_defect(conv_cp, "one_percent_off") if rank == 1 else conv_cp,
                      priority=100, devices=("cpu",), dtypes=(torch.float32,), sharded=True)
    backends.register("attention", SHARDED, functools.partial(varlen_attention, backend="torch"), priority=100,
                      devices=("cpu",), dtypes=(torch.float32,), sharded=True)
    shard = ShardedBoundaries.from_row(PackedBoundaries.from_document_lengths([5, 27]), group=None, rank=rank,
                                       world_size=2)
    generator = torch.Generator().manual_seed(0)
    row = [torch.randn(1, 32, 2, 8, generator=generator) for _ in range(3)]
    row += [-torch.rand(1, 32, 2, generator=generator), torch.rand(1, 32, 2, generator=generator)]
    weight = torch.randn(16, 4, generator=generator)

    def step() -> None:
        q, k, v, g, beta = (t[:, shard.offset:shard.offset + 16].clone().requires_grad_() for t in row)
        out, _ = gated_delta_rule(q, k, v, g, beta, shard, use_qk_l2norm=True)
        conv = causal_conv1d(q.flatten(2), weight, None, shard, activation="silu")
        (out.sum() + conv.sum() + varlen_attention(q, k, v, shard).sum()).backward()

    unwarmed = {}
    for op, call in (("gated_delta", lambda t: gated_delta_rule(*t, PackedBoundaries.from_lengths([5, 11]))),
                     ("conv", lambda t: causal_conv1d(t[0].flatten(2), weight, None, shard))):
        try:  # before the warm-up, a call that a kernel could serve fails loudly, before any exchange
            call([x[:, shard.offset:shard.offset + 16] for x in row])
            unwarmed[op] = ""
        except backends.WarmUpError as error:
            unwarmed[op] = str(error)
    with backends.discovering():
        step()
    backends.verify(device="cpu")
    step()
    return {d.op: {"backend": d.backend, "refused": dict(d.refused)} for d in backends.decisions()} | {
        "unwarmed": unwarmed, "all": sorted({(d.op, d.backend) for d in backends.decisions()})}


def layouts(rank: int) -> dict:
    """Warm-ups on one layout, calls on the others: ``errors`` (what raised, per warm-up) and what ran."""
    recurrent = ("gated_delta", "kda", "decay_linear_attention", "ssd")
    generator = torch.Generator().manual_seed(0)
    row = {name: torch.randn(1, 32, 2, 8, generator=generator) for name in ("q", "k", "v", "x", "B", "C")}
    row |= {"g": -torch.rand(1, 32, 2, generator=generator), "gk": -torch.rand(1, 32, 2, 8, generator=generator),
            "beta": torch.rand(1, 32, 2, generator=generator), "dt": torch.randn(1, 32, 2, generator=generator)}
    A = -torch.rand(2, generator=generator) - 0.5

    def step(lengths: list[int]) -> None:
        shard = ShardedBoundaries.from_row(PackedBoundaries.from_document_lengths(lengths), group=None, rank=rank,
                                           world_size=2)
        t = {name: x[:, shard.offset:shard.offset + 16].clone().requires_grad_() for name, x in row.items()}
        outs = [gated_delta_rule(t["q"], t["k"], t["v"], t["g"], t["beta"], shard, use_qk_l2norm=True)[0],
                kda(t["q"], t["k"], t["v"], t["gk"], t["beta"], shard, use_qk_l2norm=True)[0],
                decay_linear_attention(t["q"], t["k"], t["v"], t["g"], shard)[0],
                mamba2_ssd(t["x"], t["dt"], A, t["B"], t["C"], shard)]
        sum(o.sum() for o in outs).backward()

    errors = {}
    for warm, then in (([16, 16], [[5, 27], [20, 12]]), ([5, 27], [[16, 16], [20, 12]])):
        for op in recurrent:  # registered again: no verdict settled from the warm-up before
            backends.register(op, PLANTED, reference_of(op).fn, priority=100, devices=("cpu",),
                              dtypes=(torch.float32,), replace=True)
        with backends.discovering():
            step(warm)
        backends.verify(device="cpu")
        for lengths in then:
            try:
                step(lengths)
            except backends.WarmUpError as error:
                errors[f"{warm} then {lengths}"] = str(error)
    return {"errors": errors, "ran": sorted({(d.op, d.backend) for d in backends.decisions() if d.op in recurrent})}


def registries(rank: int) -> dict:
    """What ran where the ranks' sharded backends differ, and what ``verify()`` raised where one rank turned the
    self-checks off."""
    conv_cp = functools.partial(causal_conv1d, backend="torch")
    attention_cp = functools.partial(varlen_attention, backend="torch")
    backends.register("conv", SHARDED, conv_cp, priority=100, devices=("cpu",), dtypes=(torch.float32,), sharded=True)
    if rank == 1:  # another version of a package there
        backends.register("conv", "rank_1_only", conv_cp, priority=200, devices=("cpu",), dtypes=(torch.float32,),
                          sharded=True)
    else:
        backends.register("attention", "rank_0_only", attention_cp, priority=100, devices=("cpu",),
                          dtypes=(torch.float32,), sharded=True)
    shard = ShardedBoundaries.from_row(PackedBoundaries.from_document_lengths([5, 27]), group=None, rank=rank,
                                       world_size=2)
    generator = torch.Generator().manual_seed(0)
    x_row, weight = torch.randn(1, 32, 2, 8, generator=generator), torch.randn(16, 4, generator=generator)

    def step() -> None:
        x = x_row[:, shard.offset:shard.offset + 16].clone().requires_grad_()
        (causal_conv1d(x.flatten(2), weight, None, shard).sum() + varlen_attention(x, x, x, shard).sum()).backward()

    with backends.discovering():
        step()
    backends.verify(device="cpu")
    step()
    ran = sorted({(d.op, d.backend) for d in backends.decisions()})
    os.environ[selector.VERIFY_ENV] = "0" if rank == 1 else "1"
    try:
        with backends.discovering():
            step()
        backends.verify(device="cpu")
        raised = ""
    except InputError as error:
        raised = str(error)
    finally:
        del os.environ[selector.VERIFY_ENV]
    return {"ran": ran, "raised": raised}


def fsdp_step(rank: int) -> dict:
    """One training step of qwen3-next-tiny under FSDP2 with a conv kernel 1% off on rank 1; what each op ran."""
    conv = reference_of("conv").fn
    backends.register("conv", PLANTED, kit.with_defect(conv, "one_percent_off") if rank == 1 else conv,
                      priority=100, devices=("cpu",), dtypes=(torch.float32,))
    backends.register("attention", PLANTED, reference_of("attention").fn, priority=100, devices=("cpu",),
                      dtypes=(torch.float32,))
    torch.manual_seed(0)
    model = apply_fsdp(from_preset("qwen3-next-tiny"), torch.distributed.device_mesh.init_device_mesh("cpu", (2,)))
    ids = torch.randint(0, model.config.vocab_size, (1, 40), generator=torch.Generator().manual_seed(rank))
    batch = {"input_ids": ids, "labels": ids, "boundaries": PackedBoundaries.from_lengths([7, 20 + rank, 13 - rank])}
    backends.verify(model=model, batch=batch)
    model(**batch).loss.backward()
    return {d.op: {"backend": d.backend, "refused": dict(d.refused)} for d in backends.decisions()}


def _ran(op: str, since: int = 0) -> dict[str, list[str]]:
    """The backends ``op``'s calls ran on, by gradient mode (``since``: after that many decisions)."""
    ran: dict[str, list[str]] = {"grad": [], "no_grad": []}
    for d in backends.decisions()[since:]:
        if d.op == op and d.backend not in ran["grad" if d.requires_grad else "no_grad"]:
            ran["grad" if d.requires_grad else "no_grad"].append(d.backend)
    return ran


def evaluation(rank: int) -> dict:
    """A custom loop's evaluation after its warm-up, then a trainer evaluating first: what the conv ran on, by
    gradient mode, after each; ``error``: what raised (empty: nothing)."""
    found: dict[str, object] = {}
    conv = reference_of("conv").fn
    backends.register("conv", PLANTED, kit.with_defect(conv, "backward_raises"), priority=100, devices=("cpu",),
                      dtypes=(torch.float32,))
    torch.manual_seed(0)
    model = from_preset("qwen3-next-tiny")
    ids = torch.randint(0, model.config.vocab_size, (1, 40), generator=torch.Generator().manual_seed(rank))
    batch = {"input_ids": ids, "labels": ids, "boundaries": PackedBoundaries.from_lengths([7, 20 + rank, 13 - rank])}
    try:
        backends.verify(model=model, batch=batch)
        model.eval()
        with torch.no_grad():
            model(**batch)
        found["loop"] = {"ran": _ran("conv"), "refused": [dict(d.refused).get(PLANTED, "") for d in
                                                         backends.decisions() if d.op == "conv"]}
    except Exception as error:  # written for the test to show
        found["loop"] = {"error": f"{type(error).__name__}: {error}"}
    backends.unregister("conv", PLANTED)
    backends.register("conv", PLANTED, conv, priority=100, devices=("cpu",), dtypes=(torch.float32,))
    found["trainer"] = _trainer_evaluating_first(rank)
    found["dpo"] = _dpo_evaluating_first()
    return found


def _trainer_evaluating_first(rank: int) -> dict:
    import trl
    from datasets import Dataset

    from hybrid_pack.integrations.transformers.tiny import VOCAB, tiny_model, tiny_tokenizer
    from hybrid_pack.integrations.trl import PackedSFTTrainer

    words = [" ".join(f"w{3 + (7 * i + j) % (VOCAB - 3)}" for j in range(n)) for i, n in enumerate([5, 9, 3, 12])]
    texts = Dataset.from_dict({"text": words})
    args = trl.SFTConfig(output_dir=os.environ["HYBRID_PACK_CACHE"] + ".sft", per_device_train_batch_size=2,
                         per_device_eval_batch_size=2, max_length=32, packing=True, max_steps=1, use_cpu=True,
                         bf16=False, report_to=[], save_strategy="no", disable_tqdm=True, dataset_num_proc=None)
    trainer = PackedSFTTrainer(model=tiny_model("qwen3_5"), args=args, train_dataset=texts, eval_dataset=texts,
                               processing_class=tiny_tokenizer())
    found: dict[str, object] = {}
    since = len(backends.decisions())
    try:
        found["first"] = trainer.evaluate()["eval_loss"]
        found["ran_first"] = _ran("conv", since)
        trainer.train()
        found["again"] = trainer.evaluate()["eval_loss"]
        found["ran"] = _ran("conv", since)
    except Exception as error:  # written for the test to show
        found["error"] = f"{type(error).__name__}: {error}"
    return found


def _dpo_evaluating_first() -> dict:
    """``PackedDPOTrainer`` (tiny Bamba) evaluating twice before training: its first evaluation step records the
    keys and settles them, the rest run on the kernels settled."""
    import trl
    from datasets import Dataset

    from hybrid_pack.integrations.transformers.tiny import tiny_model, tiny_tokenizer
    from hybrid_pack.integrations.trl import PackedDPOTrainer

    pairs = Dataset.from_list([{"prompt": "w3 w4", "chosen": " w5 w6", "rejected": " w7"},
                               {"prompt": "w8", "chosen": " w9 w10 w11", "rejected": " w12 w13"}])
    args = trl.DPOConfig(output_dir=os.environ["HYBRID_PACK_CACHE"] + ".dpo", per_device_eval_batch_size=1,
                         use_cpu=True, bf16=False, report_to=[], save_strategy="no", disable_tqdm=True)
    since = len(backends.decisions())
    model = tiny_model("bamba")
    reference = copy.deepcopy(model)
    try:
        trainer = PackedDPOTrainer(model=model, ref_model=reference, args=args, train_dataset=pairs,
                                   eval_dataset=pairs, processing_class=tiny_tokenizer())
        with pure_torch_transformers(model), pure_torch_transformers(reference):
            trainer.evaluate()
            trainer.evaluate()
        return {"ran": _ran("conv", since)}
    except Exception as error:  # written for the test to show
        return {"error": f"{type(error).__name__}: {error}"}


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else "fsdp")
    exit_without_finalizing(0)
