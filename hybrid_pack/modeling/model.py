"""The hybrid causal LM: pre-norm decoder layers whose mixer is Gated DeltaNet, Mamba-2 or attention.

Every token-mixing op takes the row's :class:`~hybrid_pack.PackedBoundaries`, built once per
forward from the batch keys the :class:`~hybrid_pack.PackingCollator` emits (from its ``host_boundaries`` and the
boundary tensors as they are, reading no tensor value: docs/api.md §9b), so a packed row of
documents gives each document the logits (and gradients) it would get alone. A context-parallel shard's
:class:`~hybrid_pack.parallel.ShardedBoundaries` go to the same ops, each of which has a context-parallel
path, and RoPE reads their ``document_positions`` (counted from the document's start on earlier ranks).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from os import PathLike
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Partial
from torch.utils.hooks import RemovableHandle

from hybrid_pack.boundaries import PackedBoundaries
from hybrid_pack.boundaries.host import HostBoundaries, StaticHostBoundaries
from hybrid_pack.boundaries.sharded import ShardedBoundaries, require_row_count
from hybrid_pack.boundaries.static import StaticBoundaries
from hybrid_pack.boundaries.targets import shift_labels as shifted_targets
from hybrid_pack.errors import BoundaryError, InputError
from hybrid_pack.loss import packed_loss
from hybrid_pack.modeling.attention import Attention
from hybrid_pack.modeling.checkpointing import Checkpointing, checkpoint_layers, checkpointing_of
from hybrid_pack.modeling.config import HybridConfig
from hybrid_pack.modeling.gated_deltanet import GatedDeltaNet
from hybrid_pack.modeling.mamba2 import Mamba2
from hybrid_pack.modeling.mlp import build_mlp
from hybrid_pack.modeling.norm import GatedRMSNorm, RMSNorm
from hybrid_pack.modeling.rope import RotaryEmbedding
from hybrid_pack.ops.linear_cross_entropy import linear_cross_entropy
from hybrid_pack.ops.validate import local_boundaries
from hybrid_pack.schema import (
    CU_SEQ_LENS_K,
    CU_SEQ_LENS_Q,
    HOST_BOUNDARIES,
    INPUT_IDS,
    INPUTS_EMBEDS,
    MAX_LENGTH_K,
    MAX_LENGTH_Q,
    NUM_PAD_TOKENS,
    POSITION_IDS,
    PRIMARY_BOUNDARY_KEYS,
    SECONDARY_BOUNDARY_KEYS,
    SEQ_IDX,
    SHIFT_LABELS,
)

__all__ = ["CausalLMOutput", "HybridDecoderLayer", "HybridModel", "HybridForCausalLM"]

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
_MIXERS = {"G": GatedDeltaNet, "M": Mamba2, "A": Attention}


@dataclass
class CausalLMOutput:
    """``loss``: float32 scalar or None (no labels); ``logits``: ``[B, T, vocab_size]``.

    With labels, the loss comes from the final hidden states and the LM head's weight through
    :func:`~hybrid_pack.ops.linear_cross_entropy` and the forward pass builds no logits: ``logits`` computes them
    on first read, ``head(last_hidden_state)``, and keeps them. A training step that reads only ``loss`` never holds
    ``[T, V]`` logits; one that reads ``logits`` (the guard, the harness, an evaluation) gets the same tensor as
    without labels, with its gradient. Under FSDP2 the head's weight is sharded again after the forward pass, and
    reading ``logits`` then gathers it: a collective, so every rank of the mesh must read them.
    ``last_hidden_state`` (the final norm's output ``[B, T, hidden]``) and ``head`` are what they are built from;
    ``computed_logits`` holds them once built. They are built as at the forward pass: under the autocast and the
    grad mode it ran under (``autocast``: enabled and dtype; ``grad_mode``: gradients, inference mode), and, in eager
    mode, only while the head's weight is the one it used
    (``head_weight`` at its version then): read after an optimizer step changed it in place, they raise (not
    checked under FSDP2, whose gathered weight is another tensor after the backward).

    Indexable like a Hugging Face ``ModelOutput`` (``out["loss"]``, ``out[0]`` is the first field
    that is not None), so ``transformers.Trainer`` can read it.
    """

    loss: torch.Tensor | None
    computed_logits: torch.Tensor | None = None
    last_hidden_state: torch.Tensor | None = field(default=None, repr=False)
    head: nn.Linear | None = field(default=None, repr=False)
    autocast: tuple[bool, torch.dtype] | None = field(default=None, repr=False)
    head_weight: tuple[torch.Tensor, int] | None = field(default=None, repr=False)
    grad_mode: tuple[bool, bool] = field(default=(True, False), repr=False)  # gradients on, inference mode

    @classmethod
    def deferred(cls, loss: torch.Tensor, last_hidden_state: torch.Tensor, head: nn.Linear) -> CausalLMOutput:
        """The output of a forward pass with labels: ``loss`` now, the logits on first read, as they were now."""
        device = last_hidden_state.device.type
        weight, compiling = head.weight, torch.compiler.is_compiling()  # a trace reads no version, no inference
        version = None if compiling or weight.is_inference() else (weight, weight._version)  # (inference: none)
        inference = not compiling and last_hidden_state.is_inference()  # computed in inference mode
        return cls(loss=loss, last_hidden_state=last_hidden_state, head=head, head_weight=version,
                   autocast=(torch.is_autocast_enabled(device), torch.get_autocast_dtype(device)),
                   grad_mode=(torch.is_grad_enabled(), inference))

    @property
    def logits(self) -> torch.Tensor:
        """``[B, T, vocab_size]`` in the model's dtype; computed from ``last_hidden_state`` on first read."""
        if self.computed_logits is None:
            weight = self.head.weight
            if self.head_weight is not None and weight is self.head_weight[0] and \
                    weight._version != self.head_weight[1]:
                raise InputError("logits: the LM head's weight changed in place after the forward pass (an "
                                 "optimizer step); read out.logits before the step, or run the model again")
            enabled, dtype = self.autocast or (False, None)
            grads, inference = self.grad_mode
            with torch.autocast(self.last_hidden_state.device.type, dtype=dtype, enabled=enabled), \
                    torch.inference_mode(inference), torch.set_grad_enabled(grads and not inference):
                if isinstance(weight, DTensor):  # FSDP2 sharded the head again after the forward: gather it
                    # the gathered weight's gradient is reduce-scattered (averaged) like FSDP2's own
                    weight = weight.full_tensor(grad_placements=[Partial("avg")] * weight.device_mesh.ndim)
                    self.computed_logits = F.linear(self.last_hidden_state, weight)
                else:
                    self.computed_logits = self.head(self.last_hidden_state)
        return self.computed_logits

    def to_tuple(self) -> tuple[torch.Tensor, ...]:
        return tuple(v for v in (self.loss, self.logits) if v is not None)

    def __getitem__(self, key: str | int | slice) -> torch.Tensor | tuple[torch.Tensor, ...] | None:
        if isinstance(key, str):
            return getattr(self, key)
        if key == 0:  # what transformers.Trainer reads for the loss: no logits built for it
            return self.loss if self.loss is not None else self.logits
        return self.to_tuple()[key]


class HybridDecoderLayer(nn.Module):
    """``h += mixer(norm(h)); h += mlp(norm(h))`` with the mixer named by one pattern letter."""

    def __init__(self, config: HybridConfig, layer_idx: int) -> None:
        super().__init__()
        self.kind = config.layer_pattern[layer_idx]
        self.input_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mixer = _MIXERS[self.kind](config)
        self.post_mixer_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = build_mlp(config)

    def forward(self, hidden_states: torch.Tensor, boundaries: PackedBoundaries | ShardedBoundaries,
                rotary: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
        """``[1, T, hidden]`` -> ``[1, T, hidden]``; ``rotary`` is used by attention layers only."""
        normed = self.input_norm(hidden_states)
        mixed = self.mixer(normed, boundaries, rotary) if self.kind == "A" else self.mixer(normed, boundaries)
        hidden_states = hidden_states + mixed
        return hidden_states + self.mlp(self.post_mixer_norm(hidden_states))


class HybridModel(nn.Module):
    """Embedding, the decoder layers of ``config.layer_pattern``, and the final RMSNorm."""

    def __init__(self, config: HybridConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(HybridDecoderLayer(config, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary = RotaryEmbedding(config.head_dim, config.rope_theta) if "A" in config.layer_pattern else None

    def forward(self, boundaries: PackedBoundaries | ShardedBoundaries, input_ids: torch.Tensor | None = None,
                inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        """int64 ``input_ids`` ``[1, T]`` or ``inputs_embeds`` ``[1, T, hidden]`` -> ``[1, T, hidden]``."""
        hidden_states = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        rotary = None if self.rotary is None else self.rotary(boundaries.document_positions)
        for layer in self.layers:
            hidden_states = layer(hidden_states, boundaries, rotary)
        return self.norm(hidden_states)


def _boundaries_for(batch: dict[str, Any], rows: int, tokens: int) -> PackedBoundaries | StaticBoundaries:
    """Boundaries from the collator keys in ``batch``, or one document per row when there are none.

    Inside ``torch.compile`` they are :class:`StaticBoundaries` (tensors only, nothing read from them), so one
    graph serves every batch of the same shapes (the static batches of docs/api.md §9).
    """
    if all(batch.get(key) is None for key in (*PRIMARY_BOUNDARY_KEYS, HOST_BOUNDARIES)):
        given = [key for key in SECONDARY_BOUNDARY_KEYS if batch.get(key) is not None]
        given = [key for key in given if not (key == NUM_PAD_TOKENS and batch[key] == 0)]
        if given:
            raise BoundaryError(f"{given[0]}: given without {', '.join(PRIMARY_BOUNDARY_KEYS)}, which say where "
                                "the documents start; pass the whole PackingCollator batch")
        return PackedBoundaries.from_lengths([tokens] * rows)
    if rows != 1:
        raise BoundaryError(f"{INPUT_IDS}: a packed batch is one row [1, T] (PackingCollator flattens the batch); "
                            f"got {rows} rows together with boundary keys")
    if torch.compiler.is_compiling():
        return StaticBoundaries.from_batch(batch)
    return PackedBoundaries.from_batch(batch)   # with the collator's HOST_BOUNDARIES: no value read (§9b)


def _outputs_require_grad(module: nn.Module, args: Any, output: torch.Tensor) -> None:
    if torch.is_grad_enabled() and not output.requires_grad:
        output.requires_grad_(True)


class HybridForCausalLM(nn.Module):
    """A hybrid LM with an LM head, taking the batches :class:`~hybrid_pack.PackingCollator` builds.

    ``model(**collator(features))`` works: the boundary keys (``cu_seq_lens_q/k``, ``seq_idx``,
    ``position_ids``, ``max_length_q/k``, ``num_pad_tokens``) define the documents of the row.
    Without any of them, each row of ``input_ids`` ``[B, T]`` is one document.
    """

    def __init__(self, config: HybridConfig) -> None:
        super().__init__()
        self.config = config
        self.model = HybridModel(config)
        self._checkpointing: Checkpointing | None = None
        self._input_grads_hook: RemovableHandle | None = None
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.apply(self._init_weights)

    @torch.no_grad()
    def _init_weights(self, module: nn.Module) -> None:
        """Normal(0, ``initializer_range``) linears and embeddings, unit norms, SSM-specific mixer params."""
        std = self.config.initializer_range
        if isinstance(module, (nn.Linear, nn.Embedding)):
            module.weight.normal_(0.0, std)
            if getattr(module, "bias", None) is not None:
                module.bias.zero_()
        elif isinstance(module, (RMSNorm, GatedRMSNorm)):
            module.weight.fill_(1.0)
        elif isinstance(module, (GatedDeltaNet, Mamba2)):
            module.reset_parameters()

    supports_gradient_checkpointing = True
    """transformers' name for: :meth:`activation_checkpointing_enable` turns activation checkpointing on."""

    def activation_checkpointing_enable(self, activation_checkpointing_kwargs: Mapping[str, Any] | None = None,
                                        every_n_layers: int = 1, offload: bool = False) -> None:
        """Recompute every ``every_n_layers``-th decoder layer's forward in the backward, as transformers' models
        do (what ``Trainer`` and TRL call for ``gradient_checkpointing=True``): ``activation_checkpointing_kwargs``
        go to ``torch.utils.checkpoint.checkpoint`` (default non-reentrant); ``offload`` keeps the inputs it saves
        in host memory. Called again with the same arguments, it changes nothing."""
        checkpointing = checkpointing_of(activation_checkpointing_kwargs, every_n_layers, offload)
        if checkpointing != self._checkpointing:
            checkpoint_layers(self.model.layers, checkpointing)
            self._checkpointing = checkpointing
            self.enable_input_require_grads()  # a reentrant checkpoint of a frozen embedding's output: no gradient

    def activation_checkpointing_disable(self) -> None:
        """Every decoder layer keeps its activations again."""
        checkpoint_layers(self.model.layers, None)
        self._checkpointing = None
        self.disable_input_require_grads()

    def enable_input_require_grads(self) -> None:
        """The input embeddings' output requires grad even when the embedding is frozen (an adapter's training): a
        reentrant checkpoint differentiates a layer only when its input requires grad (transformers' name)."""
        if self._input_grads_hook is None:
            self._input_grads_hook = self.get_input_embeddings().register_forward_hook(_outputs_require_grad)

    def disable_input_require_grads(self) -> None:
        if self._input_grads_hook is not None:
            self._input_grads_hook.remove()
            self._input_grads_hook = None

    def gradient_checkpointing_enable(self, gradient_checkpointing_kwargs: Mapping[str, Any] | None = None,
                                      every_n_layers: int = 1, offload: bool = False) -> None:
        """:meth:`activation_checkpointing_enable` by its name before transformers 5 (PEFT and TRL call it)."""
        self.activation_checkpointing_enable(gradient_checkpointing_kwargs, every_n_layers, offload)

    def gradient_checkpointing_disable(self) -> None:
        self.activation_checkpointing_disable()

    @property
    def is_activation_checkpointing(self) -> bool:
        """Whether some decoder layer recomputes its forward in the backward."""
        return self._checkpointing is not None

    is_gradient_checkpointing = is_activation_checkpointing

    def get_input_embeddings(self) -> nn.Embedding:
        return self.model.embed_tokens

    def get_output_embeddings(self) -> nn.Linear:
        return self.lm_head

    def num_parameters(self, exclude_embeddings: bool = False) -> int:
        """Distinct parameters (a tied head counts once); without the embedding and head if asked."""
        skip = set()
        if exclude_embeddings:
            skip = {id(self.model.embed_tokens.weight), id(self.lm_head.weight)}
        return sum(p.numel() for p in self.parameters() if id(p) not in skip)

    def forward(self, input_ids: torch.Tensor | None = None, labels: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None, seq_idx: torch.Tensor | None = None,
                cu_seq_lens_q: torch.Tensor | None = None, cu_seq_lens_k: torch.Tensor | None = None,
                max_length_q: int | None = None, max_length_k: int | None = None,
                num_pad_tokens: int | None = None, inputs_embeds: torch.Tensor | None = None, *,
                host_boundaries: HostBoundaries | StaticHostBoundaries | None = None,
                boundaries: PackedBoundaries | ShardedBoundaries | None = None,
                num_items_in_batch: int | torch.Tensor | None = None, attention_mask: torch.Tensor | None = None,
                **kwargs: Any) -> CausalLMOutput:
        """Logits and, with ``labels``, the next-token loss of a packed batch.

        Args:
            input_ids: int64 ``[1, T]`` packed row (or ``[B, T]`` of B whole documents without boundary keys).
            labels: int64, same shape, unshifted, ``-100`` ignored (the collator puts it on each document's
                first token). The loss is :func:`hybrid_pack.packed_loss`'s (mean over target tokens), computed by
                :func:`~hybrid_pack.ops.linear_cross_entropy` from the final hidden states without ``[T, V]`` logits
                (through the logits when the head is not a plain bias-free ``nn.Linear``).
            position_ids, seq_idx, cu_seq_lens_q, cu_seq_lens_k, max_length_q, max_length_k, num_pad_tokens:
                the collator's boundary keys; any subset that agrees is fine.
            host_boundaries: the collator's segment lengths on the host (in the static form, host tensors): with
                it the boundaries are built from them and the boundary tensors as they are, reading no device value
                (docs/api.md §9b); without it they are read from the tensors (a device-to-host copy when those are
                on an accelerator).
            inputs_embeds: ``[1, T, hidden]`` instead of ``input_ids`` (e.g. to take gradients w.r.t. them).
            boundaries: a ready :class:`~hybrid_pack.PackedBoundaries` instead of the keys (a
                :class:`~hybrid_pack.parallel.ShardedBoundaries`: this rank's part of a context-parallel row).
            num_items_in_batch: divide the summed loss by this (gradient accumulation).
            attention_mask: not supported; packed rows carry boundaries, not masks.
            **kwargs: ``shift_labels``: labels already shifted (the target of position t at t), used instead of
                ``labels`` for the loss: what :func:`hybrid_pack.parallel.shard_batch` gives a context-parallel
                shard (a keyword of ``**kwargs``, so that transformers' ``Trainer``, which takes every parameter
                named like a label for one the batch must hold, computes its evaluation loss from ``labels``).
                Other per-token keys of the batch (``response_mask``, ``advantages``, ...) are for the training
                loss, not the model, and are not read here.

        Returns:
            :class:`CausalLMOutput` with ``logits`` ``[B, T, vocab_size]`` (with labels, built on first read) and
            ``loss`` (None without labels).
        """
        shift_labels = kwargs.pop(SHIFT_LABELS, None)
        if (input_ids is None) == (inputs_embeds is None):
            raise InputError("input_ids: expected exactly one of input_ids or inputs_embeds")
        if attention_mask is not None:
            raise InputError("attention_mask: not supported; pass a padding-free packed row with its boundary keys "
                             "(cu_seq_lens_q / seq_idx / position_ids) as PackingCollator builds it")
        source = input_ids if inputs_embeds is None else inputs_embeds
        if source.dim() != (2 if inputs_embeds is None else 3):
            name = INPUT_IDS if inputs_embeds is None else INPUTS_EMBEDS
            raise InputError(f"{name}: expected shape {'[B, T]' if inputs_embeds is None else '[B, T, hidden]'}; "
                             f"got {list(source.shape)}")
        rows, tokens = source.shape[:2]
        if boundaries is None:
            unknown = [key for key in kwargs if key.startswith(("cu_seq", "seq_", "max_len"))]
            if unknown:
                raise InputError(f"{unknown[0]}: not a boundary key this model reads; use the PackingCollator "
                                 "keys (cu_seq_lens_q, seq_idx, position_ids, ...)")
            batch = {POSITION_IDS: position_ids, SEQ_IDX: seq_idx, CU_SEQ_LENS_Q: cu_seq_lens_q,
                     CU_SEQ_LENS_K: cu_seq_lens_k, MAX_LENGTH_Q: max_length_q, MAX_LENGTH_K: max_length_k,
                     NUM_PAD_TOKENS: num_pad_tokens, HOST_BOUNDARIES: host_boundaries}
            boundaries = _boundaries_for(batch, rows, tokens)
        here = local_boundaries(boundaries)  # a context-parallel shard: this rank's tokens
        if here.total_tokens != rows * tokens:
            raise InputError(f"boundaries: expected {rows * tokens} tokens (the input's); got {here.total_tokens}")
        if boundaries.device != source.device:
            boundaries = boundaries.to(source.device)
        if inputs_embeds is None:
            hidden_states = self.model(boundaries, input_ids=input_ids.reshape(1, -1))
        else:
            hidden_states = self.model(boundaries, inputs_embeds=inputs_embeds.reshape(1, rows * tokens, -1))
        if rows != 1:  # a packed row is [1, T, hidden] already: no view (FSDP2 hooks the outputs)
            hidden_states = hidden_states.view(rows, tokens, -1)
        targets = self._targets(labels, shift_labels, boundaries, rows, tokens)
        if targets is not None:
            require_row_count(boundaries, num_items_in_batch)
        if targets is not None and self._fused_loss:
            loss = linear_cross_entropy(hidden_states, self.lm_head.weight, targets.view(rows, tokens),
                                        num_items=num_items_in_batch)
            return CausalLMOutput.deferred(loss, hidden_states, self.lm_head)
        logits = self.lm_head(hidden_states)   # not a view: FSDP2 hooks the output
        loss = None
        if targets is not None:
            loss = packed_loss(logits.view(1, rows * tokens, -1), targets, boundaries=boundaries,
                               num_items_in_batch=num_items_in_batch, shifted=True)
        return CausalLMOutput(loss=loss, computed_logits=logits)

    @property
    def _fused_loss(self) -> bool:
        """Whether the loss can skip the logits: the head is a plain bias-free ``nn.Linear`` (not wrapped by an
        adapter or sharded on its own by FSDP2, which would change what its weight holds outside its forward)."""
        return type(self.lm_head) is nn.Linear and self.lm_head.bias is None

    @staticmethod
    def _targets(labels: torch.Tensor | None, shift_labels: torch.Tensor | None,
                 boundaries: PackedBoundaries | StaticBoundaries | ShardedBoundaries, rows: int, tokens: int
                 ) -> torch.Tensor | None:
        """The row's next-token targets ``[1, B * T]`` (``shift_labels`` as given; ``labels`` shifted within each
        document), or None without labels."""
        given = shift_labels if shift_labels is not None else labels
        if given is None:
            return None
        name = "shift_labels" if shift_labels is not None else "labels"
        if tuple(given.shape) != (rows, tokens):
            raise InputError(f"{name}: expected the input's shape [B, T] = {[rows, tokens]}; got shape "
                             f"{list(given.shape)}")
        if shift_labels is not None:
            return shift_labels.reshape(1, rows * tokens)
        if isinstance(boundaries, ShardedBoundaries):
            raise InputError("labels: a context-parallel shard's last target is the next rank's first label; pass "
                             "the shard's shift_labels from shard_batch (shift_labels=)")
        return shifted_targets(labels.reshape(1, rows * tokens), boundaries)

    def save_pretrained(self, directory: str | PathLike[str]) -> None:
        """Write ``config.json`` and ``model.safetensors`` (the weights, a tied head stored once) to ``directory``."""
        from safetensors.torch import save_model

        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        self.config.save(directory / CONFIG_NAME)
        save_model(self, str(directory / WEIGHTS_NAME), metadata={"format": "pt"})

    @staticmethod
    def saved_in(directory: str | PathLike[str]) -> bool:
        """Whether ``directory`` holds a model :meth:`save_pretrained` wrote (its ``config.json`` a
        :class:`HybridConfig`'s: a ``layer_pattern``, no Hugging Face ``model_type``)."""
        path = Path(directory) / CONFIG_NAME
        try:
            config = json.loads(path.read_text())
        except (OSError, ValueError):
            return False
        return isinstance(config, dict) and "layer_pattern" in config and "model_type" not in config

    @classmethod
    def from_pretrained(cls, directory: str | PathLike[str], map_location: str | torch.device = "cpu"
                        ) -> HybridForCausalLM:
        """Load a model written by :meth:`save_pretrained` onto ``map_location``."""
        from safetensors.torch import load_model

        directory = Path(directory)
        for name in (CONFIG_NAME, WEIGHTS_NAME):
            if not (directory / name).is_file():
                raise InputError(f"directory: no {name} in {directory}; expected a folder written by save_pretrained")
        model = cls(HybridConfig.load(directory / CONFIG_NAME)).to(torch.device(map_location))
        load_model(model, directory / WEIGHTS_NAME, device=str(torch.device(map_location)))
        return model
