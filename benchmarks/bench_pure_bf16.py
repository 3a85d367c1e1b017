"""Pure bf16 training (issue 20): final eval loss of the built-in GPT trained with bf16 weights and no fp32 master
(``PureBF16AdamW``, stochastic rounding) beside fp32-master AdamW, same seed, data, hyper-parameters and bf16
autocast, on this machine's CPU.

Prints each final eval loss, their ratio (the target: within 2%) and the model-state bytes per parameter of each
(weights, gradients and optimizer state, measured on the model and the optimizer).

Run: ``.venv/bin/python benchmarks/bench_pure_bf16.py --steps 300`` (or ``memtrain bench pure_bf16 --steps 300``).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from memtrain.accumulation import GradientAccumulator  # noqa: E402
from memtrain.data import builtin_corpus  # noqa: E402
from memtrain.measure import optimizer_state_bytes  # noqa: E402
from memtrain.models import GPT  # noqa: E402
from memtrain.optim import build_optimizer  # noqa: E402


def train_gpt(pure_bf16: bool, *, steps: int, model: str = "gpt-tiny", batch: int = 16, lr: float = 3e-3,
              seed: int = 0, eval_batches: int = 8, state_precision: str = "fp32") -> dict[str, float]:
    """Trains the built-in GPT on the built-in corpus under bf16 autocast, with fp32 weights and fused AdamW (an
    fp32 master) or, ``pure_bf16``, bf16 weights and ``PureBF16AdamW``; returns the final eval loss and the
    model-state bytes per parameter."""
    torch.manual_seed(seed)
    gpt = GPT.from_preset(model)
    if pure_bf16:
        gpt = gpt.to(torch.bfloat16)
        opt = build_optimizer(gpt.named_parameters(), lr=lr, weight_decay=0.1, state_precision=state_precision,
                              pure_bf16=True)
    else:
        opt = torch.optim.AdamW(gpt.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.1, fused=True)
    train, val = builtin_corpus(gpt.config.seq_len, max_bytes=2 * 2**20)
    acc = GradientAccumulator(gpt, opt, steps=1, max_grad_norm=1.0)
    order = torch.randperm(len(train), generator=torch.Generator().manual_seed(seed))
    for step in range(steps):
        idx = order[(step * batch) % (len(order) - batch):][:batch].tolist()
        x, y = (torch.stack(t) for t in zip(*(train[i] for i in idx), strict=True))
        with acc.micro_batch(is_last=True), torch.autocast("cpu", dtype=torch.bfloat16):
            acc.backward(gpt(x, y), reduction="mean")
        acc.step()
    gpt.eval()
    losses = []
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        for b in range(eval_batches):
            x, y = (torch.stack(t) for t in zip(*(val[(b * batch + i) % len(val)] for i in range(batch)),
                                                strict=True))
            losses.append(gpt(x, y).float().item())
    numel = sum(p.numel() for p in gpt.parameters())
    weights = sum(p.numel() * p.element_size() for p in gpt.parameters())
    state = optimizer_state_bytes(opt) + weights * 2  # weights, gradients (their dtype), optimizer state
    if hasattr(opt, "close"):
        opt.close()
    return {"eval_loss": sum(losses) / len(losses), "bytes_per_param": state / numel}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--model", default="gpt-tiny")
    parser.add_argument("--state-precision", choices=["fp32", "bf16"], default="fp32",
                        help="pure bf16's moments (the fp32-master run keeps fp32 moments)")
    parser.add_argument("--json", action="store_true", help="accepted for memtrain bench; prints the same table")
    args = parser.parse_args()
    started = time.perf_counter()
    master = train_gpt(False, steps=args.steps, model=args.model)
    pure = train_gpt(True, steps=args.steps, model=args.model, state_precision=args.state_precision)
    ratio = pure["eval_loss"] / master["eval_loss"]
    print(f"== pure bf16 vs fp32-master AdamW: {args.model}, {args.steps} steps, built-in corpus, bf16 autocast, CPU ==")
    print("run                                   eval loss  model state bytes/param")
    print(f"fp32 master (fused AdamW, fp32 moments)  {master['eval_loss']:.4f}     {master['bytes_per_param']:.2f}")
    print(f"pure bf16 ({args.state_precision} moments)                {pure['eval_loss']:.4f}     "
          f"{pure['bytes_per_param']:.2f}")
    print(f"ratio pure / master: {ratio:.4f} ({100 * (ratio - 1):+.2f}%; target within 2%) in "
          f"{time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
