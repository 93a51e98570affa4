"""A patched model stays patched and correct where real models go (SPEC §6b).

- ``pickle``, ``torch.save``/``torch.load``, ``copy.deepcopy`` and ``torch.multiprocessing.spawn`` keep every
  mixer patched: the copy is still isolated on packed rows (init 0.2, so a leak is the size of the logits).
- Nothing per call is stored on a shared object: threads calling one model, packed and padded mixed, each get
  their single-threaded result.
- Patching leaves every other model of the process computing bitwise what it computed before any patching
  (checked in a fresh interpreter, where nothing was patched yet).
"""

from __future__ import annotations

import copy
import io
import pickle
import subprocess
import sys
import textwrap
import threading
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from hybrid_pack.boundaries import PackedBoundaries
from hybrid_pack.integrations.transformers import patch_model
from hybrid_pack.integrations.transformers.tiny import TINY_CONFIGS, VOCAB, tiny_config
from hybrid_pack.testing import check_isolation
from tests.support.torch_path import pure_torch_transformers

FAMILIES = sorted(TINY_CONFIGS)
LENGTHS = [7, 13, 5]


@pytest.fixture(autouse=True)
def _quiet() -> Iterator[None]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def _high_init(family: str) -> torch.nn.Module:
    config = tiny_config(family)
    config.initializer_range = 0.2
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()


def _pickled(model: torch.nn.Module) -> torch.nn.Module:
    return pickle.loads(pickle.dumps(model))


def _torch_saved(model: torch.nn.Module) -> torch.nn.Module:
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)


ROUND_TRIPS: dict[str, Callable[[torch.nn.Module], torch.nn.Module]] = {
    "pickle": _pickled, "torch.save": _torch_saved, "deepcopy": copy.deepcopy}


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("trip", sorted(ROUND_TRIPS))
def test_a_copied_patched_model_is_still_isolated(family: str, trip: str) -> None:
    model = patch_model(_high_init(family))
    copied = ROUND_TRIPS[trip](model)
    report = check_isolation(copied, lengths=LENGTHS, grads=True, atol=1e-5)
    assert report.ok, str(report)
    assert patch_model(copied) is copied


@pytest.mark.parametrize("family", ["jamba", "bamba", "lfm2"])   # conv weights read directly; Mamba-1's dt_proj
@pytest.mark.parametrize("order", ["patch_then_offload", "offload_then_patch"])
def test_accelerate_offloading_keeps_its_hooks_and_the_patch(family: str, order: str) -> None:
    """accelerate's ``cpu_offload`` (what ``device_map`` offloading installs), before or after patching: unpacked
    calls bitwise as unpatched, packed calls those of the patched model without offloading (each mixer fires the
    hooks of the children whose weights its packed forward reads; the hooks wrap the patched forward)."""
    from accelerate import cpu_offload

    model = _high_init(family)
    batch = PackedBoundaries.from_lengths(LENGTHS).batch_kwargs()
    ids = torch.randint(3, VOCAB, (1, sum(LENGTHS)), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        unpatched = model(input_ids=ids).logits
        packed = patch_model(copy.deepcopy(model))(input_ids=ids, **batch).logits
    if order == "patch_then_offload":
        patch_model(model)
    cpu_offload(model, execution_device=torch.device("cpu"))
    if order == "offload_then_patch":
        patch_model(model)
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids).logits, unpatched, rtol=0, atol=0)
        torch.testing.assert_close(model(input_ids=ids, **batch).logits, packed, rtol=1e-5, atol=1e-5)


def _spawned(rank: int, model: torch.nn.Module, queue: torch.multiprocessing.SimpleQueue) -> None:
    report = check_isolation(model, lengths=LENGTHS, grads=False, atol=1e-5)
    queue.put((report.ok, str(report)))


@pytest.mark.slow
def test_a_patched_model_sent_to_a_spawned_process_is_still_isolated() -> None:
    context = torch.multiprocessing.get_context("spawn")
    queue = context.SimpleQueue()
    torch.multiprocessing.spawn(_spawned, args=(patch_model(_high_init("bamba")), queue), nprocs=1)
    ok, report = queue.get()
    assert ok, report


_LOADED = textwrap.dedent("""
    import sys
    from unittest import mock

    import torch
    from transformers import masking_utils

    from hybrid_pack import PackingCollator

    model = torch.load(sys.argv[1], weights_only=False)
    batch = PackingCollator()([{"input_ids": torch.arange(3, 3 + n)} for n in (7, 13, 5)])
    with mock.patch.object(masking_utils, "_preprocess_mask_arguments",
                           wraps=masking_utils._preprocess_mask_arguments) as built, torch.no_grad():
        model(**batch)
        print("MASKS", built.call_count)
""")


@pytest.mark.parametrize("family", ["bamba", "qwen3_5"])
def test_a_patched_model_loaded_in_a_fresh_process_builds_no_attention_mask(family: str, tmp_path: Path) -> None:
    """``torch.save(model)`` loaded by another interpreter (as ``torch.multiprocessing.spawn`` hands a model over):
    its packed calls build no ``[1, 1, T, T]`` mask there either (nor read ``position_ids`` on the host for it)."""
    path = tmp_path / "model.pt"
    torch.save(patch_model(_high_init(family)), path)
    root = Path(__file__).parents[2]
    result = subprocess.run([sys.executable, "-c", _LOADED, str(path)], capture_output=True, text=True, timeout=300,
                            cwd=root)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    assert "MASKS 0" in result.stdout, result.stdout[-2000:]


def _calls(seed: int) -> list[dict[str, torch.Tensor]]:
    """Packed rows and padded batches with an ``attention_mask``, alternating."""
    generator = torch.Generator().manual_seed(seed)
    calls = []
    for i in range(60):
        if i % 2:
            ids = torch.randint(3, VOCAB, (1, sum(LENGTHS)), generator=generator)
            calls.append({"input_ids": ids, **PackedBoundaries.from_lengths(LENGTHS).hf_kwargs()})
        else:
            mask = torch.ones(2, 11, dtype=torch.long)
            mask[i % 4 // 2, :1 + i % 5] = 0
            calls.append({"input_ids": torch.randint(3, VOCAB, (2, 11), generator=generator), "attention_mask": mask})
    return calls


@pytest.mark.parametrize("family", ["bamba", "qwen3_5"])
def test_threads_on_one_model_get_their_own_results(family: str) -> None:
    model = patch_model(_high_init(family))
    work = [_calls(seed) for seed in range(4)]
    with torch.no_grad(), pure_torch_transformers(model):
        expected = [[model(**call).logits for call in calls] for calls in work]
    got: list[list[torch.Tensor]] = [[] for _ in work]
    errors: list[BaseException] = []

    def run(index: int) -> None:
        try:
            with torch.no_grad():
                got[index] = [model(**call).logits for call in work[index]]
        except BaseException as error:   # reported below, on the test's thread
            errors.append(error)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(work))]
    with pure_torch_transformers(model):
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    assert not errors, errors
    wrong = [(t, c) for t in range(len(work)) for c in range(len(work[t]))
             if not torch.equal(got[t][c], expected[t][c])]
    assert not wrong, f"{len(wrong)} of {sum(map(len, work))} calls differ from their single-threaded result"


_OTHER_MODELS = textwrap.dedent("""
    import warnings, torch
    warnings.simplefilter("ignore")
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM
    from hybrid_pack.errors import UnsupportedModelError
    from hybrid_pack.integrations.transformers import patch_model
    from hybrid_pack.integrations.transformers.tiny import TINY_CONFIGS, tiny_config
    from tests.support.torch_path import pure_torch_transformers

    def build(config):
        torch.manual_seed(0)
        return AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()

    def outputs(models):
        mask = torch.ones(2, 12, dtype=torch.long)
        mask[1, :5] = 0
        ids = torch.randint(3, 100, (2, 12), generator=torch.Generator().manual_seed(0))
        restarting = torch.tensor([list(range(5)) + list(range(7))])
        result = {}
        for name, model in models.items():
            with torch.no_grad(), pure_torch_transformers(model):
                for implementation in ("sdpa", "eager"):
                    try:
                        model.set_attn_implementation(implementation)
                    except ValueError:   # a family without softmax attention (Mamba) takes only "eager"
                        continue
                    result[name, implementation, "padded"] = model(input_ids=ids, attention_mask=mask).logits
                    result[name, implementation, "positions"] = model(input_ids=ids[:1],
                                                                      position_ids=restarting).logits
        return result

    llama = LlamaConfig(vocab_size=128, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                        num_attention_heads=2, num_key_value_heads=1)
    others = {"llama": build(llama)} | {family: build(tiny_config(family)) for family in sorted(TINY_CONFIGS)}
    before = outputs(others)
    for family in sorted(TINY_CONFIGS):
        try:
            patch_model(build(tiny_config(family)))
        except UnsupportedModelError:   # a refusal leaves the others unchanged too
            pass
    after = outputs(others)
    changed = [key for key in before if not torch.equal(before[key], after[key])]
    print("CHANGED", changed)
    assert not changed
""")


@pytest.mark.slow
def test_patching_leaves_every_other_model_bitwise_unchanged() -> None:
    """Unpatched models of every family (and Llama), padded and with restarting positions, ``sdpa`` and ``eager``:
    bitwise the same logits after other models of their families were patched as before any patching."""
    root = Path(__file__).parents[2]   # tests.support for the torch path
    result = subprocess.run([sys.executable, "-c", _OTHER_MODELS], capture_output=True, text=True, timeout=900,
                            cwd=root)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
