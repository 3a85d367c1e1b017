"""The ``memtrain`` command: ``memtrain train``, ``memtrain estimate`` and ``memtrain bench``.

Exit codes: 0 success, 2 bad input (one message naming the fix), 1 an environment fault (one line: a full disk,
a read-only filesystem, stdout closed early) or an internal failure (with its trace).

The library names its arguments in its errors (``out_dir=``); this module translates them into flags (``--out``)
with one table, ``ARGUMENT_FLAGS``.
"""

from __future__ import annotations

import argparse
import contextlib
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
    "world_size": "torchrun --nproc_per_node",
}
# Switches: (the flag that makes the argument True, the flag that makes it False); None where the default is.
ARGUMENT_SWITCHES: dict[str, tuple[str | None, str | None]] = {
    "overwrite": ("--overwrite", None), "resume": ("--resume", None), "fsdp": ("--fsdp", None),
    "offload_optimizer": ("--offload-optimizer", None), "offload_activations": ("--offload-activations", None),
    "compile": ("--compile", None), "chunked_loss": (None, "--no-chunked-loss"), "progress": (None, "--no-progress"),
}
_VALUE = r"('[^']*'|\"[^\"]*\"|\[[^\]]*\]|[^\s,;)]+)"


def in_flag_terms(message: str) -> str:
    """A library message in the command's terms: ``out_dir='x'`` -> ``--out 'x'``, ``resume=True`` -> ``--resume``,
    ``micro_batch_size`` -> ``--micro-batch-size``."""
    def switch(match: re.Match[str]) -> str:
        on, off = ARGUMENT_SWITCHES[match.group(1)]
        flag = on if match.group(2) == "True" else off
        return flag if flag is not None else f"without {off if match.group(2) == 'True' else on}"

    names = "|".join(sorted(ARGUMENT_SWITCHES, key=len, reverse=True))
    message = re.sub(rf"(?<![\w./-])({names})=(True|False)\b", switch, message)
    names = "|".join(sorted(ARGUMENT_FLAGS, key=len, reverse=True))

    def valued(match: re.Match[str]) -> str:
        flag = ARGUMENT_FLAGS[match.group(1)]
        return f"{flag}{match.group(2)}" if flag.endswith(":") else f"{flag} {match.group(2)}"

    message = re.sub(rf"(?<![\w./-])({names})={_VALUE}", valued, message)
    bare = [n for n in (*ARGUMENT_FLAGS, *ARGUMENT_SWITCHES) if "_" in n]
    names = "|".join(sorted(bare, key=len, reverse=True))

    def named(match: re.Match[str]) -> str:
        name = match.group(1)
        if name in ARGUMENT_FLAGS:
            return ARGUMENT_FLAGS[name].removesuffix(" every:")
        on, off = ARGUMENT_SWITCHES[name]
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


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"{value} must be > 0")
    return value


def _non_negative_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"{value} must be >= 0")
    return value


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


def _checkpointing(text: str) -> tuple[str, int]:
    """none | all | auto | every:K -> (mode, K)."""
    if text in ("none", "all", "auto"):
        return text, 2
    match = re.fullmatch(r"every:(\d+)", text)
    if match and int(match.group(1)) >= 1:
        return "every", int(match.group(1))
    raise argparse.ArgumentTypeError(f"{text!r} is not one of none, all, auto, every:K (K >= 1, e.g. every:2)")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="memtrain", description="Make a PyTorch model fit a memory budget at the least slowdown.")
    parser.add_argument("--version", action="version", version=f"memtrain {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    t = sub.add_parser("train", help="train the built-in GPT on the built-in corpus (or your model and data)")
    t.add_argument("--config", metavar="FILE.toml", help="read flags from a TOML file (keys as the flags, e.g. "
                   "micro-batch-size = 4); flags given on the command line win")
    _add_model_flags(t)
    t.add_argument("--data", metavar="PATH", help="a text file to train on (default: the Python standard library)")
    t.add_argument("--global-batch-size", type=_positive_int,
                   help="examples per optimizer step over all ranks (default: micro-batch x world size); the "
                   "accumulation steps follow")
    t.add_argument("--precision", choices=["auto", "fp32", "bf16-mixed", "fp16-mixed"], default="auto",
                   help="auto picks bf16-mixed where the GPU supports it, fp32 on a CPU (default auto)")
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
    t.add_argument("--offload-activations", action="store_true",
                   help="keep saved activations in pinned host memory, prefetched before backward (CUDA only)")
    t.add_argument("--offload-optimizer", action="store_true",
                   help="keep fp32 master weights and AdamW state in host RAM (saves 8-12 bytes per parameter)")
    t.add_argument("--fsdp", action="store_true", help="under torchrun: shard with FSDP2 instead of DDP")
    t.add_argument("--compile", action="store_true",
                   help="torch.compile the training step (after checkpointing and the DDP/FSDP2 wrapper)")
    t.add_argument("--no-progress", action="store_true", help="no progress bar (on a terminal) or progress lines "
                   "(in a log)")
    t.add_argument("--json", action="store_true", help="print the result as JSON on stdout")

    e = sub.add_parser("estimate", help="predict the peak memory of a training step, without a GPU")
    _add_model_flags(e)
    e.add_argument("--precision", choices=["fp32", "bf16-mixed", "fp16-mixed"], default="bf16-mixed",
                   help="the precision to predict for (default bf16-mixed)")
    e.add_argument("--device", choices=["cuda", "cpu"], default="cuda",
                   help="the device whose peak is predicted (default cuda)")
    e.add_argument("--offload-optimizer", action="store_true", help="optimizer state in host memory")
    e.add_argument("--offload-activations", action="store_true", help="saved activations in host memory")
    e.add_argument("--json", action="store_true", help="print the report as JSON (peak_bytes: the predicted peak)")

    b = sub.add_parser("bench", help="run the side-by-side benchmarks in benchmarks/")
    b.add_argument("name", nargs="?", default="checkpointing", help="benchmark to run (default: checkpointing)")
    b.add_argument("bench_args", nargs=argparse.REMAINDER, help="passed to the benchmark script")
    b.add_argument("--json", action="store_true", help="print the results as JSON on stdout")
    return parser


def _add_model_flags(parser: argparse.ArgumentParser) -> None:
    """The model / batch / technique flags shared by train and estimate."""
    parser.add_argument("--model", default="gpt-mini", help="GPT preset: gpt-tiny, gpt-mini (default), gpt-small")
    parser.add_argument("--hf-config", metavar="PATH",
                        help="a Hugging Face config.json: that model, randomly initialised")
    parser.add_argument("--seq-len", type=_positive_int, help="tokens per example (default: the preset's)")
    parser.add_argument("--micro-batch-size", type=_positive_int, default=16, help="examples per forward (default 16)")
    parser.add_argument("--checkpointing", type=_checkpointing, default=("auto", 2),
                        help="none | all | every:K | auto (default auto)")
    parser.add_argument("--no-chunked-loss", action="store_true",
                        help="with checkpointing, compute the loss on the whole batch's fp32 logits instead of "
                        "1024 tokens at a time (the default where the model allows it)")


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
    problems, defaults = [], {}
    for key, value in values.items():
        action = actions.get(key)
        if action is None:
            import difflib

            close = difflib.get_close_matches(key.replace("_", "-"), list(actions), n=1)
            hint = f" Did you mean {close[0]!r}?" if close else ""
            problems.append(f"--config: unknown key {key!r}.{hint} Keys are the flags of memtrain {argv[0]} "
                            "without the dashes, e.g. micro-batch-size = 4.")
            continue
        if isinstance(action, argparse._StoreTrueAction):  # noqa: SLF001
            if not isinstance(value, bool):
                problems.append(f"--config: {key} = {value!r} must be true or false.")
                continue
            defaults[action.dest] = value
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


def _build_language_model(args: argparse.Namespace) -> tuple[Any, int]:
    """The model and its sequence length."""
    if args.hf_config:
        return _build_hf_model(args.hf_config, args.seq_len)
    model = _build_gpt(args)
    return model, model.config.seq_len


# Encoder model types whose causal-LM class attends both ways unless the config says is_decoder.
_ENCODERS = frozenset({"bert", "roberta", "xlm-roberta", "xlm-roberta-xl", "electra", "camembert", "ernie",
                       "data2vec-text", "rembert", "roformer", "megatron-bert", "xmod", "big_bird", "bert-generation"})


def _build_gpt(args: argparse.Namespace) -> Any:
    """The --model preset, with --seq-len applied."""
    from memtrain.models import GPT, GPT_PRESETS

    if args.model not in GPT_PRESETS:
        raise ConfigError(f"--model {args.model!r} is not a known model. To resolve this error, pass one of "
                          f"{', '.join(GPT_PRESETS)}, or --hf-config PATH.")
    return GPT.from_preset(args.model, **({"seq_len": args.seq_len} if args.seq_len else {}))


def _build_hf_model(path: str, seq_len: int | None) -> tuple[Any, int]:
    from memtrain.estimate import hf_config_from_file

    config = hf_config_from_file(path)  # plain JSON: nothing executed; every bad field is a ConfigError
    problems = []
    vocab = getattr(config, "vocab_size", None)
    if not isinstance(vocab, int) or vocab < 256:
        problems.append(f"--hf-config: vocab_size={vocab!r} must be an integer >= 256: the data is byte-level. To "
                        "resolve this error, set vocab_size >= 256 in the config.")
    if config.model_type in _ENCODERS and not getattr(config, "is_decoder", False):
        problems.append(f"--hf-config: a {config.model_type} config is an encoder: trained on next tokens it would "
                        "see the tokens it predicts. To resolve this error, set \"is_decoder\": true in the config, "
                        "or use a decoder model (llama, gpt2, qwen2, ...).")
    max_len = getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)
    wanted = seq_len or min(256, max_len or 256)
    if max_len is not None and wanted > max_len:
        problems.append(f"--seq-len {wanted} is longer than the model's {max_len} positions. To resolve this "
                        f"error, pass --seq-len {max_len} or less.")
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


def _check_data_path(path: str) -> None:
    """--data must be a readable regular text file: a directory or a FIFO would fail late or block forever."""
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
    if p.suffix.lower() == ".jsonl":
        raise ConfigError(f"{shown} is a .jsonl file, which memtrain train does not read yet (it would train on "
                          "the raw JSON bytes). To resolve this error, pass a plain .txt file of the texts.")
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
            dist.destroy_process_group()


# The options of memtrain train that config.json records (the others say how to run, not what: --json, --out,
# --resume, --overwrite, --config); and those that define the model and the data, which a resume must keep.
_NOT_RECORDED = frozenset({"help", "config", "out", "resume", "overwrite", "json", "command"})
_MODEL_FLAGS = ("model", "seq_len")  # refused here when changed; a new --data or --hf-config path is let through:
# train() compares the contents (a SHA-256 of the token stream, the parameters' names and shapes), so a moved
# file still resumes and a changed one is refused


def _command_record(args: argparse.Namespace, parser: argparse.ArgumentParser) -> dict[str, Any]:
    """The train options as JSON values, paths absolute (a resume may run from another folder)."""
    record = {}
    for action in _subparser(parser, "train")._actions:  # noqa: SLF001
        if action.dest in _NOT_RECORDED:
            continue
        value = getattr(args, action.dest)
        if action.dest in ("data", "hf_config") and value:
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
    for dest, value in saved.items():
        if dest not in explicit and dest in now:
            setattr(args, dest, tuple(value) if isinstance(value, list) else value)
    return [f"--resume: the flags of the run in {args.out} (config.json)"
            + (f", with {', '.join('--' + d.replace('_', '-') for d in sorted(explicit & set(now)))} given now"
               if explicit & set(now) else "")]


def cmd_train(args: argparse.Namespace, parser: argparse.ArgumentParser, explicit: set[str]) -> int:
    from memtrain.data import builtin_corpus, split_windows, text_file_tokens
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
    if args.data:
        _check_data_path(args.data)
    mode, every = args.checkpointing
    name = Path(args.hf_config).stem if args.hf_config else args.model
    out = args.out or f"runs/{name}-{time.strftime('%Y%m%d-%H%M%S')}"
    config = TrainConfig(
        max_steps=args.max_steps, micro_batch_size=args.micro_batch_size, global_batch_size=args.global_batch_size,
        lr=args.lr, warmup_steps=args.warmup_steps, weight_decay=args.weight_decay, grad_clip=args.grad_clip,
        precision=args.precision, checkpointing=mode, checkpoint_every=every, fsdp=args.fsdp,
        offload_optimizer=args.offload_optimizer, offload_activations=args.offload_activations,
        chunked_loss=not args.no_chunked_loss, compile=args.compile, seed=args.seed, eval_every=args.eval_every,
        save_every=args.save_every, out_dir=out, overwrite=args.overwrite, resume=args.resume,
        progress=not args.no_progress,
    )
    config.validate()
    RunFolder(out, overwrite=args.overwrite, resume=args.resume).check()
    import torch

    with _distributed_group() as (rank, world, device):
        from memtrain.accumulation import accumulation_steps

        accumulation_steps(args.micro_batch_size, args.global_batch_size or args.micro_batch_size * world, world)
        torch.manual_seed(args.seed)
        model, seq_len = _build_language_model(args)
        model.to(device)
        if args.data:
            data = split_windows(text_file_tokens(args.data), seq_len)
            source = args.data
        else:
            data = builtin_corpus(seq_len)
            source = "the Python standard library's source (built-in corpus)"
        n_params = sum(p.numel() for p in model.parameters())
        if rank == 0:
            for note in notes:
                _print(f"  {note}", file=sys.stderr)
            _log(args, f"memtrain train: {name} ({n_params / 1e6:.2f}M parameters) on {device}, {seq_len} tokens x "
                       f"{config.global_batch_size or args.micro_batch_size * world} per step, {args.max_steps} steps on "
                       f"{source} ({len(data[0])} training windows)")
        result = train(model, data, config, command=_command_record(args, parser))
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


def cmd_estimate(args: argparse.Namespace) -> int:
    import torch

    from memtrain.estimate import estimate, hf_config_from_file
    from memtrain.loss import HF_MODEL_TYPES, supports_chunked_loss
    from memtrain.train import estimate_policy

    if args.hf_config:
        target = hf_config_from_file(args.hf_config)
        seq_len = args.seq_len or min(2048, getattr(target, "max_position_embeddings", None) or 2048)
        name = Path(args.hf_config).name
    else:
        with torch.device("meta"):  # nothing is allocated
            target = _build_gpt(args)
        seq_len, name = target.config.seq_len, args.model
    policy = estimate_policy(*args.checkpointing)
    # As memtrain train does: with checkpointing on, the loss 1024 tokens at a time where the model allows it.
    chunked = policy != "none" and not args.no_chunked_loss and (supports_chunked_loss(target) if isinstance(target, torch.nn.Module)
                                    else getattr(target, "model_type", None) in HF_MODEL_TYPES)
    report = estimate(target, (args.micro_batch_size, seq_len), device=args.device, precision=args.precision,
                      checkpointing=policy, optimizer="adamw-offload" if args.offload_optimizer else "adamw",
                      offload_activations=args.offload_activations, chunked_loss=chunked)
    if args.json:
        _print(json.dumps(report.to_dict()))
    else:
        _print(f"{name}: batch {args.micro_batch_size} x {seq_len} tokens, {args.precision}, checkpointing "
               f"{policy}{' with a chunked loss' if chunked else ''}, on {args.device}")
        _print(report.summary())
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


def main(argv: list[str] | None = None) -> int:
    global _STDOUT_CLOSED
    argv = list(sys.argv[1:] if argv is None else argv)
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
            code = {"estimate": cmd_estimate, "bench": cmd_bench}[args.command](args)
    except BrokenPipeError:  # a benchmark printing to a closed stdout
        _drop_stdout()
        _STDOUT_CLOSED = True
        code = EXIT_OK
    except ConfigError as e:
        print(f"memtrain {args.command}: error: {in_flag_terms(str(e))}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except MemtrainError as e:
        from memtrain.runstate import RunWriteError

        print(f"memtrain {args.command}: error: {in_flag_terms(str(e))}", file=sys.stderr)
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
