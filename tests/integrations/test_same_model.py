"""A patched model is the same model (docs/api.md §6a): patching changes how packed calls are computed and
nothing else a user, a trainer or ``torch.compile`` can observe.

Tiny random models of every supported family, float32 on CPU. "Alone" runs use transformers' own torch
code for the family (``pure_torch_transformers``), the reference the packed row must equal.
"""

from __future__ import annotations

import inspect
import warnings
from collections.abc import Iterator

import pytest
import torch

pytest.importorskip("transformers")

from hybrid_pack import PackingCollator
from hybrid_pack.errors import InputError, UnsupportedModelError
from hybrid_pack.integrations.transformers import is_patched, patch_model
from hybrid_pack.integrations.transformers.tiny import TINY_CONFIGS, VOCAB, tiny_config
from hybrid_pack.schema import INPUT_IDS, LABELS
from hybrid_pack.testing import check_training_step
from tests.support.torch_path import pure_torch_transformers

FAMILIES = sorted(TINY_CONFIGS)
LENGTHS = [5, 19, 1, 7]          # a one-token document, one longer than the chunk size (16)


@pytest.fixture(autouse=True)
def _quiet() -> Iterator[None]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def _documents(lengths: list[int] = LENGTHS, seed: int = 0) -> list[dict]:
    generator = torch.Generator().manual_seed(seed)
    return [{INPUT_IDS: torch.randint(3, VOCAB, (n,), generator=generator)} for n in lengths]


def _model(config) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config).eval()


def _max_error_against_alone(model: torch.nn.Module, lengths: list[int] = LENGTHS) -> float:
    batch = PackingCollator()(_documents(lengths))
    with torch.no_grad(), pure_torch_transformers(model):
        packed = model(**batch).logits
        errors, start = [], 0
        for n in lengths:
            alone = model(input_ids=batch[INPUT_IDS][:, start:start + n]).logits
            errors.append((packed[:, start:start + n] - alone).abs().max().item())
            start += n
    return max(errors)


def _signatures(model: torch.nn.Module) -> dict[str, str]:
    return {name: str(inspect.signature(module.forward)) for name, module in model.named_modules()}


@pytest.mark.parametrize("family", FAMILIES)
def test_every_forward_keeps_its_signature(family: str) -> None:
    """HF ``Trainer`` keeps the dataset columns the forward's signature names: ``input_ids`` must be there."""
    model = _model(tiny_config(family))
    before = _signatures(model)
    patch_model(model)
    assert _signatures(model) == before
    assert "input_ids" in inspect.signature(model.forward).parameters


@pytest.mark.parametrize("family", FAMILIES)
def test_attention_implementation_reads_and_switches_as_unpatched(family: str) -> None:
    model = _model(tiny_config(family))
    name = model.config._attn_implementation
    patch_model(model)
    assert model.config._attn_implementation == name
    model.set_attn_implementation("eager")
    assert model.config._attn_implementation == "eager"
    # the model's own per-document mask, still isolated (float32 round-off of a different algorithm than the packed
    # run's; the MoE routers of Qwen3.5-MoE and Qwen4-Exp amplify it to 2.3e-5)
    assert _max_error_against_alone(model) < 3e-5


@pytest.mark.parametrize("family", ["qwen3_next", "bamba", "lfm2"])
def test_output_attentions(family: str) -> None:
    """Unpacked calls return weights as unpatched; packed calls return them with ``eager`` (the model's own
    per-document causal mask: zero across documents) and refuse, naming ``eager``, with any other kernel."""
    reference = _model(tiny_config(family))
    reference.set_attn_implementation("eager")
    model = patch_model(_model(tiny_config(family)))
    ids = torch.randint(3, VOCAB, (1, 12))
    with pytest.raises(InputError, match="output_attentions.*set_attn_implementation\\('eager'\\)"):
        model(**PackingCollator()(_documents()), output_attentions=True)
    model.set_attn_implementation("eager")
    with torch.no_grad(), pure_torch_transformers(reference):
        expected = [a for a in reference(input_ids=ids, output_attentions=True).attentions if a is not None]
        got = [a for a in model(input_ids=ids, output_attentions=True).attentions if a is not None]
        packed = model(**PackingCollator()(_documents()), output_attentions=True).attentions
    assert expected and len(got) == len(expected)
    for a, b in zip(got, expected):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    weights = next(a for a in packed if a is not None)[0, 0]                     # [T, T]
    first, second = LENGTHS[0], LENGTHS[0] + LENGTHS[1]
    assert weights[first:second, :first].abs().max() == 0
    torch.testing.assert_close(weights.sum(-1), torch.ones(sum(LENGTHS)))


def test_jamba_with_gelu_is_served_exactly() -> None:
    """An activation the conv kernels lack is applied after the kernel, as the family's code applies it."""
    config = tiny_config("jamba")
    config.hidden_act = "gelu"
    model = patch_model(_model(config))
    assert _max_error_against_alone(model) < 1e-5


def test_all_attention_granite_hybrid_is_patched_and_exact() -> None:
    """A family's configuration without any Mamba layer: only its attention needs the boundaries."""
    settings = tiny_config("granitemoehybrid").to_dict()
    settings["layer_types"] = ["attention"] * len(settings["layer_types"])
    model = _model(type(tiny_config("granitemoehybrid"))(**settings))
    assert not any(type(m).__name__ == "GraniteMoeHybridMambaLayer" for m in model.modules())
    patch_model(model)
    assert _max_error_against_alone(model) < 1e-5


@pytest.mark.parametrize("family", ["qwen3_next", "qwen4_exp"])  # qwen4_exp: its indexed attention too
def test_attention_dropout_is_refused_by_patch_model_itself(family: str) -> None:
    config = tiny_config(family)
    config.attention_dropout = 0.1
    with pytest.raises(UnsupportedModelError, match=r"config\.attention_dropout: 0\.1"):
        patch_model(_model(config))


def test_indexed_attention_refuses_packed_attention_weights_by_name() -> None:
    model = patch_model(_model(tiny_config("qwen4_exp")))
    model.set_attn_implementation("eager")
    with pytest.raises(InputError, match="^output_attentions: Qwen4ExpTextAttention forms no attention weights"):
        model(**PackingCollator()(_documents()), output_attentions=True)


@pytest.mark.parametrize("implementation", ["sdpa", "eager"])
def test_minimax_sliding_window_from_its_config_is_served_exactly(implementation: str) -> None:
    """MiniMax's attention applies ``config.sliding_window`` without holding it: the eager mask reads the config."""
    config = tiny_config("minimax")
    config.sliding_window = 4
    model = _model(config)
    model.set_attn_implementation(implementation)
    patch_model(model)
    assert _max_error_against_alone(model) < 3e-5


def test_sequence_classification_heads_are_refused() -> None:
    from transformers import Qwen3NextForSequenceClassification

    config = tiny_config("qwen3_next")
    config.num_labels, config.pad_token_id = 3, 0
    with pytest.raises(UnsupportedModelError, match="^model: Qwen3NextForSequenceClassification pools each row"):
        patch_model(Qwen3NextForSequenceClassification(config))


@pytest.mark.parametrize("family", ["qwen3_next", "bamba", "jamba"])
def test_gradient_checkpointing_gives_the_same_loss_and_gradients(family: str) -> None:
    batch = PackingCollator()(_documents())
    results = []
    for checkpointing in (False, True):
        model = patch_model(_model(tiny_config(family))).train()
        if checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        loss = model(**batch).loss
        loss.backward()
        results.append((loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}))
        if checkpointing:
            report = check_training_step(model, batch)
            assert report.ok and report.error is None, str(report)
            assert all(d.gradient_leak == 0.0 for d in report.documents)
    (loss, grads), (loss_ckpt, grads_ckpt) = results
    torch.testing.assert_close(loss_ckpt, loss, rtol=0, atol=1e-6)
    assert grads.keys() == grads_ckpt.keys()
    for name in grads:
        torch.testing.assert_close(grads_ckpt[name], grads[name], rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize("family", ["qwen3_next", "bamba"])
def test_saved_patched_model_loads_plain_and_patches_again(family: str, tmp_path) -> None:
    from transformers import AutoModelForCausalLM

    model = patch_model(_model(tiny_config(family)))
    model.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert not is_patched(loaded) and loaded.config._attn_implementation == model.config._attn_implementation
    patch_model(loaded)
    batch = PackingCollator()(_documents())
    with torch.no_grad():
        torch.testing.assert_close(loaded(**batch).logits, model(**batch).logits, rtol=0, atol=0)


@pytest.mark.slow
@pytest.mark.parametrize("family", ["qwen3_next", "bamba", "mamba"])  # mamba: boundaries handed off to a child
def test_fullgraph_compile_unpacked_and_static_packed(family: str) -> None:
    """``torch.compile(model, fullgraph=True)``: no graph break at all (fullgraph would raise), one graph for
    every static batch of one shape (a recompile raises), logits and gradients equal to eager (1e-5).

    Unpacked calls run the family's own code; with the fla kernels installed that code calls a
    ``torch.compiler.disable``d kernel (the model's own graph break, unpatched too), so both runs use
    transformers' torch functions (``pure_torch_transformers``)."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    model = patch_model(_model(tiny_config(family))).train()
    static = PackingCollator(pack_length=48, max_documents=6)
    torch._dynamo.reset()
    counters.clear()
    with pure_torch_transformers(model):
        compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
        ids = torch.randint(3, VOCAB, (2, 12))
        torch.testing.assert_close(compiled(input_ids=ids).logits, model(input_ids=ids).logits, rtol=1e-5, atol=1e-5)
        torch._dynamo.reset()
        compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
        for i, lengths in enumerate([(30, 18), (10, 10, 10, 10, 1), (1, 2, 3), (48,)]):
            batch = static(_documents(list(lengths), seed=i))
            with torch._dynamo.config.patch(error_on_recompile=i > 0):
                out = compiled(**batch)
            grads = torch.autograd.grad(out.loss, list(model.parameters()), allow_unused=True)
            reference = model(**batch)
            expected = torch.autograd.grad(reference.loss, list(model.parameters()), allow_unused=True)
            torch.testing.assert_close(out.logits, reference.logits, rtol=1e-5, atol=1e-5)
            for got, want in zip(grads, expected):
                if want is not None:
                    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert not counters["graph_break"], dict(counters["graph_break"])


def test_plain_trainer_with_default_arguments_trains_a_patched_model(tmp_path) -> None:
    """HF ``Trainer`` with its defaults (``remove_unused_columns=True``) on a dataset with extra text columns:
    the columns the forward does not name are dropped, ``input_ids`` reaches the collator, the loss falls."""
    from datasets import Dataset
    from transformers import Trainer, TrainingArguments

    documents = _documents([9, 14, 5, 20, 7, 11, 3, 16] * 4)
    dataset = Dataset.from_list([{INPUT_IDS: d[INPUT_IDS].tolist(), "text": f"example {i}", "source": "test"}
                                 for i, d in enumerate(documents)])
    model = patch_model(_model(tiny_config("qwen3_next")))
    args = TrainingArguments(output_dir=str(tmp_path), max_steps=8, report_to="none", disable_tqdm=True,
                             learning_rate=1e-2)
    assert args.remove_unused_columns
    trainer = Trainer(model=model, args=args, train_dataset=dataset, data_collator=PackingCollator())
    before = [p.detach().clone() for p in model.parameters()]
    result = trainer.train()
    assert trainer.state.global_step == 8 and torch.isfinite(torch.tensor(result.training_loss))
    assert any(not torch.equal(b, p) for b, p in zip(before, model.parameters()))
    assert LABELS not in dataset.column_names


@pytest.mark.parametrize("family", FAMILIES)
def test_generation_and_cache_are_unchanged(family: str) -> None:
    """Greedy generation with the cache, patched and unpatched, gives the same tokens and scores (transformers'
    torch functions for both: with fla installed, the family would call its Triton kernels on CPU tensors)."""
    reference = _model(tiny_config(family))
    model = patch_model(_model(tiny_config(family)))
    ids = torch.randint(3, VOCAB, (2, 6), generator=torch.Generator().manual_seed(0))
    settings = {"max_new_tokens": 5, "do_sample": False, "output_scores": True, "return_dict_in_generate": True,
                "pad_token_id": 0}
    with torch.no_grad(), pure_torch_transformers(model):
        expected = reference.generate(ids, **settings)
        got = model.generate(ids, **settings)
    assert torch.equal(got.sequences, expected.sequences)
    for a, b in zip(got.scores, expected.scores):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize("family", ["qwen3_next", "bamba", "jamba"])
def test_a_packed_call_builds_no_attention_mask(family: str) -> None:
    """The boundaries replace the mask: no ``[1, 1, T, T]`` per-document mask, no host read of ``position_ids``
    (transformers' packed-sequence detection) for a packed row; an ordinary padded batch builds its mask."""
    from unittest import mock

    from transformers import masking_utils

    model = patch_model(_model(tiny_config(family)))
    batch = PackingCollator()(_documents())
    mask = torch.ones(2, 9, dtype=torch.long)
    mask[0, :3] = 0
    with mock.patch.object(masking_utils, "_preprocess_mask_arguments",
                           wraps=masking_utils._preprocess_mask_arguments) as built, torch.no_grad(), \
            pure_torch_transformers(model):
        model(**batch)
        assert built.call_count == 0
        model(input_ids=torch.randint(3, VOCAB, (2, 9)), attention_mask=mask)
        assert built.call_count > 0
    assert not hasattr(model.config, "_hybrid_pack_packed_call")    # nothing left on the config to be saved


@pytest.mark.parametrize("family", ["qwen3_5", "bamba"])
def test_dtype_cast_after_patching_keeps_packed_calls_exact(family: str) -> None:
    """``.to(float64)`` after patching: packed rows run in float64 (the families' own torch code keeps a few
    float32 steps, so "alone" agrees to 1e-7, not 1e-15; Qwen3-Next's MoE has no float64 kernel)."""
    model = patch_model(_model(tiny_config(family))).to(torch.float64)
    with torch.no_grad():
        assert model(**PackingCollator()(_documents())).logits.dtype == torch.float64
    assert _max_error_against_alone(model) < 1e-6


def test_attention_registered_after_patching_is_served_packed() -> None:
    """A custom attention function registered (and selected) after ``patch_model`` is wrapped at the first packed
    call: the packed row never reaches a kernel that would ignore the documents."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    model = patch_model(_model(tiny_config("bamba")))
    AttentionInterface.register("custom_test_attention", sdpa_attention_forward)
    model.set_attn_implementation("custom_test_attention")
    assert model.config._attn_implementation == "custom_test_attention"
    assert _max_error_against_alone(model) < 1e-5


@pytest.mark.parametrize("v_head_dim", [6, 16], ids=["narrower", "wider"])
@pytest.mark.parametrize("family", ["kimi_linear", "bailing_hybrid"])
def test_mla_with_a_value_head_unlike_the_query_head_is_served_packed(family: str, v_head_dim: int) -> None:
    """Multi-head latent attention whose value heads are narrower or wider than its query/key heads (12 here): a
    packed row's documents get what each gets alone."""
    config = tiny_config(family)
    config.v_head_dim = v_head_dim
    model = patch_model(_model(config))
    assert _max_error_against_alone(model) < 1e-5
