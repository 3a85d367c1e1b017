"""Lean optimizer state (issue 14): final eval loss and bytes per parameter of each state precision, and the cost
of step-in-backward against the ordinary step, on the built-in GPT and corpus, on this machine's CPU.

- ``--case loss`` (default): trains ``gpt-tiny`` (or ``--model``) for ``--steps`` steps on the built-in corpus with
  fp32, bf16 and int8 AdamW moments (same seed, data and hyper-parameters), and prints each final eval loss, its
  relative difference to fp32 (the target: within 1%), and the state bytes per parameter measured on the
  optimizer (``memtrain.measure.optimizer_state_bytes``) beside ``optimizer_memory``'s prediction.
- ``--case cpu-rate``: one CPU AdamW step on ``--params`` parameters (4 tensors) with each state precision,
  interleaved: the host step's rate that ``memtrain.optim.cpu_step_rate`` probes for the planner.
- ``--case step-in-backward``: one optimizer step of ``gpt-mini`` (2 micro-batches: forward, backward and step),
  ordinary vs step-in-backward without clipping and with clipping (lagged: one backward pass), side by side
  (median of ``--repeats``, interleaved); the last line is the ratio of the clipped step-in-backward step to the
  ordinary one (the target: at most 1.15).

Run: ``.venv/bin/python benchmarks/bench_optim_state.py --steps 300``,
``.venv/bin/python benchmarks/bench_optim_state.py --case cpu-rate --repeats 20`` and
``.venv/bin/python benchmarks/bench_optim_state.py --case step-in-backward --repeats 20``.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from runner import Case, common_args, run_side_by_side  # noqa: E402

from memtrain.accumulation import GradientAccumulator  # noqa: E402
from memtrain.data import builtin_corpus  # noqa: E402
from memtrain.measure import optimizer_state_bytes  # noqa: E402
from memtrain.models import GPT  # noqa: E402
from memtrain.optim import build_optimizer, host_step_probe, optimizer_memory  # noqa: E402


def train_gpt(state_precision: str, *, steps: int, model: str = "gpt-tiny", batch: int = 16, lr: float = 3e-3,
              seed: int = 0, eval_batches: int = 8, **optimizer_options) -> dict[str, float]:
    """Trains the built-in GPT on the built-in corpus; returns the final eval loss and the state bytes."""
    torch.manual_seed(seed)
    gpt = GPT.from_preset(model)
    train, val = builtin_corpus(gpt.config.seq_len, max_bytes=2 * 2**20)
    opt = build_optimizer(gpt.named_parameters(), lr=lr, weight_decay=0.1, state_precision=state_precision,
                          **optimizer_options)
    acc = GradientAccumulator(gpt, opt, steps=1, max_grad_norm=1.0)
    order = torch.randperm(len(train), generator=torch.Generator().manual_seed(seed))
    for step in range(steps):
        idx = order[(step * batch) % (len(order) - batch):][:batch].tolist()
        x, y = (torch.stack(t) for t in zip(*(train[i] for i in idx), strict=True))
        with acc.micro_batch(is_last=True):
            acc.backward(gpt(x, y), reduction="mean")
        acc.step()
    gpt.eval()
    losses = []
    with torch.no_grad():
        for b in range(eval_batches):
            x, y = (torch.stack(t) for t in zip(*(val[(b * batch + i) % len(val)] for i in range(batch)),
                                                strict=True))
            losses.append(gpt(x, y).item())
    numel = sum(p.numel() for p in gpt.parameters())
    predicted = optimizer_memory([(p.numel(), p.dtype) for p in gpt.parameters()], state_precision=state_precision,
                                 device_type="cpu", **optimizer_options)
    measured = optimizer_state_bytes(opt)
    opt.close()
    return {"eval_loss": sum(losses) / len(losses), "state_bytes": measured, "predicted_bytes": predicted.state_bytes,
            "bytes_per_param": measured / numel}


def step_in_backward_case(mode: str):
    torch.manual_seed(0)
    gpt = GPT.from_preset("gpt-mini")
    opt = build_optimizer(gpt.named_parameters(), lr=1e-3, step_in_backward=mode != "ordinary")
    acc = GradientAccumulator(gpt, opt, steps=2, max_grad_norm=None if mode == "one pass" else 1.0)
    g = torch.Generator().manual_seed(1)
    data = [torch.randint(0, 256, (2, 8, gpt.config.seq_len), generator=g) for _ in range(2)]

    def step() -> None:
        for m, (x, y) in enumerate(data):
            with acc.micro_batch(is_last=m == 1):
                acc.backward(gpt(x, y), reduction="mean")
        acc.step()

    return step


def cpu_rate_case(precision: str, n_params: int):
    opt = host_step_probe(precision, n_params)

    def step() -> dict[str, float]:
        opt.step()
        return {}

    return step


def main() -> None:
    parser = common_args(__doc__.splitlines()[0])
    parser.add_argument("--case", choices=["loss", "cpu-rate", "step-in-backward"], default="loss")
    parser.add_argument("--params", type=float, default=4e6, help="parameters of --case cpu-rate")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--model", default="gpt-tiny")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch intra-op threads (1 steadies timings on a machine shared with other jobs)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.case == "cpu-rate":
        n = int(args.params)
        cases = [Case(f"{p} moments", lambda p=p: cpu_rate_case(p, n)) for p in ("fp32", "bf16", "int8")]
        results = run_side_by_side(cases, title="optim_cpu_rate", repeats=args.repeats, warmup=args.warmup,
                                   device="cpu", json_path=args.out)
        for r in results:
            if r.median_s:
                print(f"  {r.name}: {n / r.median_s / 1e6:.0f} M params/s on {torch.get_num_threads()} threads")
        return
    if args.case == "step-in-backward":
        cases = [Case("ordinary step, clip 1.0", lambda: step_in_backward_case("ordinary")),
                 Case("step-in-backward, no clip", lambda: step_in_backward_case("one pass")),
                 Case("step-in-backward, clip 1.0", lambda: step_in_backward_case("clip"))]
        results = run_side_by_side(cases, title="optim_step_in_backward", repeats=args.repeats, warmup=args.warmup,
                                   device="cpu", json_path=args.out)
        if all(r.median_s for r in results):
            print(f"step-in-backward (clip 1.0) / ordinary step: {results[2].median_s / results[0].median_s:.3f}x "
                  "(target <= 1.15)")
        return
    results = {p: train_gpt(p, steps=args.steps, model=args.model) for p in ("fp32", "bf16", "int8")}
    base = results["fp32"]["eval_loss"]
    print(f"== optimizer state precision: {args.model}, {args.steps} steps, built-in corpus, CPU ==")
    print("state  eval loss  vs fp32    state bytes/param  measured = predicted")
    for name, r in results.items():
        print(f"{name:5}  {r['eval_loss']:.4f}     {100 * (r['eval_loss'] / base - 1):+.2f}%    "
              f"{r['bytes_per_param']:.3f}              {r['state_bytes'] == r['predicted_bytes']}")


if __name__ == "__main__":
    main()
