"""The native model's activation checkpointing, as transformers' ``Trainer`` and TRL turn it on: the same loss and
gradients as without it, layer by layer, through every option they pass."""

from __future__ import annotations

import copy

import pytest
import torch

from hybrid_pack import PackingCollator
from hybrid_pack.errors import InputError
from hybrid_pack.modeling import from_preset
from hybrid_pack.modeling.checkpointing import is_checkpointed_layer
from hybrid_pack.schema import INPUT_IDS

ROWS = [{INPUT_IDS: torch.randint(0, 128, (n,), generator=torch.Generator().manual_seed(n)).tolist()}
        for n in (10, 20, 1, 7)]


def _loss_and_grads(model: torch.nn.Module) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    batch = PackingCollator()(ROWS)
    batch["labels"] = batch[INPUT_IDS].clone()
    model.zero_grad()
    loss = model(**batch).loss
    loss.backward()
    return loss.detach(), {name.replace("._checkpoint_wrapped_module", ""): p.grad.clone()  # the wrapper's name
                           for name, p in model.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("preset", ["qwen3-next-tiny", "bamba-tiny"])
@pytest.mark.parametrize("options", [{}, {"every_n_layers": 2}, {"offload": True},
                                     {"activation_checkpointing_kwargs": {"use_reentrant": True}}],
                         ids=["default", "every_2", "offload", "reentrant"])
def test_checkpointed_layers_give_the_same_loss_and_gradients(preset: str, options: dict) -> None:
    torch.manual_seed(0)
    plain = from_preset(preset, vocab_size=128)
    checkpointed = copy.deepcopy(plain)
    checkpointed.activation_checkpointing_enable(**options)
    step = options.get("every_n_layers", 1)
    layers = checkpointed.model.layers
    assert [is_checkpointed_layer(layer) for layer in layers] == [i % step == 0 for i in range(len(layers))]
    assert checkpointed.is_activation_checkpointing and checkpointed.is_gradient_checkpointing
    assert list(checkpointed.state_dict()) == list(plain.state_dict())
    want_loss, want = _loss_and_grads(plain)
    got_loss, got = _loss_and_grads(checkpointed)
    torch.testing.assert_close(got_loss, want_loss, rtol=0, atol=0)
    assert list(got) == list(want)
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-6, atol=1e-7, msg=name)


def test_enabling_again_keeps_the_wrappers_and_disabling_restores_the_layers() -> None:
    model = from_preset("qwen3-next-tiny", vocab_size=128)
    originals = list(model.model.layers)
    model.gradient_checkpointing_enable()
    wrapped = list(model.model.layers)
    model.activation_checkpointing_enable({"use_reentrant": False})  # the same settings: nothing changes
    assert list(model.model.layers) == wrapped
    model.activation_checkpointing_enable(every_n_layers=3)
    assert [is_checkpointed_layer(layer) for layer in model.model.layers] == [i % 3 == 0 for i in
                                                                              range(len(originals))]
    model.gradient_checkpointing_disable()
    assert list(model.model.layers) == originals and not model.is_activation_checkpointing


@pytest.mark.parametrize("every_n_layers", [1, 2])
def test_reentrant_checkpoints_train_the_layers_of_a_frozen_embedding(every_n_layers: int) -> None:
    """A reentrant checkpoint differentiates a layer only when its input requires grad: with the embedding frozen
    (an adapter's training) it raised, or with ``every_n_layers=2`` left layer 0 without gradients, silently."""
    torch.manual_seed(0)
    plain = from_preset("qwen3-next-tiny", vocab_size=128)
    plain.get_input_embeddings().weight.requires_grad_(False)
    checkpointed = copy.deepcopy(plain)
    checkpointed.activation_checkpointing_enable({"use_reentrant": True}, every_n_layers=every_n_layers)
    _, want = _loss_and_grads(plain)
    _, got = _loss_and_grads(checkpointed)
    for name, grad in want.items():
        assert got[name] is not None, name
        torch.testing.assert_close(got[name], grad, rtol=1e-6, atol=1e-7, msg=name)
    checkpointed.activation_checkpointing_disable()
    assert not checkpointed.get_input_embeddings()._forward_hooks


def test_the_trainers_call_after_parallelize_keeps_the_compiled_layers() -> None:
    """``parallelize`` checkpoints, then compiles (or shards) each layer; transformers' ``Trainer`` then asks for
    checkpointing with its defaults, which re-wrapped every layer and dropped the compiled (sharded) one. The same
    settings change nothing now, and other settings are refused, naming the order that works."""
    from hybrid_pack.parallel import parallelize

    model = parallelize(from_preset("qwen3-next-tiny", vocab_size=128), mesh=None, activation_checkpointing=True,
                        compile=True)
    layers = list(model.model.layers)
    assert all(layer._compiled_call_impl is not None for layer in layers)
    model.activation_checkpointing_enable()  # the Trainer's call: gradient_checkpointing_kwargs None
    model.gradient_checkpointing_enable({"use_reentrant": False})
    assert list(model.model.layers) == layers
    with pytest.raises(InputError, match="activation_checkpointing: decoder layer 0 is sharded by FSDP2 or compiled"):
        model.activation_checkpointing_enable(every_n_layers=2)
    assert list(model.model.layers) == layers


def test_an_offloading_model_pickles() -> None:
    import io

    model = from_preset("qwen3-next-tiny", vocab_size=128)
    model.activation_checkpointing_enable(offload=True)
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    assert loaded.is_activation_checkpointing and is_checkpointed_layer(loaded.model.layers[0])


@pytest.mark.parametrize(("options", "field"), [({"every_n_layers": 0}, "every_n_layers"),
                                                ({"every_n_layers": 1.5}, "every_n_layers"),
                                                ({"offload": "yes"}, "offload"),
                                                ({"activation_checkpointing_kwargs": ["use_reentrant"]},
                                                 "activation_checkpointing_kwargs")])
def test_bad_options_are_refused_by_name(options: dict, field: str) -> None:
    model = from_preset("qwen3-next-tiny", vocab_size=128)
    with pytest.raises(InputError, match=field):
        model.activation_checkpointing_enable(**options)
    assert not model.is_activation_checkpointing


@pytest.mark.parametrize("flag", ["gradient_checkpointing", "activation_checkpointing"])
def test_trainer_trains_a_native_model_with_checkpointing_on(tmp_path, flag: str) -> None:
    """transformers' ``Trainer`` calls the model's ``activation_checkpointing_enable`` for
    ``gradient_checkpointing=True`` (TRL's default): it raised AttributeError on a native model. The run trains to
    the parameters of the same run without checkpointing."""
    from transformers import Trainer, TrainingArguments

    trained = []
    for on in (False, True):
        torch.manual_seed(0)
        model = from_preset("qwen3-next-tiny", vocab_size=128)
        args = TrainingArguments(output_dir=str(tmp_path / str(on)), max_steps=2, per_device_train_batch_size=4,
                                 report_to=[], use_cpu=True, save_strategy="no", disable_tqdm=True,
                                 **{flag: on})
        Trainer(model=model, args=args, train_dataset=ROWS, data_collator=PackingCollator()).train()
        assert model.is_activation_checkpointing == on
        trained.append(model.state_dict())
    for name, want in trained[0].items():
        torch.testing.assert_close(trained[1][name], want, rtol=1e-5, atol=1e-6, msg=name)
