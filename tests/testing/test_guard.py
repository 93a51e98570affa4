"""The runtime guard (docs/api.md §7a): which calls it checks, what it compares, what it leaves as it was."""

from __future__ import annotations

import types
import warnings

import pytest
import torch
from torch import nn

import hybrid_pack.testing
from hybrid_pack import PackedBoundaries, PackingCollator
from hybrid_pack.errors import InputError, IsolationError, UnsupportedModelError
from hybrid_pack.isolation import TOLERANCE
from hybrid_pack.modeling import from_preset
from hybrid_pack.schema import BOUNDARIES, INPUT_IDS, LABELS, NUM_PAD_TOKENS, POSITION_IDS
from hybrid_pack.testing import GuardRecord, IsolationWarning, PackingGuard
from tests.testing.late_leak import LeakAfter
from tests.testing.leaky_zoo import Attention, CausalConv, ToyLM

LENGTHS = [7, 1, 33, 64, 65, 5]


def _batch(lengths: list[int] = LENGTHS, vocab: int = 500, **collator: object) -> dict:
    g = torch.Generator().manual_seed(0)
    features = [{INPUT_IDS: torch.randint(1, vocab, (n,), generator=g).tolist()} for n in lengths]
    return PackingCollator(**collator)(features)


@pytest.fixture(scope="module")
def model() -> nn.Module:
    torch.manual_seed(0)
    return from_preset("qwen3-next-tiny", vocab_size=512)


def _train_calls(model: nn.Module, batch: dict, calls: int) -> None:
    model.train()
    for _ in range(calls):
        model(**batch).loss.backward()
    model.zero_grad(set_to_none=True)


def test_checks_the_first_packed_call_and_every_nth_after_it(model):
    batch = _batch()
    with PackingGuard(model, every=3) as guard:
        _train_calls(model, batch, 7)
    assert [r.call for r in guard.records] == [0, 3, 6] and guard.calls == 7
    assert all(isinstance(r, GuardRecord) and r.ok and r.max_diff < 2e-4 for r in guard.records)
    record = guard.records[0]
    assert record.documents[:2] == [1, 4]                     # the shortest, then the longest
    assert len(record.documents) == 3 and len(set(record.documents)) == 3
    assert record.lengths == [LENGTHS[i] for i in record.documents]
    assert record.seconds > 0 and record.compared == "logits" and record.atol == TOLERANCE[torch.float32]
    assert record.step == 0                                   # no trainer step set: the call index


def test_trainer_step_names_the_records(model):
    guard = PackingGuard(model, every=1).attach()
    guard.step = 41
    _train_calls(model, _batch(), 1)
    guard.detach()
    assert guard.records[-1].step == 41 and guard.records[-1].call == 0
    _train_calls(model, _batch(), 1)                          # detached: nothing more
    assert len(guard.records) == 1


def test_eval_and_unpacked_calls_are_not_counted(model):
    batch = _batch()
    guard = PackingGuard(model, every=5, action="warn").attach()
    with torch.no_grad():
        model.eval()
        model(**batch)                                        # eval mode
        model.train()
        model(input_ids=batch[INPUT_IDS][:, :40].reshape(2, 20))   # two whole rows, no boundaries
        model(input_ids=batch[INPUT_IDS], **{BOUNDARIES: None})
    with pytest.warns(IsolationWarning, match="none of them a packed row"):
        guard.detach()
    assert guard.calls == 0 and guard.records == [] and guard.unpacked_calls == 2


def test_a_guard_that_sees_no_packed_call_never_stays_silent(model):
    """A trainer that pads (TRL's GRPO, DPO): the guard checks nothing, and says so after ``every`` training
    calls (``action="raise"``: raises), naming what it saw; by the end of training at the latest."""
    from hybrid_pack.errors import UncheckedError

    padded = {INPUT_IDS: torch.randint(1, 500, (4, 21))}
    guard = PackingGuard(model, every=3).attach()
    model.train()
    with torch.no_grad():
        model(input_ids=padded[INPUT_IDS])
        model(input_ids=padded[INPUT_IDS])
        with pytest.raises(UncheckedError, match=r"3 training calls, none of them a packed row.*input_ids \[4, 21\]"):
            model(input_ids=padded[INPUT_IDS])
    guard.detach()                                            # said once, not again
    guard = PackingGuard(model, every=100, action="warn").attach()
    with torch.no_grad():
        model(input_ids=padded[INPUT_IDS])                    # fewer than every: said when the guard detaches
    with pytest.warns(IsolationWarning, match="1 training calls, none of them"):
        guard.detach()
    with warnings.catch_warnings():
        warnings.simplefilter("error")                        # packed calls seen: nothing to say
        with PackingGuard(model, every=100, action="warn"):
            _train_calls(model, _batch(), 1)
            with torch.no_grad():
                model(input_ids=padded[INPUT_IDS])


def test_boundaries_given_ready_made_are_checked(model):
    batch = _batch()
    call = {INPUT_IDS: batch[INPUT_IDS], LABELS: batch[LABELS], BOUNDARIES: PackedBoundaries.from_batch(batch)}
    with PackingGuard(model, every=1) as guard:
        model.train()
        model(**call)
    assert guard.records[0].ok and guard.records[0].documents[:2] == [1, 4]


def test_padding_segment_is_never_a_checked_document(model):
    batch = _batch([3, 9, 4], pad_to_multiple_of=32)
    assert batch[NUM_PAD_TOKENS] == 16
    with PackingGuard(model, every=1, documents=5) as guard:
        _train_calls(model, batch, 1)
    assert sorted(guard.records[0].documents) == [0, 1, 2] and guard.records[0].ok


@pytest.mark.parametrize("preset", ["qwen3-next-tiny", "bamba-tiny"])
def test_a_leak_that_starts_later_is_caught_at_the_first_check_after_it(preset):
    torch.manual_seed(0)
    model = from_preset(preset, vocab_size=512).train()
    batch = _batch()
    guard = PackingGuard(model, every=2).attach()
    LeakAfter(model.model.layers[1].mixer, after=3)           # leaks from training call 3 on
    for _ in range(4):
        model(**batch)
    with pytest.raises(IsolationError) as info:
        model(**batch)                                        # call 4: the first check after call 3
    assert [(r.call, r.ok) for r in guard.records] == [(0, True), (2, True), (4, False)]
    record = info.value.report
    assert record is guard.records[-1] and record.max_diff > 1e-2
    worst = record.documents[record.diffs.index(record.max_diff)]
    message = str(info.value)
    assert "step 4" in message and f"document {worst} " in message and f"{record.max_diff:.3g}" in message
    assert isinstance(info.value, AssertionError) and hybrid_pack.testing.IsolationError is IsolationError


def test_localize_names_the_leaking_mixer(model):
    leak = LeakAfter(model.model.layers[2].mixer, after=0)
    model.train()
    try:
        with PackingGuard(model, every=1, localize=True) as guard, pytest.raises(IsolationError) as info:
            model(**_batch())
    finally:
        leak.remove()
    assert guard.records[0].first_leaking_module == "model.layers.2.mixer"
    assert "First leaking module: model.layers.2.mixer" in str(info.value)


def test_warn_action_warns_and_training_goes_on(model):
    leak = LeakAfter(model.model.layers[0].mixer, after=0)
    try:
        with PackingGuard(model, every=1, action="warn") as guard, pytest.warns(IsolationWarning, match="mixes"):
            _train_calls(model, _batch(), 2)
    finally:
        leak.remove()
    assert [r.ok for r in guard.records] == [False, False]


def test_the_guard_leaves_modes_random_state_and_gradients_as_they_were(model):
    batch = _batch()

    def run(every: int | None) -> tuple:
        model.train()
        model.model.layers[0].eval()                          # a submodule the user keeps in eval mode
        guard = PackingGuard(model, every=every).attach() if every else None
        torch.manual_seed(123)
        out = model(**batch)
        out.loss.backward()
        state = torch.get_rng_state()
        grads = [p.grad.clone() for p in model.parameters()]
        modes = [m.training for m in model.modules()]
        model.zero_grad(set_to_none=True)
        if guard is not None:
            assert len(guard.records) == 1
            guard.detach()
        return state, grads, modes, out.logits.detach()

    plain, guarded = run(None), run(1)
    assert torch.equal(plain[0], guarded[0])
    assert all(torch.equal(a, b) for a, b in zip(plain[1], guarded[1]))
    assert plain[2] == guarded[2] and guarded[2][:3] == [True, True, True]
    assert torch.equal(plain[3], guarded[3])


class _DropoutMixer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.dropout = nn.Dropout(0.3)

    def forward(self, x: torch.Tensor, boundaries: PackedBoundaries) -> torch.Tensor:
        return self.dropout(x)


def test_a_model_with_dropout_is_compared_without_dropout_and_keeps_its_random_stream():
    torch.manual_seed(0)
    model = ToyLM([CausalConv(16), _DropoutMixer(), Attention(16)]).train()
    batch = _batch(vocab=37)

    def logits_after_two_calls() -> torch.Tensor:
        torch.manual_seed(7)
        model(**batch)
        return model(**batch).logits

    plain = logits_after_two_calls()
    with PackingGuard(model, every=1) as guard:
        guarded = logits_after_two_calls()
    assert torch.equal(plain, guarded)                       # same dropout masks: the RNG stream was not touched
    assert [r.ok for r in guard.records] == [True, True] and max(r.max_diff for r in guard.records) < 1e-5


def test_direct_check_with_and_without_logits(model):
    batch = _batch()
    guard = PackingGuard(model, documents=6)
    model.train()
    with torch.no_grad():
        logits = model(**batch).logits
    record = guard.check(batch, logits, step=9)
    assert record.ok and record.step == 9 and record.call is None and sorted(record.documents) == list(range(6))
    assert guard.check(batch).ok and model.training
    broken = logits.clone()
    broken[0, 50:60] += 1.0                                  # inside document 3 (tokens 41..104)
    with pytest.raises(IsolationError, match="document 3"):
        guard.check(batch, broken)
    with pytest.raises(InputError, match=r"logits: expected shape \[1, 175"):
        guard.check(batch, logits[:, :10])


def test_bf16_autocast_uses_the_bf16_tolerance(model):
    with PackingGuard(model, every=1) as guard, torch.autocast("cpu", dtype=torch.bfloat16):
        _train_calls(model, _batch(), 1)
    assert guard.records[0].atol == TOLERANCE[torch.bfloat16] and guard.records[0].ok


def test_atol_overrides_the_dtype_tolerance(model):
    with PackingGuard(model, every=1, atol=1e-12, action="warn") as guard, warnings.catch_warnings():
        warnings.simplefilter("ignore", IsolationWarning)
        _train_calls(model, _batch(), 1)
    assert guard.records[0].atol == 1e-12


def test_patched_hugging_face_model_with_keys_or_restarting_positions():
    from hybrid_pack.integrations.transformers import patch_model
    from hybrid_pack.integrations.transformers.tiny import tiny_model
    from tests.support.torch_path import pure_torch_transformers

    model = patch_model(tiny_model("qwen3_next")).train()
    batch = _batch([7, 1, 33, 20, 5], vocab=120)
    with PackingGuard(model, every=1) as guard, pure_torch_transformers(model):
        model(**batch)
        model(input_ids=batch[INPUT_IDS], **{POSITION_IDS: batch[POSITION_IDS]})   # TRL's padding-free batch
        model(**{**batch, LABELS: batch[INPUT_IDS]}, return_dict=False)   # a tuple (loss, logits, ...)
        LeakAfter(model.model.layers[0].linear_attn, after=0)
        with pytest.raises(IsolationError):
            model(**batch)
    assert [r.ok for r in guard.records] == [True, True, True, False]
    assert guard.records[2].compared == "logits"


def _fused_head(model: nn.Module) -> None:
    """Replace ``forward`` by one that runs the backbone and returns no logits, as TRL's fused LM head does."""
    original = model.forward

    def forward(self: nn.Module, fused_lm_head: bool = False, **kwargs: object) -> object:
        if not fused_lm_head:
            return original(**kwargs)
        hidden = self.base_model(**{k: v for k, v in kwargs.items() if k != LABELS}).last_hidden_state
        return types.SimpleNamespace(loss=hidden.sum(), log_probs=hidden[..., 0])

    model.forward = types.MethodType(forward, model)


def test_output_without_logits_is_compared_on_the_backbone_hidden_states():
    from hybrid_pack.integrations.transformers import patch_model
    from hybrid_pack.integrations.transformers.tiny import tiny_model

    model = tiny_model("mamba2").train()
    _fused_head(model)
    patch_model(model)                                       # the patch around the fused forward
    batch = _batch([9, 30, 4], vocab=120)
    with PackingGuard(model, every=1) as guard:
        model(**batch, fused_lm_head=True)
        LeakAfter(model.backbone.layers[0].mixer, after=0)
        with pytest.raises(IsolationError, match="hidden states"):
            model(**batch, fused_lm_head=True)
    assert [(r.compared, r.ok) for r in guard.records] == [("hidden states", True), ("hidden states", False)]


def test_trl_fused_lm_head_is_compared_on_the_backbone_hidden_states():
    trl_utils = pytest.importorskip("trl.trainer.utils", reason="TRL is not installed (the bench extra has it)")
    from hybrid_pack.integrations.transformers import patch_model
    from hybrid_pack.integrations.transformers.tiny import tiny_model

    model = tiny_model("qwen3_next").train()
    trl_utils.add_fused_lm_head(model, outputs=("log_probs", "entropy", "is_top1"))   # what SFTTrainer does
    patch_model(model)                                       # around TRL's forward: the fused path runs packed
    batch = _batch([7, 1, 33, 20, 5], vocab=120)
    with PackingGuard(model, every=1) as guard:
        model(**batch, fused_lm_head=True)
        LeakAfter(model.model.layers[0].linear_attn, after=0)
        with pytest.raises(IsolationError, match="hidden states"):
            model(**batch, fused_lm_head=True)
    assert [(r.compared, r.ok) for r in guard.records] == [("hidden states", True), ("hidden states", False)]


class _NoLogits(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(1))

    def forward(self, **batch: object) -> dict:
        return {"loss": self.weight.sum()}


def test_output_without_logits_or_backbone_is_refused_clearly():
    model = _NoLogits().train()
    with PackingGuard(model, every=1), pytest.raises(UnsupportedModelError, match="no logits"):
        model(**_batch())


def test_calls_that_are_not_checked_read_no_tensor_values(model):
    """Only shapes: a meta tensor (no data) would raise on any read of its values."""
    guard = PackingGuard(model, every=2).attach()
    meta = {INPUT_IDS: torch.empty(1, 64, dtype=torch.long, device="meta"),
            POSITION_IDS: torch.empty(1, 64, dtype=torch.long, device="meta")}
    model.train()
    guard.calls = 1                                          # the next call is not due
    guard._before_call(model, (), meta)
    guard._after_call(model, (), meta, None)
    guard.detach()
    assert guard.calls == 2 and guard.records == []


@pytest.mark.parametrize(("setting", "value"), [("every", 0), ("documents", 1), ("action", "stop"), ("atol", 0.0)])
def test_bad_settings_name_the_field(model, setting, value):
    with pytest.raises(InputError, match=setting):
        PackingGuard(model, **{setting: value})
