"""The command line: the parser of the four commands, the flags' types and checks, the ``--config FILE.toml``
file, and which options the command line gave itself (a resume keeps the others)."""

from __future__ import annotations

import argparse
import ast
import difflib
import re
import sys
import tomllib
from typing import Any

from memtrain import __version__
from memtrain.checkpointing import Checkpointing
from memtrain.choices import Choices, OptimizerChoice
from memtrain.cli.console import EXIT_BAD_INPUT, EXIT_CODES_HELP
from memtrain.cli.terms import in_flag_terms
from memtrain.cli.workloads import HF_SEQ_LEN
from memtrain.config import LR_SCHEDULES
from memtrain.errors import ConfigError
from memtrain.report import parse_bytes
from memtrain.run.tensorboard import LOGGERS
from memtrain.setting import flags_of


class _HelpFormatter(argparse.HelpFormatter):
    def _format_action_invocation(self, action: argparse.Action) -> str:
        if isinstance(action, _SwitchWords):  # the word after --offload-optimizer only: --no-offload-optimizer takes none
            on, *off = action.option_strings
            return ", ".join([f"{on} [{action.metavar}]", *off])
        return super()._format_action_invocation(action)


class _Parser(argparse.ArgumentParser):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", _HelpFormatter)
        super().__init__(*args, **kwargs)

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


def _dropout(text: str) -> float:
    value = _non_negative_float(text)
    if value >= 1:
        raise argparse.ArgumentTypeError(f"{value} must be < 1 (a probability of dropping an input)")
    return value


def _betas(text: str) -> tuple[float, float]:
    """``B1,B2``: AdamW's two decays, each in [0, 1)."""
    parts = text.split(",")
    try:
        betas = tuple(float(part) for part in parts)
    except ValueError:
        betas = ()
    if len(betas) != 2 or not all(0 <= b < 1 for b in betas):
        raise argparse.ArgumentTypeError(f"{text!r} is not two numbers in [0, 1) separated by a comma, e.g. 0.9,0.999")
    return betas  # type: ignore[return-value]


def _names(text: str) -> tuple[str, ...]:
    """Comma-separated names, none empty."""
    names = tuple(part.strip() for part in text.split(","))
    if not all(names):
        raise argparse.ArgumentTypeError(f"{text!r} has an empty name; pass names separated by commas, e.g. "
                                         "q_proj,v_proj")
    return names


def _checkpointing(text: str) -> str:
    """auto, or a spelling ``Checkpointing.parse`` reads, written back as ``str(Checkpointing)`` (one spelling
    per policy in the run's config.json)."""
    if text.strip().lower() == "auto":
        return "auto"
    try:
        return str(Checkpointing.parse(text))
    except ConfigError as e:
        spellings = ("auto (the planner chooses), none, all, every:K (K >= 1), selective, selective(matmul,attention), "
                     "blocks(RKO...) (one letter per block: recompute, keep, offload; +selective after it recomputes "
                     "the R blocks selectively), each with an optional +offload")
        why = in_flag_terms(e.message)
        # Checkpointing.parse's catch-all says what this one does and lists the spellings: said once, not twice
        why = "" if why.startswith(f"--checkpointing {text!r} is not a checkpointing policy.") else f" ({why})"
        raise argparse.ArgumentTypeError(f"{text!r} is not a checkpointing policy{why}; the spellings are "
                                         f"{spellings}") from None


def _optimizer_arg(text: str) -> tuple[str, Any]:
    """``KEY=VALUE``: one keyword argument of the --optimizer class, the value a Python literal (else a string)."""
    key, sep, value = text.partition("=")
    if not sep or not key.strip().isidentifier():
        raise argparse.ArgumentTypeError(f"{text!r} is not KEY=VALUE, e.g. beta2_decay=-0.8")
    try:
        parsed = ast.literal_eval(value.strip())
    except (ValueError, SyntaxError):
        parsed = value.strip()
    return key.strip(), parsed


class _Pairs(argparse.Action):
    """A repeatable KEY=VALUE flag, gathered into a tuple of pairs (a fresh one: never the default's)."""

    def __call__(self, parser: Any, namespace: Any, values: Any, option_string: str | None = None) -> None:
        current = getattr(namespace, self.dest, None)
        setattr(namespace, self.dest, (*(current if isinstance(current, tuple) else ()), values))


class _SwitchWords(argparse.BooleanOptionalAction):
    """A switch that also takes a word for each of its field's further values (``Flag.more``): ``--offload-optimizer``,
    ``--offload-optimizer bf16-weights``, ``--no-offload-optimizer`` (which takes none)."""

    def __init__(self, option_strings: list[str], dest: str, words: tuple[str, ...] = (), **kwargs: Any) -> None:
        super().__init__(option_strings, dest, **kwargs)
        self.nargs, self.words = "?", words
        self.metavar = "|".join(words)

    def __call__(self, parser: Any, namespace: Any, values: Any, option_string: str | None = None) -> None:
        if option_string is not None and option_string.startswith("--no-"):
            if values is not None:
                parser.error(f"argument {option_string}: takes no value (got {values!r})")
            setattr(namespace, self.dest, False)
        elif values is None or values in self.words:
            setattr(namespace, self.dest, values or True)
        else:
            parser.error(f"argument {option_string}: invalid choice: {values!r} (choose from "
                         f"{', '.join(map(repr, self.words))}, or give the flag alone)")


def _config_pairs(value: Any) -> tuple[tuple[str, Any], ...]:
    """A config file's --optimizer-arg: a table (beta2_decay = -0.8, ...), a "KEY=VALUE" string, or a list of them."""
    if isinstance(value, dict):
        return tuple(value.items())
    return tuple(_optimizer_arg(str(v)) for v in (value if isinstance(value, list) else [value]))


def _kept_share(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"{value} must be a fraction in (0, 1]: the share of label positions the "
                                         "loss counts, e.g. 0.5 where half of each row is a prompt")
    return value


def _fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not 0 <= value <= 1:
        raise argparse.ArgumentTypeError(f"{value} must be a fraction in [0, 1] (the share of the optimizer state "
                                         "kept in host RAM)")
    return value


def _loggers(text: str) -> tuple[str, ...]:
    """``tensorboard``, a comma-separated list of loggers, or ``none`` (metrics.jsonl only)."""
    if text.strip().lower() == "none":
        return ()
    names = tuple(dict.fromkeys(name.strip().lower() for name in text.split(",") if name.strip()))
    unknown = [name for name in names if name not in LOGGERS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"{text!r}: {', '.join(map(repr, unknown)) or 'no logger'} is not a logger "
                                         f"memtrain has; the loggers are {', '.join(LOGGERS)} (or none)")
    return names


UNLIMITED = "unlimited"
PLAN_PRECISION = "bf16-mixed"  # memtrain plan's precision without --precision (a plan is mostly for a GPU)


def _size(text: str) -> int | str:
    """A byte size with its unit (``24GiB``, ``8000MB``, ``4096B``) as an int, or ``unlimited``; a bare number is
    refused (``--budget 24`` meant 24GiB, not 24 bytes)."""
    if text.strip().lower() in ("unlimited", "none", "inf"):
        return UNLIMITED
    fix = "To resolve this error, pass a positive size such as 24GiB or 8000MB (GiB = 2**30, GB = 10**9), or unlimited"
    if text.strip().startswith("-"):
        raise argparse.ArgumentTypeError(f"{text!r} is negative. {fix}")
    if re.fullmatch(r"\s*[0-9]*\.?[0-9]+\s*", text) and float(text) > 0:  # 24 as 24 bytes: never what was meant
        raise argparse.ArgumentTypeError(f"{text!r} has no unit, so it would be {text.strip()} bytes. To resolve this "
                                         f"error, pass {text.strip()}GiB (GiB = 2**30) or {text.strip()}GB (10**9), "
                                         f"or {text.strip()}B if bytes are meant")
    try:
        return parse_bytes(text)
    except ConfigError:
        what = "zero" if re.fullmatch(r"\s*0*\.?0*\s*[a-zA-Z]*\s*", text) and re.search(r"\d", text) else "not a size"
        raise argparse.ArgumentTypeError(f"{text!r} is {what}. {fix}") from None


# Flags whose value may start with "-" (a negative size): argparse would take it for a flag and say only
# "expected one argument"; main() joins them as --budget=-1GiB so the size's own check explains.
_SIZE_FLAGS = ("--budget", "--host-budget")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="memtrain", description="Make a PyTorch model fit a memory budget at the least slowdown.",
                     epilog=EXIT_CODES_HELP)
    parser.add_argument("--version", action="version", version=f"memtrain {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    _add_train_parser(sub)
    _add_estimate_parser(sub)
    _add_plan_parser(sub)
    _add_bench_parser(sub)
    _add_export_parser(sub)
    return parser


# train --help's sections, by purpose (argparse argument groups): a flag is found by what it is for.
TRAIN_GROUPS = {
    "model": "model (default: the built-in GPT, gpt-mini)",
    "data": "data (default: the Python standard library's source, as bytes)",
    "batch": "batch and sequence",
    "techniques": "memory techniques (unset: the plan decides)",
    "optimizer": "optimizer and learning-rate schedule",
    "precision": "precision",
    "budget": "budget and plan",
    "run": "run length, run folder and resume",
    "logging": "logging and output",
    "distributed": "distributed (under torchrun)",
}
# memtrain plan's and estimate's sections: the same names for the flags they share with train.
PLAN_GROUPS = {key: TRAIN_GROUPS[key] for key in ("model", "batch", "techniques", "precision", "budget")}


def _groups(parser: argparse.ArgumentParser, titles: dict[str, str]) -> dict[str, Any]:
    return {key: parser.add_argument_group(title) for key, title in titles.items()}


def _add_train_parser(sub: Any) -> None:
    t = sub.add_parser("train", help="train the built-in GPT on the built-in corpus (or your model and data)",
                       epilog=EXIT_CODES_HELP)
    t.add_argument("--config", metavar="FILE.toml", help="read flags from a TOML file (keys as the flags, e.g. "
                   "micro-batch-size = 4 or micro_batch_size = 4); flags given on the command line win")
    g = _groups(t, TRAIN_GROUPS)
    _add_model_flags(g, pretrained_weights=True)
    g["data"].add_argument("--data", metavar="PATH", help="the text to train on: with --hf-model a .txt (documents "
                           "split on blank lines) or .jsonl (a \"text\" field, or \"prompt\"/\"completion\": the "
                           "loss on the completion) tokenised with the folder's tokenizer; for the built-in GPT a text "
                           "file read as bytes (default: the Python standard library)")
    g["data"].add_argument("--eval-data", metavar="PATH", help="held-out text to evaluate on every --eval-every "
                           "steps, in the formats of --data (tokenised and packed the same way); default: the last "
                           "5%% of --data's documents, or for the built-in corpus every 20th block of 64 KiB")
    _add_lora_flags(g["model"], adapters="; hf/ then holds the adapters")
    g["model"].add_argument("--merge-lora", action="store_true", help="with --lora: hf/ holds the weights with the "
                            "adapters merged in (a plain from_pretrained folder)")
    g["batch"].add_argument("--global-batch-size", type=_positive_int,
                            help="examples per optimizer step over all ranks (default: 16 x world size, or micro-batch "
                            "x world size when --micro-batch-size is given); the accumulation steps follow")
    g["precision"].add_argument("--precision", choices=["auto", "fp32", "bf16-mixed", "fp16-mixed"], default="auto",
                                help="auto picks bf16-mixed where the GPU supports it, fp32 on a CPU (default auto)")
    _add_budget_flags(g["budget"], default_text="the device's free memory (CUDA) or the free RAM (CPU)")
    g["distributed"].add_argument("--nproc", type=_positive_int, metavar="N", help="check that torchrun started N "
                                  "processes (memtrain train starts none itself: launch torchrun --nproc_per_node N "
                                  "-m memtrain -- train --nproc N; the -- keeps torchrun from reading --nproc as "
                                  "its own)")
    length = g["run"].add_mutually_exclusive_group()
    length.add_argument("--max-steps", type=_positive_int, default=500, help="optimizer steps (default 500)")
    length.add_argument("--epochs", type=_positive_int, metavar="N", help="instead of --max-steps: N passes over the "
                        "training data, ceil(N x examples / global batch) optimizer steps (said at the start)")
    _add_optimizer_flags(g["optimizer"])
    g["run"].add_argument("--seed", type=_non_negative_int, default=0, help="seed of the weights, the data order and "
                          "dropout (0 <= seed < 2**63; default 0)")
    g["run"].add_argument("--out", metavar="DIR", help="run folder (default runs/<model>-<time>)")
    g["run"].add_argument("--save-every", type=_positive_int, default=100, help="optimizer steps between resumable "
                          "checkpoints, also written at the end and on SIGTERM/SIGINT (default 100)")
    g["data"].add_argument("--eval-every", type=_positive_int, default=100, help="optimizer steps between "
                           "evaluations on the held-out windows (default 100; also at the end)")
    g["run"].add_argument("--resume", action="store_true", help="continue the run in --out from its newest intact "
                          "checkpoint, with the flags it started with (flags given now are checked against them)")
    g["run"].add_argument("--overwrite", action="store_true", help="replace another run's results in --out "
                          "(memtrain's files only: it never deletes what it did not write)")
    g["distributed"].add_argument("--fsdp", action=argparse.BooleanOptionalAction, default=False,
                                  help="shard with FSDP2 instead of DDP (--no-fsdp: DDP or one process, e.g. to "
                                  "resume an FSDP2 run on other ranks: its checkpoint reshards)")
    g["techniques"].add_argument("--compile", action="store_true", help="torch.compile the training step (after "
                                 "checkpointing and the DDP/FSDP2 wrapper)")
    _add_logging_flags(g["logging"])


def _add_optimizer_flags(group: Any) -> None:
    """train's optimizer and learning-rate flags (the optimizer's memory, --optimizer-state, is a technique)."""
    group.add_argument("--lr", type=_positive_float, default=None, help="peak learning rate (default: 2e-5 "
                       "fine-tuning --hf-model, 2e-4 with --lora, 3e-3 training from random weights; the reason is "
                       "logged)")
    group.add_argument("--warmup-steps", type=_non_negative_int, default=None,
                       help="linear warm-up steps to --lr (default: 3%% of the steps (at least 1) fine-tuning "
                       "--hf-model, else min(50, max-steps // 10): a 10-step run warms up in 1)")
    group.add_argument("--lr-schedule", choices=LR_SCHEDULES, default="cosine",
                       help="after the warm-up: cosine or linear decay to a tenth of --lr at the last step, or "
                       "constant at --lr (default cosine)")
    group.add_argument("--adam-betas", type=_betas, metavar="B1,B2", default=(0.9, 0.95),
                       help="AdamW's moment decays, each in [0, 1) (default 0.9,0.95; an --optimizer class that "
                       "takes two betas gets them too)")
    group.add_argument("--adam-eps", type=_positive_float, metavar="EPS", default=1e-8,
                       help="AdamW's epsilon (default 1e-8; an --optimizer class whose eps is one number gets it "
                       "too)")
    group.add_argument("--weight-decay", type=_non_negative_float, default=0.1,
                       help="weight decay (AdamW's, or the --optimizer class's; default 0.1)")
    group.add_argument("--grad-clip", type=_grad_clip, default=1.0,
                       help="clip the global gradient norm to this (default 1.0; 0 or none: no clipping)")


def _add_logging_flags(group: Any) -> None:
    group.add_argument("--no-progress", action="store_true", help="no progress bar (on a terminal) or progress lines "
                       "(in a log), transformers' and huggingface_hub's bars (\"Loading weights\") included")
    group.add_argument("--log", type=_loggers, default=(), metavar="LOGGER[,LOGGER]", help="where the run logs beside "
                       "metrics.jsonl: tensorboard (event files in <run>/tensorboard/: loss, eval loss, lr, tokens/s, "
                       "memory, the plan as text; pip install 'memtrain[tensorboard]'); none (default): metrics.jsonl "
                       "only")
    group.add_argument("--quiet", action="store_true", help="print the plan in one line at the start instead of each "
                       "automatic choice with its reason (report.json and --json keep the reasons)")
    group.add_argument("--json", action="store_true", help="print the result as JSON on stdout")


def _add_estimate_parser(sub: Any) -> None:
    e = sub.add_parser("estimate", help="predict the peak memory of a training step, without a GPU")
    g = _groups(e, {k: v for k, v in PLAN_GROUPS.items() if k != "budget"})
    g["techniques"].title = "memory techniques (unset: off)"
    _add_model_flags(g, micro_batch_default=16, checkpointing_default="all")
    _add_lora_flags(g["model"], adapters=": the frozen base weights take no gradients and no optimizer state")
    g["precision"].add_argument("--precision", choices=["fp32", "bf16-mixed", "fp16-mixed"], default="bf16-mixed",
                                help="the precision to predict for (default bf16-mixed)")
    g["precision"].add_argument("--device", choices=["cuda", "cpu"], default="cuda",
                                help="the device whose peak is predicted (default cuda)")
    e.add_argument("--json", action="store_true", help="print the report as JSON (peak_bytes: the predicted peak)")


def _add_plan_parser(sub: Any) -> None:
    p = sub.add_parser("plan", help="choose the fastest set-up that fits a memory budget, with its reasons")
    g = _groups(p, {**PLAN_GROUPS, "distributed": "distributed (ranks to plan for)"})
    _add_model_flags(g)
    _add_lora_flags(g["model"], adapters=": the frozen base weights take no gradients and no optimizer state")
    g["batch"].add_argument("--global-batch-size", type=_positive_int,
                            help="examples per optimizer step over all ranks (default, as memtrain train: 16 x "
                            "--nproc, or micro-batch x --nproc when --micro-batch-size is given)")
    g["batch"].add_argument("--kept-labels", type=_kept_share, default=1.0, metavar="SHARE",
                            help="the share of label positions the loss counts (not -100), e.g. 0.5 where half of "
                            "each row is a prompt: the chunked loss runs the head on those alone, so its time follows "
                            "(memtrain train reads it from the data; default 1)")
    g["precision"].add_argument("--precision", choices=["fp32", "bf16-mixed", "fp16-mixed"],
                                help=f"compute precision (default {PLAN_PRECISION}: a GPU's autocast)")
    g["budget"].add_argument("--device", choices=["cuda", "cpu"], default="cuda",
                             help="the device planned for (default cuda; a CPU plan is probed on this machine)")
    _add_budget_flags(g["budget"], default_text="unlimited")
    g["distributed"].add_argument("--nproc", type=_positive_int, default=1, metavar="N",
                                  help="ranks to plan for (the peak is per rank; default 1)")
    dist = g["distributed"].add_mutually_exclusive_group()
    dist.add_argument("--fsdp", action="store_const", const=True, dest="fsdp",
                      help="with --nproc > 1: plan FSDP2 only (default: DDP and FSDP2 compared)")
    dist.add_argument("--ddp", action="store_const", const=False, dest="fsdp",
                      help="with --nproc > 1: plan DDP only")
    g["techniques"].add_argument("--compile", action="store_true", help="also consider torch.compile'd set-ups")
    g["budget"].add_argument("--calibrate", action="store_true", help="measure this machine's device first (a few "
                             "seconds of matmuls, copies and a CPU AdamW step; cached) instead of the table of known "
                             "GPUs; a CPU plan always probes")
    g["budget"].add_argument("--gpu", metavar="NAME", help="plan for this GPU from the table of known ones (H200, "
                             "H100, A100, L4, 4090), e.g. for another machine (default: this machine's GPU, else an "
                             "H100)")
    p.add_argument("--no-progress", action="store_true", help="no progress lines on stderr (a line per slow stage "
                   "of the search: each traced step, each full estimate; --json prints none either)")
    p.add_argument("--json", action="store_true", help="print the plan as JSON: plan (the chosen settings), "
                   "peak_bytes, step_seconds, tokens_per_s, candidates")


def _add_bench_parser(sub: Any) -> None:
    b = sub.add_parser("bench", help="run the side-by-side benchmarks in benchmarks/")
    b.add_argument("name", nargs="?", default="checkpointing", help="benchmark to run (default: checkpointing)")
    b.add_argument("bench_args", nargs=argparse.REMAINDER, help="passed to the benchmark script")
    b.add_argument("--json", action="store_true", help="print the results as JSON on stdout")


def _add_export_parser(sub: Any) -> None:
    x = sub.add_parser("export", help="write a run's hf/ and sample.txt again from its weights (no training)",
                       epilog=EXIT_CODES_HELP)
    x.add_argument("run_dir", metavar="RUN_DIR", help="the run folder (memtrain train --out): its model.safetensors, "
                   "else its newest checkpoint, and the model flags in its config.json")
    x.add_argument("--export-dtype", choices=["auto", "fp32", "bf16", "fp16"], default="auto",
                   help="the weights' dtype in hf/ (default auto: the --hf-model checkpoint's own; LoRA adapters "
                   "stay as trained)")
    x.add_argument("--json", action="store_true", help="print what was written as JSON on stdout")


def _add_lora_flags(parser: Any, *, adapters: str) -> None:
    """--lora R and its options, one definition for train, estimate and plan (``adapters`` ends --lora's help)."""
    parser.add_argument("--lora", type=_positive_int, metavar="R", help="train LoRA adapters of rank R on the frozen "
                        f"model (every linear layer but the output head, or --lora-targets){adapters}")
    parser.add_argument("--lora-alpha", type=_positive_float, metavar="A", help="with --lora: the adapters' update "
                        "is scaled by A / R (default: PEFT's LoraConfig default, 8)")
    parser.add_argument("--lora-dropout", type=_dropout, metavar="P", help="with --lora: dropout on the adapters' "
                        "input, 0 <= P < 1 (default 0)")
    parser.add_argument("--lora-targets", type=_names, metavar="NAMES", help="with --lora: the comma-separated "
                        "module names to adapt, as PEFT's target_modules matches them (a name or the end of a dotted "
                        "path, e.g. q_proj,v_proj); a name the model lacks is an error listing those it has (default: "
                        "every linear layer but the output head)")
    parser.add_argument("--quantize-base", choices=["nf4"], help="with --lora (QLoRA): store the frozen linear "
                        "weights (all but the output head) in 4-bit NF4 through bitsandbytes, about 0.56 bytes a "
                        "weight (blocks of 64 with an fp32 scale each), dequantised to the compute dtype for each "
                        "matmul; Hugging Face models only; needs pip install 'memtrain[qlora]'")


def _add_model_flags(groups: dict[str, Any], *, micro_batch_default: int | None = None,
                     checkpointing_default: str = "auto", pretrained_weights: bool = False) -> None:
    """The model / batch / technique flags shared by train, estimate and plan, each in its group of ``groups``."""
    models = groups["model"].add_mutually_exclusive_group()
    models.add_argument("--model", default="gpt-mini", help="GPT preset: gpt-tiny, gpt-mini (default), gpt-small")
    models.add_argument("--hf-config", metavar="PATH",
                        help="a Hugging Face config.json: that model, randomly initialised")
    models.add_argument("--hf-model", metavar="DIR", help=(
        "a local pretrained Hugging Face folder: config.json, *.safetensors weights (loaded in fp32: master "
        "weights for mixed precision) and a tokenizer, never the network" if pretrained_weights else
        "a local Hugging Face model folder: only its config.json is read (nothing is loaded)"))
    batch = groups["batch"]
    # One default for train, plan and estimate: a plan predicts the run that memtrain train would start.
    batch.add_argument("--seq-len", type=_positive_int, help=f"tokens per example (default: the preset's; "
                       f"{HF_SEQ_LEN} for Hugging Face models, at most their positions; the same in train, plan and "
                       "estimate)")
    batch.add_argument("--micro-batch-size", type=_positive_int, default=micro_batch_default, help=(
        f"examples per forward (default {micro_batch_default})" if micro_batch_default else
        "examples per forward (default: the plan picks it; given, it is fixed)"))
    groups["techniques"].add_argument("--checkpointing", type=_checkpointing, default=checkpointing_default, help=(
        "none | all | every:K | selective | blocks(RKO..) (per block: recompute, keep, offload; "
        "blocks(RKO..)+selective recomputes the R blocks selectively), each with an optional +offload (the recomputed blocks' inputs in host "
        "memory)"
        + (" | auto: the planner chooses (default)" if checkpointing_default == "auto"
           else f" (default {checkpointing_default})")))
    _add_technique_flags(groups["techniques"], planned=checkpointing_default == "auto")


def _add_technique_flags(parser: Any, *, planned: bool) -> None:
    """The memory techniques a user may fix; unset, the planner decides (train, plan) or they are off (estimate):
    the flags the setting types declare on their fields (``Choices``, ``OptimizerChoice``)."""
    _add_setting_flags(parser, Choices, planned=planned)
    _add_setting_flags(parser, OptimizerChoice, planned=planned)


# The command line's parsers of a setting's values, by the name its Flag gives (memtrain.setting).
_PARSERS: dict[str, Any] = {"fraction": _fraction}


def _add_setting_flags(parser: Any, setting: type, *, planned: bool) -> None:
    """The flags a setting type declares on its fields (``memtrain.setting.Flag``), with their help."""
    for _, f in flags_of(setting):
        options: dict[str, Any] = {"default": None, "help": f.help_text(planned=planned)}
        if f.kind == "switch" and f.more:
            options.update(action=_SwitchWords, words=tuple(word for _, word in f.more))
        elif f.kind == "switch":
            options["action"] = argparse.BooleanOptionalAction
        elif f.kind == "on":
            options.update(action="store_true", default=False)
        elif f.kind == "pairs":
            options.update(type=_optimizer_arg, action=_Pairs, metavar=f.metavar)
        else:
            options.update(type=_PARSERS.get(f.parse or ""), choices=f.choices, metavar=f.metavar)
        parser.add_argument(f.name, **{k: v for k, v in options.items() if v is not None or k == "default"})


def _add_budget_flags(parser: Any, *, default_text: str) -> None:
    parser.add_argument("--budget", type=_size, metavar="SIZE", help="device bytes per rank the run may use, e.g. "
                        f"24GiB or 8000MB (GiB = 2**30, GB = 10**9; default {default_text})")
    parser.add_argument("--host-budget", type=_size, metavar="SIZE", help="host RAM the run may use (offloaded "
                        "state, pinned buffers; default: the RAM available now)")


def subparser(parser: argparse.ArgumentParser, command: str) -> argparse.ArgumentParser:
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))  # noqa: SLF001
    return sub.choices[command]


def explicit_dests(parser: argparse.ArgumentParser, argv: list[str], command: str) -> set[str]:
    """The options the command line gives itself (argparse fills the others in with their defaults)."""
    sub = subparser(parser, command)
    unset = object()
    # argparse sets a default only where the namespace has no value yet: a marker shows which were never given.
    namespace = argparse.Namespace(**{a.dest: unset for a in sub._actions if a.dest != "help"})  # noqa: SLF001
    sub.parse_known_args(argv[argv.index(command) + 1:], namespace=namespace)
    return {dest for dest, value in vars(namespace).items() if value is not unset}


def apply_config_file(parser: argparse.ArgumentParser, argv: list[str]) -> set[str]:
    """Makes the keys of ``--config FILE.toml`` the sub-parser's defaults; checks every key and value at once.
    Returns the options the file set."""
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
        name = key.replace("_", "-")  # max_steps = 3, as TOML files often spell keys, is max-steps = 3
        action = actions.get(name) or negated.get(name)
        if action is None:
            close = difflib.get_close_matches(name, [*actions, *negated], n=1)
            hint = f" Did you mean {close[0]!r}?" if close else ""
            problems.append(f"--config: unknown key {key!r}.{hint} To resolve this error, write the keys as the flags "
                            f"of memtrain {argv[0]} without the dashes, e.g. micro-batch-size = 4 (or "
                            "micro_batch_size = 4).")
            continue
        key = name
        if isinstance(action, _SwitchWords) and key not in negated and value in action.words:
            defaults[action.dest] = value  # offload-optimizer = "bf16-weights"
            continue
        if isinstance(action, (argparse._StoreTrueAction, argparse.BooleanOptionalAction)):  # noqa: SLF001
            if not isinstance(value, bool):
                words = getattr(action, "words", ())
                if key in negated:  # no-offload-optimizer = "bf16-weights": the word is the positive key's
                    whose = action.option_strings[0][2:]
                    hint = f". To resolve this error, write {whose} = {value!r}" if value in words else ""
                    problems.append(f"--config: {key} = {value!r} must be true or false{hint}.")
                    continue
                words = "".join(f" or {word!r}" for word in words)
                problems.append(f"--config: {key} = {value!r} must be true or false{words}.")
                continue
            defaults[action.dest] = value if key not in negated else not value
            continue
        if isinstance(action, _Pairs):  # a table of the class's arguments
            try:
                defaults[action.dest] = _config_pairs(value)
            except argparse.ArgumentTypeError as e:
                problems.append(f"--config: {key} = {value!r}: {e}.")
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


def join_sizes(argv: list[str]) -> list[str]:
    """``--budget -1GiB`` as ``--budget=-1GiB``: argparse reads a value starting with "-" as a flag."""
    out = []
    for i, token in enumerate(argv):
        if i and argv[i - 1] in _SIZE_FLAGS and re.match(r"-[\d.]", token) and "--" not in argv[:i]:
            out[-1] = f"{out[-1]}={token}"
        else:
            out.append(token)
    return out


