"""How long does the planner take? CPU seconds of the 1.1B Llama's, the README's 8B and the 70B plans, in this
process; with ``--against REV`` the same plans from a git revision of memtrain beside them.

Each plan runs as ``memtrain plan ... --json`` runs it (the CLI, in this process) and is timed in CPU seconds (user
+ system, ``resource.getrusage``): on a shared machine wall time measures the neighbours too. The start-up (the
interpreter, importing torch, transformers and the Llama's modeling code) is timed once, before the first plan.
``--against REV`` exports REV (``git archive``) into a temporary folder and runs this script in a subprocess with
that folder first on the path (``--child``), then says whether both revisions chose the same plans with the same
predictions. The models are the configs in this checkout's examples/ (REV need not have them).

Run: ``memtrain bench plan_speed`` (about 20 s on 2 cores), ``--against main``, ``--plans 1.1b,70b``.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import resource
import shlex
import statistics
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path
from typing import Any

_HERE = Path(__file__).resolve().parent
_ROOT = _HERE.parent
_CHILD = "--child" in sys.argv  # run for another revision: its memtrain (on PYTHONPATH) is the one timed
if not _CHILD and str(_ROOT) not in sys.path:  # the repo root (memtrain), when run directly
    sys.path.insert(0, str(_ROOT))

_EXAMPLES = _ROOT / "examples"
PLANS = {
    "1.1b": f"--hf-config {_EXAMPLES / 'tinyllama-1.1b.json'} --seq-len 2048 --global-batch-size 16 --budget 24GiB "
            "--gpu H200",
    "8b": f"--hf-config {_EXAMPLES / 'llama3-8b.json'} --seq-len 2048 --global-batch-size 16 --gpu 4090 "
          "--budget 24GiB --host-budget 96GiB",
    "8b-lora": f"--hf-config {_EXAMPLES / 'llama3-8b.json'} --seq-len 2048 --global-batch-size 16 --gpu 4090 "
               "--budget 24GiB --host-budget 64GiB --lora 16",
    "70b": f"--hf-config {_EXAMPLES / 'llama3-70b.json'} --seq-len 4096 --global-batch-size 16 --gpu h100 "
           "--budget 80GiB --host-budget 1TiB",
}
DEFAULT_PLANS = ("1.1b", "8b", "70b")


def cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _chosen(p: dict[str, Any]) -> dict[str, Any]:
    """What a plan is judged by: the settings and the predictions."""
    return {k: p[k] for k in ("plan", "peak_bytes", "host_bytes", "step_seconds", "tokens_per_s")}


def _same_choice(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Whether two revisions' plans are the same set-up with the same predictions: the settings read by this
    revision's ``PlanSettings.from_dict``, which reads an older revision's form too (each field its own key)."""
    from memtrain.planner.settings import PlanSettings

    rest = [k for k in a if k != "plan"]
    return PlanSettings.from_dict(a["plan"]) == PlanSettings.from_dict(b["plan"]) and \
        [a[k] for k in rest] == [b.get(k) for k in rest]


def time_plans(names: list[str], repeats: int) -> dict[str, Any]:
    """CPU seconds of the start-up and of each plan (each ``repeats`` times), with each plan's choice."""
    import transformers.models.llama.modeling_llama  # noqa: F401 - the start-up: the Llama's code, imported once

    import memtrain
    from memtrain.cli import main

    out: dict[str, Any] = {"startup_s": cpu_seconds(), "memtrain": str(Path(memtrain.__file__).parent), "plans": {}}
    for name in names:
        seconds, chosen = [], None
        for _ in range(repeats):
            printed = io.StringIO()
            before = cpu_seconds()
            with contextlib.redirect_stdout(printed):
                code = main(["plan", *shlex.split(PLANS[name]), "--json"])
            seconds.append(cpu_seconds() - before)
            if code != 0:
                raise SystemExit(f"memtrain plan {PLANS[name]} exited {code}: {printed.getvalue()}")
            chosen = _chosen(json.loads(printed.getvalue()))
        out["plans"][name] = {"cpu_s": seconds, "median_s": statistics.median(seconds), "chosen": chosen}
    return out


def _git(*args: str) -> str:
    return subprocess.run(["git", "-C", str(_ROOT), *args], check=True, capture_output=True, text=True).stdout.strip()


def time_revision(rev: str, names: list[str], repeats: int) -> dict[str, Any]:
    """``time_plans`` of the memtrain of git revision ``rev``, in a subprocess (its imports and caches its own)."""
    commit = _git("rev-parse", "--verify", f"{rev}^{{commit}}")
    with tempfile.TemporaryDirectory(prefix="memtrain-plan-speed-") as folder:
        archive = subprocess.run(["git", "-C", str(_ROOT), "archive", commit, "memtrain"], check=True,
                                 capture_output=True).stdout
        with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
            tar.extractall(folder, filter="data")
        env = {**os.environ, "PYTHONPATH": folder}
        done = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--child", "--plans", ",".join(names),
                               "--repeats", str(repeats)], cwd=folder, env=env, capture_output=True, text=True)
        if done.returncode != 0:
            raise SystemExit(f"the plans of {rev} ({commit[:10]}) failed:\n{done.stderr[-3000:]}")
        result = json.loads(done.stdout.splitlines()[-1])
    result["revision"] = f"{rev} ({commit[:10]})"
    return result


def table(here: dict[str, Any], other: dict[str, Any] | None, names: list[str]) -> str:
    header = ["plan", "this checkout (CPU s)"]
    if other is not None:
        header += [f"{other['revision']} (CPU s)", "speed-up", "same plan"]
    rows = [header, ["start-up", f"{here['startup_s']:.2f}"]
            + ([f"{other['startup_s']:.2f}", "", ""] if other is not None else [])]
    for name in names:
        mine = here["plans"][name]
        row = [name, f"{mine['median_s']:.2f}"]
        if other is not None:
            theirs = other["plans"][name]
            row += [f"{theirs['median_s']:.2f}", f"{theirs['median_s'] / mine['median_s']:.1f}x",
                    "yes" if _same_choice(theirs["chosen"], mine["chosen"]) else "NO"]
        rows.append(row)
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    lines = ["== plan speed: CPU seconds (user + system) of each `memtrain plan`, in one process =="]
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows]
    lines += [f"  {name}: memtrain plan {PLANS[name]}" for name in names]
    return "\n".join(lines)


def main() -> None:
    from memtrain.files import atomic_write_bytes

    # runner.common_args's --device and --warmup do not apply: the plans name their GPUs, and each is timed cold.
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--plans", default=",".join(DEFAULT_PLANS), help=f"comma-separated, of {', '.join(PLANS)}")
    parser.add_argument("--against", metavar="REV", help="also time the plans of this git revision (e.g. main)")
    parser.add_argument("--repeats", type=int, default=1, help="times each plan runs (the median is shown)")
    parser.add_argument("--json", action="store_true", help="also print the JSON results on stdout")
    parser.add_argument("--out", help="JSON file to write (default bench-results/plan-speed.json)")
    args = parser.parse_args()
    names = [n for n in args.plans.split(",") if n]
    unknown = [n for n in names if n not in PLANS]
    if unknown:
        raise SystemExit(f"--plans: unknown {', '.join(unknown)}; choose from {', '.join(PLANS)}")
    here = time_plans(names, args.repeats)
    other = time_revision(args.against, names, args.repeats) if args.against else None
    print(table(here, other, names))
    doc = {"title": "plan-speed", "this_checkout": here, "against": other}
    path = Path(args.out or Path("bench-results") / "plan-speed.json")
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(path, json.dumps(doc, indent=2).encode())
    if args.json:
        sys.stdout.write(json.dumps(doc) + "\n")


def child() -> None:
    """``--child``: the plans timed with the memtrain on PYTHONPATH, as one JSON line on stdout."""
    args = sys.argv[1:]
    names = args[args.index("--plans") + 1].split(",")
    repeats = int(args[args.index("--repeats") + 1])
    with contextlib.redirect_stdout(sys.stderr):  # only the JSON line on stdout
        result = time_plans(names, repeats)
    sys.stdout.write(json.dumps(result) + "\n")


if __name__ == "__main__":
    child() if _CHILD else main()
