"""``memtrain bench NAME``: runs benchmarks/bench_NAME.py (or gpu_NAME.py) of the source checkout in this process."""

from __future__ import annotations

import argparse
import os
import runpy
import sys
from pathlib import Path

from memtrain.cli.console import EXIT_OK
from memtrain.errors import ConfigError


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


def cmd_bench(args: argparse.Namespace) -> int:
    root = Path(__file__).resolve().parents[2] / "benchmarks"  # memtrain/cli/bench.py -> the checkout
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


