"""One rank of the context-parallel proofs in tests/parallel/test_context_parallel.py (launched by torchrun, gloo).

Every case runs the same row unsharded on every rank and split across the group (each case under both
layouts, ``contiguous`` and ``zigzag``), and compares rank r's share, gathered over the group, with the
unsharded result: op outputs and input gradients, model logits,
summed losses and summed parameter gradients; cross-document gradients must be exactly zero; bad input
must raise :class:`InputError` naming its field. Each case's verdict ("ok" or the failure) is gathered,
and rank 0 writes ``{case: verdict}`` as JSON to ``sys.argv[1]``. ``sys.argv[2:]`` names the case groups
to run (``ops``, ``models``, ``presets``, ``errors``; default all).
"""

from __future__ import annotations

import copy
import functools
import sys
from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh

from hybrid_pack import PackedBoundaries, PackingCollator
from hybrid_pack.boundaries.sharded import LAYOUTS
from hybrid_pack.distributed import end_process_group
from hybrid_pack.errors import InputError
from hybrid_pack.modeling import HybridConfig, HybridForCausalLM, from_preset
from hybrid_pack.parallel import ShardedBoundaries, parallelize, shard_batch
from hybrid_pack.testing import Layout, PackingGuard
from tests.kit import (
    assert_close,
    attention_signature,
    conv_signature,
    gated_delta_signature,
    op_inputs,
    projection,
    public_op,
    run,
    ssd_signature,
)
from tests.workers.gathered import gather_tokens, summed
from tests.workers.launch import exit_without_finalizing, run_cases, write_on_rank0

TOL = {torch.float64: 1e-10, torch.float32: 1e-5}
PER_RANK = 6


def op_layouts(world: int) -> list[Layout]:
    """Rows of ``world * PER_RANK`` tokens (and one of ``world * 2``) that stress every rank and zigzag chunk
    edge (every row divides by ``2 * world``: zigzag chunks of ``PER_RANK / 2`` tokens, of 1 in the short row)."""
    n, total = PER_RANK, world * PER_RANK
    return [
        Layout("document_across_every_rank", (2, total - 4, 2)),
        Layout("documents_end_on_rank_edges", (n,) * world),
        Layout("documents_end_on_chunk_edges", (n // 2,) * (2 * world)),
        Layout("one_token_documents_at_every_edge", (1, n - 2, 1) * world),
        Layout("last_rank_only_padding", (3, total - n - 5), num_pad_tokens=n + 2),
        Layout("halo_from_two_ranks", (2 * world - 1, 1)),
        Layout("mixed_with_padding", (1, 2, total - 8, 1, 2), num_pad_tokens=2),
    ]


OP_SIGNATURES = {
    "conv": conv_signature(channels=5, width=4, activation="silu"),
    "attention": attention_signature(heads=4, kv_heads=2, dim=8),
    "gated_delta": gated_delta_signature(heads=2, v_heads=4, k_dim=4, v_dim=3, output_final_state=False),
    "ssd": ssd_signature(heads=2, head_dim=3, groups=1, state_dim=4, chunk_size=4, D="H", z=True, dt_bias=True,
                         return_final_states=False),
}
"""Per-token outputs only: per-document states are refused under zigzag."""
TESTED_LAYOUTS = {"conv": LAYOUTS, "attention": LAYOUTS, "gated_delta": ("zigzag",), "ssd": ("zigzag",)}
"""The layouts each op's cases run under here: Gated DeltaNet and the SSD serve the contiguous layout only and
reach zigzag through a relayout; their contiguous path (states included) is proved by tests/workers/cp_recurrent.py
on rows built for it."""
OP_KEYWORDS = {"attention": {"softmax_scale": 0.3}}  # not the default scale: both paths must use the given one


def check_op(op: str, layout: Layout, cp_layout: str, rank: int, world: int) -> None:
    """Outputs, every input's gradient, and zero cross-document gradients, sharded vs unsharded."""
    row = layout.boundaries()
    case = op_inputs(op, OP_SIGNATURES[op], row, seed=0)
    fn = functools.partial(public_op(op), **OP_KEYWORDS.get(op, {}))
    expected = run(op, fn, case, row)["output"]
    weight = projection({"output": expected}, seed=1)["output"]
    leaves = {name: value for name, value in case.arguments.items()
              if isinstance(value, torch.Tensor) and value.requires_grad}
    expected_grads = torch.autograd.grad((expected * weight).sum(), list(leaves.values()))

    shard = ShardedBoundaries.from_row(row, group=None, rank=rank, world_size=world, layout=cp_layout)
    local = {name: (shard.take(value) if name in case.token_inputs else value).detach().requires_grad_()
             if name in leaves else value for name, value in case.arguments.items()}
    output = run(op, fn, case, shard, local)["output"]
    assert_close(gather_tokens(output.detach(), shard), expected.detach(), f"{op} output", tol=TOL[torch.float64])
    grads = torch.autograd.grad((output * shard.take(weight)).sum(), [local[name] for name in leaves],
                                retain_graph=True)
    for name, grad, want in zip(leaves, grads, expected_grads, strict=True):
        got = gather_tokens(grad, shard) if name in case.token_inputs else summed(grad)
        assert_close(got, want, f"{op} d{name}", tol=TOL[torch.float64])

    token_leaves = [name for name in leaves if name in case.token_inputs]
    for doc, (start, length) in enumerate(zip(row.starts, row.segment_lengths, strict=True)):
        mask = torch.zeros(1, row.total_tokens, 1, 1, dtype=torch.float64)
        mask[:, start:start + length] = 1
        doc_out = (output * shard.take(weight) * shard.take(mask).view(1, -1, *[1] * (output.dim() - 2))).sum()
        doc_grads = torch.autograd.grad(doc_out, [local[name] for name in token_leaves], retain_graph=True,
                                        allow_unused=True)
        for name, grad in zip(token_leaves, doc_grads, strict=True):
            full = gather_tokens(torch.zeros_like(local[name]) if grad is None else grad, shard)
            outside = torch.ones(row.total_tokens, dtype=torch.bool)
            outside[start:start + length] = False
            leak = full[0, outside].abs().max().item() if outside.any() else 0.0
            assert leak == 0.0, f"{op}: segment {doc}'s output has gradient {leak:g} w.r.t. other segments' {name}"


def packed_batch(layout: Layout, vocab: int, seed: int) -> dict:
    generator = torch.Generator().manual_seed(seed)
    features = [{"input_ids": torch.randint(vocab, (n,), generator=generator).tolist()} for n in layout.lengths]
    return PackingCollator(pack_length=layout.total_tokens)(features)


def check_model(make: Callable[[], torch.nn.Module], layout: Layout, cp_layout: str, dtype: torch.dtype,
                world: int, *, loss_dtype: torch.dtype | None = None) -> None:
    """Logits slice, loss shares summing to the loss, summed gradients equal to the unsharded ones.

    ``loss_dtype``: the dtype the model computes its loss in (Hugging Face's: float32), which bounds the
    precision of the loss and the gradients; the logits are compared at ``dtype``'s tolerance.
    """
    torch.manual_seed(0)
    model = make().to(dtype)
    sharded_model = copy.deepcopy(model)
    batch = packed_batch(layout, model.config.vocab_size, seed=2)
    out = model(**batch)
    out.loss.backward()

    shard = shard_batch(batch, layout=cp_layout)
    cut = PackedBoundaries.from_lengths([n for r in range(world) for n in ShardedBoundaries.from_row(
        shard["boundaries"].row, group=None, rank=r, world_size=world).local.segment_lengths])
    with torch.no_grad():  # the row cut at the rank edges: what a shard would get without context parallelism
        alone = model(input_ids=batch["input_ids"], boundaries=cut).logits
    sensitivity = (alone - out.logits).abs().max().item()
    assert sensitivity > 100 * TOL[dtype], f"the model barely mixes tokens ({sensitivity:g}): this test could not fail"
    local = sharded_model(**shard)
    local.loss.backward()
    loss, grads = summed(local.loss), [summed(p.grad) for p in sharded_model.parameters()]  # collectives first
    tol = TOL[loss_dtype or dtype]
    assert_close(local.logits.detach(), shard["boundaries"].take(out.logits).detach(), "logits", tol=TOL[dtype])
    assert_close(loss, out.loss.detach(), "summed loss", tol=tol)
    for (name, want), got in zip(model.named_parameters(), grads, strict=True):
        assert_close(got, want.grad, f"summed grad of {name}", tol=tol)


def patched(family: str) -> Callable[[], torch.nn.Module]:
    """A tiny Hugging Face model of ``family``, patched, in training mode (eager experts: they run in float64)."""
    from hybrid_pack.integrations.transformers import patch_model
    from hybrid_pack.integrations.transformers.tiny import tiny_model

    def make() -> torch.nn.Module:
        model = tiny_model(family)
        if getattr(model.config, "num_experts", 0):
            model.set_experts_implementation("eager")
        return patch_model(model).train()

    return make


def attention_model() -> HybridForCausalLM:
    return HybridForCausalLM(HybridConfig(vocab_size=97, hidden_size=32, layer_pattern="AA", intermediate_size=48,
                                          num_attention_heads=4, num_key_value_heads=2, head_dim=8))


def preset(name: str) -> Callable[[], HybridForCausalLM]:
    return lambda: from_preset(name, vocab_size=97)


def expect_input_error(field: str, call: Callable[[], object]) -> None:
    try:
        call()
    except InputError as error:
        message = str(error)
    else:
        raise AssertionError(f"no InputError naming {field!r}")
    assert message.startswith(field), f"InputError names {message.split(':')[0]!r}, not {field!r}"


def check_errors(rank: int, world: int) -> None:
    layout = Layout("row", (5, 3 * world - 5))
    batch = packed_batch(layout, 50, seed=0)
    two_rows = {**batch, "input_ids": batch["input_ids"].repeat(2, 1)}
    expect_input_error("input_ids", lambda: shard_batch(two_rows))
    odd = packed_batch(Layout("odd", (3, 3 * world - 2)), 50, seed=0)
    expect_input_error("pack_length", lambda: shard_batch(odd))
    not_zigzag = packed_batch(Layout("divides_by_world_not_twice", (3, 3 * world - 3)), 50, seed=0)  # 3R tokens
    shard_batch(not_zigzag)
    expect_input_error("pack_length", lambda: shard_batch(not_zigzag, layout="zigzag"))
    # Boundaries built for another rank's place, then for a group this process is not in.
    shard = shard_batch(batch)["boundaries"]
    wrong = ShardedBoundaries.from_row(shard.row, group=None, rank=(rank + 1) % world, world_size=world)
    x = torch.randn(1, 3, 4)
    conv = public_op("conv")
    expect_input_error("boundaries", lambda: conv(x, torch.randn(4, 3), None, wrong))
    halves = [dist.new_group(list(range(world))[half::2]) for half in (0, 1)]  # every rank makes both
    foreign = ShardedBoundaries.from_row(shard.row, group=halves[1 - rank % 2], rank=0, world_size=world // 2)
    expect_input_error("boundaries", lambda: conv(torch.randn(1, foreign.local.total_tokens, 4), torch.randn(4, 3),
                                                  None, foreign))
    model = attention_model()
    with PackingGuard(model, every=1):
        expect_input_error("boundaries", lambda: model(**shard_batch(batch)))
    # Ranks given different rows (tokens, then lengths) raise on every rank instead of hanging or training on a row
    # no rank holds; a mesh is a group; a loss on a shard needs the row's target count.
    other_tokens = packed_batch(layout, 50, seed=rank)
    expect_input_error("input_ids", lambda: shard_batch(other_tokens))
    other_lengths = packed_batch(Layout("row", (2 + rank % 2, 3 * world - 2 - rank % 2)), 50, seed=0)
    expect_input_error("input_ids", lambda: shard_batch(other_lengths))
    with_image = {**batch, "pixel_values": torch.ones(1, 3)} if rank == 0 else batch  # one rank refuses: all stop
    expect_input_error("pixel_values" if rank == 0 else "input_ids", lambda: shard_batch(with_image))
    # a refusal of the row's shape or of the layout on one rank only: every rank raises (the other ranks waited)
    two_rows = {**batch, "input_ids": batch["input_ids"].expand(2, -1)} if rank == 0 else batch
    expect_input_error("input_ids", lambda: shard_batch(two_rows))
    expect_input_error("layout" if rank == 0 else "input_ids",
                       lambda: shard_batch(batch, layout="zig-zag" if rank == 0 else "contiguous"))
    mesh = init_device_mesh("cpu", (world,))
    assert torch.equal(shard_batch(batch, mesh)["input_ids"], shard_batch(batch)["input_ids"])
    expect_input_error("group", lambda: shard_batch(batch, list(range(world))))
    moved = {**batch, "boundaries": PackedBoundaries.from_lengths([2 * world])}
    expect_input_error("boundaries", lambda: shard_batch(moved))
    whole = shard_batch(batch)
    expect_input_error("num_items_in_batch", lambda: model(**{k: v for k, v in whole.items()
                                                                if k != "num_items_in_batch"}))
    hf_model = patched("lfm2")()
    expect_input_error("num_items_in_batch", lambda: hf_model(**{k: v for k, v in whole.items()
                                                                   if k != "num_items_in_batch"}))
    expect_input_error("labels", lambda: hf_model(**{k: v for k, v in whole.items() if k != "shift_labels"}))
    mrope = torch.arange(3 * world * 3).view(3, 1, -1)
    expected = mrope[..., 3 * rank:3 * rank + 3]  # contiguous: rank r holds row tokens [3r, 3r + 3)
    got = shard_batch({**batch, "position_ids": mrope})["position_ids"]
    assert got.shape == (3, 1, 3) and torch.equal(got, expected), f"M-RoPE position_ids are not this rank's: {got}"


def check_fsdp_logits(tied: bool, rank: int, world: int) -> None:
    """Under FSDP2 a loss built from the lazily computed logits (the head gathered after the forward) gives the
    unsharded gradients, like the fused loss does."""
    torch.manual_seed(0)
    model = HybridForCausalLM(HybridConfig(vocab_size=97, hidden_size=32, layer_pattern="AA", intermediate_size=48,
                                           num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                           tie_word_embeddings=tied)).double()
    sharded = parallelize(copy.deepcopy(model), mesh=None, fsdp=True)
    batch = packed_batch(Layout("row", (9, 4 * world - 1)), 97, seed=1)
    model(**batch).loss.backward()
    shard = shard_batch(batch)
    out = sharded(**shard)
    loss = F.cross_entropy(out.logits[0], shard["shift_labels"][0], ignore_index=-100, reduction="sum")
    (loss / shard["num_items_in_batch"] * world).backward()  # FSDP2 averages the gradients over the ranks
    for name, want in model.named_parameters():
        got = dict(sharded.named_parameters())[name].grad.full_tensor()
        assert_close(got, want.grad, f"grad of {name}", tol=TOL[torch.float64])


def cases(world: int) -> dict[str, Callable[[int], None]]:
    """Every case name of one launch (also the pytest ids), by group: each op and model under every layout; on
    4 ranks the native presets in float64 only and no patched Qwen3-Next or Bamba (the launch's time)."""
    out: dict[str, dict[str, Callable[[int], None]]] = {"ops": {}, "models": {}, "presets": {}, "errors": {}}
    # Padding that keeps the row divisible by 2 * world (the zigzag chunks), never none.
    model_layout = Layout("model_row", (1, 9, 1, 20, 2, 4 * world + 3),
                          num_pad_tokens=2 * world - (36 + 4 * world) % (2 * world))
    for cp in LAYOUTS:
        for op in (op for op in OP_SIGNATURES if cp in TESTED_LAYOUTS[op]):
            for layout in op_layouts(world):
                out["ops"][f"{op}-{cp}-{layout.name}"] = (
                    lambda rank, op=op, layout=layout, cp=cp: check_op(op, layout, cp, rank, world))
        for dtype in TOL:
            name = str(dtype).removeprefix("torch.")
            out["models"][f"attention_model-{cp}-{name}"] = (
                lambda rank, dtype=dtype, cp=cp: check_model(attention_model, model_layout, cp, dtype, world))
            for preset_name in ("qwen3-next-tiny", "bamba-tiny") if world == 2 or dtype == torch.float64 else ():
                out["presets"][f"{preset_name}-{cp}-{name}"] = (lambda rank, p=preset_name, dtype=dtype, cp=cp:
                                                                check_model(preset(p), model_layout, cp, dtype, world))
        # lfm2: conv + attention; the others need every op's CP (on 2 ranks: 4 add no rank edge of a new kind).
        for family in ("lfm2", "qwen3_next", "bamba") if world == 2 else ("lfm2",):
            group = "models" if family == "lfm2" else "presets"
            out[group][f"hf_{family}-{cp}-float64"] = (lambda rank, family=family, cp=cp: check_model(
                patched(family), model_layout, cp, torch.float64, world, loss_dtype=torch.float32))
    out["errors"]["bad_input"] = lambda rank: check_errors(rank, world)
    for tied in (False, True):
        out["models"][f"fsdp_logits_{'tied' if tied else 'untied'}_head"] = (
            lambda rank, tied=tied: check_fsdp_logits(tied, rank, world))
    return out


def main(out_path: str, groups: list[str]) -> None:
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))  # a case that hangs fails instead
    chosen = {name: case for group, group_cases in cases(dist.get_world_size()).items()
              if not groups or group in groups for name, case in group_cases.items()}
    write_on_rank0(out_path, run_cases(chosen))
    end_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
    exit_without_finalizing(0)
