"""The per-step cost of the run's metrics log: one appended line (``MetricsLog``) beside rewriting the whole file
atomically every step (what memtrain did before: quadratic in the run's length, with two fsyncs per step).

Each case logs one step per timed repeat into a log that already holds ``--lines`` lines; cases are interleaved.

Run: ``.venv/bin/python benchmarks/bench_metrics_log.py`` or ``memtrain bench metrics_log`` (a few seconds).
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

_HERE = Path(__file__).resolve().parent
for _path in (_HERE.parent, _HERE):  # the repo root (memtrain) and benchmarks/ (runner), when run directly
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

from runner import Case, common_args, print_json_if_asked, run_side_by_side  # noqa: E402

from memtrain.files import atomic_write_bytes  # noqa: E402
from memtrain.run import MetricsLog  # noqa: E402

# A line as train() writes it (CPU run).
LINE = {"step": 0, "loss": 3.14159, "grad_norm": 0.5, "skipped": False, "tokens_per_s": 91234.5,
        "activation_bytes": 6340000, "parameter_bytes": 3370000, "gradient_bytes": 3370000,
        "optimizer_state_bytes": 6740000, "model_state_bytes": 13480000, "peak_bytes": None, "lr": 0.003}


def _cases(folder: Path, lines: int) -> list[Case]:
    def rewrite():
        path, metrics = folder / f"rewrite-{lines}.jsonl", [dict(LINE, step=i + 1) for i in range(lines)]

        def step():
            metrics.append(dict(LINE, step=len(metrics) + 1))
            atomic_write_bytes(path, "".join(json.dumps(m) + "\n" for m in metrics).encode())

        return step

    def append():
        path = folder / f"append-{lines}.jsonl"
        path.write_text("".join(json.dumps(dict(LINE, step=i + 1)) + "\n" for i in range(lines)))
        log = MetricsLog(path)
        kept, _ = log.start(resume_step=lines)
        steps = [len(kept)]

        def step():
            steps[0] += 1
            log.append(dict(LINE, step=steps[0]))

        return step

    return [Case(f"rewrite whole file ({lines} lines)", rewrite), Case(f"append one line ({lines} lines)", append)]


def main(argv: list[str] | None = None) -> None:
    parser = common_args(__doc__.splitlines()[0])
    parser.add_argument("--lines", type=int, nargs="+", default=[100, 1000, 10000],
                        help="lines already in the log (default 100 1000 10000)")
    parser.set_defaults(repeats=21, device="cpu")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        for lines in args.lines:
            title = f"metrics-log-{lines}"
            json_path = (Path(args.out).with_name(f"{Path(args.out).stem}-{lines}.json") if args.out else
                         Path("bench-results") / f"{title}.json")
            run_side_by_side(_cases(Path(tmp), lines), title=title, repeats=args.repeats, warmup=args.warmup,
                             device="cpu", isolate=False, json_path=json_path)
            print_json_if_asked(args, json_path)


if __name__ == "__main__":
    main()
