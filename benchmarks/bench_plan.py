"""Does the planner's time model rank set-ups the way the machine does? Predicted beside measured step times.

For a Llama shape, a grid of set-ups (micro-batch x checkpointing x loss, and on CUDA optimizer placement) is
predicted by ``memtrain.planner.predictions`` (the figures ``plan`` ranks candidates by) and then run for a few
steps each, side by side in one process (interleaved on the CPU), through ``apply_plan``. The table shows
predicted and measured step time per set-up, and the Spearman rank correlation between them (issue 11's target:
>= 0.8 on the CPU Llama shape of ``bench_checkpointing.py``).

``--anchors`` prints, instead, what the table of known GPUs predicts for docs/design.md's H200 anchors on the 1.1B
Llama (the table's efficiencies are fitted to three of them; the offloaded-optimizer one is a check).

Run: ``.venv/bin/python benchmarks/bench_plan.py`` (CPU Llama, about 3 minutes on 2 cores) or
``memtrain bench plan``; ``--shape tiny`` for a smoke run; on a GPU ``--shape llama-1.1b``.
"""

from __future__ import annotations

import sys
from pathlib import Path

_HERE = Path(__file__).resolve().parent
for _path in (_HERE.parent, _HERE):  # the repo root (memtrain) and benchmarks/ (runner), when run directly
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

import torch  # noqa: E402
from bench_checkpointing import SHAPES, Shape, build_model  # noqa: E402
from runner import Case, common_args, print_json_if_asked, run_side_by_side  # noqa: E402

from memtrain.planner import PlanSettings, apply_plan, known_gpu, predictions  # noqa: E402


def grid(shape: Shape, device: str, precision: str) -> list[PlanSettings]:
    """The set-ups compared: every micro-batch, with checkpointing none / every other block / all / selective, the
    loss whole or chunked; on CUDA also the optimizer offloaded."""
    n = shape.layers
    kinds = {
        "none": ("keep",) * n,
        "half": tuple("recompute" if i % 2 == 0 else "keep" for i in range(n)),
        "all": ("recompute",) * n,
    }
    out = []
    for micro in [m for m in (shape.batch, shape.batch // 2, shape.batch // 4) if m >= 1 and shape.batch % m == 0]:
        for name, blocks in kinds.items():
            for chunked in (False, True):
                out.append(PlanSettings(micro_batch_size=micro, accumulation=shape.batch // micro, blocks=blocks,
                                        flavor="full", chunked_loss=chunked, optimizer="device",
                                        distribution="none", compile=False,
                                        precision=precision))
            if name == "all":
                out.append(PlanSettings(micro_batch_size=micro, accumulation=shape.batch // micro, blocks=blocks,
                                        flavor="selective", chunked_loss=False, optimizer="device",
                                        distribution="none",
                                        compile=False, precision=precision))
        if device == "cuda":
            out.append(PlanSettings(micro_batch_size=micro, accumulation=shape.batch // micro, blocks=kinds["all"],
                                    flavor="full", chunked_loss=True, optimizer="offload", distribution="none",
                                    compile=False,
                                    precision=precision))
    return out


def label(s: PlanSettings) -> str:
    return (f"micro {s.micro_batch_size} x {s.accumulation}, {s.checkpointing}, "
            f"{'chunked' if s.chunked_loss else 'whole'} loss" + (f", {s.optimizer}" if s.optimizer != "device" else ""))


def spearman(a: list[float], b: list[float]) -> float:
    """Rank correlation (Pearson's r of the ranks; ties share their mean rank)."""

    def ranks(values: list[float]) -> list[float]:
        order = sorted(range(len(values)), key=lambda i: values[i])
        out = [0.0] * len(values)
        i = 0
        while i < len(order):
            j = i
            while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
                j += 1
            for k in range(i, j + 1):
                out[order[k]] = (i + j) / 2
            i = j + 1
        return out

    ra, rb = ranks(a), ranks(b)
    ma, mb = sum(ra) / len(ra), sum(rb) / len(rb)
    cov = sum((x - ma) * (y - mb) for x, y in zip(ra, rb, strict=True))
    var = (sum((x - ma) ** 2 for x in ra) * sum((y - mb) ** 2 for y in rb)) ** 0.5
    return cov / var if var else 1.0


def step_fn(shape: Shape, settings: PlanSettings, device: str):
    def setup():
        from memtrain.loss import language_model_loss

        torch.manual_seed(0)
        model = build_model(shape, device)
        run = apply_plan(model, settings, lr=1e-4)
        generator = torch.Generator().manual_seed(1)
        x = torch.randint(0, shape.vocab, (shape.batch, shape.seq_len), generator=generator).to(device)
        acc = run.accumulator

        def step():
            for i, (xb, yb) in enumerate(zip(x.split(settings.micro_batch_size), x.split(settings.micro_batch_size),
                                             strict=True)):
                with acc.micro_batch(is_last=i == settings.accumulation - 1):
                    with run.precision.autocast():
                        loss = language_model_loss(run.train_model, xb, yb)
                    acc.backward(loss, reduction="sum", items=yb.numel())
            result = acc.step()
            return {"loss": result.loss}

        return step

    return setup


def main() -> None:
    parser = common_args(__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="cpu-llama")
    parser.add_argument("--anchors", action="store_true", help="print the table's predictions for docs/design.md's anchors")
    parser.set_defaults(repeats=5, warmup=1)
    args = parser.parse_args()
    if args.anchors:
        return anchors()
    shape = SHAPES[args.shape]
    device = args.device
    precision = "bf16-mixed" if device == "cuda" else "fp32"
    model = build_model(shape, "meta")
    given = grid(shape, device, precision)
    predicted = predictions(model, given, seq_len=shape.seq_len, global_batch_size=shape.batch, device=device)
    cases = [Case(label(s), step_fn(shape, s, device), notes=f"predicted {c.step_seconds:.4f} s")
             for s, c in zip(given, predicted, strict=True)]
    results = run_side_by_side(cases, title=f"plan-{args.shape}-{device}", repeats=args.repeats, warmup=args.warmup,
                               device=device, json_path=args.out, tokens_per_step=shape.tokens_per_step)
    pairs = [(c.step_seconds, r.median_s) for c, r in zip(predicted, results, strict=True) if r.median_s]
    if len(pairs) < 2:
        raise SystemExit("fewer than two set-ups ran: no correlation to report (see the failures above)")
    rho = spearman([p for p, _ in pairs], [m for _, m in pairs])
    print(f"\nSpearman rank correlation, predicted vs measured step time over {len(pairs)} set-ups: {rho:.3f}")
    print(f"device figures: {_profile_line(device)}")
    print_json_if_asked(args, args.out or Path("bench-results") / f"plan-{args.shape}-{device}.json")


def _profile_line(device: str) -> str:
    from memtrain.planner import device_profile

    return device_profile(device).source


def anchors() -> None:
    """docs/design.md's H200 anchors on the 1.1B Llama beside the table's predictions."""
    shape = SHAPES["llama-1.1b"]
    model = build_model(shape, "meta")
    n = shape.layers
    rows = [
        ("no memory savings", PlanSettings(micro_batch_size=4, accumulation=1, blocks=("keep",) * n, flavor="full",
                                           chunked_loss=False, optimizer="device", distribution="none",
                                           compile=False), 35.9, 45.4),
        ("Hugging Face checkpointing", PlanSettings(micro_batch_size=4, accumulation=1, blocks=("recompute",) * n,
                                                    flavor="full", chunked_loss=False, optimizer="device",
                                                    distribution="none",
                                                    compile=False), 18.3, 36.5),
        ("checkpointing + optimizer offload", PlanSettings(micro_batch_size=4, accumulation=1,
                                                           blocks=("recompute",) * n, flavor="full",
                                                           chunked_loss=False, optimizer="offload",
                                                           distribution="none", compile=False), 10.1, 15.8),
        ("torch.compile, default", PlanSettings(micro_batch_size=4, accumulation=1, blocks=("keep",) * n,
                                                flavor="full", chunked_loss=False, optimizer="device",
                                                distribution="none", compile=True), 30.4,
         56.5),
    ]
    got = predictions(model, [s for _, s, _, _ in rows], seq_len=shape.seq_len, global_batch_size=shape.batch,
                      device="cuda", device_profile=known_gpu("NVIDIA H200"))
    print("docs/design.md's H200 anchors (measured) beside the planner's predictions (table of known GPUs):")
    print(f"  {'set-up':36s} {'peak GiB':>9s} {'pred':>6s} {'tokens/s':>9s} {'pred':>7s}")
    for (name, _, peak, tps), c in zip(rows, got, strict=True):
        print(f"  {name:36s} {peak:9.1f} {c.peak_bytes / 2**30:6.1f} {tps * 1e3:9,.0f} {c.tokens_per_s:7,.0f}")
    print("  (the efficiencies are fitted to the first, second and fourth; the third is a check; torch.compile's "
          "memory is predicted as eager's)")


if __name__ == "__main__":
    main()
