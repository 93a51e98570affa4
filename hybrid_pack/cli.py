"""``hybrid-pack``: demo, train, check, backends, bench.

Exit codes: 0 success, 1 a failed check (a leak, a model that raises on a packed batch, a backend
that fails its self-check), 2 bad arguments or settings (including a model hybrid_pack cannot
patch). Only hybrid_pack's own errors (:class:`~hybrid_pack.errors.HybridPackError`) are reported
as one line; anything else is a bug and shows its traceback.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NoReturn

DEMO_EXAMPLES = 600
DEMO_SETTINGS = ("out", "model", "max_examples", "capacity", "overflow", "report_to", "seed", "progress",
                 "guard_every")
"""The :class:`~hybrid_pack.training.TrainConfig` fields ``hybrid-pack demo`` takes; it always compares padded
training and checks isolation first."""


def _add_config_options(parser: argparse.ArgumentParser, only: Sequence[str] | None = None,
                        defaults: dict[str, Any] | None = None) -> None:
    """One option per :class:`~hybrid_pack.training.TrainConfig` field (those named in ``only``), read from the
    field: ``--kebab-case``, its type, its default (or ``defaults[name]``, shown in the help unless None), its
    metadata's ``help``, ``choices`` and ``metavar``. A boolean is a flag: ``--name`` sets a field that defaults
    to False, ``--no-name`` clears one that defaults to True ("without" its help); a field that takes a list takes
    one value or more."""
    import dataclasses
    import typing

    from hybrid_pack.training import TrainConfig

    types = typing.get_type_hints(TrainConfig)
    for setting in dataclasses.fields(TrainConfig):
        if only is not None and setting.name not in only:
            continue
        default = (defaults or {}).get(setting.name, setting.default)
        option = "--" + setting.name.replace("_", "-")
        described = {"help": setting.metadata.get("help", ""), "dest": setting.name, "default": default}
        kinds = [kind for kind in typing.get_args(types[setting.name]) if kind is not type(None)] or [
            types[setting.name]]
        if kinds == [bool]:
            if default:
                parser.add_argument("--no-" + option[2:], action="store_false",
                                    **{**described, "help": "without " + described["help"]})
            else:
                parser.add_argument(option, action="store_true", **described)
            continue
        if setting.name in (defaults or {}) and setting.default is None:  # its "...; X when not given" is the field's
            described["help"] = described["help"].split("; ")[0]
        if default is not None:
            described["help"] += f" (default: {default})"
        values = {key: setting.metadata[key] for key in ("choices", "metavar") if key in setting.metadata}
        if any(typing.get_origin(kind) is list for kind in kinds):
            values["nargs"] = "+"
        scalar = next(kind for kind in kinds if typing.get_origin(kind) is not list)
        parser.add_argument(option, type=scalar, **values, **described)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hybrid-pack", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="train qwen3-next-tiny packed on bundled GSM8K, check isolation, compare padded")
    _add_config_options(demo, only=DEMO_SETTINGS, defaults={"out": "runs/demo", "max_examples": DEMO_EXAMPLES})
    for flag in ("--compare-padded", "--isolation-check"):
        demo.add_argument(flag, action="store_true", default=True, help="always on for the demo")
    train = sub.add_parser("train", help="packed supervised fine-tuning")
    _add_config_options(train)
    check = sub.add_parser("check", help="run the cross-contamination harness on a model or a trainer")
    check.add_argument("model", nargs="?", default=None,
                       help="a preset name, a Hugging Face config directory, or hf:<family> (tiny random)")
    check.add_argument("--trainer", default=None, metavar="FILE.py:FUNCTION",
                       help="check the training step of the trainer this function returns (a transformers or TRL "
                            "Trainer), on its first training batch; also MODULE:FUNCTION")
    check.add_argument("--backend", action="append", default=[],
                       help="force backends: 'torch' (every op) or op=name, repeatable (conv=torch)")
    check.add_argument("--lengths", default=None, help="comma-separated document lengths (default: adversarial set)")
    check.add_argument("--dtype", choices=("float32", "float64", "bfloat16"), default="float32")
    check.add_argument("--vocab-size", type=int, default=None,
                       help="a preset's vocabulary size (default: the preset's; 151680 is Qwen3's full vocabulary)")
    check.add_argument("--device", default=None, help="cpu, cuda, cuda:1 ... (default: cuda if available)")
    check.add_argument("--no-grads", action="store_true", help="skip the gradient check")
    check.add_argument("--no-patch", action="store_true", help="check a Hugging Face model without patch_model")
    check.add_argument("--json", default=None, help="also write the report as JSON to this file")
    check.add_argument("--seed", type=int, default=0)
    backends = sub.add_parser("backends", help="which backend runs each op here, and why not the others")
    backends.add_argument("--device", default=None, help="cpu, cuda, cuda:1 ... (default: cuda if available)")
    backends.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default=None,
                          help="default: float32 for the table; with --verify, bfloat16 and float32 on CUDA")
    backends.add_argument("--verify", action="store_true",
                          help="run every backend's self-check now (exit 1 if one fails)")
    bench = sub.add_parser("bench", help="kernels (boundary cost) and packed-vs-padded training")
    bench.add_argument("--out", default="runs/bench", help="writes bench.json here")
    bench.add_argument("--model", default="qwen3-next-tiny")
    bench.add_argument("--steps", type=int, default=5,
                       help="training steps per mode (the first is a warm-up, not timed; 11 or more to judge)")
    bench.add_argument("--device", default=None, help="cpu, cuda, cuda:1 ... (default: cuda if available)")
    bench.add_argument("--tokens", type=int, default=None,
                       help="tokens per row of the kernel benchmark, at least 8192 (default: 32768 on CUDA, 8192 "
                            "on CPU)")
    bench.add_argument("--skip-kernels", action="store_true", help="only the training comparison")
    return parser


def _train_config(args: argparse.Namespace) -> Any:
    """The :class:`~hybrid_pack.training.TrainConfig` of the parsed options (a field without one keeps its default)."""
    import dataclasses

    from hybrid_pack.training import TrainConfig

    return TrainConfig(**{setting.name: getattr(args, setting.name) for setting in dataclasses.fields(TrainConfig)
                          if hasattr(args, setting.name)})


def _print_summary(metrics: dict[str, Any], out: str) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"hybrid-pack: {metrics['model']} on {metrics['data']} "
                        f"({metrics['device']}, {metrics['dtype']})")
    table.add_column("what")
    table.add_column("value", justify="right")
    table.add_row("tokenizer (chat template)", metrics["tokenizer"])
    table.add_row("examples / documents trained / real tokens",
                  f"{metrics['examples']:,} / {metrics['documents_trained']:,} / {metrics['real_tokens']:,}")
    for row in _data_loss_rows(metrics):
        table.add_row(*row)
    table.add_row("packs per epoch (lower bound) / steps",
                  f"{metrics['packs_per_epoch']} ({metrics['packs_lower_bound']}) / {metrics['steps']}")
    table.add_row("packing efficiency", f"{100 * metrics['packing_efficiency']:.1f}% of {metrics['capacity']}")
    if "fsdp" in metrics:
        table.add_row("sharded with FSDP2", f"{metrics['world_size']} ranks, {metrics['fsdp']['mixed_precision']}")
    if metrics.get("isolation_ok") is not None:
        table.add_row("isolation harness", "no leak" if metrics["isolation_ok"] else "LEAK")
    for decision in metrics.get("backends", []):
        if decision["requires_grad"]:
            table.add_row(f"{decision['op']} runs on", _decision_text(decision))
    if "guard" in metrics:
        guard = metrics["guard"]
        table.add_row(f"runtime guard (every {guard['every']} packed calls)",
                      f"{guard['checks']} checks, no leak (max diff {guard['max_diff'] or 0:.1e})")
    if "guard_off" in metrics:
        table.add_row("runtime guard", f"OFF: {metrics['guard_off']}")
    if "compiles" in metrics:
        table.add_row("compiled, static batches", f"[1, {metrics['pack_length']}], up to {metrics['max_documents']} "
                      f"documents: {metrics['compiles']} graph(s), {metrics.get('recompiles', 0)} after the first step")
    table.add_row("loss first -> last step", f"{metrics['first_loss']:.3f} -> {metrics['final_loss']:.3f}")
    table.add_row("packed real tokens/s", f"{metrics['tokens_per_second']:,.0f}")
    if "padded_tokens_per_second" in metrics:
        table.add_row("padded real tokens/s", f"{metrics['padded_tokens_per_second']:,.0f}")
        table.add_row("padded tokens per real token", f"{metrics['padded_tokens_ratio']:.2f}")
        table.add_row(f"packed speed-up ({metrics['timed_steps']} timed steps each, warm-up step excluded)",
                      f"{metrics['speedup']:.2f}x")
        table.add_row(f"target speed-up ({metrics['target_factor']} x padding ratio)",
                      f"{metrics['target_speedup']:.2f}x")
        table.add_row("speed-up against target", metrics["speedup_verdict"])
        agree = "yes" if metrics["losses_agree"] else "NO"
        table.add_row("packed and padded losses agree",
                      f"{agree} (same batch {metrics['same_batch_loss_rel_diff']:.1e}, "
                      f"end of run {100 * metrics['final_loss_rel_diff']:.1f}%)")
    table.add_row("time taken", f"{metrics['wall_seconds']:.0f} s")
    console = Console()
    console.print(table)
    console.print(f"wrote {out}/metrics.json, {out}/loss.png, {out}/pack_fill.png")
    if "model_dir" in metrics:
        console.print(f"saved the trained model to {metrics['model_dir']} (save_pretrained format, "
                      f"ids of the tokenizer: {metrics['tokenizer']})")
        if metrics["compact_vocabulary"]:
            console.print(f"  a small-vocabulary demo model: trained on {metrics['compact_vocabulary']:,} ids, the "
                          f"other tokenizer ids share its <unk> row (see COMPACT_VOCABULARY.md there)")


def _data_loss_rows(metrics: dict[str, Any]) -> list[tuple[str, str]]:
    """A summary row for every example count of what the data lost that is not zero."""
    from hybrid_pack.training.data import DROP_REASONS

    rows = []
    if metrics["truncated_examples"]:
        rows.append(("examples truncated to --capacity", f"{metrics['truncated_examples']:,}"))
    if metrics["split_examples"]:
        rows.append(("examples split into pieces of --capacity", f"{metrics['split_examples']:,}"))
    what = "examples or split pieces" if metrics["split_examples"] else "examples"  # a piece is dropped alone
    if metrics["dropped_examples"]:
        reasons = ", ".join(f"{n:,} {DROP_REASONS[reason]}"
                            for reason, n in metrics["dropped_examples_by_reason"].items() if n)
        rows.append((f"{what} dropped", f"{metrics['dropped_examples']:,} ({reasons})"))
    if metrics["examples_without_targets"]:
        rows.append((f"{what} without targets (dropped)", f"{metrics['examples_without_targets']:,}"))
    return rows


def _decision_text(decision: dict[str, Any]) -> str:
    """``"fla"``, or ``"torch (fla: failed its self-check: ...)"`` when a kernel that could run was passed over."""
    if decision["refused"]:
        return f"{decision['backend']} ({'; '.join(f'{name}: {why}' for name, why in decision['refused'])})"
    if decision["skipped"] and decision["backend"] == "torch":
        return "torch (no kernel of this op can run here: see hybrid-pack backends)"
    return decision["backend"]


def _run_train(args: argparse.Namespace) -> int:
    from tqdm.contrib.logging import logging_redirect_tqdm

    from hybrid_pack.training import IsolationFailed, train

    guard_log = logging.getLogger("hybrid_pack.guard")  # one line per check, printed above the progress bar
    guard_log.setLevel(logging.INFO)
    try:
        with logging_redirect_tqdm(loggers=[guard_log]):
            metrics = train(_train_config(args))
    except IsolationFailed as err:
        print(err, file=sys.stderr)
        return 1
    if int(os.environ.get("RANK", "0")) == 0:
        _print_summary(metrics, args.out)
    return 0


def _forced_backends(values: Sequence[str]) -> dict[str, str]:
    from hybrid_pack.backends import OPS, backends_of
    from hybrid_pack.errors import InputError

    forced: dict[str, str] = {}
    for value in values:
        if "=" in value:
            op, name = value.split("=", 1)
            forced[op] = name
        else:
            matched = {op: value for op in OPS if any(b.name == value for b in backends_of(op))}
            if not matched:
                raise InputError(f"--backend: no op has a backend named {value!r}")
            forced.update(matched)
    return forced


def _model_for_check(name: str, *, patch: bool, vocab_size: int | None) -> Any:
    from hybrid_pack.errors import InputError
    from hybrid_pack.modeling import HybridForCausalLM

    if HybridForCausalLM.saved_in(name):
        if vocab_size is not None:
            raise InputError(f"--vocab-size: only a preset's vocabulary can be changed; {name!r} is a saved model")
        return HybridForCausalLM.from_pretrained(name).float().eval()
    is_hf = name.startswith("hf:") or (Path(name) / "config.json").is_file()
    if vocab_size is not None and is_hf:
        raise InputError(f"--vocab-size: only a preset's vocabulary can be changed; {name!r} is a Hugging Face model")
    if name.startswith("hf:"):
        from hybrid_pack.integrations.transformers.tiny import tiny_model

        model = tiny_model(name[3:])
    elif (Path(name) / "config.json").is_file():
        from hybrid_pack.training.trainer import hf_causal_lm

        model = hf_causal_lm(name, weights=False).float().eval()
    else:
        from hybrid_pack.modeling import from_preset

        return from_preset(name, **({} if vocab_size is None else {"vocab_size": vocab_size})).eval()
    if patch:
        from hybrid_pack.integrations.transformers import patch_model

        model = patch_model(model)
    return model


def _load_factory(spec: str) -> Callable[[], Any]:
    """The function named by ``FILE.py:FUNCTION`` or ``MODULE:FUNCTION``."""
    import importlib
    import importlib.util

    from hybrid_pack.errors import InputError

    location, sep, name = spec.rpartition(":")
    if not sep or not name:
        raise InputError(f"--trainer: expected FILE.py:FUNCTION or MODULE:FUNCTION; got {spec!r}")
    if location.endswith(".py"):
        if not Path(location).is_file():
            raise InputError(f"--trainer: no file {location!r}")
        module_spec = importlib.util.spec_from_file_location(Path(location).stem, location)
        module = importlib.util.module_from_spec(module_spec)
        module_spec.loader.exec_module(module)
    else:
        try:
            module = importlib.import_module(location)
        except ModuleNotFoundError as err:
            raise InputError(f"--trainer: cannot import {location!r}: {err}") from None
    factory = getattr(module, name, None)
    if not callable(factory):
        raise InputError(f"--trainer: {location!r} has no function {name!r}")
    return factory


def _lengths(text: str) -> list[int]:
    """``--lengths 3,5,1`` as ints (each checked by the harness)."""
    from hybrid_pack.errors import InputError

    try:
        return [int(n) for n in text.split(",")]
    except ValueError:
        raise InputError(f"--lengths: expected comma-separated document lengths such as 3,5,1; got {text!r}"
                         ) from None


def _device(text: str | None) -> Any:
    """``--device`` as a ``torch.device`` (default: cuda if available); InputError naming it when it cannot be
    used here."""
    import torch

    from hybrid_pack.errors import InputError

    try:
        device = torch.device(text or ("cuda" if torch.cuda.is_available() else "cpu"))
    except RuntimeError:
        raise InputError(f"--device: expected cpu, cuda, cuda:1 ...; got {text!r}") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise InputError(f"--device: {text!r}, but this torch ({torch.__version__}) sees no CUDA device; pass "
                         "--device cpu")
    return device


def _run_check(args: argparse.Namespace) -> int:
    import torch

    from hybrid_pack.backends import use_backends
    from hybrid_pack.errors import InputError
    from hybrid_pack.testing import check_isolation

    if (args.model is None) == (args.trainer is None):
        raise InputError("check: give a MODEL or --trainer FILE.py:FUNCTION (one of them)")
    if args.json and not Path(args.json).absolute().parent.is_dir():
        raise InputError(f"--json: the folder of {args.json!r} does not exist; create it or name another file")
    forced = _forced_backends(args.backend)
    with use_backends(**forced):
        if args.trainer:
            report = check_isolation(_load_factory(args.trainer)(), grads=not args.no_grads, seed=args.seed)
        else:
            lengths = None if args.lengths is None else _lengths(args.lengths)
            device = _device(args.device)
            model = _model_for_check(args.model, patch=not args.no_patch, vocab_size=args.vocab_size)
            model = model.to(device, getattr(torch, args.dtype))
            report = check_isolation(model, lengths=lengths, grads=not args.no_grads, seed=args.seed, progress=True)
    report.model = args.model or args.trainer
    print(report)
    if args.json:
        try:
            Path(args.json).write_text(report.to_json(indent=1))
        except OSError as err:
            raise InputError(f"--json: cannot write {args.json!r} ({err.strerror}); the report above stands") from None
    return 0 if report.ok else 1


def _run_backends(args: argparse.Namespace) -> int:
    import torch

    from hybrid_pack.backends import report, verify

    dtype = getattr(torch, args.dtype) if args.dtype else None
    device = _device(args.device)
    failed = False
    if args.verify:
        results = verify(device=device, dtype=dtype, progress=True)
        print(f"self-checks on {results[0].device if results else device}\n")
        wide = [max(len(text) for text in (name, *(getattr(r, key) for r in results)))
                for name, key in (("op", "op"), ("backend", "backend"))]
        print(f"{'op':<{wide[0]}} {'backend':<{wide[1]}} {'dtype':<9} {'checked':<14} {'result':<7} {'max error':>9} "
              f"{'seconds':>8}")
        for r in results:
            verdict, checked = "ok" if r.ok else "FAILED", "with backward" if r.requires_grad else "forward only"
            print(f"{r.op:<{wide[0]}} {r.backend:<{wide[1]}} {r.dtype:<9} {checked:<14} {verdict:<7} "
                  f"{r.max_error:>9.1e} {r.seconds:>8.2f}")
            if not r.ok:
                print(f"{'':<{wide[0]}} {r.reason}")
        failed = not all(r.ok for r in results)
        print()
    print(report(device=device, dtype=dtype or torch.float32))
    return 1 if failed else 0


def _run_bench(args: argparse.Namespace) -> int:
    import torch

    from hybrid_pack.bench.kernels import not_benchmarked, run_kernel_benchmarks
    from hybrid_pack.bench.report import kernel_table
    from hybrid_pack.errors import InputError
    from hybrid_pack.isolation.layouts import MIN_REAL_TOKENS
    from hybrid_pack.ops.selfcheck.kept import environment
    from hybrid_pack.ops.selfcheck.result import device_name
    from hybrid_pack.training.benchmark import run_benchmark

    if args.tokens is not None and args.skip_kernels:
        raise InputError("--tokens: sets the kernel benchmark's rows, which --skip-kernels skips; drop one of them")
    if args.tokens is not None and args.tokens < MIN_REAL_TOKENS:
        raise InputError(f"--tokens: expected at least {MIN_REAL_TOKENS} tokens per row (the mixed row holds "
                         f"documents of every size); got {args.tokens}")
    if args.steps < 2:
        raise InputError(f"--steps: expected at least 2 (the first step is a warm-up, not timed); got {args.steps}")
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise InputError(f"--out: {str(out)!r} is a file; name a folder for bench.json")
    device = _device(args.device)
    results: dict[str, Any] = {"device": device_name(device), "environment": environment()}
    if not args.skip_kernels:
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        tokens = args.tokens or (32_768 if device.type == "cuda" else 8192)
        kernels = run_kernel_benchmarks(device, dtype, tokens)
        results["kernels"] = [r.to_dict() for r in kernels]
        results["not_benchmarked"] = not_benchmarked()
        print(kernel_table(kernels), end="\n")
        print(f"not benchmarked (checked, not timed): {', '.join(results['not_benchmarked'])}", end="\n\n")
    results["training"] = run_benchmark(model=args.model, steps=args.steps, device=str(device))
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench.json").write_text(json.dumps(results, indent=1))
    for key, value in results["training"].items():
        print(f"{key:<40} {value:,.3f}" if isinstance(value, float) else f"{key:<40} {value}")
    print(f"wrote {out / 'bench.json'}")
    return 0


def _end_rank(code: int) -> NoReturn:
    """End this torchrun rank of ``hybrid-pack train`` with ``code``, output flushed, skipping the interpreter's
    finalization: gloo's threads can still hold tensors then, and freeing them aborts a finished run ("terminate
    called without an active exception", pytorch/pytorch#179291)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def main(argv: Sequence[str] | None = None) -> int:
    from hybrid_pack.errors import HybridPackError, IsolationError

    args = _parser().parse_args(argv)
    try:
        if args.command in ("demo", "train"):
            code = _run_train(args)
            if argv is None and int(os.environ.get("WORLD_SIZE", "1")) > 1:  # a torchrun rank, its group ended
                _end_rank(code)
            return code
        return {"check": _run_check, "backends": _run_backends, "bench": _run_bench}[args.command](args)
    except IsolationError as err:
        print(f"hybrid-pack {args.command}: {err}", file=sys.stderr)
        return 1
    except HybridPackError as err:
        print(f"hybrid-pack {args.command}: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
