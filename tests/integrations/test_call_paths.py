"""A patched model keeps documents apart on every call path, not only through its top-level forward.

Trainers and wrappers enter a model in different places: TRL's fused LM head calls the backbone
(``model.base_model``) directly, pipeline schedules call decoder layers, ``torch.compile`` traces the
forward. For tiny Qwen3-Next, Bamba and Jamba models, each path is compared with every document run
alone, forward and backward; packed keys that reach a patched layer past every entry are refused.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator

import pytest
import torch

pytest.importorskip("transformers")

from hybrid_pack import PackingCollator
from hybrid_pack.boundaries import PackedBoundaries
from hybrid_pack.errors import BoundaryError
from hybrid_pack.integrations.transformers import patch_model
from hybrid_pack.integrations.transformers.tiny import VOCAB, tiny_model
from hybrid_pack.schema import CU_SEQ_LENS_Q, INPUT_IDS, LABELS, POSITION_IDS, SEQ_IDX
from hybrid_pack.testing import check_isolation, check_training_step
from tests.support.torch_path import pure_torch_transformers

FAMILIES = ["qwen3_next", "bamba", "jamba"]
LENGTHS = [5, 19, 1, 7]          # a one-token document, one longer than the chunk size (16)
MIXERS = {"qwen3_next": "linear_attn", "bamba": "mamba", "jamba": "mamba"}   # layer 0's sequence mixer


@pytest.fixture(autouse=True)
def _quiet() -> Iterator[None]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def _batch(lengths: list[int] = LENGTHS, seed: int = 0) -> dict:
    generator = torch.Generator().manual_seed(seed)
    return PackingCollator()([{INPUT_IDS: torch.randint(3, VOCAB, (n,), generator=generator)} for n in lengths])


def _starts(lengths: list[int]) -> list[int]:
    return [sum(lengths[:i]) for i in range(len(lengths))]


def _layer_inputs(family: str) -> dict:
    """Keyword arguments a decoder layer needs besides the hidden states (Qwen3-Next's are required)."""
    return {"position_embeddings": None} if family == "qwen3_next" else {}


@pytest.mark.parametrize("family", FAMILIES)
def test_backbone_called_directly_keeps_documents_apart(family: str) -> None:
    """TRL's path: the packed keys enter at ``model.base_model``, never at the top-level forward."""
    model = patch_model(tiny_model(family))
    batch = _batch()
    report = check_training_step(lambda b: model.lm_head(model.base_model(**b).last_hidden_state), batch, model=model)
    assert report.ok and report.error is None, str(report)
    assert all(d.gradient_leak == 0.0 for d in report.documents)


@pytest.mark.parametrize("family", FAMILIES)
def test_decoder_layer_called_directly_keeps_documents_apart(family: str) -> None:
    model = patch_model(tiny_model(family))
    layer = model.base_model.layers[0]
    batch = _batch()
    hidden = torch.randn(1, sum(LENGTHS), model.config.hidden_size, generator=torch.Generator().manual_seed(1))
    keys = {key: value for key, value in batch.items() if key not in (INPUT_IDS, LABELS)}
    x = hidden.clone().requires_grad_(True)
    packed = layer(x, **_layer_inputs(family), **keys)
    packed = packed[0] if isinstance(packed, tuple) else packed
    with pure_torch_transformers(model):
        for start, n in zip(_starts(LENGTHS), LENGTHS, strict=True):
            alone = layer(hidden[:, start:start + n], **_layer_inputs(family))
            alone = alone[0] if isinstance(alone, tuple) else alone
            torch.testing.assert_close(packed[:, start:start + n], alone, rtol=1e-5, atol=1e-5)
    (grad,) = torch.autograd.grad(packed[:, : LENGTHS[0] + LENGTHS[1]].sum(), x)
    assert grad[0, LENGTHS[0] + LENGTHS[1]:].abs().max() == 0


def test_attention_decoder_layer_called_first_keeps_documents_apart() -> None:
    """An attention implementation registered again after patching (a kernel hub's, or a fresh process loading a
    pickled model): a packed call entering at an attention decoder layer still runs per-document attention (it ran
    the new implementation over the whole row until a whole-model call wrapped it)."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    model = patch_model(tiny_model("jamba"))
    registered = ALL_ATTENTION_FUNCTIONS["sdpa"]
    AttentionInterface.register("sdpa", lambda *args, **kwargs: sdpa_attention_forward(*args, **kwargs))
    try:
        layer = model.base_model.layers[1]                                   # Jamba's attention decoder layer
        assert type(layer).__name__ == "JambaAttentionDecoderLayer"
        batch = _batch()
        keys = {key: value for key, value in batch.items() if key not in (INPUT_IDS, LABELS)}
        hidden = torch.randn(1, sum(LENGTHS), model.config.hidden_size, generator=torch.Generator().manual_seed(2))
        with torch.no_grad():
            packed = layer(hidden, **keys)
            packed = packed[0] if isinstance(packed, tuple) else packed
            for start, n in zip(_starts(LENGTHS), LENGTHS, strict=True):
                alone = layer(hidden[:, start:start + n])
                alone = alone[0] if isinstance(alone, tuple) else alone
                torch.testing.assert_close(packed[:, start:start + n], alone, rtol=1e-5, atol=1e-5)
    finally:
        AttentionInterface.register("sdpa", registered)


@pytest.mark.parametrize("family", FAMILIES)
def test_mixer_reached_past_every_entry_refuses_packed_keys(family: str) -> None:
    """Never a silent one-document run, never another library's "install a kernel" advice."""
    model = patch_model(tiny_model(family))
    mixer = getattr(model.base_model.layers[0], MIXERS[family])
    batch = _batch()
    hidden = torch.randn(1, sum(LENGTHS), model.config.hidden_size)
    refusal = rf"{type(mixer).__name__}: received {CU_SEQ_LENS_Q}.*{SEQ_IDX}.*boundaries=.*from_batch"
    with pytest.raises(BoundaryError, match=refusal):
        mixer(hidden, seq_idx=batch[SEQ_IDX], cu_seq_lens_q=batch[CU_SEQ_LENS_Q])
    packed = mixer(hidden, boundaries=PackedBoundaries.from_batch(batch))     # the fix the error names
    second = slice(LENGTHS[0], LENGTHS[0] + LENGTHS[1])
    with pure_torch_transformers(model):
        torch.testing.assert_close(packed[:, second], mixer(hidden[:, second]), rtol=1e-5, atol=1e-5)


def test_attention_reached_past_every_entry_refuses_packed_keys() -> None:
    model = patch_model(tiny_model("qwen3_next"))
    attention = model.base_model.layers[1].self_attn
    batch = _batch()
    hidden = torch.randn(1, sum(LENGTHS), model.config.hidden_size)
    rope = model.base_model.rotary_emb(hidden, batch[POSITION_IDS])
    with pytest.raises(BoundaryError, match="Qwen3NextAttention: received cu_seq_lens_q"):
        attention(hidden, position_embeddings=rope, attention_mask=None, cu_seq_lens_q=batch[CU_SEQ_LENS_Q])


@pytest.mark.parametrize("family", FAMILIES)
def test_patch_holds_with_lora_and_gradient_checkpointing_on_the_backbone(family: str) -> None:
    """PEFT LoRA applied to the patched model, gradient checkpointing on, the backbone called directly."""
    peft = pytest.importorskip("peft")
    model = patch_model(tiny_model(family))
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    lora = peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=["in_proj", "in_proj_qkvz", "q_proj"]))
    backbone = lora.get_base_model().base_model
    report = check_training_step(lambda b: model.lm_head(backbone(**b).last_hidden_state), _batch(), model=lora)
    assert report.ok and report.error is None, str(report)
    assert all(d.gradient_leak == 0.0 for d in report.documents)
    assert model.is_gradient_checkpointing


@pytest.mark.parametrize(("family", "mixer"), [("jamba", "mamba"), ("mamba", "mixer"), ("falcon_mamba", "mixer")])
@pytest.mark.parametrize("order", ["patch_then_peft", "peft_then_patch"])
def test_a_wrapped_mixer_of_a_hand_off_family_keeps_documents_apart(family: str, mixer: str, order: str) -> None:
    """PEFT's ``modules_to_save`` wraps the mixer its parent hands the boundaries to: the trainable copy got none
    and ran the row as one document (Mamba: 0.16 off each document alone, 11 of gradient across documents)."""
    peft = pytest.importorskip("peft")
    config = peft.LoraConfig(r=4, target_modules=["q_proj"] if family == "jamba" else ["embeddings"],
                             modules_to_save=[mixer])
    model = tiny_model(family)
    model = (peft.get_peft_model(patch_model(model), config) if order == "patch_then_peft"
             else patch_model(peft.get_peft_model(model, config)))
    report = check_isolation(model, lengths=LENGTHS, progress=False)
    assert report.ok, str(report)


@pytest.mark.parametrize("family", ["mamba", "falcon_mamba", "mamba2"])
@pytest.mark.parametrize("keys", ["collator", "position_ids", "boundaries"])
def test_forward_called_directly_on_a_hand_off_family_keeps_documents_apart(family: str, keys: str) -> None:
    """``model.forward(...)`` skips the hooks, and the forward of these causal LMs drops the packed keys (or never
    passes ``boundaries`` on): the row ran as one document (Mamba2: 0.74 off each document alone)."""
    model = patch_model(tiny_model(family))

    def forward(batch: dict) -> torch.Tensor:
        if keys == "position_ids":
            batch = {INPUT_IDS: batch[INPUT_IDS], POSITION_IDS: batch[POSITION_IDS]}
        elif keys == "boundaries":
            batch = {INPUT_IDS: batch[INPUT_IDS], "boundaries": PackedBoundaries.from_batch(batch)}
        return model.forward(**batch).logits

    report = check_training_step(forward, _batch(), model=model)
    assert report.ok and report.error is None, str(report)


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_compiled_model_keeps_documents_apart_on_every_layout(family: str) -> None:
    """``torch.compile`` of the patched model: two layouts of the same length must each give the eager results
    (no compiled graph holds on to one layout's boundaries), and gradients stay inside their document.

    Inside the graph the boundaries are read from tensors only and the ops run their static forms (row chunks
    with masks instead of per-document chunks): the same sums in another order, a few 1e-6 apart in float32."""
    eager = patch_model(tiny_model(family))
    compiled = torch.compile(eager, backend="eager")
    assert patch_model(compiled) is compiled
    for lengths in ([5, 19, 1, 7], [7, 1, 19, 5]):
        batch = _batch(lengths)
        with torch.no_grad():
            torch.testing.assert_close(compiled(**batch).logits, eager(**batch).logits, rtol=0, atol=1e-5)
    grads = []
    for model in (eager, compiled):
        embeds = eager.get_input_embeddings()(batch[INPUT_IDS]).detach().requires_grad_(True)
        keys = {key: value for key, value in batch.items() if key not in (INPUT_IDS, LABELS)}
        model(inputs_embeds=embeds, **keys).logits[0, :7].sum().backward()
        grads.append(embeds.grad)
    assert grads[1][0, 7:].abs().max() == 0
    torch.testing.assert_close(grads[1], grads[0], rtol=0, atol=1e-5)


@pytest.mark.parametrize("family", ["bamba", "jamba"])
def test_harness_on_a_packed_hugging_face_trainer(family: str, tmp_path) -> None:
    """``PackedTrainer`` (a ``transformers.Trainer``) checked on its own first packed batch and compute_loss."""
    from transformers import TrainingArguments

    from hybrid_pack.integrations.transformers.trainer import PackedTrainer

    generator = torch.Generator().manual_seed(0)
    features = [{INPUT_IDS: torch.randint(3, VOCAB, (n,), generator=generator).tolist()} for n in LENGTHS * 2]
    arguments = TrainingArguments(str(tmp_path), max_steps=1, use_cpu=True, report_to=[], save_strategy="no",
                                  disable_tqdm=True)
    trainer = PackedTrainer(model=patch_model(tiny_model(family)), args=arguments, train_dataset=features,
                            lengths=[len(f[INPUT_IDS]) for f in features], capacity=40)
    report = check_isolation(trainer)
    assert report.ok and report.error is None, str(report)
    assert report.layouts[0].name == "training step: per-token logits" and len(report.documents) > 1
    assert all(d.gradient_leak == 0.0 for d in report.documents)
