"""Context parallelism (docs/parallel.md): a row split across 2 and 4 gloo processes equals the row on one.

One torchrun launch per group size runs every case (tests/workers/dist_context_parallel.py), each under
both layouts (contiguous and zigzag), and reports one verdict per case; the tests below read them.
``ops``: conv, attention, Gated DeltaNet and SSD outputs and every input's gradient on adversarial layouts,
and exactly zero gradient across documents. ``models``: an attention model's and a patched LFM2's logits
slice, summed loss and summed gradients. ``presets``: the same for both native presets (they need every
op's context-parallel path, Gated DeltaNet and SSD included) and patched Qwen3-Next and Bamba.
``errors``: bad input. The in-process tests check the exchange plans (by running them on row positions),
the layouts' chunks and positions, and the label shift on the host.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from hybrid_pack import PackedBoundaries, PackingCollator, packed_loss
from hybrid_pack.boundaries.sharded import LAYOUTS
from hybrid_pack.errors import BoundaryError, InputError, UnsupportedModelError
from hybrid_pack.ops.cp.exchange import TokenExchange, halo_plan
from hybrid_pack.ops.cp.relayout import relayout_plan
from hybrid_pack.parallel import ShardedBoundaries, shard_batch
from hybrid_pack.schema import NUM_ITEMS_IN_BATCH, SHIFT_LABELS
from tests.workers import dist_context_parallel as worker
from tests.workers.launch import launch_once, torchrun

WORKER = Path(worker.__file__)
WORLDS = (2, 4)


@pytest.fixture(scope="module")
def verdicts(tmp_path_factory: pytest.TempPathFactory):
    """``verdicts(world)``: every case's verdict of the one launch on ``world`` ranks (run on first use)."""
    return launch_once(WORKER, tmp_path_factory.mktemp, timeout=600)


@pytest.mark.distributed
@pytest.mark.parametrize(("world", "case"), [(world, case) for world in WORLDS
                                             for cases in worker.cases(world).values() for case in cases],
                         ids=lambda value: f"{value}ranks" if isinstance(value, int) else value)
def test_sharded_equals_unsharded(verdicts, world, case):
    verdict = verdicts(world)[case]
    assert verdict == "ok", verdict


# ---------------------------------------------------------------- on the host
def _run_on_positions(plans: list[TokenExchange], holdings: list[np.ndarray]) -> list[np.ndarray]:
    """Every rank's output of one planned exchange, on the host: each rank holds its tokens' row positions."""
    messages = {(plan.rank, peer): np.concatenate([holdings[plan.rank][start:stop] for start, stop in ranges])
                for plan in plans for peer, ranges in plan.outgoing()}
    outputs = []
    for plan in plans:
        for peer, count in plan.receives:
            assert len(messages[(peer, plan.rank)]) == count, f"rank {peer} sends rank {plan.rank} another count"
        sources = {peer: messages[(peer, plan.rank)] for peer, _ in plan.receives} | {plan.rank: holdings[plan.rank]}
        outputs.append(np.concatenate([sources[source][start:stop] for source, start, stop in plan.pieces]))
    assert len(messages) == sum(len(plan.receives) for plan in plans), "a message nobody receives"
    return outputs


def _positions(shard: ShardedBoundaries, rank: int) -> np.ndarray:
    return np.concatenate([np.arange(start, start + length) for start, length in shard.chunks_of(rank)])


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("limit", [3, None])
def test_halo_plans_deliver_each_chunk_its_preceding_document_tokens(layout, world, limit):
    """Run every rank's planned halo exchange on row positions: each rank gets exactly ``[halo, chunk]`` for
    each chunk, the halo the last ``min(limit, first position)`` row tokens before it; senders and receivers
    agree on every message."""
    row = PackedBoundaries.from_document_lengths([1, 2, 6 * world - 10 if world > 1 else 4, 1, 1, 3],
                                                 num_pad_tokens=2)
    shards = [ShardedBoundaries.from_row(row, group=None, rank=r, world_size=world, layout=layout)
              for r in range(world)]
    plans = [halo_plan(shard, limit) for shard in shards]
    outputs = _run_on_positions([plan.exchange for plan in plans], [_positions(shard, r) for r, shard in
                                                                    enumerate(shards)])
    starts = np.asarray(row.starts)
    for shard, plan, output in zip(shards, plans, outputs, strict=True):
        expected = []
        for (start, length), halo in zip(shard.chunks, plan.halos, strict=True):
            document_start = starts[starts <= start].max()
            assert halo == (start - document_start if limit is None else min(limit, start - document_start))
            expected.append(np.arange(start - halo, start + length))
        np.testing.assert_array_equal(output, np.concatenate(expected))


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def testrelayout_plans_move_every_token_to_its_contiguous_rank_and_back(world):
    row = PackedBoundaries.from_document_lengths([5, 6 * world - 5], num_pad_tokens=6 * world)
    shards = [ShardedBoundaries.from_row(row, group=None, rank=r, world_size=world, layout="zigzag")
              for r in range(world)]
    zigzag = [_positions(shard, r) for r, shard in enumerate(shards)]
    contiguous = _run_on_positions([relayout_plan(shard, "zigzag", "contiguous") for shard in shards], zigzag)
    per_rank = row.total_tokens // world
    for r, positions in enumerate(contiguous):
        np.testing.assert_array_equal(positions, np.arange(r * per_rank, (r + 1) * per_rank))
    back = _run_on_positions([relayout_plan(shard, "contiguous", "zigzag") for shard in shards], contiguous)
    for got, want in zip(back, zigzag, strict=True):
        np.testing.assert_array_equal(got, want)


def test_zigzag_chunks_segments_and_document_positions():
    """16 tokens on 2 ranks: chunks of 4; rank 0 holds chunks 0 and 3, rank 1 chunks 1 and 2. Documents of 5,
    9 and 2 tokens: rank 0's late chunk continues the 9-token document, rank 1's chunks cut it in two."""
    row = PackedBoundaries.from_document_lengths([5, 9, 2])
    first, second = (ShardedBoundaries.from_row(row, group=None, rank=r, world_size=2, layout="zigzag")
                     for r in range(2))
    assert (first.chunks, second.chunks) == (((0, 4), (12, 4)), ((4, 4), (8, 4)))
    assert (first.offset, second.offset) == (0, 4)
    assert first.chunk_segments == ((4,), (2, 2)) and second.chunk_segments == ((1, 3), (4,))
    assert first.chunk_first_positions == ((0, 7), (4, 3))
    assert first.document_positions.tolist() == [[0, 1, 2, 3, 7, 8, 0, 1]]
    assert second.document_positions.tolist() == [[4, 0, 1, 2, 3, 4, 5, 6]]
    tokens = torch.arange(16)[None]
    assert first.take(tokens).tolist() == [[0, 1, 2, 3, 12, 13, 14, 15]]


@pytest.mark.parametrize("world", [1, 2, 4])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_document_positions_are_the_rows_at_every_local_token(world, layout):
    row = PackedBoundaries.from_document_lengths([3, 16 * world - 9, 1, 2], num_pad_tokens=3)
    for rank in range(world):
        shard = ShardedBoundaries.from_row(row, group=None, rank=rank, world_size=world, layout=layout)
        assert torch.equal(shard.document_positions, shard.take(row.position_ids))
        assert sum(shard.chunk_segments, ()) == shard.local.segment_lengths


def test_zigzag_padding_in_an_early_chunk_is_a_plain_segment():
    """Padding reaching a rank's first chunk: that piece is a segment there; its last chunk's is the padding."""
    row = PackedBoundaries.from_document_lengths([3, 1], num_pad_tokens=8)  # 12 tokens, chunks of 3 on 2 ranks
    shard = ShardedBoundaries.from_row(row, group=None, rank=1, world_size=2, layout="zigzag")
    assert shard.chunks == ((3, 3), (6, 3))
    assert shard.local.segment_lengths == (1, 2, 3) and shard.local.num_pad_tokens == 3
    assert shard.chunk_first_positions[1] == (0, 2)


def test_zigzag_needs_a_row_divisible_by_twice_the_group():
    row = PackedBoundaries.from_document_lengths([5, 7])
    ShardedBoundaries.from_row(row, group=None, rank=0, world_size=4)  # 12 tokens divide by 4
    with pytest.raises(InputError, match=r"^pack_length: .*do not divide by the 8 chunks .*pad_to_multiple_of=8"):
        ShardedBoundaries.from_row(row, group=None, rank=0, world_size=4, layout="zigzag")
    with pytest.raises(InputError, match="^layout: expected one of"):
        ShardedBoundaries.from_row(row, group=None, rank=0, world_size=4, layout="ring")


def test_contiguous_edges_raise_under_zigzag_and_its_contiguous_shard_has_them():
    row = PackedBoundaries.from_document_lengths([5, 7, 4])
    shard = ShardedBoundaries.from_row(row, group=None, rank=1, world_size=2, layout="zigzag")
    for name in ("first_positions", "first_position", "continues_from_previous", "continues_into_next",
                 "first_segment"):
        with pytest.raises(BoundaryError, match=rf"^boundaries\.{name}: .*'zigzag' layout .*contiguous\(\)"):
            getattr(shard, name)
    contiguous = shard.contiguous()
    assert contiguous is shard.contiguous() and contiguous.contiguous() is contiguous
    assert (contiguous.layout, contiguous.offset, contiguous.first_position) == ("contiguous", 8, 3)


@pytest.mark.parametrize(("op", "states"), [("gated_delta", "initial_state"), ("gated_delta", "output_final_state"),
                                            ("ssd", "initial_states"), ("ssd", "return_final_states")])
def test_per_document_states_are_refused_under_zigzag(op, states):
    """A rank's documents under zigzag are not the contiguous shard's the recurrent ops run on: raised before any
    exchange (one process here), naming the argument and the layout to use."""
    from tests.kit import gated_delta_signature, op_inputs, public_op, ssd_signature

    row = PackedBoundaries.from_document_lengths([3, 5])
    shard = ShardedBoundaries.from_row(row, group=None, rank=0, world_size=1, layout="zigzag")
    flags = {states: True, "output_final_state" if op == "gated_delta" else "return_final_states": states.endswith(
        ("final_state", "final_states"))}
    signature = (gated_delta_signature(initial_state=flags.get("initial_state", False),
                                       output_final_state=flags["output_final_state"]) if op == "gated_delta" else
                 ssd_signature(initial_states=flags.get("initial_states", False),
                               return_final_states=flags["return_final_states"]))
    case = op_inputs(op, signature, shard.local)  # one state per local segment: what the op's checks count
    with pytest.raises(InputError, match=rf"^{states}: per-document states .*layout='contiguous'"):
        case.call(public_op(op), shard)


@pytest.mark.parametrize("world", [2, 3, 4])
def test_rank_edges_are_read_from_the_row(world):
    """Every rank's view of its edges (what the exchanges are planned from) against a count on the row."""
    row = PackedBoundaries.from_document_lengths([1, 2, 6 * world - 10, 1, 1, 3], num_pad_tokens=2)
    starts, per_rank = set(row.starts), row.total_tokens // world
    for rank in range(world):
        shard = ShardedBoundaries.from_row(row, group=None, rank=rank, world_size=world)
        lo, hi = rank * per_rank, (rank + 1) * per_rank
        assert shard.first_position == lo - max(s for s in starts if s <= lo)
        assert shard.continues_from_previous == (lo not in starts)
        assert shard.continues_into_next == (hi < row.total_tokens and hi not in starts)


def test_moving_a_shard_moves_its_local_tensors_and_leaves_the_row_on_the_host():
    row = PackedBoundaries.from_document_lengths([5, 7, 4])
    shard = ShardedBoundaries.from_row(row, group=None, rank=1, world_size=2).to("meta")
    assert shard.local.cu_seqlens.device.type == "meta" and shard.device.type == "meta" and shard.row is row
    assert (shard.rank, shard.offset, shard.first_position, shard.local.segment_lengths) == (1, 8, 3, (4, 4))


def test_a_shard_is_no_packed_boundaries_and_its_fields_name_local():
    """A rank's slice cannot pass for whole documents: it is not a PackedBoundaries, and reading one of their
    fields from it raises naming ``local`` (the slice's segments, a document cut at the rank edge in two)."""
    row = PackedBoundaries.from_document_lengths([5, 7, 4])
    shard = ShardedBoundaries.from_row(row, group=None, rank=1, world_size=2)
    assert not isinstance(shard, PackedBoundaries) and isinstance(shard.local, PackedBoundaries)
    assert shard.local.segment_lengths == (4, 4) and shard.local.position_ids.tolist() == [[0, 1, 2, 3, 0, 1, 2, 3]]
    assert shard.document_positions.tolist() == [[3, 4, 5, 6, 0, 1, 2, 3]]  # the first piece continues rank 0's
    for name in ("seq_idx", "cu_seqlens", "position_ids", "total_tokens", "num_docs", "segment_lengths",
                 "chunk_layout", "hf_kwargs"):
        with pytest.raises(BoundaryError, match=rf"^boundaries: .*no '{name}'.*boundaries\.local\.{name};"):
            getattr(shard, name)
    assert not hasattr(shard, "no_such_attribute")  # any other name is a plain AttributeError


def test_sharded_boundaries_built_by_hand_must_be_a_slice_of_their_row():
    row = PackedBoundaries.from_document_lengths([5, 7, 4])
    local = PackedBoundaries.from_lengths([4, 4])
    assert ShardedBoundaries(local=local, row=row, group=None, rank=1, world_size=2, offset=8).first_position == 3
    with pytest.raises(BoundaryError, match="^local: expected rank 1's 8 tokens"):
        ShardedBoundaries(local=local, row=row, group=None, rank=1, world_size=2, offset=0)
    with pytest.raises(BoundaryError, match="^local: expected a PackedBoundaries; got ShardedBoundaries"):
        ShardedBoundaries(local=ShardedBoundaries.from_row(row, group=None, rank=1, world_size=2), row=row,
                          group=None, rank=1, world_size=2, offset=8)
    with pytest.raises(BoundaryError, match=r"^local: .* at offset 4 \(zigzag layout\); got 8 tokens at offset 8"):
        ShardedBoundaries(local=local, row=row, group=None, rank=1, world_size=2, offset=8, layout="zigzag")
    with pytest.raises(BoundaryError, match=r"^local: segments \[2, 6\] are not cut at the edges \[4, 8\]"):
        ShardedBoundaries(local=PackedBoundaries.from_lengths([2, 6]), row=row, group=None, rank=1, world_size=2,
                          offset=4, layout="zigzag")
    zigzag = PackedBoundaries.from_lengths([1, 3, 4])
    assert ShardedBoundaries(local=zigzag, row=row, group=None, rank=1, world_size=2, offset=4,
                             layout="zigzag").chunk_segments == ((1, 3), (4,))
    with pytest.raises(InputError, match="^layout"):
        ShardedBoundaries(local=local, row=row, group=None, rank=1, world_size=2, offset=8, layout="ring")


def test_whole_document_code_refuses_a_shard():
    """Helpers that read whole documents fail loudly on a slice instead of taking its pieces for documents."""
    from hybrid_pack.boundaries.targets import shift_labels

    row = PackedBoundaries.from_document_lengths([5, 7, 4])
    shard = ShardedBoundaries.from_row(row, group=None, rank=1, world_size=2)
    labels = torch.arange(8)[None]
    with pytest.raises(BoundaryError, match="^boundaries: .*boundaries.local"):
        shift_labels(labels, shard)
    with pytest.raises(InputError, match="^reduction: 'sequence' needs whole documents"):
        packed_loss(torch.randn(1, 8, 5), labels, boundaries=shard, shifted=True, reduction="sequence")
    with pytest.raises(InputError, match=r"^boundaries: expected 16 tokens .*; got 8"):
        packed_loss(torch.randn(1, 16, 5), torch.arange(16)[None], boundaries=shard, shifted=True)


def test_ops_check_a_shard_against_its_local_tokens():
    from hybrid_pack.ops import causal_conv1d

    row = PackedBoundaries.from_document_lengths([5, 7, 4])
    shard = ShardedBoundaries.from_row(row, group=None, rank=1, world_size=2)
    weight = torch.randn(3, 4, dtype=torch.float64)
    with pytest.raises(InputError, match=r"^x: expected T = 8 tokens \(boundaries\.local\.total_tokens\)"):
        causal_conv1d(torch.randn(1, 16, 3, dtype=torch.float64), weight, None, shard)
    with pytest.raises(InputError, match=r"^boundaries: on meta but x is on cpu"):
        causal_conv1d(torch.randn(1, 8, 3, dtype=torch.float64), weight, None, shard.to("meta"))
    whole = ShardedBoundaries.from_row(row, group=None, rank=0, world_size=1)  # a group of one: the row itself
    x = torch.randn(1, 16, 3, dtype=torch.float64)
    assert torch.equal(causal_conv1d(x, weight, None, whole), causal_conv1d(x, weight, None, row))


@pytest.mark.parametrize(("family", "attention", "refused"), [
    ("lfm2", "eager", "^config._attn_implementation: 'eager' masks whole documents"),
])
def test_patched_layers_without_a_context_parallel_path_refuse_a_shard(family, attention, refused):
    """A Hugging Face mixer that would run a rank's pieces as documents raises naming the fix (one process)."""
    pytest.importorskip("transformers")
    from hybrid_pack.integrations.transformers import patch_model
    from hybrid_pack.integrations.transformers.tiny import tiny_model

    model = patch_model(tiny_model(family))
    model.set_attn_implementation(attention)
    batch = PackingCollator()([{"input_ids": [1, 2, 3]}, {"input_ids": [4, 5]}])
    with pytest.raises(UnsupportedModelError, match=refused):
        model(**shard_batch(batch))


def test_one_process_shard_is_the_row_and_its_loss_is_the_row_loss():
    collator = PackingCollator(pack_length=20)
    batch = collator([{"input_ids": list(range(3, 3 + n))} for n in (4, 1, 9)])
    shard = shard_batch(batch)
    assert torch.equal(shard["input_ids"], batch["input_ids"])
    assert isinstance(shard["boundaries"], ShardedBoundaries) and shard["boundaries"].world_size == 1
    logits = torch.randn(1, 20, 16, dtype=torch.float64)
    row = PackedBoundaries.from_batch(batch)
    expected = packed_loss(logits, batch["labels"], boundaries=row)
    got = packed_loss(logits, shard[SHIFT_LABELS], boundaries=shard["boundaries"], shifted=True,
                      num_items_in_batch=shard[NUM_ITEMS_IN_BATCH])
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-12)


def test_shift_labels_cross_rank_edges_and_stop_at_documents():
    batch = PackingCollator(pack_length=8)([{"input_ids": [5, 6, 7]}, {"input_ids": [8, 9, 10, 11]}])
    row = PackedBoundaries.from_batch(batch)
    shards = [ShardedBoundaries.from_row(row, group=None, rank=r, world_size=2) for r in range(2)]
    assert [s.first_position for s in shards] == [0, 1]
    assert shards[1].document_positions.tolist() == [[1, 2, 3, 0]]
    from hybrid_pack.loss import shift_labels
    assert shift_labels(batch["labels"], row).tolist() == [[6, 7, -100, 9, 10, 11, -100, -100]]


@pytest.mark.parametrize("layout", ["ring", "Zigzag"])
def test_unknown_layout_is_refused(layout):
    batch = PackingCollator()([{"input_ids": [1, 2]}])
    with pytest.raises(InputError, match="^layout"):
        shard_batch(batch, layout=layout)


def test_halo_plan_is_flat_in_row_length_for_the_conv():
    for total in (64, 4096):
        row = PackedBoundaries.from_document_lengths([total])
        for layout in LAYOUTS:
            plan = halo_plan(ShardedBoundaries.from_row(row, group=None, rank=3, world_size=4, layout=layout), 3)
            assert plan.halo_tokens == 3 * len(plan.halos)
            assert np.sum([c for _, c in plan.exchange.receives]) <= plan.halo_tokens


TRAIN_SETTINGS = {"max_examples": 12, "capacity": 256, "max_steps": 2, "dtype": "float32", "guard_every": 0,
                  "overflow": "truncate"}


def _train_under_torchrun(out: Path, nproc: int, *options: str, **settings: object) -> dict:
    import hybrid_pack.cli

    settings = {**TRAIN_SETTINGS, **settings}
    torchrun(Path(hybrid_pack.cli.__file__), "train", "--out", str(out), "--no-progress", *options,
             *[f"--{key.replace('_', '-')}={value}" for key, value in settings.items()], processes=nproc)
    return json.loads((out / "metrics.json").read_text())


@pytest.fixture
def lfm2_directory(tmp_path: Path) -> Path:
    """A tiny Hugging Face LFM2 (short conv + attention: every op it runs has its context-parallel path)."""
    pytest.importorskip("transformers")
    from hybrid_pack.integrations.transformers.tiny import tiny_config

    tiny_config("lfm2").save_pretrained(tmp_path / "lfm2")
    return tmp_path / "lfm2"


@pytest.mark.distributed
@pytest.mark.slow
def test_train_with_context_parallel_2_equals_one_process(tmp_path, lfm2_directory):
    """`hybrid-pack train --context-parallel 2` on 2 ranks (one replica) takes the steps one process takes."""
    from hybrid_pack.training import TrainConfig, train

    one = train(TrainConfig(model=str(lfm2_directory), out=str(tmp_path / "one"), progress=False, **TRAIN_SETTINGS))
    sharded = _train_under_torchrun(tmp_path / "cp", 2, "--model", str(lfm2_directory), "--context-parallel", "2",
                                    guard_every=1)
    assert sharded["world_size"] == 2 and sharded["context_parallel"] == 2
    assert "guard" not in sharded and "context-parallel" in sharded["guard_off"]  # off, and said so
    assert sharded["losses"] == pytest.approx(one["losses"], rel=1e-5)
    assert sharded["parameters_checksum"] == pytest.approx(one["parameters_checksum"], rel=1e-5)


@pytest.mark.distributed
@pytest.mark.slow
def test_train_two_replicas_of_two_context_parallel_ranks_equals_two_data_parallel_ranks(tmp_path, lfm2_directory):
    """4 ranks as a ("dp", "cp") = (2, 2) mesh draw the rows 2 data-parallel ranks draw and take the same steps."""
    model = ("--model", str(lfm2_directory))
    data_parallel = _train_under_torchrun(tmp_path / "dp", 2, *model)
    mesh = _train_under_torchrun(tmp_path / "mesh", 4, *model, "--context-parallel", "2")
    assert mesh["world_size"] == 4 and mesh["context_parallel"] == 2
    assert mesh["losses"] == pytest.approx(data_parallel["losses"], rel=1e-5)
    assert mesh["parameters_checksum"] == pytest.approx(data_parallel["parameters_checksum"], rel=1e-5)


def test_guard_refuses_a_sharded_call():
    from hybrid_pack.modeling import HybridConfig, HybridForCausalLM
    from hybrid_pack.testing import PackingGuard

    model = HybridForCausalLM(HybridConfig(layer_pattern="A", vocab_size=32))
    batch = PackingCollator()([{"input_ids": [1, 2, 3]}, {"input_ids": [4, 5]}])
    with PackingGuard(model, every=1), pytest.raises(InputError, match="^boundaries: .*context-parallel"):
        model(**shard_batch(batch))


def test_context_parallel_size_must_divide_the_world():
    from hybrid_pack.parallel.mesh import context_parallel_mesh

    assert context_parallel_mesh(1, "cpu") is None
    with pytest.raises(InputError, match="^context_parallel: 2 does not divide the 1 processes"):
        context_parallel_mesh(2, "cpu")
    with pytest.raises(InputError, match="^context_parallel: expected a positive int"):
        context_parallel_mesh(0, "cpu")


def test_bidirectional_attention_on_a_shard_is_refused():
    from hybrid_pack.ops import varlen_attention

    row = PackedBoundaries.from_document_lengths([3, 5])
    shard = ShardedBoundaries.from_row(row, group=None, rank=0, world_size=1)
    q = torch.randn(1, 8, 2, 4)
    with pytest.raises(InputError, match="^causal: context-parallel attention is causal only"):
        varlen_attention(q, q, q, shard, causal=False)


def test_one_process_zigzag_shard_is_the_row_in_two_chunks():
    batch = PackingCollator(pack_length=20)([{"input_ids": list(range(3, 3 + n))} for n in (4, 1, 9)])
    shard = shard_batch(batch, layout="zigzag")
    bounds = shard["boundaries"]
    assert bounds.layout == "zigzag" and bounds.chunks == ((0, 10), (10, 10))
    assert torch.equal(shard["input_ids"], batch["input_ids"])
    assert bounds.local.segment_lengths == (4, 1, 5, 4, 6) and bounds.local.num_pad_tokens == 6
    assert torch.equal(bounds.document_positions, batch["position_ids"])


@pytest.mark.parametrize("key", ["pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw"])
def test_a_row_with_images_or_videos_is_refused(key):
    batch = PackingCollator()([{"input_ids": [1, 2]}, {"input_ids": [3, 4]}])
    with pytest.raises(InputError, match=f"^{key}: a row with images or videos cannot be split"):
        shard_batch({**batch, key: torch.ones(1, 3)})
    shard_batch({**batch, key: torch.ones(0, 3)})  # an empty one is no image


def test_boundaries_of_another_row_and_a_group_of_another_kind_are_refused():
    batch = PackingCollator()([{"input_ids": [1, 2]}, {"input_ids": [3, 4]}])
    with pytest.raises(BoundaryError, match="^boundaries: describe 3 tokens; the row has 4"):
        shard_batch({**batch, "boundaries": PackedBoundaries.from_lengths([3])})
    with pytest.raises(InputError, match="^group: expected a process group"):
        shard_batch(batch, [0, 1])


def test_a_loss_on_a_shard_needs_the_rows_target_count():
    batch = PackingCollator()([{"input_ids": [1, 2, 3]}, {"input_ids": [4, 5]}])
    shard = shard_batch(batch)
    logits = torch.randn(1, 5, 8, dtype=torch.float64)
    with pytest.raises(InputError, match="^num_items_in_batch: a context-parallel shard's loss"):
        packed_loss(logits, shard[SHIFT_LABELS], boundaries=shard["boundaries"], shifted=True)
