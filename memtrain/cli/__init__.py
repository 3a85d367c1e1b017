"""The ``memtrain`` command: ``memtrain train``, ``memtrain estimate``, ``memtrain plan``, ``memtrain bench`` and
``memtrain export``.

Exit codes: 0 success, 2 bad input (one message naming the fix), 1 an environment fault (one line: a full disk,
a read-only filesystem, stdout closed early) or an internal failure (with its trace), 130 / 143 a run stopped by
SIGINT / SIGTERM after its checkpoint (``--resume`` continues it).

The parts, from the bottom up:
- ``terms``: the library's errors in flag terms: each argument a message keeps (``memtrain.message``) as its flag
  (``out_dir=`` -> ``--out``), from the settings' declared flags and ``ARGUMENT_FLAGS`` for the other arguments.
- ``console``: the exit codes; output that survives a reader closing stdout early.
- ``flags``: the parser, the flags' types and checks, ``--config FILE.toml``, the flags given explicitly.
- ``techniques``: the technique flags as the one ``Choices`` that train, plan and estimate take.
- ``workloads``: the model and the data the flags name (GPT presets, --hf-config, --hf-model, --data).
- ``launch``: torchrun's environment, the distributed group, the --nproc check.
- ``resume``: the flags a run records and a --resume takes back.
- ``train``, ``estimate``, ``plan``, ``bench``, ``export``: one module per command.
"""

from __future__ import annotations

import sys
import traceback

from memtrain.cli.bench import cmd_bench
from memtrain.cli.console import (
    EXIT_BAD_INPUT,
    EXIT_ENVIRONMENT,
    EXIT_INTERNAL,
    EXIT_OK,
    close_stdout,
    reset_stdout,
    stdout_closed,
)
from memtrain.cli.estimate import cmd_estimate
from memtrain.cli.export import cmd_export
from memtrain.cli.flags import apply_config_file, build_parser, explicit_dests, join_sizes
from memtrain.cli.plan import cmd_plan
from memtrain.cli.terms import ARGUMENT_FLAGS, ARGUMENT_SWITCHES, in_flag_terms
from memtrain.cli.train import cmd_train
from memtrain.errors import ConfigError, MemtrainError
from memtrain.run import RunWriteError

__all__ = ["ARGUMENT_FLAGS", "ARGUMENT_SWITCHES", "build_parser", "in_flag_terms", "main"]


def main(argv: list[str] | None = None) -> int:
    argv = join_sizes(list(sys.argv[1:] if argv is None else argv))
    reset_stdout()
    parser = build_parser()
    try:
        from_file = apply_config_file(parser, argv)
    except ConfigError as e:  # already in the file's terms: its keys are flags, not library arguments
        print(f"memtrain: error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    args = parser.parse_args(argv)
    try:
        if args.command == "train":
            code = cmd_train(args, parser, explicit_dests(parser, argv, "train") | from_file)
        else:
            code = {"estimate": cmd_estimate, "plan": cmd_plan, "bench": cmd_bench,
                    "export": cmd_export}[args.command](args)
    except BrokenPipeError:  # a benchmark printing to a closed stdout
        close_stdout()
        code = EXIT_OK
    except ConfigError as e:
        print(f"memtrain {args.command}: error: {in_flag_terms(e.message, args.command)}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except MemtrainError as e:
        print(f"memtrain {args.command}: error: {in_flag_terms(e.message, args.command)}", file=sys.stderr)
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
        traceback.print_exc()
        print(f"memtrain {args.command}: internal error (a bug in memtrain: please report it with the trace above)",
              file=sys.stderr)
        return EXIT_INTERNAL
    if stdout_closed():
        print(f"memtrain {args.command}: stdout was closed before all the output was written (e.g. by `| head`); "
              "the rest was dropped", file=sys.stderr)
        return EXIT_ENVIRONMENT
    return code


