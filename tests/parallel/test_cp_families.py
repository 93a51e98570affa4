"""Every patched Hugging Face family and both native presets are exact under context parallelism, or refuse
(docs/api.md §10, issue 27).

One torchrun launch of 2 gloo ranks (tests/workers/cp_families.py) runs, in float64, the tiny model of every
family of ``TINY_CONFIGS`` (patched) and ``qwen3-next-tiny`` / ``bamba-tiny`` on a row of documents of 10, 40
and 14 tokens (the second crosses the rank edge), on one ending in padding, and on the first again in the
zigzag layout: each rank's :func:`shard_batch` share against the unsharded row. Logits (gathered), the
gradient of the token embeddings (gathered: every mixer's backward, token by token), the float64 loss of the
logits and the parameters' gradients (summed over the ranks) agree to 1e-10. Where the model itself rounds to
float32 the comparison is at float32's rounding, never looser: the loss of float32 logits (Mamba2 and
Nemotron-H return them), the loss transformers computes (in float32), and the gradients of parameters the
model casts to float32 (RMSNorm weights, ``A_log``, ``D``: each rank's gradient arrives rounded to float32
before the ranks' sum; the native presets have none). The row cut into documents at the rank edge gives other
logits (so the comparison can fail). A family with a layer that has no context-parallel path (Qwen4-Exp: QSA
indexed attention, the per-layer n-gram embedding) raises :class:`UnsupportedModelError` naming that layer on a
sharded row, and every other family does not. A patched model whose served softmax attention has no
context-parallel path (``attn_implementation="eager"``) raises it too; attention-free families have no such case.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hybrid_pack.integrations.transformers.tiny import TINY_CONFIGS
from tests.workers import cp_families as worker
from tests.workers.launch import torchrun

FLOAT64 = 1e-10
FLOAT32_ROUNDING = 1e-6
CASES = list(worker.cases())
REFUSED = [case for case in CASES if case.startswith("refused/")]
EAGER = [case for case in CASES if case.startswith("eager/")]
MODELS = [case for case in CASES if case not in REFUSED and case not in EAGER]
CONTIGUOUS = [case for case in MODELS if not case.endswith("/zigzag")]


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict[str, dict]:
    """Every case's result from one launch of the worker on 2 ranks."""
    out = tmp_path_factory.mktemp("cp_families") / "results.json"
    torchrun(Path(worker.__file__), str(out), processes=2)
    return json.loads(out.read_text())


def test_every_family_and_both_presets_are_covered():
    exact = {case.split("/")[0].removeprefix("hf_") for case in MODELS}
    refused = {case.removeprefix("refused/") for case in REFUSED}
    assert exact | refused == set(TINY_CONFIGS) | set(worker.PRESETS) and not exact & refused
    assert refused == {"qwen4_exp"}, "a family gained or lost its context-parallel path: update docs/parallel.md"
    eager = {case.removeprefix("eager/") for case in EAGER}
    assert eager == {family for family in exact & set(TINY_CONFIGS) if worker.attention_layers(family)}
    assert eager, "no family's attention is served: the eager refusal would go unchecked"


@pytest.mark.distributed
@pytest.mark.parametrize("case", MODELS)
def test_sharded_equals_unsharded(results, case):
    errors = results[case]
    assert "raised" not in errors, errors["raised"]
    native = not case.startswith("hf_")
    limits = {
        "logits": FLOAT64,
        "embedding gradient": FLOAT64,
        "gradients": FLOAT64,
        "loss": FLOAT64 if errors["logits dtype"] == "float64" else FLOAT32_ROUNDING,
        "model loss": FLOAT64 if native else FLOAT32_ROUNDING,
        "gradients rounded to float32": FLOAT32_ROUNDING,
    }
    beyond = {name: (errors[name], limit) for name, limit in limits.items() if not errors[name] <= limit}
    assert not beyond, f"(error, limit): {beyond}"
    if native:
        assert errors["parameters rounded to float32"] == [], "a native preset computes every gradient in float64"


@pytest.mark.distributed
@pytest.mark.parametrize("case", CONTIGUOUS)
def test_the_row_cut_at_the_rank_edge_differs(results, case):
    """Without context parallelism (each rank's pieces as documents) the logits differ: the comparison can fail."""
    assert results[case]["cut at rank edges"] > 1e-3, results[case]


@pytest.mark.distributed
@pytest.mark.parametrize("case", REFUSED)
def test_a_layer_without_a_context_parallel_path_refuses_a_sharded_row(results, case):
    result = results[case]
    layers = worker.layers_without_context_parallel(case.removeprefix("refused/"))
    assert result["raised"] == "UnsupportedModelError", result
    assert result["message"].split(":")[0] in layers, (layers, result["message"])
    assert "context parallelism" in result["message"], result["message"]


@pytest.mark.distributed
@pytest.mark.parametrize("case", EAGER)
def test_eager_attention_refuses_a_sharded_row(results, case):
    result = results[case]
    assert result["raised"] == "UnsupportedModelError", result
    assert result["message"].startswith("config._attn_implementation:"), result["message"]
