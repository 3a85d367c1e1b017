"""The ``memtrain`` command: ``memtrain train``, ``memtrain estimate``, ``memtrain plan`` and ``memtrain bench``.

Exit codes: 0 success, 2 bad input (one message naming the fix), 1 an environment fault (one line: a full disk,
a read-only filesystem, stdout closed early) or an internal failure (with its trace).

The library names its arguments in its errors (``out_dir=``); this module translates them into flags (``--out``)
with one table, ``ARGUMENT_FLAGS`` (``COMMAND_FLAGS`` where one command spells an argument its own way).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import re
import runpy
import stat
import sys
import time
from collections.abc import Iterator
from dataclasses import asdict
from pathlib import Path
from typing import Any

from memtrain import __version__
from memtrain.errors import ConfigError, MemtrainError

EXIT_OK, EXIT_INTERNAL, EXIT_BAD_INPUT = 0, 1, 2
EXIT_ENVIRONMENT = 1  # one line, no trace: the machine, not memtrain, failed

# The flag behind each library argument, for translating the library's errors into the command's terms.
ARGUMENT_FLAGS: dict[str, str] = {
    "out_dir": "--out", "max_steps": "--max-steps", "micro_batch_size": "--micro-batch-size",
    "global_batch_size": "--global-batch-size", "lr": "--lr", "warmup_steps": "--warmup-steps",
    "weight_decay": "--weight-decay", "grad_clip": "--grad-clip", "precision": "--precision",
    "checkpointing": "--checkpointing", "checkpoint_every": "--checkpointing every:", "seed": "--seed",
    "eval_every": "--eval-every", "save_every": "--save-every", "seq_len": "--seq-len", "device": "--device",
    "world_size": "torchrun --nproc_per_node", "budget": "--budget", "host_budget": "--host-budget",
    "state_precision": "--optimizer-state", "offload_fraction": "--offload-optimizer-fraction",
}
# Switches: (the flag that makes the argument True, the flag that makes it False); None where the default is.
ARGUMENT_SWITCHES: dict[str, tuple[str | None, str | None]] = {
    "overwrite": ("--overwrite", None), "resume": ("--resume", None), "fsdp": ("--fsdp", None),
    "offload_optimizer": ("--offload-optimizer", "--no-offload-optimizer"),
    "offload_activations": ("--offload-activations", "--no-offload-activations"),
    "compile": ("--compile", None), "chunked_loss": ("--chunked-loss", "--no-chunked-loss"),
    "progress": (None, "--no-progress"), "step_in_backward": ("--step-in-backward", "--no-step-in-backward"),
    "merge_lora": ("--merge-lora", None),
}
# Where a command spells an argument its own way: memtrain plan plans --nproc ranks and compares --fsdp / --ddp.
COMMAND_FLAGS: dict[str, dict[str, str]] = {"plan": {"world_size": "--nproc"}}
COMMAND_SWITCHES: dict[str, dict[str, tuple[str | None, str | None]]] = {"plan": {"fsdp": ("--fsdp", "--ddp")}}
_VALUE = r"('[^']*'|\"[^\"]*\"|\[[^\]]*\]|[^\s,;)]+)"


def in_flag_terms(message: str, command: str | None = None, extra: dict[str, str] | None = None) -> str:
    """A library message in the command's terms: ``out_dir='x'`` -> ``--out 'x'``, ``resume=True`` -> ``--resume``,
    ``micro_batch_size`` -> ``--micro-batch-size`` (``world_size=2`` -> ``--nproc 2`` for ``command="plan"``);
    ``extra`` names what an argument means at one call site (``path=`` is --hf-model's folder or --data's file)."""
    flags = {**ARGUMENT_FLAGS, **COMMAND_FLAGS.get(command or "", {}), **(extra or {})}
    switches = {**ARGUMENT_SWITCHES, **COMMAND_SWITCHES.get(command or "", {})}

    def switch(match: re.Match[str]) -> str:
        on, off = switches[match.group(1)]
        flag = on if match.group(2) == "True" else off
        return flag if flag is not None else f"without {off if match.group(2) == 'True' else on}"

    names = "|".join(sorted(switches, key=len, reverse=True))
    message = re.sub(rf"(?<![\w./-])({names})=(True|False)\b", switch, message)
    names = "|".join(sorted(flags, key=len, reverse=True))

    def valued(match: re.Match[str]) -> str:
        flag = flags[match.group(1)]
        return f"{flag}{match.group(2)}" if flag.endswith(":") else f"{flag} {match.group(2)}"

    message = re.sub(rf"(?<![\w./-])({names})={_VALUE}", valued, message)
    bare = [n for n in (*flags, *switches) if "_" in n]
    names = "|".join(sorted(bare, key=len, reverse=True))

    def named(match: re.Match[str]) -> str:
        name = match.group(1)
        if name in flags:
            return flags[name].removesuffix(" every:")
        on, off = switches[name]
        return on or off or name

    return re.sub(rf"(?<![\w./-])({names})(?![\w=/-])", named, message)


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # argparse's own exit code is 2 as well; keep one message format
        self.print_usage(sys.stderr)
        print(f"memtrain: error: {message}", file=sys.stderr)
        sys.exit(EXIT_BAD_INPUT)


def _int_at_least(minimum: int):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"{value} must be >= {minimum}")
        return value

    parse.__name__ = f"integer >= {minimum}"
    return parse


_positive_int = _int_at_least(1)
_non_negative_int = _int_at_least(0)


def _float(text: str, *, zero_allowed: bool) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not (value >= 0 if zero_allowed else value > 0):
        raise argparse.ArgumentTypeError(f"{value} must be {'>=' if zero_allowed else '>'} 0")
    return value


def _positive_float(text: str) -> float:
    return _float(text, zero_allowed=False)


def _non_negative_float(text: str) -> float:
    return _float(text, zero_allowed=True)


def _grad_clip(text: str) -> float | None:
    """A norm > 0, or 0 / none: no clipping."""
    if text.strip().lower() in ("none", "0", "0.0"):
        return None
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number or 'none'") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"{value} must be > 0 (or 0 / none: no clipping)")
    return value


def _checkpointing(text: str) -> str:
    """auto, or a spelling ``Checkpointing.parse`` reads, written back as ``str(Checkpointing)`` (one spelling
    per policy in the run's config.json)."""
    from memtrain.checkpointing import Checkpointing

    if text.strip().lower() == "auto":
        return "auto"
    try:
        return str(Checkpointing.parse(text))
    except ConfigError as e:
        spellings = ("auto (the planner chooses), none, all, every:K (K >= 1), selective, selective(matmul,attention), "
                     "blocks(RKO...) (one letter per block: recompute, keep, offload), each with an optional +offload")
        raise argparse.ArgumentTypeError(f"{text!r} is not a checkpointing policy ({e}); the spellings are "
                                         f"{spellings}") from None


def _fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not 0 <= value <= 1:
        raise argparse.ArgumentTypeError(f"{value} must be a fraction in [0, 1] (the share of the optimizer state "
                                         "kept in host RAM)")
    return value


UNLIMITED = "unlimited"


def _size(text: str) -> int | str:
    """A byte size (``24GiB``, ``8000MB``, ``4096``) as an int, or ``unlimited``."""
    from memtrain.report import parse_bytes

    if text.strip().lower() in ("unlimited", "none", "inf"):
        return UNLIMITED
    fix = "To resolve this error, pass a positive size such as 24GiB or 8000MB (GiB = 2**30, GB = 10**9), or unlimited"
    if text.strip().startswith("-"):
        raise argparse.ArgumentTypeError(f"{text!r} is negative. {fix}")
    try:
        return parse_bytes(text)
    except ConfigError:
        what = "zero" if re.fullmatch(r"\s*0*\.?0*\s*[a-zA-Z]*\s*", text) and re.search(r"\d", text) else "not a size"
        raise argparse.ArgumentTypeError(f"{text!r} is {what}. {fix}") from None


# Flags whose value may start with "-" (a negative size): argparse would take it for a flag and say only
# "expected one argument"; main() joins them as --budget=-1GiB so the size's own check explains.
_SIZE_FLAGS = ("--budget", "--host-budget")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="memtrain", description="Make a PyTorch model fit a memory budget at the least slowdown.")
    parser.add_argument("--version", action="version", version=f"memtrain {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    t = sub.add_parser("train", help="train the built-in GPT on the built-in corpus (or your model and data)")
    t.add_argument("--config", metavar="FILE.toml", help="read flags from a TOML file (keys as the flags, e.g. "
                   "micro-batch-size = 4); flags given on the command line win")
    _add_model_flags(t, pretrained_weights=True)
    t.add_argument("--data", metavar="PATH", help="the text to train on: with --hf-model a .txt (documents split on "
                   "blank lines) or .jsonl (a \"text\" field, or \"prompt\"/\"completion\": the loss on the completion) "
                   "tokenised with the folder's tokenizer; for the built-in GPT a text file read as bytes (default: "
                   "the Python standard library)")
    t.add_argument("--lora", type=_positive_int, metavar="R", help="train LoRA adapters of rank R on the frozen "
                   "model (every linear layer but the output head); hf/ then holds the adapters")
    t.add_argument("--merge-lora", action="store_true", help="with --lora: hf/ holds the weights with the adapters "
                   "merged in (a plain from_pretrained folder)")
    t.add_argument("--global-batch-size", type=_positive_int,
                   help="examples per optimizer step over all ranks (default: 16 x world size, or micro-batch x "
                   "world size when --micro-batch-size is given); the accumulation steps follow")
    t.add_argument("--precision", choices=["auto", "fp32", "bf16-mixed", "fp16-mixed"], default="auto",
                   help="auto picks bf16-mixed where the GPU supports it, fp32 on a CPU (default auto)")
    _add_budget_flags(t, default_text="the device's free memory (CUDA) or the free RAM (CPU)")
    t.add_argument("--nproc", type=_positive_int, metavar="N", help="check that torchrun started N processes "
                   "(memtrain train starts none itself: launch torchrun --nproc_per_node N -m memtrain train)")
    t.add_argument("--max-steps", type=_positive_int, default=500, help="optimizer steps (default 500)")
    t.add_argument("--lr", type=_positive_float, default=3e-3, help="peak learning rate (default 3e-3)")
    t.add_argument("--warmup-steps", type=_non_negative_int, default=None,
                   help="linear warm-up steps to --lr (default min(50, max-steps // 10): a 10-step run warms up "
                   "in 1), then cosine decay to a tenth of --lr")
    t.add_argument("--weight-decay", type=_non_negative_float, default=0.1, help="AdamW weight decay (default 0.1)")
    t.add_argument("--grad-clip", type=_grad_clip, default=1.0,
                   help="clip the global gradient norm to this (default 1.0; 0 or none: no clipping)")
    t.add_argument("--seed", type=_non_negative_int, default=0, help="seed of the weights, the data order and "
                   "dropout (0 <= seed < 2**63; default 0)")
    t.add_argument("--out", metavar="DIR", help="run folder (default runs/<model>-<time>)")
    t.add_argument("--save-every", type=_positive_int, default=100, help="optimizer steps between resumable "
                   "checkpoints, also written at the end and on SIGTERM/SIGINT (default 100)")
    t.add_argument("--eval-every", type=_positive_int, default=100,
                   help="optimizer steps between evaluations on the held-out windows (default 100; also at the end)")
    t.add_argument("--resume", action="store_true", help="continue the run in --out from its newest intact "
                   "checkpoint, with the flags it started with (flags given now are checked against them)")
    t.add_argument("--overwrite", action="store_true", help="replace another run's results in --out (memtrain's "
                   "files only: it never deletes what it did not write)")
    t.add_argument("--fsdp", action="store_true", help="under torchrun: shard with FSDP2 instead of DDP")
    t.add_argument("--compile", action="store_true",
                   help="torch.compile the training step (after checkpointing and the DDP/FSDP2 wrapper)")
    t.add_argument("--no-progress", action="store_true", help="no progress bar (on a terminal) or progress lines "
                   "(in a log)")
    t.add_argument("--json", action="store_true", help="print the result as JSON on stdout")

    e = sub.add_parser("estimate", help="predict the peak memory of a training step, without a GPU")
    _add_model_flags(e, micro_batch_default=16, checkpointing_default="all")
    e.add_argument("--precision", choices=["fp32", "bf16-mixed", "fp16-mixed"], default="bf16-mixed",
                   help="the precision to predict for (default bf16-mixed)")
    e.add_argument("--device", choices=["cuda", "cpu"], default="cuda",
                   help="the device whose peak is predicted (default cuda)")
    e.add_argument("--json", action="store_true", help="print the report as JSON (peak_bytes: the predicted peak)")

    p = sub.add_parser("plan", help="choose the fastest set-up that fits a memory budget, with its reasons")
    _add_model_flags(p)
    p.add_argument("--global-batch-size", type=_positive_int,
                   help="examples per optimizer step over all ranks (default 16 x --nproc, as memtrain train)")
    p.add_argument("--precision", choices=["fp32", "bf16-mixed", "fp16-mixed"], default="bf16-mixed",
                   help="compute precision (default bf16-mixed)")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda",
                   help="the device planned for (default cuda; a CPU plan is probed on this machine)")
    _add_budget_flags(p, default_text="unlimited")
    p.add_argument("--nproc", type=_positive_int, default=1, metavar="N",
                   help="ranks to plan for (the peak is per rank; default 1)")
    dist = p.add_mutually_exclusive_group()
    dist.add_argument("--fsdp", action="store_const", const=True, dest="fsdp",
                      help="with --nproc > 1: plan FSDP2 only (default: DDP and FSDP2 compared)")
    dist.add_argument("--ddp", action="store_const", const=False, dest="fsdp",
                      help="with --nproc > 1: plan DDP only")
    p.add_argument("--compile", action="store_true", help="also consider torch.compile'd set-ups")
    p.add_argument("--calibrate", action="store_true", help="measure this machine's device first (a few seconds "
                   "of matmuls, copies and a CPU AdamW step; cached) instead of the table of known GPUs; a CPU "
                   "plan always probes")
    p.add_argument("--gpu", metavar="NAME", help="plan for this GPU from the table of known ones (H200, H100, A100, "
                   "L4, 4090), e.g. for another machine (default: this machine's GPU, else an H100)")
    p.add_argument("--json", action="store_true", help="print the plan as JSON: plan (the chosen settings), "
                   "peak_bytes, step_seconds, tokens_per_s, candidates")

    b = sub.add_parser("bench", help="run the side-by-side benchmarks in benchmarks/")
    b.add_argument("name", nargs="?", default="checkpointing", help="benchmark to run (default: checkpointing)")
    b.add_argument("bench_args", nargs=argparse.REMAINDER, help="passed to the benchmark script")
    b.add_argument("--json", action="store_true", help="print the results as JSON on stdout")
    return parser


def _add_model_flags(parser: argparse.ArgumentParser, *, micro_batch_default: int | None = None,
                     checkpointing_default: str = "auto", pretrained_weights: bool = False) -> None:
    """The model / batch / technique flags shared by train, estimate and plan."""
    models = parser.add_mutually_exclusive_group()
    models.add_argument("--model", default="gpt-mini", help="GPT preset: gpt-tiny, gpt-mini (default), gpt-small")
    models.add_argument("--hf-config", metavar="PATH",
                        help="a Hugging Face config.json: that model, randomly initialised")
    models.add_argument("--hf-model", metavar="DIR", help=(
        "a local pretrained Hugging Face folder: config.json, *.safetensors weights (loaded in fp32: master "
        "weights for mixed precision) and a tokenizer, never the network" if pretrained_weights else
        "a local Hugging Face model folder: only its config.json is read (nothing is loaded)"))
    parser.add_argument("--seq-len", type=_positive_int, help="tokens per example (default: the preset's; 256 for "
                        "Hugging Face models, at most their positions)" if pretrained_weights else
                        "tokens per example (default: the preset's; for Hugging Face models 2048, at most their "
                        "positions)")
    parser.add_argument("--micro-batch-size", type=_positive_int, default=micro_batch_default, help=(
        f"examples per forward (default {micro_batch_default})" if micro_batch_default else
        "examples per forward (default: the plan picks it; given, it is fixed)"))
    parser.add_argument("--checkpointing", type=_checkpointing, default=checkpointing_default, help=(
        "none | all | every:K | selective | blocks(RKO..) (per block: recompute, keep, offload), each with an "
        "optional +offload (the recomputed blocks' inputs in host memory)"
        + (" | auto: the planner chooses (default)" if checkpointing_default == "auto"
           else f" (default {checkpointing_default})")))
    _add_technique_flags(parser, planned=checkpointing_default == "auto")


def _add_technique_flags(parser: argparse.ArgumentParser, *, planned: bool) -> None:
    """The memory techniques a user may fix; unset, the planner decides (train, plan) or they are off (estimate)."""
    unset = "default: the plan decides" if planned else "default: off"
    switch = argparse.BooleanOptionalAction
    parser.add_argument("--offload-activations", action=switch, default=None,
                        help=f"saved activations in pinned host memory, prefetched before backward (CUDA; {unset})")
    parser.add_argument("--offload-optimizer", action=switch, default=None,
                        help=f"fp32 master weights and AdamW state in host RAM, 8-12 bytes per parameter off the "
                        f"device ({unset})")
    parser.add_argument("--offload-optimizer-fraction", type=_fraction, metavar="F", default=None,
                        help=f"this share of the parameters' fp32 master and AdamW state in host RAM, the rest on "
                        f"the device ({unset})")
    parser.add_argument("--chunked-loss", action=switch, default=None,
                        help="the loss's fp32 logits 1024 tokens at a time, never whole (default: "
                        + ("the plan decides)" if planned else "on with checkpointing where the model allows it)"))
    parser.add_argument("--optimizer-state", choices=["fp32", "bf16", "int8"], default=None,
                        help=f"AdamW's moments in fp32 (8 bytes per parameter), bf16 (4) or int8 (about 2; needs "
                        f"bitsandbytes) ({unset.replace('off', 'fp32')})")
    parser.add_argument("--step-in-backward", action=switch, default=None,
                        help=f"each parameter steps as soon as its gradient is final, which is freed at once: the "
                        f"whole model's gradients never coexist ({unset})")


def _add_budget_flags(parser: argparse.ArgumentParser, *, default_text: str) -> None:
    parser.add_argument("--budget", type=_size, metavar="SIZE", help="device bytes per rank the run may use, e.g. "
                        f"24GiB or 8000MB (GiB = 2**30, GB = 10**9; default {default_text})")
    parser.add_argument("--host-budget", type=_size, metavar="SIZE", help="host RAM the run may use (offloaded "
                        "state, pinned buffers; default: the RAM available now)")


def _subparser(parser: argparse.ArgumentParser, command: str) -> argparse.ArgumentParser:
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))  # noqa: SLF001
    return sub.choices[command]


def _explicit_dests(parser: argparse.ArgumentParser, argv: list[str], command: str) -> set[str]:
    """The options the command line gives itself (argparse fills the others in with their defaults)."""
    sub = _subparser(parser, command)
    unset = object()
    # argparse sets a default only where the namespace has no value yet: a marker shows which were never given.
    namespace = argparse.Namespace(**{a.dest: unset for a in sub._actions if a.dest != "help"})  # noqa: SLF001
    sub.parse_known_args(argv[argv.index(command) + 1:], namespace=namespace)
    return {dest for dest, value in vars(namespace).items() if value is not unset}


def _apply_config_file(parser: argparse.ArgumentParser, argv: list[str]) -> set[str]:
    """Makes the keys of ``--config FILE.toml`` the sub-parser's defaults; checks every key and value at once.
    Returns the options the file set."""
    import tomllib

    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))  # noqa: SLF001
    if not argv or argv[0] not in sub.choices or "--config" not in " ".join(argv):
        return set()
    train_parser = sub.choices[argv[0]]
    known, _ = train_parser.parse_known_args(argv[1:])
    path = getattr(known, "config", None)
    if not path:
        return set()
    try:
        with open(path, "rb") as f:
            values = tomllib.load(f)
    except FileNotFoundError:
        raise ConfigError(f"--config {path!r}: no such file. To resolve this error, pass the path of a TOML "
                          "file.") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"--config {path!r} cannot be read as a TOML file ({e}). To resolve this error, pass "
                          "the path of a UTF-8 text file.") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"--config {path!r} is not valid TOML ({e}). To resolve this error, fix that line.") from None
    actions = {a.option_strings[0][2:]: a for a in train_parser._actions if a.option_strings and  # noqa: SLF001
               a.option_strings[0].startswith("--") and a.dest not in ("help", "config")}
    # A switch's negative spelling is a key too: no-chunked-loss = true is chunked-loss = false.
    negated = {a.option_strings[1][2:]: a for a in actions.values()
               if isinstance(a, argparse.BooleanOptionalAction) and len(a.option_strings) > 1}
    problems, defaults = [], {}
    for key, value in values.items():
        action = actions.get(key) or negated.get(key)
        if action is None:
            import difflib

            close = difflib.get_close_matches(key.replace("_", "-"), [*actions, *negated], n=1)
            hint = f" Did you mean {close[0]!r}?" if close else ""
            problems.append(f"--config: unknown key {key!r}.{hint} Keys are the flags of memtrain {argv[0]} "
                            "without the dashes, e.g. micro-batch-size = 4.")
            continue
        if isinstance(action, (argparse._StoreTrueAction, argparse.BooleanOptionalAction)):  # noqa: SLF001
            if not isinstance(value, bool):
                problems.append(f"--config: {key} = {value!r} must be true or false.")
                continue
            defaults[action.dest] = value if key not in negated else not value
            continue
        if isinstance(value, (dict, list)):
            problems.append(f"--config: {key} = {value!r} must be a single value.")
            continue
        text = str(value).lower() if isinstance(value, bool) else str(value)
        try:
            converted = action.type(text) if action.type else text
        except (argparse.ArgumentTypeError, ValueError) as e:
            problems.append(f"--config: {key} = {value!r}: {e}.")
            continue
        if action.choices and converted not in action.choices:
            problems.append(f"--config: {key} = {value!r} is not one of {', '.join(map(str, action.choices))}.")
            continue
        defaults[action.dest] = converted
    ConfigError.raise_if(problems)
    train_parser.set_defaults(**defaults)
    return set(defaults)


_STDOUT_CLOSED = False  # set when a reader closed stdout early (e.g. `| head -1`); main() exits 1 saying so


def _print(message: str, *, file: Any = None) -> None:
    """print(), except that a stdout closed by its reader drops the rest of the output instead of raising."""
    global _STDOUT_CLOSED
    file = file or sys.stdout
    if _STDOUT_CLOSED and file is sys.stdout:
        return
    try:
        print(message, file=file, flush=True)
    except BrokenPipeError:
        if file is not sys.stdout:
            raise
        _STDOUT_CLOSED = True
        _drop_stdout()


def _drop_stdout() -> None:
    """Points stdout at /dev/null: Python would otherwise fail again flushing it at exit."""
    devnull = open(os.devnull, "w")  # noqa: SIM115 - lives as long as the process
    if sys.stdout is sys.__stdout__:
        with contextlib.suppress(OSError, ValueError):
            os.dup2(devnull.fileno(), sys.stdout.fileno())
            return
    sys.stdout = devnull


def _log(args: argparse.Namespace, message: str) -> None:
    # With --json, stdout carries only the JSON document.
    _print(message, file=sys.stderr if args.json else sys.stdout)


@contextlib.contextmanager
def _flags_of(extra: dict[str, str]) -> Any:
    """Library errors raised inside, with the arguments of this call site named as their flags."""
    try:
        yield
    except ConfigError as e:
        raise ConfigError([in_flag_terms(p, extra=extra) for p in e.problems]) from None


_HF_MODEL, _DATA = {"path": "--hf-model"}, {"path": "--data"}


def _build_language_model(args: argparse.Namespace) -> tuple[Any, int]:
    """The model (LoRA adapters added with --lora) and its sequence length."""
    if args.hf_model:
        from memtrain.hf import load_pretrained

        # fp32 weights whatever the checkpoint holds: the master weights of mixed precision (autocast computes in
        # bf16), which the optimizer needs; the plan may still put bf16 copies on the device (offloaded master).
        with _flags_of(_HF_MODEL):
            model = load_pretrained(args.hf_model)
        seq_len = _hf_seq_len(model.config, args.seq_len, "--hf-model")
    elif args.hf_config:
        model, seq_len = _build_hf_model(args.hf_config, args.seq_len)
    else:
        model = _build_gpt(args)
        seq_len = model.config.seq_len
    if args.lora:
        from memtrain.hf import apply_lora

        with _flags_of({"r": "--lora"}):
            model = apply_lora(model, args.lora)
    return model, seq_len


# Encoder model types whose causal-LM class attends both ways unless the config says is_decoder.
_ENCODERS = frozenset({"bert", "roberta", "xlm-roberta", "xlm-roberta-xl", "electra", "camembert", "ernie",
                       "data2vec-text", "rembert", "roformer", "megatron-bert", "xmod", "big_bird", "bert-generation"})


def _build_gpt(args: argparse.Namespace) -> Any:
    """The --model preset, with --seq-len applied."""
    from memtrain.models import GPT, GPT_PRESETS

    if args.model not in GPT_PRESETS:
        raise ConfigError(f"--model {args.model!r} is not a known model. To resolve this error, pass one of "
                          f"{', '.join(GPT_PRESETS)}, --hf-config PATH or --hf-model DIR.")
    return GPT.from_preset(args.model, **({"seq_len": args.seq_len} if args.seq_len else {}))


def _hf_seq_len(config: Any, seq_len: int | None, flag: str, *, default: int = 256,
                problems: list[str] | None = None) -> int:
    """--seq-len, or ``default`` capped at the model's positions; a causal LM only (not an encoder)."""
    own = problems is None
    problems = [] if problems is None else problems
    if config.model_type in _ENCODERS and not getattr(config, "is_decoder", False):
        problems.append(f"{flag}: a {config.model_type} config is an encoder: trained on next tokens it would "
                        "see the tokens it predicts. To resolve this error, set \"is_decoder\": true in the config, "
                        "or use a decoder model (llama, gpt2, qwen2, ...).")
    max_len = getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)
    wanted = seq_len or min(default, max_len or default)
    if max_len is not None and wanted > max_len:
        problems.append(f"--seq-len {wanted} is longer than the model's {max_len} positions. To resolve this "
                        f"error, pass --seq-len {max_len} or less.")
    if own:
        ConfigError.raise_if(problems)
    return wanted


def _build_hf_model(path: str, seq_len: int | None) -> tuple[Any, int]:
    from memtrain.estimate import hf_config_from_file

    config = hf_config_from_file(path)  # plain JSON: nothing executed; every bad field is a ConfigError
    problems: list[str] = []
    vocab = getattr(config, "vocab_size", None)
    if not isinstance(vocab, int) or vocab < 256:
        problems.append(f"--hf-config: vocab_size={vocab!r} must be an integer >= 256: the data is byte-level. To "
                        "resolve this error, set vocab_size >= 256 in the config.")
    wanted = _hf_seq_len(config, seq_len, "--hf-config", problems=problems)
    ConfigError.raise_if(problems)
    import transformers

    try:
        return transformers.AutoModelForCausalLM.from_config(config), wanted
    except Exception as e:  # noqa: BLE001 - transformers refuses configs with exceptions of many types
        cause = " ".join(str(e).split()) or type(e).__name__
        raise ConfigError(f"--hf-config {path!r}: transformers cannot build a causal language model from this "
                          f"{config.model_type} config ({type(e).__name__}: {cause[:400]}"
                          f"{'...' if len(cause) > 400 else ''}). To resolve this error, pass the config of a "
                          "decoder model (llama, gpt2, qwen2, ...) whose sizes are positive.") from None


def _hf_folder_config(path: str) -> Any:
    """The config.json of a --hf-model folder (only that file is read)."""
    from memtrain.estimate import hf_config_from_file

    folder = Path(path)
    if not folder.is_dir():
        raise ConfigError(f"--hf-model {path!r}: no such folder. To resolve this error, pass a local folder holding "
                          "config.json (and, to train, *.safetensors weights and a tokenizer).")
    if not (folder / "config.json").is_file():
        raise ConfigError(f"--hf-model {path!r} holds no config.json, so the architecture is unknown. To resolve "
                          "this error, pass the folder save_pretrained wrote (config.json beside the weights).")
    return hf_config_from_file(folder / "config.json")


def _check_data_path(path: str, *, tokenised: bool) -> None:
    """--data must be a readable regular text file: a directory or a FIFO would fail late or block forever.
    ``tokenised``: a model tokenizer reads it, so .jsonl is read too (bytes otherwise)."""
    p = Path(path)
    shown = f"--data {path!r}"
    if not p.exists():
        what = "a symbolic link to nothing" if os.path.islink(p) else "no such file"
        raise ConfigError(f"{shown}: {what}. To resolve this error, pass the path of a text file.")
    if p.is_dir():
        raise ConfigError(f"{shown} is a directory. To resolve this error, pass the path of a text file in it.")
    if not stat.S_ISREG(p.stat().st_mode):
        raise ConfigError(f"{shown} is not a regular file (a FIFO, socket or device: reading it could block or "
                          "never end). To resolve this error, pass the path of a text file.")
    if p.suffix.lower() == ".jsonl" and not tokenised:
        raise ConfigError(f"{shown} is a .jsonl file, which only a model with a tokenizer reads (the built-in GPT "
                          "and --hf-config models read bytes: they would train on the raw JSON). To resolve this "
                          "error, pass --hf-model DIR (a folder with a tokenizer), or a plain .txt file of the texts.")
    if not os.access(p, os.R_OK):
        raise ConfigError(f"{shown} is not readable. To resolve this error, pass a text file you can read.")


def _check_writable_file(path: str, flag: str) -> None:
    """The file at ``path`` can be created or replaced (checked before a long command, not after it)."""
    p = Path(path)
    if p.is_dir():
        raise ConfigError(f"{flag} {path!r} is a directory. To resolve this error, pass a file path.")
    parent = p.absolute().parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    target = p if p.exists() else parent
    if not (parent.is_dir() and os.access(parent, os.W_OK | os.X_OK) and os.access(target, os.W_OK)):
        raise ConfigError(f"{flag} {path!r} cannot be written ({str(target)!r} is not writable). To resolve "
                          "this error, pass a path in a folder you can write to.")


def _launch_environment() -> tuple[int, int]:
    """(world size, local rank) from torchrun's environment, checked: a partial one is refused, not crashed on."""
    names = ("WORLD_SIZE", "RANK", "LOCAL_RANK")
    values = {}
    for name in names:
        text = os.environ.get(name)
        if text is not None:
            try:
                values[name] = int(text)
            except ValueError:
                raise ConfigError(f"the environment variable {name}={text!r} is not an integer. To resolve this "
                                  f"error, unset {name} or launch with torchrun, which sets it.") from None
    world = values.get("WORLD_SIZE", 1)
    if world > 1:
        missing = [n for n in ("RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT") if n not in os.environ]
        if missing:
            raise ConfigError(f"WORLD_SIZE={world} is set but {', '.join(missing)} {'is' if len(missing) == 1 else 'are'}"
                              " not: memtrain joins a distributed group only as torchrun starts it. To resolve this "
                              f"error, launch with torchrun --nproc_per_node {world} -m memtrain train ..., or unset "
                              "WORLD_SIZE.")
        if not 0 <= values["RANK"] < world:
            raise ConfigError(f"RANK={values['RANK']} is not in [0, WORLD_SIZE={world}). To resolve this error, "
                              "launch with torchrun, which sets both.")
    elif world < 1:
        raise ConfigError(f"WORLD_SIZE={world} must be >= 1. To resolve this error, unset WORLD_SIZE.")
    return world, values.get("LOCAL_RANK", 0)


@contextlib.contextmanager
def _distributed_group() -> Iterator[tuple[int, int, Any]]:
    """Joins the torchrun group when launched by torchrun; yields (rank, world size, device).

    The group this opens is closed here: after a barrier when the run succeeded, so no rank tears its
    connections down while a peer still uses them, and in any case before the interpreter exits (a gloo group
    left to interpreter shutdown can abort the process).
    """
    import torch
    import torch.distributed as dist

    world, local_rank = _launch_environment()
    device = torch.device("cuda", local_rank) if torch.cuda.is_available() else torch.device("cpu")
    opened = world > 1 and not dist.is_initialized()
    if opened:
        if device.type == "cuda":
            torch.cuda.set_device(device)
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    try:
        yield (dist.get_rank() if dist.is_initialized() else 0), world, device
        if opened:
            dist.barrier()
    finally:
        if opened:
            gc.collect()  # a DDP reducer left in a reference cycle must not outlive the group it uses
            dist.destroy_process_group()


# The options of memtrain train that config.json records (the others say how to run, not what: --json, --out,
# --resume, --overwrite, --config); and those that define the model and the data, which a resume must keep.
_NOT_RECORDED = frozenset({"help", "config", "out", "resume", "overwrite", "json", "command"})
_MODEL_FLAGS = ("model", "hf_model", "lora", "seq_len")  # refused here when changed; a new --data or --hf-config
# path is let through: train() compares the contents (a SHA-256 of the token stream, the parameters' names and
# shapes), so a moved file still resumes and a changed one is refused
_PATH_FLAGS = ("data", "hf_config", "hf_model")  # recorded absolute: a resume may run from another folder


def _command_record(args: argparse.Namespace, parser: argparse.ArgumentParser) -> dict[str, Any]:
    """The train options as JSON values, paths absolute (a resume may run from another folder)."""
    record = {}
    for action in _subparser(parser, "train")._actions:  # noqa: SLF001
        if action.dest in _NOT_RECORDED:
            continue
        value = getattr(args, action.dest)
        if action.dest in _PATH_FLAGS and value:
            value = str(Path(value).absolute())
        record[action.dest] = list(value) if isinstance(value, tuple) else value
    return record


def _resume_flags(args: argparse.Namespace, parser: argparse.ArgumentParser, explicit: set[str]) -> list[str]:
    """With --resume: every option not given now takes the value the run started with (from its config.json);
    model and data options given now must equal those. Returns notes for the log.

    The other options given now go to train(), which refuses a changed run-defining one (e.g. --lr, other data
    under a new --data path) and applies the others (e.g. --max-steps) with a logged line.
    """
    from memtrain.runstate import read_run_config

    try:
        saved = read_run_config(args.out).get("command")
    except ConfigError as e:
        return [f"--resume: {e}: using the flags given now (the checkpoint checks the run-defining ones)"]
    if not isinstance(saved, dict):
        raise ConfigError(f"--resume: the run in {args.out!r} was started from Python (train()), not by memtrain "
                          "train, so its model and data flags are not recorded. To resolve this error, resume it "
                          "from Python with TrainConfig(resume=True), or pass its flags to a new run.")
    now = _command_record(args, parser)
    problems = []
    for dest in _MODEL_FLAGS:
        if dest in explicit and dest in saved and now[dest] != saved[dest]:
            flag = "--" + dest.replace("_", "-")
            problems.append(f"--resume: {flag} {now[dest]!r} now but {saved[dest]!r} in the run being resumed: "
                            f"another model would not continue it. To resolve this error, drop {flag} (--resume "
                            "reads it from the run's config.json), or start a new run in another --out.")
    ConfigError.raise_if(problems)
    # Runs recorded before the planner: checkpointing as [mode, K], and a --no-chunked-loss switch.
    if isinstance(saved.get("checkpointing"), list):
        mode, every = saved["checkpointing"]
        saved["checkpointing"] = f"every:{every}" if mode == "every" else mode
    if saved.get("no_chunked_loss") is True and "chunked_loss" not in saved:
        saved["chunked_loss"] = False
    for dest, value in saved.items():
        if dest not in explicit and dest in now:
            setattr(args, dest, tuple(value) if isinstance(value, list) else value)
    return [f"--resume: the flags of the run in {args.out} (config.json)"
            + (f", with {', '.join('--' + d.replace('_', '-') for d in sorted(explicit & set(now)))} given now"
               if explicit & set(now) else "")]


def _technique_problems(args: argparse.Namespace) -> list[str]:
    """Flags that contradict each other, named as flags (train and plan)."""
    from memtrain.checkpointing import Checkpointing

    problems = []
    if args.offload_optimizer and args.offload_optimizer_fraction is not None:
        problems.append(f"--offload-optimizer and --offload-optimizer-fraction {args.offload_optimizer_fraction} "
                        "together: the first puts all of the optimizer state in host RAM, the second a share of it. "
                        "To resolve this error, pass one of them.")
    if args.offload_optimizer is False and args.offload_optimizer_fraction:
        problems.append(f"--no-offload-optimizer and --offload-optimizer-fraction {args.offload_optimizer_fraction} "
                        "contradict each other. To resolve this error, drop one of them.")
    if args.offload_optimizer and args.optimizer_state not in (None, "fp32"):
        problems.append(f"--offload-optimizer with --optimizer-state {args.optimizer_state}: CPUOffloadOptimizer "
                        "keeps fp32 state in host RAM (the device holds none). To resolve this error, drop "
                        "--optimizer-state, or use it with the optimizer on the device (--no-offload-optimizer).")
    if args.offload_optimizer and args.step_in_backward:
        problems.append("--offload-optimizer with --step-in-backward: the offloaded optimizer already takes each "
                        "gradient off the device as it is produced and steps on the host; --step-in-backward is for "
                        "the device optimizer. To resolve this error, pass one of them.")
    if args.step_in_backward and args.offload_optimizer_fraction:
        problems.append("--step-in-backward with --offload-optimizer-fraction: a partial offload steps after "
                        "backward. To resolve this error, pass one of them.")
    if args.checkpointing != "auto" and args.offload_activations is False and \
            Checkpointing.parse(args.checkpointing).offload_inputs:
        problems.append(f"--checkpointing {args.checkpointing} offloads the recomputed blocks' inputs, but "
                        "--no-offload-activations says not to. To resolve this error, drop +offload or "
                        "--no-offload-activations.")
    return problems


def cmd_train(args: argparse.Namespace, parser: argparse.ArgumentParser, explicit: set[str]) -> int:
    from memtrain.data import builtin_corpus, split_windows, text_file_tokens, tokenized_rows
    from memtrain.report import format_bytes
    from memtrain.runstate import RunFolder
    from memtrain.train import TrainConfig, train

    # The checks that need no model come first: a bad folder or file fails in a second, not after set-up.
    if args.resume and not args.out:
        raise ConfigError("--resume needs the run folder to continue. To resolve this error, pass --out DIR.")
    notes = []
    if args.resume and not args.overwrite:
        RunFolder(args.out, resume=True).check()
        notes = _resume_flags(args, parser, explicit)
    problems = _technique_problems(args)
    if args.merge_lora and not args.lora:
        problems.append("--merge-lora without --lora: there are no adapters to merge. To resolve this error, pass "
                        "--lora R (e.g. --lora 8), or drop --merge-lora.")
    if args.nproc is not None:
        problems += _nproc_problems(args.nproc)
    ConfigError.raise_if(problems)
    tokenizer = None
    if args.hf_model:
        from memtrain.hf import load_tokenizer, safetensors_files

        with _flags_of(_HF_MODEL):
            safetensors_files(args.hf_model)  # config.json and safetensors weights, before anything is loaded
            _hf_seq_len(_hf_folder_config(args.hf_model), args.seq_len, "--hf-model")
        if not args.data:
            raise ConfigError(f"--hf-model {args.hf_model!r} without --data: the built-in corpus is read as bytes, "
                              "not with the model's tokenizer. To resolve this error, pass --data PATH (a .txt "
                              "file, documents split on blank lines, or a .jsonl file with a \"text\" field).")
        with _flags_of(_HF_MODEL):
            tokenizer = load_tokenizer(args.hf_model, needed_for=f"--data {args.data!r} (and the run's hf/ folder)")
    if args.data:
        _check_data_path(args.data, tokenised=tokenizer is not None)
    name = Path(args.hf_model).name if args.hf_model else Path(args.hf_config).stem if args.hf_config else args.model
    out = args.out or f"runs/{name}-{time.strftime('%Y%m%d-%H%M%S')}"
    config = TrainConfig(
        max_steps=args.max_steps, micro_batch_size=args.micro_batch_size, global_batch_size=args.global_batch_size,
        lr=args.lr, warmup_steps=args.warmup_steps, weight_decay=args.weight_decay, grad_clip=args.grad_clip,
        precision=args.precision, checkpointing=args.checkpointing, budget=args.budget, host_budget=args.host_budget,
        fsdp=args.fsdp, offload_optimizer=args.offload_optimizer, offload_activations=args.offload_activations,
        chunked_loss=args.chunked_loss, state_precision=args.optimizer_state,
        step_in_backward=args.step_in_backward, offload_fraction=args.offload_optimizer_fraction,
        merge_lora=args.merge_lora, compile=args.compile, seed=args.seed, eval_every=args.eval_every,
        save_every=args.save_every, out_dir=out, overwrite=args.overwrite, resume=args.resume,
        progress=not args.no_progress,
    )
    config.validate()
    RunFolder(out, overwrite=args.overwrite, resume=args.resume).check()
    import torch

    with _distributed_group() as (rank, world, device):
        from memtrain.accumulation import accumulation_steps

        if args.micro_batch_size is not None:  # else the plan picks one that divides the global batch
            accumulation_steps(args.micro_batch_size, args.global_batch_size or args.micro_batch_size * world, world)
        torch.manual_seed(args.seed)
        if args.hf_model:
            seq_len = _hf_seq_len(_hf_folder_config(args.hf_model), args.seq_len, "--hf-model")
            # Tokenised (or read from the cache beside the data) before the model loads: a bad line fails fast.
            with _flags_of(_DATA):
                data = tokenized_rows(args.data, tokenizer, seq_len)
        model, seq_len = _build_language_model(args)
        model.to(device)
        if args.hf_model:
            source = f"{args.data} (tokenised with {args.hf_model}'s tokenizer, packed)"
        elif args.data:
            data = split_windows(text_file_tokens(args.data), seq_len)
            source = args.data
        else:
            data = builtin_corpus(seq_len)
            source = "the Python standard library's source (built-in corpus)"
        n_params = sum(p.numel() for p in model.parameters())
        trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
        global_batch = args.global_batch_size or (args.micro_batch_size or 16) * world
        if rank == 0:
            for note in notes:
                _print(f"  {note}", file=sys.stderr)
            lora = f", LoRA rank {args.lora}: {trainable / 1e6:.2f}M trainable" if args.lora else ""
            _log(args, f"memtrain train: {name} ({n_params / 1e6:.2f}M parameters{lora}) on {device}, {seq_len} "
                       f"tokens x {global_batch} per step, {args.max_steps} steps on {source} ({len(data[0])} "
                       "training rows)")
        result = train(model, data, config, command=_command_record(args, parser), tokenizer=tokenizer)
        if rank != 0:
            return EXIT_OK
        if result.stopped_by:
            _log(args, f"stopped by {result.stopped_by} after step {result.steps}; checkpoint in {result.out_dir}; "
                       f"continue with: memtrain train --out {result.out_dir} --resume")
        else:
            eval_text = f" (eval {result.eval_loss:.3f})" if result.eval_loss is not None else ""
            peak = f", peak {format_bytes(result.peak_bytes)}" if result.peak_bytes is not None else ""
            # The first figure is the progress bar's: tokens over the time inside training steps.
            speed = (f"{result.tokens / result.step_seconds:.0f} tokens/s in training steps "
                     f"({result.tokens / result.seconds:.0f} tokens/s wall-clock, with evaluation and checkpoints)"
                     if result.step_seconds else "no step run")
            _log(args, f"done: loss {result.final_loss:.3f}{eval_text}, {speed}, saved activations "
                       f"{format_bytes(result.activation_bytes)} per micro-batch, model state "
                       f"{format_bytes(result.model_state_bytes)}{peak}; run folder {result.out_dir}")
        if args.json:
            _print(json.dumps(asdict(result)))
        return EXIT_OK


def _nproc_problems(nproc: int) -> list[str]:
    """memtrain train --nproc N is a check: torchrun, not memtrain, starts the processes."""
    world, _ = _launch_environment()
    if nproc == world:
        return []
    if "WORLD_SIZE" not in os.environ:
        return [f"--nproc {nproc}: this is one process, not started by torchrun (memtrain train starts no "
                "processes itself). To resolve this error, launch torchrun --nproc_per_node "
                f"{nproc} -m memtrain train ..., or drop --nproc."]
    return [f"--nproc {nproc}, but torchrun started WORLD_SIZE={world} processes. To resolve this error, pass "
            f"--nproc {world} (or drop it), or launch torchrun --nproc_per_node {nproc}."]


def _meta_target(args: argparse.Namespace, *, default_seq_len: int = 2048) -> tuple[Any, int, str]:
    """(the model on the meta device, tokens per example, its name) for estimate and plan: nothing allocated."""
    import torch

    from memtrain.estimate import _meta_model, hf_config_from_file

    if args.hf_config or args.hf_model:
        config = hf_config_from_file(args.hf_config) if args.hf_config else _hf_folder_config(args.hf_model)
        flag = "--hf-config" if args.hf_config else "--hf-model"
        seq_len = _hf_seq_len(config, args.seq_len, flag, default=default_seq_len)
        name = Path(args.hf_config).name if args.hf_config else Path(args.hf_model).name
        return _meta_model(config), seq_len, name
    with torch.device("meta"):
        model = _build_gpt(args)
    return model, model.config.seq_len, args.model


def _chunkable(model: Any) -> bool:
    from memtrain.loss import supports_chunked_loss

    return supports_chunked_loss(model)


def cmd_estimate(args: argparse.Namespace) -> int:
    from memtrain.checkpointing import Checkpointing
    from memtrain.estimate import estimate

    if args.checkpointing == "auto":
        raise ConfigError("--checkpointing auto asks the planner to choose, and memtrain estimate predicts one given "
                          "set-up. To resolve this error, run memtrain plan --budget SIZE (it estimates its choice), "
                          "or pass a policy such as all, every:2 or none.")
    target, seq_len, name = _meta_target(args)
    policy = Checkpointing.parse(args.checkpointing)
    chunked = args.chunked_loss
    if chunked is None:  # as memtrain train did by hand: with checkpointing, the loss chunked where the model allows
        chunked = policy.mode != "none" and _chunkable(target)
    elif chunked and not _chunkable(target):
        raise ConfigError(f"--chunked-loss, but memtrain cannot chunk the loss of {name} (see memtrain.loss). To "
                          "resolve this error, drop --chunked-loss.")
    report = estimate(target, (args.micro_batch_size, seq_len), device=args.device, precision=args.precision,
                      checkpointing=policy, optimizer="adamw-offload" if args.offload_optimizer else "adamw",
                      offload_activations=bool(args.offload_activations), chunked_loss=chunked,
                      state_precision=args.optimizer_state or "fp32",
                      offload_fraction=args.offload_optimizer_fraction or 0.0,
                      step_in_backward=bool(args.step_in_backward))
    if args.json:
        _print(json.dumps(report.to_dict()))
    else:
        optimizer = ("offloaded" if args.offload_optimizer else
                     f"{100 * args.offload_optimizer_fraction:.0f}% offloaded" if args.offload_optimizer_fraction
                     else "on the device") + f", {args.optimizer_state or 'fp32'} moments" + (
                         ", step in backward" if args.step_in_backward else "")
        _print(f"{name}: batch {args.micro_batch_size} x {seq_len} tokens, {args.precision}, checkpointing "
               f"{policy}{' with a chunked loss' if chunked else ''}, AdamW {optimizer}, on {args.device}")
        _print(report.summary())
    return EXIT_OK


def _fixed_choices(args: argparse.Namespace, n_blocks: int) -> tuple[Any, list[str]]:
    """The planner's ``Fixed`` choices and allowed ``techniques`` for the technique flags given (unset: planned).

    --checkpointing fixes the layout of blocks (+offload: the recomputed blocks' inputs offloaded);
    --offload-activations with a fixed layout offloads what the layout keeps and the recomputed blocks' inputs,
    with auto it fixes how recomputed blocks recompute (inputs offloaded); --no-...: the plan never offloads them.
    """
    from memtrain.checkpointing import Checkpointing, SelectivePolicy
    from memtrain.planner import TECHNIQUES, Fixed

    techniques = list(TECHNIQUES)
    blocks, flavor = None, None
    if args.checkpointing != "auto":
        policy = Checkpointing.parse(args.checkpointing)
        blocks = policy.block_policies(n_blocks)
        if policy.mode == "selective":
            if policy.selective != SelectivePolicy():
                raise ConfigError(f"--checkpointing {policy}: the planner's selective recompute keeps the outputs of "
                                  f"{', '.join(SelectivePolicy().keep)}. To resolve this error, pass --checkpointing "
                                  "selective, or estimate this policy with memtrain estimate.")
            if policy.offload_inputs:
                raise ConfigError(f"--checkpointing {policy}: the planner does not combine a selective recompute "
                                  "with offloaded inputs. To resolve this error, pass selective or all+offload.")
            flavor = "selective"
        else:
            flavor = "offload-inputs" if policy.offload_inputs else "full"
        if args.offload_activations:
            blocks = tuple("offload" if kind == "keep" else kind for kind in blocks)
            if flavor == "full":
                flavor = "offload-inputs"
    elif args.offload_activations:
        flavor = "offload-inputs"
    if args.offload_activations is False:
        techniques.remove("offload-activations")
    optimizer = {True: "offload", False: "device", None: None}[args.offload_optimizer]
    if args.offload_optimizer is False:
        techniques = [t for t in techniques if t not in ("offload-optimizer", "bf16-weights")]
    fraction = args.offload_optimizer_fraction
    if fraction is not None:
        optimizer = "device"  # a partial offload is the device optimizer with a share of its state on the host
    if args.offload_optimizer is False and fraction is None:
        fraction = 0.0
    fixed = Fixed(blocks=blocks, flavor=flavor, chunked_loss=args.chunked_loss, optimizer=optimizer,
                  state_precision=args.optimizer_state, step_in_backward=args.step_in_backward,
                  offload_fraction=fraction)
    return fixed, techniques


def cmd_plan(args: argparse.Namespace) -> int:
    from memtrain.checkpointing import find_blocks
    from memtrain.planner import calibrate, known_gpu, plan

    ConfigError.raise_if(_technique_problems(args))
    target, seq_len, name = _meta_target(args)
    fixed, techniques = _fixed_choices(args, len(find_blocks(target)))
    # On the CPU the planner always probes; --calibrate probes a GPU now instead of the table of known ones.
    if args.gpu and (args.calibrate or args.device != "cuda"):
        other = "--calibrate" if args.calibrate else "--device cpu"
        why = " (which measures this machine's GPU instead)" if args.calibrate else ""
        raise ConfigError(f"--gpu {args.gpu!r} names the GPU to plan for from the table, which contradicts "
                          f"{other}{why}. To resolve this error, drop --gpu or {other}.")
    profile = calibrate(args.device, refresh=True) if args.calibrate else known_gpu(args.gpu) if args.gpu else None
    p = plan(target, budget=None if args.budget == UNLIMITED else args.budget, seq_len=seq_len,
             global_batch_size=args.global_batch_size or 16 * args.nproc, device=args.device,
             precision=args.precision, world_size=args.nproc, fsdp=args.fsdp if args.nproc > 1 else False,
             host_budget=None if args.host_budget == UNLIMITED else args.host_budget, compile=args.compile,
             micro_batch_size=args.micro_batch_size, techniques=techniques, device_profile=profile, fixed=fixed)
    if args.json:
        _print(json.dumps(p.to_dict()))
    else:
        _print(f"{name}: {p.summary()}")
        _print(f"  planned in {p.plan_seconds:.1f} s")
    return EXIT_OK


def cmd_bench(args: argparse.Namespace) -> int:
    root = Path(__file__).resolve().parent.parent / "benchmarks"
    # bench_<name>.py run anywhere; gpu_<name>.py are the GPU workloads (each has a --small CPU mode).
    script = next((root / f"{kind}_{args.name}.py" for kind in ("bench", "gpu")
                   if (root / f"{kind}_{args.name}.py").is_file()), root / f"bench_{args.name}.py")
    if not script.is_file():
        available = sorted({p.stem.split("_", 1)[1] for p in [*root.glob("bench_*.py"), *root.glob("gpu_*.py")]}
                           ) if root.is_dir() else []
        raise ConfigError(f"no benchmark named {args.name!r}" + (f"; available: {', '.join(available)}" if available
                          else " (benchmarks ship with the source checkout)") + ". To resolve this error, pass one "
                          "of those names.")
    if "--out" in args.bench_args[:-1]:  # the benchmark writes its results at the end: check before it runs
        _check_writable_file(args.bench_args[args.bench_args.index("--out") + 1], "bench --out")
    argv = [str(script), *args.bench_args] + (["--json"] if args.json else [])
    saved_argv, sys.argv = sys.argv, argv
    sys.path.insert(0, str(root))
    try:
        runpy.run_path(str(script), run_name="__main__")
    finally:
        sys.argv = saved_argv
        sys.path.remove(str(root))
    return EXIT_OK


def _join_sizes(argv: list[str]) -> list[str]:
    """``--budget -1GiB`` as ``--budget=-1GiB``: argparse reads a value starting with "-" as a flag."""
    out = []
    for i, token in enumerate(argv):
        if i and argv[i - 1] in _SIZE_FLAGS and re.match(r"-[\d.]", token) and "--" not in argv[:i]:
            out[-1] = f"{out[-1]}={token}"
        else:
            out.append(token)
    return out


def main(argv: list[str] | None = None) -> int:
    global _STDOUT_CLOSED
    argv = _join_sizes(list(sys.argv[1:] if argv is None else argv))
    _STDOUT_CLOSED = False
    parser = build_parser()
    try:
        from_file = _apply_config_file(parser, argv)
    except ConfigError as e:
        print(f"memtrain: error: {in_flag_terms(str(e))}", file=sys.stderr)
        return EXIT_BAD_INPUT
    args = parser.parse_args(argv)
    try:
        if args.command == "train":
            code = cmd_train(args, parser, _explicit_dests(parser, argv, "train") | from_file)
        else:
            code = {"estimate": cmd_estimate, "plan": cmd_plan, "bench": cmd_bench}[args.command](args)
    except BrokenPipeError:  # a benchmark printing to a closed stdout
        _drop_stdout()
        _STDOUT_CLOSED = True
        code = EXIT_OK
    except ConfigError as e:
        print(f"memtrain {args.command}: error: {in_flag_terms(str(e), args.command)}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except MemtrainError as e:
        from memtrain.runstate import RunWriteError

        print(f"memtrain {args.command}: error: {in_flag_terms(str(e), args.command)}", file=sys.stderr)
        return EXIT_ENVIRONMENT if isinstance(e, RunWriteError) else EXIT_BAD_INPUT
    except KeyboardInterrupt:
        print("memtrain: interrupted", file=sys.stderr)
        return 130
    except SystemExit:
        raise
    except Exception as e:
        if isinstance(e, OSError) and e.filename is not None:
            # The machine refused a file (full disk, read-only, permissions): one line, not a trace.
            print(f"memtrain {args.command}: error: {e.filename}: {e.strerror}. To resolve this error, free space "
                  "on that disk or make the path writable, then run the command again.", file=sys.stderr)
            return EXIT_ENVIRONMENT
        import traceback

        traceback.print_exc()
        print(f"memtrain {args.command}: internal error (a bug in memtrain: please report it with the trace above)",
              file=sys.stderr)
        return EXIT_INTERNAL
    if _STDOUT_CLOSED:
        print(f"memtrain {args.command}: stdout was closed before all the output was written (e.g. by `| head`); "
              "the rest was dropped", file=sys.stderr)
        return EXIT_ENVIRONMENT
    return code


if __name__ == "__main__":
    sys.exit(main())
