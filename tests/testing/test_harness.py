"""The isolation harness flags every deliberately leaky mixer, names its module, and never flags a clean model."""

import json

import pytest
import torch

from hybrid_pack.boundaries import PackedBoundaries
from hybrid_pack.errors import InputError
from hybrid_pack.modeling import from_preset
from hybrid_pack.testing import IsolationError, adversarial_layouts, assert_isolated, check_isolation
from tests.testing.leaky_zoo import LEAKY, ToyLM, clean_mixers

DIM = 16


class ToyLMWithHead(ToyLM):
    """The toy LM naming its output head, as Hugging Face and native models do: the harness then compares the
    hidden states that enter the head instead of the logits."""

    def get_output_embeddings(self) -> torch.nn.Linear:
        return self.head


def _model(mixers: list, *, named_head: bool = False) -> ToyLM:
    torch.manual_seed(0)
    return (ToyLMWithHead if named_head else ToyLM)(mixers, dim=DIM).double()


def test_clean_model_is_never_flagged():
    report = check_isolation(_model(clean_mixers(DIM)), max_tokens=120)
    assert report.ok, str(report)
    assert report.first_leaking_module is None
    assert len(report.layouts) >= 5
    assert all(d.gradient_leak == 0.0 for d in report.documents)


@pytest.mark.parametrize("named_head", [False, True], ids=["logits", "hidden states"])
@pytest.mark.parametrize("name", sorted(LEAKY))
def test_leaky_mixer_is_flagged_and_named(name, named_head):
    build, module = LEAKY[name]
    report = check_isolation(_model(build(DIM), named_head=named_head), max_tokens=120)
    assert report.compared == ("hidden states entering the output head" if named_head else "logits")
    assert not report.ok, f"{name} was not flagged:\n{report}"
    assert report.max_leak > report.atol
    assert report.first_leaking_module == module, str(report)


def test_backward_only_leak_is_invisible_forward_and_caught_by_gradients():
    build, _ = LEAKY["leak only in the backward pass"]
    report = check_isolation(_model(build(DIM)), lengths=[5, 7, 3])
    docs = report.documents
    assert all(d.alone_diff <= report.atol and d.perturbation_leak <= report.atol for d in docs)
    assert any(d.gradient_leak > 0 for d in docs)
    assert report.layouts[0].leak_kind == "backward"


def test_a_check_without_gradients_says_so():
    """``grads=False`` (``hybrid-pack check --no-grads``) printed "gradients 0" and an empty ``skipped``, as if the
    gradients had been checked and were clean; the backward-only leak above passes such a check."""
    build, _ = LEAKY["leak only in the backward pass"]
    report = check_isolation(_model(build(DIM)), lengths=[5, 7, 3], grads=False)
    assert report.ok and all(d.gradient_leak is None for d in report.documents)
    assert report.skipped == ["gradients: not checked (grads=False; hybrid-pack check --no-grads)"]
    assert "skipped: gradients: not checked" in str(report)
    assert json.loads(report.to_json())["skipped"] == report.skipped


def test_report_is_readable_and_json():
    build, _ = LEAKY["conv without boundaries"]
    report = check_isolation(_model(build(DIM)), lengths=[4, 6], num_pad_tokens=3)
    text = str(report)
    assert text.startswith("LEAK") and "first leaking module" in text and "blocks.1.mixer" in text
    data = json.loads(report.to_json())
    assert data["ok"] is False and data["layouts"][0]["num_pad_tokens"] == 3
    assert len(data["layouts"][0]["documents"]) == 2


def test_assert_isolated_raises_with_report():
    build, _ = LEAKY["recurrence without resets"]
    with pytest.raises(IsolationError) as info:
        assert_isolated(_model(build(DIM)), lengths=[3, 4])
    assert not info.value.report.ok


def test_pytest_fixture(assert_isolated):
    report = assert_isolated(_model(clean_mixers(DIM)), lengths=[2, 9, 1])
    assert report.ok


def test_documents_argument_and_determinism():
    model = _model(clean_mixers(DIM))
    docs = [[1, 2, 3], [4], [5, 6, 7, 8, 9]]
    a = check_isolation(model, documents=docs, seed=3).to_dict()
    b = check_isolation(model, documents=docs, seed=3).to_dict()
    assert a == b and a["ok"]
    assert [d["length"] for d in a["layouts"][0]["documents"]] == [3, 1, 5]


def test_a_model_that_raises_is_reported_not_hidden():
    class Broken(torch.nn.Module):
        config = type("C", (), {"vocab_size": 11})()

        def forward(self, input_ids=None, **batch):
            raise RuntimeError("seq_idx is not supported")

    report = check_isolation(Broken(), lengths=[2, 3])
    assert not report.ok and "seq_idx is not supported" in report.error


def test_bad_arguments_name_the_field():
    model = _model(clean_mixers(DIM))
    with pytest.raises(ValueError, match="lengths"):
        check_isolation(model, lengths=[3, 0])
    with pytest.raises(ValueError, match="documents"):
        check_isolation(model, documents=[[1], []])


def test_layouts_cover_chunk_and_conv_edges():
    layouts = adversarial_layouts(chunk_sizes=[8], conv_widths=[4], max_tokens=1000)
    all_lengths = {n for lay in layouts for n in lay.lengths}
    assert {1, 3, 4, 5, 7, 8, 9}.issubset(all_lengths)
    assert any(lay.num_pad_tokens for lay in layouts)
    assert any(max(lay.lengths) > 3 * 8 for lay in layouts)


def test_the_output_head_is_skipped_only_during_the_check_and_as_strict():
    """With a named head the logits are never computed: a head that raises is not called, and is back after."""
    model = _model(clean_mixers(DIM), named_head=True)
    calls = []
    model.head.register_forward_hook(lambda module, args, output: calls.append(output.shape[-1]))
    report = check_isolation(model, lengths=[3, 5])
    assert report.ok and report.compared == "hidden states entering the output head", str(report)
    assert set(calls) == {DIM}  # the head returned the hidden states [.., DIM], never [.., vocab]
    assert "forward" not in vars(model.head)
    batch = PackedBoundaries.from_lengths([3]).batch_kwargs()
    assert model(input_ids=torch.tensor([[1, 2, 3]]), **batch).logits.shape == (1, 3, model.config.vocab_size)


def test_progress_bar_on_stderr_when_asked(capsys):
    check_isolation(_model(clean_mixers(DIM)), lengths=[3, 5], progress=True)
    assert "isolation check" in capsys.readouterr().err
    check_isolation(_model(clean_mixers(DIM)), lengths=[3, 5], progress=False)
    assert capsys.readouterr().err == ""


def test_cli_check_prints_the_verdict_and_shows_progress(capsys):
    from hybrid_pack.cli import main

    assert main(["check", "bamba-tiny", "--lengths", "3,5", "--device", "cpu"]) == 0
    captured = capsys.readouterr()
    assert captured.out.startswith("ISOLATED: bamba-tiny") and "isolation check" in captured.err


@pytest.mark.parametrize(("call", "message"), [
    (lambda m: check_isolation(m, lengths=[4, 4], atol=-1), r"atol: expected a tolerance >= 0"),
    (lambda m: check_isolation(m, lengths=[4, 4], grad_atol=float("nan")), r"grad_atol: expected a tolerance >= 0"),
    (lambda m: check_isolation("not a model", lengths=[3, 4]), r"model: expected a torch.nn.Module, or a"),
    (lambda m: check_isolation(m, lengths=[3], documents=[[1, 2]]), r"lengths, documents: give one of them"),
    (lambda m: check_isolation(m, documents=torch.tensor([[1, 2], [3, 4]])), r"documents: expected a list of"),
    (lambda m: check_isolation(m, documents=[[10 ** 9], [5, 6]]), r"documents: token ids 5\.\.1000000000 fall "
                                                                   r"outside the model's vocabulary"),
    (lambda m: check_isolation(m, lengths=[3, 4], vocab_size=0), r"vocab_size: expected a positive int"),
])
def test_bad_input_is_refused_naming_the_field(call, message) -> None:
    """A negative tolerance would report a leak that is not there; the others would fail deep inside a run."""
    with pytest.raises(InputError, match=message):
        call(from_preset("qwen3-next-tiny"))
