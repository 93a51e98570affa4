"""SPEC §9b: a packed training step reads no tensor value on the host (docs/api.md §9b).

The counter patches every way a tensor's value reaches Python (``item``, ``tolist``, ``numpy``, ``__array__``,
``cpu``, ``bool()``, ``int()``, ``float()``, ``__index__``, ``format()``, ``is_nonzero``, ``torch.equal``,
``torch.allclose``) and every op whose output size the host must wait for (``nonzero``, ``unique``,
``masked_select``, ``repeat_interleave`` by tensor repeats), and counts the calls made
from a frame of the hybrid_pack package only (torch's and transformers' own reads are theirs). A batch goes from
:class:`~hybrid_pack.PackingCollator` through what moves it to the device in a real run (``Trainer._prepare_inputs``,
accelerate's ``send_to_device``), and one forward + backward of a patched Hugging Face model of every tiny family
and of a native preset must count zero, after one warm-up step (the backends settle their verdicts at a
process's first call). The same step without the collator's ``host_boundaries`` counts the documented fallback
read, and a read planted in a hybrid_pack frame is counted for every patched call: the counter is not blind.
"""

from __future__ import annotations

import contextlib
import copy
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import hybrid_pack
from hybrid_pack import PackingCollator, backends
from hybrid_pack.boundaries import PackedBoundaries
from hybrid_pack.boundaries.host import HostBoundaries, StaticHostBoundaries
from hybrid_pack.errors import BoundaryError
from hybrid_pack.schema import HOST_BOUNDARIES, INPUT_IDS, LABELS, POSITION_IDS, SEQ_IDX

PACKAGE = str(Path(hybrid_pack.__file__).parent) + "/"
READS = {"item": "t.item()", "tolist": "t.tolist()", "numpy": "t.numpy()", "__array__": "np.asarray(t)",
         "cpu": "t.cpu()", "__bool__": "bool(t)", "__int__": "int(t)", "__float__": "float(t)",
         "__index__": "[0, 1, 2][t]", "__format__": "f'{t:.1f}'", "is_nonzero": "t.is_nonzero()",
         "nonzero": "t.nonzero()", "unique": "t.unique()", "masked_select": "t.masked_select(t > 0)",
         "repeat_interleave": "t.repeat_interleave(t)"}
"""Each patched ``torch.Tensor`` method, and a statement that calls it on a 0-d int64 tensor ``t``: the reads, and
the ops whose result's size or value the host must wait for (a device sync on CUDA)."""
TORCH_READS = {"equal": "torch.equal(t, t)", "allclose": "torch.allclose(t, t)", "nonzero": "torch.nonzero(t)",
               "unique": "torch.unique(t)", "masked_select": "torch.masked_select(t, t > 0)",
               "repeat_interleave": "torch.repeat_interleave(t, t)"}
"""The same for functions of the ``torch`` namespace."""
SIZE_READS = {"nonzero", "unique", "masked_select", "repeat_interleave"}
"""The counted calls whose output size depends on a value (legitimate on tensors built on the host)."""


def _is_read(name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Whether this call waits on a value: ``repeat_interleave`` by tensor repeats without ``output_size``; every
    other counted call always does. (Indexing by a boolean mask is not counted: patching ``Tensor.__getitem__``
    leaves CPython's sequence slot behind, and ``torch.tensor`` then takes a 0-d tensor for a sequence.)"""
    if name == "repeat_interleave":
        return isinstance(args[0] if args else kwargs.get("repeats"), torch.Tensor) and "output_size" not in kwargs
    return True
LENGTHS = (5, 23, 1, 9, 3)   # a one-token document, one longer than the tiny models' chunk (16); padded to 48
VOCAB = 64


def _storage(value: Any) -> int | None:
    try:
        return value.untyped_storage().data_ptr() if isinstance(value, torch.Tensor) else None
    except RuntimeError:   # a tensor without storage
        return None


@contextlib.contextmanager
def host_reads(host: StaticHostBoundaries | None = None) -> Iterator[list[str]]:
    """Inside: every read of a tensor value made from a hybrid_pack frame, as ``"method file:line"``; a read of the
    tensors of ``host`` (a static batch's host entry, which never leaves the host) as ``"host method file:line"``."""
    reads: list[str] = []
    originals = [(owner, name, getattr(owner, name), name in vars(owner))
                 for owner, names in ((torch.Tensor, READS), (torch, TORCH_READS)) for name in names]
    on_host = {_storage(t) for t in (host.cu_seqlens, host.num_pad_tokens)} if host is not None else set()

    def counting(name: str, original: Any, method: bool) -> Any:
        def counted(*args: Any, **kwargs: Any) -> Any:
            caller = sys._getframe(1).f_code.co_filename
            if caller.startswith(PACKAGE) and _is_read(name, args[1:], kwargs):
                where = "host " if args and _storage(args[0]) in on_host else ""
                reads.append(f"{where}{name} {caller[len(PACKAGE):]}:{sys._getframe(1).f_lineno}")
            return original(*args, **kwargs)
        return counted

    for owner, name, original, _ in originals:
        setattr(owner, name, counting(name, original, owner is torch.Tensor))
    try:
        yield reads
    finally:
        for owner, name, original, own in originals:
            if own:
                setattr(owner, name, original)
            else:
                delattr(owner, name)


def _batch() -> dict[str, Any]:
    generator = torch.Generator().manual_seed(0)
    features = [{INPUT_IDS: torch.randint(0, VOCAB, (n,), generator=generator).tolist()} for n in LENGTHS]
    return PackingCollator(pad_to_multiple_of=16)(features)


def _step(model: torch.nn.Module, inputs: dict[str, Any]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """One packed forward + backward: the loss and the gradients (taken, so the next step starts from none)."""
    loss = model(**inputs).loss
    loss.backward()
    grads = {name: p.grad for name, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return loss.detach(), grads


def _assert_step_reads_nothing(model: torch.nn.Module, inputs: dict[str, Any]) -> None:
    """Zero reads in a step after a warm-up one; the same step without the host entry reads (the fallback) and
    gives the same loss and gradients."""
    _step(model, inputs)
    with host_reads() as reads:
        loss, grads = _step(model, inputs)
    assert reads == [], f"hybrid_pack read tensor values in a packed step: {reads}"
    without = {key: value for key, value in inputs.items() if key != HOST_BOUNDARIES}
    with host_reads() as reads:
        expected_loss, expected_grads = _step(model, without)
    assert reads, "the counter saw no read in the step that reads the boundaries from the tensors"
    assert all("boundaries/packed.py" in read for read in reads), reads
    torch.testing.assert_close(loss, expected_loss, rtol=0, atol=0)
    assert grads.keys() == expected_grads.keys() and grads
    for name, grad in grads.items():
        torch.testing.assert_close(grad, expected_grads[name], rtol=0, atol=0, msg=name)


# ----------------------------------------------------------------------------------------------- the counter
@pytest.mark.parametrize("owner, name", [(torch.Tensor, name) for name in sorted(READS)]
                         + [(torch, name) for name in sorted(TORCH_READS)], ids=lambda x: getattr(x, "__name__", x))
def test_counter_counts_a_read_planted_in_a_hybrid_pack_frame(owner: Any, name: str) -> None:
    t = torch.tensor(1)
    statement = (READS if owner is torch.Tensor else TORCH_READS)[name]
    inside = compile(statement, PACKAGE + "planted_read.py", "exec")
    outside = compile(statement, str(Path(__file__)), "exec")
    with host_reads() as reads:
        exec(outside, {"t": t, "np": np, "torch": torch})
        assert reads == []
        exec(inside, {"t": t, "np": np, "torch": torch})
    assert len(reads) == 1 and reads[0].startswith(f"{name} planted_read.py:"), reads
    assert getattr(owner, name).__name__ != "counted"   # restored


def test_counter_leaves_calls_that_wait_on_no_value() -> None:
    t, v = torch.arange(3), torch.ones(3)
    inside = compile("v.repeat_interleave(2); "
                     "torch.repeat_interleave(v, t, output_size=3)", PACKAGE + "planted.py", "exec")
    with host_reads() as reads:
        exec(inside, {"t": t, "v": v, "torch": torch})
    assert reads == []
    assert torch.tensor([torch.tensor(1), torch.tensor(2)]).tolist() == [1, 2], "torch left as it was"


# ------------------------------------------------------------------------------------------ the host entry
def test_collator_hands_over_its_host_boundaries_and_the_movers_keep_them() -> None:
    from accelerate.utils import send_to_device

    batch = _batch()
    host = batch[HOST_BOUNDARIES]
    assert isinstance(host, HostBoundaries) and not hasattr(host, "to") and not hasattr(host, "pin_memory")
    assert host.segment_lengths == (*LENGTHS, 7) and host.num_pad_tokens == 7
    assert send_to_device(batch, torch.device("cpu"))[HOST_BOUNDARIES] is host
    assert torch.utils.data._utils.pin_memory.pin_memory({HOST_BOUNDARIES: host})[HOST_BOUNDARIES] is host
    built, read = PackedBoundaries.from_batch(batch), PackedBoundaries.from_batch({**batch, HOST_BOUNDARIES: None})
    assert built.segment_lengths == read.segment_lengths and built.max_seqlen == read.max_seqlen
    assert built.cu_seqlens is batch["cu_seq_lens_q"] and built.seq_idx is batch[SEQ_IDX]   # the batch's tensors
    static = PackingCollator(pack_length=64, max_documents=8)([{INPUT_IDS: [1, 2, 3]}])
    host = static[HOST_BOUNDARIES]   # §9: host tensors (a compiled graph's inputs), not Python ints (its constants)
    assert isinstance(host, StaticHostBoundaries) and not hasattr(host, "to") and not hasattr(host, "pin_memory")
    moved = send_to_device(static, torch.device("meta"))
    assert moved[HOST_BOUNDARIES] is host and moved["cu_seq_lens_q"].is_meta and host.cu_seqlens.device.type == "cpu"
    assert torch.utils.data._utils.pin_memory.pin_memory({HOST_BOUNDARIES: host})[HOST_BOUNDARIES] is host


def test_a_cut_batch_with_its_host_entry_raises_and_without_it_is_read() -> None:
    batch = _batch()
    cut = {key: batch[key][:, :20] for key in (INPUT_IDS, LABELS, POSITION_IDS, SEQ_IDX)}
    with pytest.raises(BoundaryError, match=HOST_BOUNDARIES):
        PackedBoundaries.from_batch({**cut, HOST_BOUNDARIES: batch[HOST_BOUNDARIES]})
    assert PackedBoundaries.from_batch(cut).segment_lengths == (5, 15)
    with pytest.raises(BoundaryError, match="max_length_q"):
        PackedBoundaries.from_batch({**batch, "max_length_q": 7})
    with pytest.raises(BoundaryError, match=HOST_BOUNDARIES):
        PackedBoundaries.from_batch({**batch, HOST_BOUNDARIES: (5, 23)})


# ------------------------------------------------------------------------------------------ packed steps
def _families() -> list[str]:
    try:
        from hybrid_pack.integrations.transformers.tiny import TINY_CONFIGS
    except ImportError:  # no transformers: the test skips
        return ["qwen3_5"]
    return sorted(TINY_CONFIGS)


@pytest.mark.parametrize("family", _families())
def test_patched_hf_model_step_through_trainer_reads_nothing(family: str, tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    from transformers import Trainer, TrainingArguments

    from hybrid_pack.integrations.transformers import patch_model
    from hybrid_pack.integrations.transformers.tiny import tiny_model

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = patch_model(tiny_model(family))
        trainer = Trainer(model=model, args=TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[]))
        batch = _batch()
        inputs = trainer._prepare_inputs(batch)
        assert inputs[HOST_BOUNDARIES] is batch[HOST_BOUNDARIES]
        _assert_step_reads_nothing(model, inputs)


@pytest.mark.parametrize("preset", ["qwen3-next-tiny", "bamba-tiny"])
def test_native_model_step_reads_nothing(preset: str) -> None:
    from accelerate.utils import send_to_device

    from hybrid_pack.modeling import from_preset

    torch.manual_seed(0)
    model = from_preset(preset, vocab_size=VOCAB)
    _assert_step_reads_nothing(model, send_to_device(_batch(), torch.device("cpu")))


# ------------------------------------------------------------------------------------------ static steps (§9)
def _static_batch(lengths: tuple[int, ...] = LENGTHS) -> dict[str, Any]:
    generator = torch.Generator().manual_seed(0)
    features = [{INPUT_IDS: torch.randint(0, VOCAB, (n,), generator=generator).tolist()} for n in lengths]
    return PackingCollator(pack_length=48, max_documents=8)(features)


def _counting(fn: Any, calls: list[int]) -> Any:
    def counted(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        return fn(*args, **kwargs)
    return counted


def _static_model(kind: str) -> tuple[torch.nn.Module, bool]:
    """The model, and whether its compiled graph is whole (a patched model's graph breaks are transformers')."""
    torch.manual_seed(0)
    if kind == "native":
        from hybrid_pack.modeling import from_preset

        return from_preset("qwen3-next-tiny", vocab_size=VOCAB), True
    pytest.importorskip("transformers")
    from hybrid_pack.integrations.transformers import patch_model
    from hybrid_pack.integrations.transformers.tiny import tiny_model

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return patch_model(tiny_model("qwen3_5")), False


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("kind", ["native", "patched"])
def test_static_step_reads_only_the_host_entry(kind: str, compiled: bool) -> None:
    """A static batch (§9) carries its boundaries on the host as tensors: an eager step builds its boundaries from
    them, and in a compiled step a kernel's opaque node (here a planted CPU conv with no static form) reads its
    lengths there, not from the batch's ``cu_seq_lens_q`` (which a real run has on the device). Without the host
    entry the same step reads the boundary tensors, and gives the same loss and gradients."""
    from hybrid_pack.ops.dispatch.registry import reference_of

    model, whole = _static_model(kind)
    call = torch.compile(model, fullgraph=whole, backend="aot_eager") if compiled else model
    warm_up, batch = _static_batch(), _static_batch((9, 1, 30))   # a new layout: nothing kept from the warm-up

    def without() -> dict[str, Any]:
        return {key: value.clone() if isinstance(value, torch.Tensor) else value for key, value in batch.items()
                if key != HOST_BOUNDARIES}

    calls: list[int] = []
    backends.register("conv", "planted", _counting(reference_of("conv").fn, calls), priority=100,
                      devices=("cpu",), dtypes=(torch.float32,))
    try:
        _step(model, warm_up)   # settles the planted kernel's verdict (a single eager process's first call)
        _step(call, warm_up)
        with host_reads(batch[HOST_BOUNDARIES]) as reads:
            before = len(calls)
            loss, grads = _step(call, batch)
            ran = len(calls) - before
        _step(call, without())
        with host_reads() as fallback:
            expected_loss, expected_grads = _step(call, without())
    finally:
        backends.unregister("conv", "planted")
    assert ran >= 1, "the planted kernel served the step"
    assert [read for read in reads if not read.startswith("host ")] == [], reads
    assert reads, "the step read its lengths from the host entry"
    assert fallback and all(read.split()[1].startswith(("boundaries/packed.py", "ops/library.py"))
                            for read in fallback), fallback
    torch.testing.assert_close(loss, expected_loss, rtol=0, atol=0)
    assert grads.keys() == expected_grads.keys() and grads
    for name, grad in grads.items():
        torch.testing.assert_close(grad, expected_grads[name], rtol=0, atol=0, msg=name)


# ------------------------------------------------------------------------------------------ TRL's log-probabilities
def _reads_in_forwards(model: torch.nn.Module, reads: list[str]) -> list[str]:
    """The reads made inside ``model``'s forwards from now on (filled as they run)."""
    inside: list[str] = []
    count_before: list[int] = []
    model.register_forward_pre_hook(lambda *_: count_before.append(len(reads)))
    model.register_forward_hook(lambda *_: inside.extend(reads[count_before.pop():]))
    return inside


def test_grpo_log_probabilities_read_once_before_their_forwards(tmp_path: Path) -> None:
    """``PackedGRPOTrainer``'s log-probability call made outside TRL's generation and loss (no lengths carried
    with the batch) reads the sequences' lengths in one copy before any forward; its forwards and the backward
    read nothing. (Inside TRL's step it reads nothing at all: tests/integrations/test_trl_grpo.py.)"""
    trl = pytest.importorskip("trl")
    from datasets import Dataset

    from hybrid_pack.integrations.transformers.tiny import tiny_model, tiny_tokenizer
    from hybrid_pack.integrations.trl import PackedGRPOTrainer

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        args = trl.GRPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=2, num_generations=2, beta=0.0,
                              use_cpu=True, bf16=False, report_to=[], disable_tqdm=True)
        trainer = PackedGRPOTrainer(model=tiny_model("qwen3_5"), reward_funcs=lambda completions, **_: [0.0],
                                    args=args, train_dataset=Dataset.from_dict({"prompt": ["w3 w4", "w5"]}),
                                    processing_class=tiny_tokenizer())
    generator = torch.Generator().manual_seed(0)
    input_ids = torch.randint(3, VOCAB, (3, 10), generator=generator)
    prompt_lengths, completion_lengths = [4, 1, 3], [5, 0, 2]    # prompts left-padded (width 4), completions right
    attention_mask = torch.tensor([[int(j >= 4 - p) for j in range(4)] + [int(j < c) for j in range(6)]
                                   for p, c in zip(prompt_lengths, completion_lengths, strict=True)])
    with host_reads() as reads:
        in_forwards = _reads_in_forwards(trainer.model, reads)
        logps, _, _ = trainer._get_per_token_logps_and_entropies(trainer.model, input_ids, attention_mask, 6,
                                                                 batch_size=2)
        before_backward = len(reads)
        logps.sum().backward()
    assert in_forwards == [] and reads[before_backward:] == []
    # Forming the rows indexes the collator's own host tensors (positions, masks): sized by values, read nothing.
    ours = [read for read in reads if "integrations/trl" in read and read.split()[0] not in SIZE_READS]
    assert len(ours) == 1 and ours[0].startswith("tolist integrations/trl_grpo.py"), ours
    assert torch.equal(logps != 0, attention_mask[:, 4:].bool() & torch.tensor([[True] * 6, [False] * 6,
                                                                               [True] * 6]))
    with pytest.raises(hybrid_pack.errors.InputError, match="attention_mask"):
        trainer._get_per_token_logps_and_entropies(trainer.model, input_ids, attention_mask.flip(1), 6)


def test_dpo_fused_call_reads_once_before_its_forward(tmp_path: Path) -> None:
    """``PackedDPOTrainer``'s packed call made without the lengths its collator adds takes them in one copy before
    the forward; the forward, the scatter back to TRL's layout and the backward read nothing. (In TRL's step the
    collator hands them over: tests/integrations/test_trl_dpo.py.)"""
    trl = pytest.importorskip("trl")
    from datasets import Dataset

    from hybrid_pack.integrations.transformers.tiny import tiny_model, tiny_tokenizer
    from hybrid_pack.integrations.trl_dpo import PackedDPOTrainer

    pairs = Dataset.from_list([{"prompt": "w3 w4", "chosen": "w5", "rejected": "w6 w7"}] * 2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        args = trl.DPOConfig(output_dir=str(tmp_path), report_to=[], use_cpu=True, disable_tqdm=True)
        model = tiny_model("bamba")
        trainer = PackedDPOTrainer(model=model, ref_model=copy.deepcopy(model), args=args, train_dataset=pairs,
                                   processing_class=tiny_tokenizer())
    lengths = [7, 1, 4]
    attention_mask = torch.tensor([[int(j < n) for j in range(7)] for n in lengths])
    input_ids = torch.randint(3, VOCAB, (3, 7), generator=torch.Generator().manual_seed(0)) * attention_mask
    labels = input_ids.masked_fill(attention_mask == 0, -100)
    with host_reads() as reads:
        in_forwards = _reads_in_forwards(trainer.model, reads)
        out = trainer.model(input_ids=input_ids, attention_mask=attention_mask, labels=labels, fused_lm_head=True)
        before_backward = len(reads)
        out.log_probs.sum().backward()
    assert in_forwards == [] and reads[before_backward:] == []
    ours = [read for read in reads if "integrations/trl" in read]
    assert len(ours) == 1 and ours[0].startswith("tolist integrations/trl_dpo.py"), ours
    scored = attention_mask[:, 1:].bool()   # a real token after a real one
    assert out.log_probs.shape == (3, 6) and torch.equal(out.log_probs != 0, scored)
