"""The chunked loss side by side: the whole batch's fp32 logits, torch's F.linear_cross_entropy, memtrain's kernel.

A step is the loss of ``--tokens`` final hidden states (``--hidden`` wide) through a bias-free head of
``--vocab`` outputs, forward and backward (gradients of the hidden states and of the head's weight), as the last
layer of a language model computes it:

- ``whole logits``: ``F.cross_entropy(head(h).float(), y, reduction="sum")``, the baseline;
- ``torch chunked``: ``chunked_cross_entropy(..., implementation="torch")``: torch >= 2.13's chunked op
  (``LinearCrossEntropyOptions(batch_chunk_size=--chunk)``);
- ``memtrain chunked``: ``implementation="memtrain"``: chunks recomputed in backward, each writing its rows of
  one preallocated gradient;
- ``memtrain chunked, before``: the kernel memtrain had before (a non-reentrant checkpoint per slice of ``h``:
  each slice's backward allocates a zero-filled gradient of the whole ``h``), kept here for the comparison;
- with ``--prompt-share F`` the first F of every 512-token row is a prompt (labels -100), as in prompt/completion
  data, and two more cases pass ``kept=`` (the labels that count, counted on the host as the training loop does):
  ``torch chunked, prompt skipped`` and ``memtrain chunked, prompt skipped`` gather only the completion's positions
  before the head's matmul (the others run it over every position and ignore the prompt's losses).

``peak_bytes`` is the most memory the CPU allocator held at once during one step, above what existed before it
(the hidden states and the head's weight), read from ``torch.profiler``'s allocation events in an untimed step.
``loss_rel_diff`` and ``grad_rel_diff`` compare each case with the baseline: the loss's relative difference, and
the largest gradient difference over the largest gradient entry.

Run: ``.venv/bin/python benchmarks/bench_loss.py`` (issue 12's shape: 8192 tokens, hidden 512, vocabulary 32000,
fp32; about 3 minutes on 2 CPUs) or ``memtrain bench loss``; ``--precision bf16`` runs under bf16 autocast;
``--prompt-share 0.5`` adds the skipped-prompt cases (issue 32: the loss's time falls by the prompt's share).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

_HERE = Path(__file__).resolve().parent
for _path in (_HERE.parent, _HERE):  # the repo root (memtrain) and benchmarks/ (runner), when run directly
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

import contextlib  # noqa: E402

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from runner import Case, common_args, print_json_if_asked, run_side_by_side  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.checkpoint import checkpoint  # noqa: E402

from memtrain.loss import _chunk_loss, chunked_cross_entropy  # noqa: E402
from memtrain.measure import cpu_allocation_peak_bytes  # noqa: E402


def before(hidden: torch.Tensor, head: nn.Module, labels: torch.Tensor, chunk: int) -> torch.Tensor:
    """memtrain's chunked loss before issue 12: a checkpoint per slice of the hidden states."""
    total = hidden.new_zeros((), dtype=torch.float32)
    for start in range(0, labels.numel(), chunk):
        total = total + checkpoint(_chunk_loss, head, hidden[start:start + chunk], labels[start:start + chunk], -100,
                                   use_reentrant=False)
    return total


PROMPT_ROW = 512  # --prompt-share: a row's first tokens are its prompt


def main(argv: list[str] | None = None) -> list[Any]:
    parser = common_args(__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--chunk", type=int, default=1024, help="tokens per chunk (both chunked kernels)")
    parser.add_argument("--precision", choices=["fp32", "bf16"], default="fp32")
    parser.add_argument("--prompt-share", type=float, default=0.0, metavar="F",
                        help="the share of each 512-token row labelled -100 (a prompt), in [0, 1)")
    parser.set_defaults(repeats=5, warmup=1)
    args = parser.parse_args(argv)
    device = args.device
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(args.tokens, args.hidden, generator=generator).to(device).requires_grad_()
    head = nn.Linear(args.hidden, args.vocab, bias=False).to(device)
    labels = torch.randint(0, args.vocab, (args.tokens,), generator=generator)
    if not 0 <= args.prompt_share < 1:
        parser.error(f"--prompt-share {args.prompt_share} must be in [0, 1)")
    labels[torch.arange(args.tokens) % PROMPT_ROW < int(args.prompt_share * PROMPT_ROW)] = -100
    kept = int((labels != -100).sum())  # on the host, before the copy: as the training loop counts
    labels = labels.to(device)
    autocast = (torch.autocast(device.split(":")[0], dtype=torch.bfloat16) if args.precision == "bf16"
                else contextlib.nullcontext())
    losses = {
        "whole logits": lambda: F.cross_entropy(head(hidden).float(), labels, reduction="sum"),
        "torch chunked": lambda: chunked_cross_entropy(hidden, head, labels, chunk_tokens=args.chunk,
                                                       implementation="torch"),
        "memtrain chunked": lambda: chunked_cross_entropy(hidden, head, labels, chunk_tokens=args.chunk,
                                                          implementation="memtrain"),
        "memtrain chunked, before": lambda: before(hidden, head, labels, args.chunk),
    }
    if args.prompt_share:
        losses["torch chunked, prompt skipped"] = lambda: chunked_cross_entropy(
            hidden, head, labels, chunk_tokens=args.chunk, implementation="torch", kept=kept)
        losses["memtrain chunked, prompt skipped"] = lambda: chunked_cross_entropy(
            hidden, head, labels, chunk_tokens=args.chunk, implementation="memtrain", kept=kept)
    reference: dict[str, torch.Tensor] = {}

    def run(name: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        hidden.grad = head.weight.grad = None
        with autocast:
            loss = losses[name]()
        loss.backward()
        return loss.detach(), hidden.grad, head.weight.grad

    def case(name: str) -> Case:
        def setup():
            loss, grad_h, grad_w = run(name)
            if not reference:
                reference.update(loss=loss, grad_h=grad_h.clone(), grad_w=grad_w.clone())
            figures = {
                "loss_rel_diff": abs(loss.item() - reference["loss"].item()) / abs(reference["loss"].item()),
                "grad_rel_diff": max((g - w).abs().max().item() / w.abs().max().item()
                                     for g, w in ((grad_h, reference["grad_h"]), (grad_w, reference["grad_w"]))),
            }
            hidden.grad = head.weight.grad = None
            figures["peak_bytes"] = cpu_allocation_peak_bytes(lambda: run(name)) if device == "cpu" else None

            def step():
                run(name)
                hidden.grad = head.weight.grad = None
                return figures
            return step
        return Case(name, setup)

    title = f"loss-{args.precision}" + (f"-prompt{args.prompt_share:g}" if args.prompt_share else "")
    path = args.out or Path("bench-results") / f"{title}.json"
    results = run_side_by_side([case(name) for name in losses], title=title, repeats=args.repeats,
                               warmup=args.warmup, device=device, json_path=path, tokens_per_step=args.tokens)
    print_json_if_asked(args, path)
    return results


if __name__ == "__main__":
    main()
