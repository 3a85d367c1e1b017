"""The ``memtrain`` command: ``memtrain train`` and ``memtrain bench``.

Exit codes: 0 success, 2 bad input (one message naming the fix), 1 an internal failure.
"""

from __future__ import annotations

import argparse
import json
import re
import runpy
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from memtrain.errors import ConfigError, MemtrainError

EXIT_OK, EXIT_INTERNAL, EXIT_BAD_INPUT = 0, 1, 2


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # argparse's own exit code is 2 as well; keep one message format
        self.print_usage(sys.stderr)
        print(f"memtrain: error: {message}", file=sys.stderr)
        sys.exit(EXIT_BAD_INPUT)


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} must be >= 1")
    return value


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"{value} must be > 0")
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
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    t = sub.add_parser("train", help="train the built-in GPT on the built-in corpus (or your model and data)")
    t.add_argument("--model", default="gpt-mini", help="GPT preset: gpt-tiny, gpt-mini (default), gpt-small")
    t.add_argument("--hf-config", metavar="PATH", help="a Hugging Face config.json: that model, randomly initialised")
    t.add_argument("--data", metavar="PATH", help="a text file to train on (default: the Python standard library)")
    t.add_argument("--seq-len", type=_positive_int, help="tokens per example (default: the preset's)")
    t.add_argument("--micro-batch-size", type=_positive_int, default=16, help="examples per forward (default 16)")
    t.add_argument("--checkpointing", type=_checkpointing, default=("auto", 2),
                   help="none | all | every:K | auto (default auto)")
    t.add_argument("--max-steps", type=_positive_int, default=500, help="optimizer steps (default 500)")
    t.add_argument("--lr", type=_positive_float, default=3e-3, help="peak learning rate (default 3e-3)")
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--out", metavar="DIR", help="run folder (default runs/<model>-<time>)")
    t.add_argument("--overwrite", action="store_true", help="replace another run's results in --out")
    t.add_argument("--no-progress", action="store_true", help="no progress bar")
    t.add_argument("--json", action="store_true", help="print the result as JSON on stdout")

    b = sub.add_parser("bench", help="run the side-by-side benchmarks in benchmarks/")
    b.add_argument("name", nargs="?", default="checkpointing", help="benchmark to run (default: checkpointing)")
    b.add_argument("bench_args", nargs=argparse.REMAINDER, help="passed to the benchmark script")
    b.add_argument("--json", action="store_true", help="print the results as JSON on stdout")
    return parser


def _log(args: argparse.Namespace, message: str) -> None:
    # With --json, stdout carries only the JSON document.
    print(message, file=sys.stderr if args.json else sys.stdout, flush=True)


def _build_language_model(args: argparse.Namespace) -> tuple[Any, int]:
    """The model and its sequence length."""
    if args.hf_config:
        return _build_hf_model(args.hf_config, args.seq_len)
    from memtrain.models import GPT, GPT_PRESETS

    if args.model not in GPT_PRESETS:
        raise ConfigError(f"--model {args.model!r} is not a known model. To resolve this error, pass one of "
                          f"{', '.join(GPT_PRESETS)}, or --hf-config PATH.")
    overrides = {"seq_len": args.seq_len} if args.seq_len else {}
    model = GPT.from_preset(args.model, **overrides)
    return model, model.config.seq_len


def _build_hf_model(path: str, seq_len: int | None) -> tuple[Any, int]:
    try:
        import transformers
    except ImportError:
        raise ConfigError("--hf-config needs transformers. To resolve this error, pip install 'memtrain[hf]'.") from None
    if not Path(path).is_file():
        raise ConfigError(f"--hf-config {path!r}: no such file. To resolve this error, pass a config.json path.")
    try:
        config = transformers.AutoConfig.from_pretrained(path)
    except (OSError, ValueError, KeyError) as e:
        raise ConfigError(f"--hf-config {path!r} is not a Hugging Face config ({e}). To resolve this error, pass "
                          "a config.json with a model_type.") from None
    if getattr(config, "vocab_size", 0) < 256:
        raise ConfigError(f"--hf-config: vocab_size={config.vocab_size} is below 256, but the data is byte-level. "
                          "To resolve this error, set vocab_size >= 256 in the config.")
    model = transformers.AutoModelForCausalLM.from_config(config)
    max_len = getattr(config, "max_position_embeddings", None) or 1024
    return model, min(seq_len or 256, max_len)


def cmd_train(args: argparse.Namespace) -> int:
    from memtrain.data import builtin_corpus, split_windows, text_file_tokens
    from memtrain.report import format_bytes
    from memtrain.train import TrainConfig, train

    mode, every = args.checkpointing
    name = Path(args.hf_config).stem if args.hf_config else args.model
    out = args.out or f"runs/{name}-{time.strftime('%Y%m%d-%H%M%S')}"
    config = TrainConfig(
        max_steps=args.max_steps, micro_batch_size=args.micro_batch_size, lr=args.lr, checkpointing=mode,
        checkpoint_every=every, seed=args.seed, out_dir=out, overwrite=args.overwrite, progress=not args.no_progress,
    )
    config.validate()
    import torch

    torch.manual_seed(args.seed)
    model, seq_len = _build_language_model(args)
    if args.data:
        data = split_windows(text_file_tokens(args.data), seq_len)
        source = args.data
    else:
        data = builtin_corpus(seq_len)
        source = "the Python standard library's source (built-in corpus)"
    n_params = sum(p.numel() for p in model.parameters())
    _log(args, f"memtrain train: {name} ({n_params / 1e6:.2f}M parameters), {seq_len} tokens x "
               f"{args.micro_batch_size} per step, {args.max_steps} steps on {source} "
               f"({len(data[0])} training windows)")
    result = train(model, data, config)
    _log(args, f"done: loss {result.final_loss:.3f} (eval {result.eval_loss:.3f}), "
               f"{result.tokens / result.seconds:.0f} tokens/s, saved activations "
               f"{format_bytes(result.activation_bytes)} per step, model state {format_bytes(result.model_state_bytes)}"
               f"; run folder {result.out_dir}")
    if args.json:
        print(json.dumps(asdict(result)))
    return EXIT_OK


def cmd_bench(args: argparse.Namespace) -> int:
    root = Path(__file__).resolve().parent.parent / "benchmarks"
    script = root / f"bench_{args.name}.py"
    if not script.is_file():
        available = sorted(p.stem.removeprefix("bench_") for p in root.glob("bench_*.py")) if root.is_dir() else []
        raise ConfigError(f"no benchmark named {args.name!r}" + (f"; available: {', '.join(available)}" if available
                          else " (benchmarks ship with the source checkout)") + ". To resolve this error, pass one "
                          "of those names.")
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
    args = build_parser().parse_args(argv)
    commands = {"train": cmd_train, "bench": cmd_bench}
    try:
        return commands[args.command](args)
    except (ConfigError, MemtrainError) as e:
        print(f"memtrain {args.command}: error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except KeyboardInterrupt:
        print("memtrain: interrupted", file=sys.stderr)
        return 130
    except SystemExit:
        raise
    except Exception:
        import traceback

        traceback.print_exc()
        print(f"memtrain {args.command}: internal error (a bug in memtrain: please report it with the trace above)",
              file=sys.stderr)
        return EXIT_INTERNAL


if __name__ == "__main__":
    sys.exit(main())
