"""Hugging Face ``Trainer`` with packed batches: the distributed, resumable
:class:`~hybrid_pack.PackedBatchSampler` and the :class:`~hybrid_pack.PackingCollator`.

``Trainer`` builds a plain sampler and a padding collator; :class:`PackedTrainer` swaps in a
packed ``DataLoader`` and hands the model ready ``boundaries=`` built on the host. The sampler
yields every rank's steps interleaved (``rank=None``), the layout accelerate's
``BatchSamplerShard`` splits across processes, and a callback sets its epoch so each epoch (and a
resumed one) walks its own order. Every training log carries ``tokens_per_second``: real (non-padding)
tokens of every rank since the previous log over the time since it (``Trainer``'s own
``train_samples_per_second`` counts packed rows, not tokens), and ``real_tokens_seen``; the final metrics
carry ``train_tokens_per_second``.
Under ``TrainingArguments(torch_compile=True)`` the rows are static batches (docs/compile.md) and the
model builds its boundaries itself, so one graph serves every row. With ``batch_invariant=True`` the rows are
static batches of ``capacity`` tokens and every step runs inside :func:`hybrid_pack.batch_invariant` (docs/rl.md,
"On-policy numerics").
"""

from __future__ import annotations

import contextlib
import copy
import functools
import json
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader

from hybrid_pack import backends
from hybrid_pack.boundaries import PackedBoundaries
from hybrid_pack.collate import PackingCollator
from hybrid_pack.errors import InputError, MissingExtraError, UnsupportedModelError
from hybrid_pack.integrations.transformers.experts import BATCH_INVARIANT_EXPERTS
from hybrid_pack.integrations.transformers.neftune import PackedNEFTune
from hybrid_pack.mrope import MRopePositions, mrope_position_ids
from hybrid_pack.ops.invariant import batch_invariant as invariant_mode
from hybrid_pack.packing.sampler import PackedBatchSampler
from hybrid_pack.schema import BOUNDARIES, CU_SEQ_LENS_Q, IMAGE_GRID_THW, POSITION_IDS, VIDEO_GRID_THW

try:
    import accelerate  # noqa: F401  (the Trainer needs it; transformers would only say so once training starts)
    from transformers import PreTrainedModel, Trainer, TrainerCallback
    from transformers.utils import SAFE_WEIGHTS_INDEX_NAME, SAFE_WEIGHTS_NAME
except ImportError as err:
    raise MissingExtraError("PackedTrainer", "hf", err) from err

__all__ = ["PackedTrainer", "PackedBatches", "SetSamplerEpoch", "SettlesBackendsAfterFirstStep",
           "BatchInvariantSteps", "check_batch_invariant", "model_position_ids_fn"]


def model_position_ids_fn(model: Any) -> MRopePositions | None:
    """How ``model`` (under PEFT / DDP wrappers) numbers one sample, for ``PackingCollator(position_ids_fn=...)``:
    its M-RoPE rule (:func:`~hybrid_pack.mrope.mrope_position_ids`) when it has
    ``get_rope_index``, else None (the collator's restarting 1-D positions are the model's)."""
    model = getattr(model, "module", model)
    get_base_model = getattr(model, "get_base_model", None)
    try:
        return mrope_position_ids(get_base_model() if callable(get_base_model) else model)
    except UnsupportedModelError:
        return None


class SetSamplerEpoch(TrainerCallback):
    """Calls ``sampler.set_epoch`` at the start of every epoch."""

    def __init__(self, sampler: PackedBatchSampler) -> None:
        self.sampler = sampler

    def on_epoch_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.sampler.set_epoch(int(state.epoch or 0))


def _renamed_on_disk(model: torch.nn.Module, folder: str) -> bool:
    """Whether the safetensors checkpoint in ``folder`` names weights ``model``'s state dict does not hold, or leaves
    out some it holds (a tied weight, stored once, aside)."""
    saved = _saved_names(folder)
    if saved is None:
        return False
    state = model.state_dict()
    aliases: dict[Any, list[str]] = {}  # the names of one tensor
    for name, tensor in state.items():
        aliases.setdefault((tensor.data_ptr(), tensor.shape, tensor.dtype) if tensor.data_ptr() else name,
                           []).append(name)
    return not (saved <= set(state) and all(saved.intersection(names) for names in aliases.values()))


def _saved_names(folder: str) -> set[str] | None:
    """The weight names of the safetensors checkpoint in ``folder`` (one file or an index), None without one."""
    from safetensors import safe_open

    index = Path(folder) / SAFE_WEIGHTS_INDEX_NAME
    if index.is_file():
        return set(json.loads(index.read_text())["weight_map"])
    single = Path(folder) / SAFE_WEIGHTS_NAME
    if not single.is_file():
        return None
    with safe_open(str(single), framework="pt") as weights:
        return set(weights.keys())


class CausalLabelSmoother:
    """transformers' ``LabelSmoother`` that always shifts the labels: the ``Trainer`` shifts them only for the causal
    LMs it knows by name, and compared a native model's logits at each token with that token's own label. On a
    packed row the shift crosses no document (each document's first label is -100)."""

    def __init__(self, smoother: Callable[..., torch.Tensor]) -> None:
        self.smoother = smoother

    def __call__(self, outputs: Any, labels: torch.Tensor, shift_labels: bool = False, **kwargs: Any) -> torch.Tensor:
        return self.smoother(outputs, labels, shift_labels=True, **kwargs)


class PackedBatches:
    """What a ``Trainer`` (or a subclass such as TRL's) needs to train on packed rows: a packed ``DataLoader``
    and boundaries built from the host batch before it moves to the device (no device syncs later).

    Mixed in before the trainer class; the subclass sets ``packing_collator`` and calls :meth:`use_packed_sampler`
    (without one, training rows come from the trainer's own loader).
    """

    packing_collator: Callable[[Any], dict[str, Any]] | None = None
    packed_sampler: PackedBatchSampler | None = None
    _tokens_since_log = 0       # this rank's real training tokens since the last training log
    _real_tokens_seen = 0       # every rank's, up to the last training log
    _log_clock: float | None = None
    _warmed_up: frozenset[bool] = frozenset()  # the gradient modes whose first loss the warm-up ran before
    _neftune: PackedNEFTune | None = None

    def train(self, *args: Any, **kwargs: Any) -> Any:
        """The trainer's ``train``; with ``neftune_noise_alpha``, each packed document's embeddings get the noise
        they would get alone (:class:`~hybrid_pack.integrations.transformers.neftune.PackedNEFTune`), not the noise
        of a sequence as long as the row."""
        alpha = self.neftune_noise_alpha  # type: ignore[attr-defined]
        if alpha is None:
            return super().train(*args, **kwargs)  # type: ignore[misc]
        self._neftune = PackedNEFTune(alpha)
        self.neftune_noise_alpha = None  # transformers' own hook stays off
        try:
            return super().train(*args, **kwargs)  # type: ignore[misc]
        finally:
            self._neftune.detach()
            self.neftune_noise_alpha, self._neftune = alpha, None

    def _prepare_inputs(self, inputs: dict[str, Any]) -> dict[str, Any]:
        positions = inputs.get(POSITION_IDS)
        if (isinstance(positions, torch.Tensor) and positions.dim() == 2
                and (IMAGE_GRID_THW in inputs or VIDEO_GRID_THW in inputs)
                and model_position_ids_fn(self.model) is not None):  # type: ignore[attr-defined]
            raise InputError("position_ids: 1-D positions for a row with images, while the model numbers its tokens "
                             "with M-RoPE; collate with PackingCollator(position_ids_fn=mrope_position_ids(model))")
        boundaries = PackedBoundaries.from_batch(inputs) if CU_SEQ_LENS_Q in inputs else None
        if boundaries is not None and self.model.training:  # type: ignore[attr-defined]
            self._log_clock = self._log_clock or time.perf_counter()
            self._tokens_since_log += boundaries.total_tokens - boundaries.num_pad_tokens  # host ints: no sync
        if self._neftune is not None:
            embeddings = self.accelerator.unwrap_model(self.model).get_input_embeddings()  # type: ignore[attr-defined]
            self._neftune.use(embeddings, boundaries, self.args.device)  # type: ignore[attr-defined]
        # Compiled, the model reads the batch's boundary tensors itself (host ints would be graph constants).
        if self.args.torch_compile:  # type: ignore[attr-defined]
            boundaries = None
        inputs = super()._prepare_inputs(inputs)  # type: ignore[misc]
        if boundaries is not None:
            inputs[BOUNDARIES] = boundaries.to(self.args.device)  # type: ignore[attr-defined]
        return inputs

    def compute_loss(self, model: torch.nn.Module, inputs: dict[str, Any], *args: Any, **kwargs: Any) -> Any:
        """The trainer's loss; before the first training loss and the first evaluation loss, the backends' warm-up
        on that batch (:meth:`warm_up_backends`). With ``label_smoothing_factor``, the labels are shifted for every
        model (:class:`CausalLabelSmoother`)."""
        self.warm_up_backends(model, inputs)
        smoother = self.label_smoother  # type: ignore[attr-defined]
        if smoother is not None and not isinstance(smoother, CausalLabelSmoother):
            self.label_smoother = CausalLabelSmoother(smoother)
        return super().compute_loss(model, inputs, *args, **kwargs)  # type: ignore[misc]

    def warm_up_backends(self, model: torch.nn.Module, inputs: dict[str, Any]) -> None:
        """:func:`hybrid_pack.backends.verify` on ``model`` and this prepared batch, once per trainer and gradient
        mode: one verdict per op and call key settled before the first forward that needs gradients (training) and
        before the first that needs none (evaluation, which may come first or in another dtype), on every rank under
        ``torch.distributed``; a compiled graph finds its kernels checked. The warm-up's pass leaves the random
        stream as it was."""
        grad = torch.is_grad_enabled()
        if grad not in self._warmed_up:
            backends.verify(model=model, batch=inputs)
            self._warmed_up = self._warmed_up | {grad}  # after: a warm-up that raised runs again

    def log(self, logs: dict[str, float], *args: Any, **kwargs: Any) -> None:
        """Add real tokens/s to a training log (one all-reduce, on every rank, as the loss already takes)."""
        if "loss" in logs and self._log_clock is not None:
            tokens = torch.tensor(self._tokens_since_log, device=self.args.device)  # type: ignore[attr-defined]
            tokens = int(self.accelerator.reduce(tokens, reduction="sum"))  # type: ignore[attr-defined]
            now = time.perf_counter()
            self._real_tokens_seen += tokens
            logs["tokens_per_second"] = tokens / max(now - self._log_clock, 1e-9)
            logs["real_tokens_seen"] = self._real_tokens_seen
            self._tokens_since_log, self._log_clock = 0, now
        if "train_runtime" in logs and self._real_tokens_seen:
            logs["train_tokens_per_second"] = self._real_tokens_seen / max(logs["train_runtime"], 1e-9)
        super().log(logs, *args, **kwargs)  # type: ignore[misc]

    def use_packed_sampler(self, sampler: PackedBatchSampler) -> None:
        """Draw training rows from ``sampler`` (its epoch follows the trainer's)."""
        self.packed_sampler = sampler
        self.add_callback(SetSamplerEpoch(sampler))  # type: ignore[attr-defined]

    def get_train_dataloader(self) -> DataLoader:
        if self.packed_sampler is None:
            return super().get_train_dataloader()  # type: ignore[misc]
        args = self.args  # type: ignore[attr-defined]
        dataset = self.train_dataset  # type: ignore[attr-defined]
        if args.remove_unused_columns and hasattr(dataset, "column_names"):   # a datasets.Dataset, as Trainer does
            dataset = self._remove_unused_columns(dataset, description="training")  # type: ignore[attr-defined]
        loader = DataLoader(dataset, batch_sampler=self.packed_sampler,
                            collate_fn=self.packing_collator,
                            num_workers=args.dataloader_num_workers, pin_memory=args.dataloader_pin_memory)
        return self.accelerator.prepare(loader)  # type: ignore[attr-defined]


class SettlesBackendsAfterFirstStep:
    """For trainers whose packed calls one batch cannot replay (TRL's GRPO and DPO score several forwards per step):
    the first training step and the first evaluation step (its calls need no gradients, and may come first) each
    record the keys they meet, then settle them for the steps after. Mixed in before the trainer class."""

    _settled: frozenset[str] = frozenset()  # "training_step", "prediction_step": the steps whose first one settled

    def training_step(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        return self._settling("training_step", functools.partial(super().training_step, *args, **kwargs))

    def prediction_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._settling("prediction_step", functools.partial(super().prediction_step, *args, **kwargs))

    def _settling(self, kind: str, step: Callable[[], Any]) -> Any:
        """``step()``; the first of its ``kind`` records the call keys it meets (one with no settled verdict runs on
        the pure-torch backends, :func:`hybrid_pack.backends.discovering`), then settles one backend per op and key
        (:func:`hybrid_pack.backends.verify`, the warm-up: every rank under ``torch.distributed``)."""
        if kind in self._settled:
            return step()
        with backends.discovering(training_step=True):
            out = step()
        backends.verify()
        self._settled = self._settled | {kind}  # after: a first step that raised settles on the next one
        return out


def refuse_neftune(trainer: str, args: Any) -> None:
    """:class:`InputError` for ``neftune_noise_alpha`` in a trainer scoring packed rows of its own making, where
    transformers' NEFTune would scale every document's noise by the whole row's length (weaker than alone)."""
    if getattr(args, "neftune_noise_alpha", None) is not None:
        raise InputError(f"neftune_noise_alpha: {trainer} scores packed rows, on which transformers' NEFTune scales "
                         "every document's noise by the row's length (weaker than the document gets alone); leave it "
                         "None (PackedTrainer and PackedSFTTrainer give each packed document its own noise)")


def check_batch_invariant(trainer: str, batch_invariant: Any, args: Any, *, capacity: int | None,
                          capacity_name: str, models: Sequence[torch.nn.Module | None]) -> bool:
    """``batch_invariant`` as a bool, refusing what the mode cannot honour (:class:`InputError` naming the option):
    no fixed row length (``capacity`` None), ``torch_compile`` (compiled static rows), a context-parallel
    ``parallelism_config``, and gradient checkpointing off the CPU (the recomputation in the backward would run on
    the autograd engine's device thread, outside the mode, a context variable of the training thread). With the mode
    on, the experts of each MoE model of ``models`` (the policy and its reference; None: none) switch to
    :data:`BATCH_INVARIANT_EXPERTS`."""
    if not isinstance(batch_invariant, bool):
        raise InputError(f"batch_invariant: expected True or False; got {batch_invariant!r}")
    if not batch_invariant:
        return False
    if capacity is None:
        raise InputError(f"batch_invariant: {trainer} needs a fixed row length to be batch-invariant; set "
                         f"{capacity_name} (every packed row is then padded to exactly that many tokens)")
    if args.torch_compile:
        raise InputError("batch_invariant: not with torch_compile=True (the mode runs eager rows; compiled static rows "
                         "are not covered): drop one of them")
    if (getattr(getattr(args, "parallelism_config", None), "cp_size", 1) or 1) > 1:
        raise InputError("batch_invariant: not with context parallelism (parallelism_config.cp_size > 1): a row "
                         "split across ranks is not covered by the mode")
    if args.gradient_checkpointing and args.device.type != "cpu":
        raise InputError(f"batch_invariant: not with gradient_checkpointing=True on {args.device.type}: the "
                         "recomputed forward runs in the autograd engine's device thread, outside the mode; set "
                         "gradient_checkpointing=False")
    for model in models:
        set_experts = getattr(model, "set_experts_implementation", None)
        if set_experts is not None:
            set_experts(BATCH_INVARIANT_EXPERTS)
    return True


class BatchInvariantSteps:
    """With ``batch_invariant`` set, every training step (forward, backward and, on the CPU, the recomputation of
    checkpointed activations) and every evaluation step run inside :func:`hybrid_pack.batch_invariant`. Mixed in
    before the trainer class."""

    batch_invariant = False

    def _mode(self) -> contextlib.AbstractContextManager[None]:
        return invariant_mode() if self.batch_invariant else contextlib.nullcontext()

    def training_step(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        with self._mode():
            return super().training_step(*args, **kwargs)  # type: ignore[misc]

    def prediction_step(self, *args: Any, **kwargs: Any) -> Any:
        with self._mode():
            return super().prediction_step(*args, **kwargs)  # type: ignore[misc]


class ResumesRenamedWeights:
    """Resuming a Hugging Face model whose checkpoint names its weights otherwise than its state dict: transformers
    5 holds a MoE model's experts fused and writes them one by one, and the ``Trainer``'s
    ``load_state_dict(strict=False)`` skipped them (a warning), so the resumed run trained on from the experts it
    started with. Such a checkpoint loads through the model's ``from_pretrained`` (a copy on the host), every weight
    then copied in, strictly; any other as the ``Trainer`` loads it. Mixed in before the trainer class."""

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: torch.nn.Module | None = None) -> None:
        target = self.accelerator.unwrap_model(model if model is not None else self.model)  # type: ignore[attr-defined]
        if isinstance(target, PreTrainedModel) and not self.is_fsdp_enabled and \
                _renamed_on_disk(target, resume_from_checkpoint):  # type: ignore[attr-defined]
            saved = type(target).from_pretrained(resume_from_checkpoint, dtype="auto", device_map="cpu")
            target.load_state_dict(saved.state_dict())  # strict: every weight, or an error naming the others
        else:
            super()._load_from_checkpoint(resume_from_checkpoint, model)  # type: ignore[misc]


class PackedTrainer(PackedBatches, BatchInvariantSteps, ResumesRenamedWeights, Trainer):
    """A ``Trainer`` whose training batches are packed rows of up to ``capacity`` tokens.

    Args:
        lengths: token count of every example of ``train_dataset``.
        capacity: tokens per packed row (``per_device_train_batch_size`` is ignored: one row per step and rank).
        collator: defaults to ``PackingCollator()``; with ``torch_compile=True`` to the static
            ``PackingCollator(pack_length=capacity, max_documents=...)`` with as many documents as the plan's
            fullest pack (one compiled graph for every row). For an M-RoPE model (vision-language Qwen3.5) the
            default takes ``position_ids_fn=mrope_position_ids(model)``; a given collator needs it once a row
            has images (refused otherwise).
        batch_invariant: every row static, ``PackingCollator(pack_length=capacity, max_documents=...)``, and every
            training and evaluation step inside :func:`hybrid_pack.batch_invariant`: each document's outputs
            bitwise the same whatever it is packed with (docs/rl.md, "On-policy numerics"). Refused with
            ``torch_compile``, context parallelism, gradient checkpointing off the CPU, or a given collator
            whose ``pack_length`` is not ``capacity``.
        *args, **kwargs: as for ``transformers.Trainer``.
    """

    def __init__(self, *args: Any, lengths: Sequence[int] | np.ndarray, capacity: int,
                 collator: PackingCollator | None = None, batch_invariant: bool = False, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.batch_invariant = check_batch_invariant("PackedTrainer", batch_invariant, self.args, capacity=capacity,
                                                     capacity_name="capacity", models=(self.model,))
        if self.args.fsdp and not self.is_fsdp_enabled:
            raise InputError(
                f"fsdp: asked for, but accelerate did not shard the model (distributed type "
                f"{self.accelerator.distributed_type}): accelerate uses its FSDP plugin only on accelerators (CUDA, "
                "NPU, XPU, ...), and on CPU the Trainer would train with DDP instead; drop fsdp= on CPU, or run on "
                "GPUs (docs/distributed.md, 'Sharded training')")
        sampler = PackedBatchSampler(lengths, capacity, num_replicas=self.args.world_size, rank=None,
                                     seed=self.args.seed)
        if self.batch_invariant and collator is not None and collator.pack_length != capacity:
            raise InputError(f"batch_invariant: the collator's rows must all be {capacity} tokens (capacity); got "
                             f"pack_length={collator.pack_length}: pass PackingCollator(pack_length={capacity}, "
                             "max_documents=...) or no collator")
        if collator is None and (self.args.torch_compile or self.batch_invariant):
            collator = PackingCollator(pack_length=capacity, max_documents=int(sampler.plan.pack_num_documents.max()),
                                       position_ids_fn=model_position_ids_fn(self.model))
        if collator is not None and collator.return_tensors != "pt":
            raise InputError(f"collator: return_tensors={collator.return_tensors!r}; a trainer feeds the model "
                             "torch tensors: leave return_tensors at 'pt'")
        self.packing_collator = collator or PackingCollator(position_ids_fn=model_position_ids_fn(self.model))
        if (args[2] if len(args) > 2 else kwargs.get("data_collator")) is None:  # evaluation and prediction too
            self.data_collator = self.packing_collator
            if self.packing_collator.pack_length is not None:  # an evaluation batch is not planned to fit it
                self.data_collator = copy.copy(self.packing_collator)
                self.data_collator.pack_length = self.data_collator.max_documents = None
        self.use_packed_sampler(sampler)

    def _save(self, output_dir: str | None = None, state_dict: dict[str, torch.Tensor] | None = None) -> None:
        """A native model (not a ``PreTrainedModel``) as its own ``save_pretrained`` writes it: the ``Trainer``
        would write its state dict with safetensors, which refuses the tied head and embedding (they share
        memory). Anything else, and a state dict given (FSDP), as the ``Trainer`` saves it."""
        from hybrid_pack.modeling import HybridForCausalLM

        model = self.accelerator.unwrap_model(self.model)
        if not isinstance(model, HybridForCausalLM) or state_dict is not None:
            super()._save(output_dir, state_dict)
            return
        output_dir = output_dir if output_dir is not None else self.args.output_dir
        model.save_pretrained(output_dir)
        if self.processing_class is not None:
            self.processing_class.save_pretrained(output_dir)
        torch.save(self.args, f"{output_dir}/training_args.bin")

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: torch.nn.Module | None = None) -> None:
        """A native model's checkpoint as :meth:`_save` wrote it (its tied head stored once); anything else as
        :class:`ResumesRenamedWeights` loads it."""
        from hybrid_pack.modeling import HybridForCausalLM
        from hybrid_pack.modeling.model import WEIGHTS_NAME

        target = self.accelerator.unwrap_model(model if model is not None else self.model)
        if not isinstance(target, HybridForCausalLM) or self.is_fsdp_enabled:
            super()._load_from_checkpoint(resume_from_checkpoint, model)
            return
        from safetensors.torch import load_model

        load_model(target, f"{resume_from_checkpoint}/{WEIGHTS_NAME}")
