"""Batch-invariant packing (docs/api.md §7d): inside ``batch_invariant()``, every sequence's outputs are bitwise the
same whatever it is packed with, wherever it sits, and alone in a row of the same length."""

from __future__ import annotations

import functools
import threading

import pytest
import torch
import torch.nn.functional as F

import hybrid_pack
from hybrid_pack.boundaries import PackedBoundaries
from hybrid_pack.errors import BackendUnavailableError, InputError
from hybrid_pack.ops.dispatch.registry import contract_of
from hybrid_pack.ops.dispatch.route import route_of
from hybrid_pack.ops.invariant import SEQUENCE_MIXING, is_batch_invariant
from hybrid_pack.testing import check_invariance

ROW = 128
LENGTHS = (1, 7, 60, 23, 2, 41, 16, 33)  # 183 tokens: two rows of 128 in any packing
PACKINGS = (
    [[0, 1, 2, 3, 4], [5, 6, 7]],
    [[7, 6, 5, 4], [3, 2, 1, 0]],
    [[2, 5, 0, 6], [1, 3, 7, 4]],
)
ALONE = [[i] for i in range(len(LENGTHS))]


def test_row_permuted_gemm_is_bitwise_stable() -> None:
    """The claim token-wise layers rest on: at a fixed row count, a row's GEMM result does not depend on the other
    rows nor on its offset (fp32 and bf16, the shapes of the tiny models' projections and heads)."""
    generator = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        for hidden, out in ((128, 384), (384, 128), (128, 8192), (32, 64), (64, 1000), (32, 5)):
            w = torch.randn(hidden, out, generator=generator).to(dtype)
            rows = torch.randn(60, hidden, generator=generator).to(dtype)
            results = []
            for offset in (0, 5, 17, 33, 68):
                x = torch.randn(ROW, hidden, generator=generator).to(dtype)
                x[offset:offset + 60] = rows
                results.append((x @ w)[offset:offset + 60])
            assert all(torch.equal(results[0], r) for r in results[1:]), (dtype, hidden, out)


def test_batched_products_are_bitwise_stable_per_member() -> None:
    """The claim the mode's whole-row ops and attention buckets rest on: a member of a batched product (``bmm``, a
    batched triangular solve, SDPA over padded rows, forward and input gradients) gets the same bits whatever the
    batch's size and its place in it (fp32 and bf16, the chunked scans' and the tiny models' attention shapes)."""
    generator = torch.Generator().manual_seed(0)
    real = torch.arange(64)[None, :] < torch.tensor([64, 40, 3, 17, 64, 1, 33])[:, None]   # key padding, per member
    eye = torch.eye(32)
    cases = {   # name: (fn(order, *inputs), input shapes, dtypes)
        "bmm": (lambda order, a, b: a @ b, [(7, 4, 64, 16), (7, 4, 16, 64)], (torch.float32, torch.bfloat16)),
        "solve_triangular": (lambda order, a, b: torch.linalg.solve_triangular(
            a.tril(-1) * 0.1 + eye, b, upper=False, unitriangular=True), [(7, 4, 32, 32), (7, 4, 32, 24)],
            (torch.float32,)),
        "sdpa causal": (lambda order, q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True),
                        [(7, 4, 64, 16), (7, 2, 64, 16), (7, 2, 64, 16)], (torch.float32, torch.bfloat16)),
        "sdpa key padding": (lambda order, q, k, v: F.scaled_dot_product_attention(
            q, k, v, enable_gqa=True, attn_mask=real[order].view(len(order), 1, 1, 64)),
            [(7, 4, 64, 16), (7, 2, 64, 16), (7, 2, 64, 16)], (torch.float32, torch.bfloat16)),
    }
    for name, (fn, shapes, dtypes) in cases.items():
        for dtype in dtypes:
            inputs = [torch.randn(shape, generator=generator).to(dtype) for shape in shapes]

            def members(order: list[int], fn=fn, inputs=inputs) -> list[list[torch.Tensor]]:
                leaves = [x[order].detach().requires_grad_() for x in inputs]
                out = fn(order, *leaves)
                weights = torch.stack([torch.randn(out.shape[1:], generator=torch.Generator().manual_seed(i))
                                       for i in order])
                (out.float() * weights).sum().backward()
                return [[out[j].detach(), *(leaf.grad[j] for leaf in leaves)] for j in range(len(order))]

            whole = members(list(range(7)))
            for order in ([3], [5, 0], [6, 5, 4, 3, 2, 1, 0]):
                for place, (member, part) in enumerate(zip(order, members(order), strict=True)):
                    assert all(torch.equal(a, b) for a, b in zip(whole[member], part, strict=True)), (
                        name, dtype, order, place)


def _op_outputs(op: str, case, layout: list[list[int]], weights: list[torch.Tensor], grads: bool, row_length: int = ROW
                ) -> tuple[dict[int, list[torch.Tensor]], dict[int, list[torch.Tensor]]]:
    """Each document's token outputs and input gradients when the documents run in the rows (of ``row_length``
    tokens) of ``layout``."""
    contract = contract_of(op)
    starts = [sum(LENGTHS[:i]) for i in range(len(LENGTHS))]
    leaves = {name: [case.arguments[name][:, s:s + n].detach().clone().requires_grad_(grads)
                     for s, n in zip(starts, LENGTHS, strict=True)]
              for name in case.token_inputs if case.arguments[name] is not None}
    outputs, gradients = {}, {}
    for row in layout:
        used = sum(LENGTHS[i] for i in row)
        boundaries = PackedBoundaries.from_document_lengths([LENGTHS[i] for i in row], num_pad_tokens=row_length - used)
        arguments = dict(case.arguments)
        for name, pieces in leaves.items():
            pad = pieces[0].new_zeros(1, row_length - used, *pieces[0].shape[2:])
            arguments[name] = torch.cat([pieces[i] for i in row] + [pad], dim=1)
        token_outputs, _ = contract.outputs(case.call(route_of(op).public, boundaries, arguments))
        start = 0
        for i in row:
            outputs[i] = [o[:, start:start + LENGTHS[i]].detach() for o in token_outputs]
            start += LENGTHS[i]
        if grads:
            w = torch.cat([weights[i] for i in row], dim=1)
            sum((o[:, :used].float() * w.reshape(*w.shape, *[1] * (o.dim() - 2))).sum()
                for o in token_outputs).backward()
    if grads:
        gradients = {i: [pieces[i].grad for pieces in leaves.values()] for i in range(len(LENGTHS))}
    return outputs, gradients


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("op", [*sorted(SEQUENCE_MIXING), "attention-window"])
def test_op_is_batch_invariant(op: str, dtype: torch.dtype) -> None:
    """Every document's outputs and input gradients: bitwise equal across three packings, alone, and alone in a
    shorter row (64 tokens) inside the mode; outside it, the difference is printed (not asserted).
    ``attention-window``: a sliding window of 5."""
    op, window = ("attention", 5) if op == "attention-window" else (op, None)
    contract = contract_of(op)
    generator = torch.Generator().manual_seed(0)
    signature = contract.default_signature(dtype, "cpu")
    if window is not None:
        signature = tuple(sorted({**dict(signature), "window": window}.items()))
    case = contract.make_case(signature, PackedBoundaries.from_document_lengths(list(LENGTHS)), generator)
    if window is not None:
        assert case.arguments["window"] == window
    weights = [torch.randn(1, n, generator=generator) for n in LENGTHS]
    with hybrid_pack.batch_invariant():
        runs = [_op_outputs(op, case, layout, weights, grads=True) for layout in (ALONE, *PACKINGS)]
        runs.append(_op_outputs(op, case, ALONE, weights, grads=True, row_length=64))
    (alone, alone_grads), others = runs[0], runs[1:]
    for outputs, grads in others:
        for i in range(len(LENGTHS)):
            assert all(torch.equal(a, b) for a, b in zip(alone[i], outputs[i], strict=True)), (op, i)
            assert all(torch.equal(a, b) for a, b in zip(alone_grads[i], grads[i], strict=True)), (op, i, "grad")
    default = [_op_outputs(op, case, layout, weights, grads=False)[0] for layout in PACKINGS]
    diff = max((a.float() - b.float()).abs().max().item() for outputs in default for i in range(len(LENGTHS))
               for a, b in zip(alone[i], outputs[i], strict=True))
    print(f"\n{op} {dtype}: outside batch_invariant(), max |packed - alone| = {diff:.3g}")


def _native(name: str) -> torch.nn.Module:
    from hybrid_pack.modeling import from_preset

    torch.manual_seed(0)
    return from_preset(name, vocab_size=512).eval()


def _patched(family: str) -> torch.nn.Module:
    from hybrid_pack.integrations.transformers import patch_model
    from hybrid_pack.integrations.transformers.experts import BATCH_INVARIANT_EXPERTS
    from hybrid_pack.integrations.transformers.tiny import tiny_model

    model = patch_model(tiny_model(family))
    model.set_experts_implementation(BATCH_INVARIANT_EXPERTS)   # what the trainers' batch_invariant=True sets
    return model


def _served_families() -> list[str]:
    """Every family with a tiny causal-LM config whose layers all run on routed §4 ops (the mode's reach)."""
    from hybrid_pack.integrations.transformers.families import family_of
    from hybrid_pack.integrations.transformers.tiny import TINY_CONFIGS, tiny_config

    class _Probe(torch.nn.Module):
        def __init__(self, family: str) -> None:
            super().__init__()
            self.config = tiny_config(family)

    return [name for name in sorted(TINY_CONFIGS)
            if all(kind.context_parallel for kind in family_of(_Probe(name)).kinds)]


MODELS = {"qwen3-next-tiny": lambda: _native("qwen3-next-tiny"), "bamba-tiny": lambda: _native("bamba-tiny"),
          **{f"hf-{family}": functools.partial(_patched, family) for family in _served_families()}}


@pytest.mark.parametrize("name", list(MODELS))
def test_model_is_batch_invariant(name: str) -> None:
    """8 sequences of lengths 1-60 in three packings of static rows of 128 and alone: inside the mode the log-probs
    are bitwise equal (fp32, bf16); outside it, the difference is printed."""
    model = MODELS[name]()
    outside = check_invariance(model, lengths=LENGTHS, row_length=ROW)
    print(f"\n{name} outside batch_invariant(): {outside}")
    with hybrid_pack.batch_invariant():
        for dtype in (torch.float32, torch.bfloat16):
            report = check_invariance(model, lengths=LENGTHS, row_length=ROW, dtype=dtype)
            assert report.ok, f"{name}: {report}"
            assert report.max_logprob_diff == 0 and report.mismatch_kl == 0


def test_the_report_names_the_autocast_it_ran_under() -> None:
    """Under torch.autocast the report said "(float32)", the parameters' dtype, not what set the products'."""
    model = MODELS["qwen3-next-tiny"]()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        report = check_invariance(model, lengths=(3, 5), row_length=16, packings=1)
    assert report.dtype == "float32 under autocast bfloat16"
    assert check_invariance(model, lengths=(3, 5), row_length=16, packings=1).dtype == "float32"


def test_mode_is_per_thread_and_refuses_what_it_does_not_cover() -> None:
    seen = []
    with hybrid_pack.batch_invariant():
        thread = threading.Thread(target=lambda: seen.append(is_batch_invariant()))
        thread.start()
        thread.join()
        assert is_batch_invariant()
        q = torch.randn(1, 8, 2, 4)
        static = PackedBoundaries.from_document_lengths([3, 5])
        from hybrid_pack.boundaries import StaticBoundaries
        with pytest.raises(InputError, match="batch_invariant"):
            hybrid_pack.ops.varlen_attention(q, q, q, StaticBoundaries.from_boundaries(static, 2))
        with pytest.raises(BackendUnavailableError, match="batch_invariant"), hybrid_pack.use_backends(conv="fla"):
            hybrid_pack.ops.causal_conv1d(torch.randn(1, 8, 4), torch.randn(4, 3), None, static)
    assert seen == [False] and not is_batch_invariant()


def test_check_invariance_refuses_bad_input() -> None:
    model = _native("bamba-tiny")
    with pytest.raises(InputError, match="row_length"):
        check_invariance(model, lengths=[200], row_length=ROW)
    with pytest.raises(InputError, match="packings"):
        check_invariance(model, lengths=[3], packings=0)


def test_a_layer_without_a_batch_invariant_form_refuses_the_mode() -> None:
    """Qwen4-Exp's QSA indexed attention and n-gram embedding do not run on routed ops: inside the mode its packed
    forward raises, naming the layer, rather than returning log-probs that are not bitwise invariant."""
    from hybrid_pack.errors import UnsupportedModelError

    model = _patched("qwen4_exp")
    with hybrid_pack.batch_invariant(), pytest.raises(UnsupportedModelError, match="no batch-invariant form"):
        check_invariance(model, lengths=LENGTHS, row_length=ROW)


def test_moe_experts_that_round_with_the_packing_refuse_the_mode() -> None:
    """transformers' ``grouped_mm`` experts round with each expert's token count, which the packing changes: inside
    the mode a patched MoE model on them raises, naming the fix, where it returned log-probs that differ by an ulp."""
    from hybrid_pack.errors import UnsupportedModelError
    from hybrid_pack.integrations.transformers.experts import experts_modules

    model = _patched("qwen3_next")
    assert experts_modules(list(model.modules()))           # the experts are found (transformers' names hold)
    model.set_experts_implementation("grouped_mm")
    with hybrid_pack.batch_invariant(), pytest.raises(UnsupportedModelError, match="set_experts_implementation"):
        check_invariance(model, lengths=LENGTHS, row_length=ROW)
    print(f"\ngrouped_mm experts outside the mode: {check_invariance(model, lengths=LENGTHS, row_length=ROW)}")
