"""Data loading side by side: ``make_loader`` vs plain ``DataLoader`` defaults, and bucketed vs random batches.

Workers overlap loading with training at the cost of a process each; this benchmark measures what that buys on
a CPU-bound transform (a pure-Python hashing tokenizer over byte windows of the standard library), on ``--cores``
CPUs (default 2: the process and its workers are pinned to them, so "auto" plans for 2 CPUs on any machine).
Each case's step pulls ``--batches`` batches from one iterator that lives across steps and epochs (an epoch is
``--epoch-batches`` batches, so workers that are not persistent restart every few steps, as in real training).

Tables:

1. ``data-loading``: loading alone (batches/s is the loader's ceiling).
2. ``data-loading-with-step``: each batch is followed by ``--step-ms`` of simulated accelerator work
   (``time.sleep``: the host waits for the device, so a worker can load meanwhile, which is what happens when
   training on a GPU).

Cases run one after another (``isolate=True``), so no case's workers compete with another case's for the CPUs.
3. ``data-bucketing``: one epoch of gpt-tiny forward + backward per step on documents of mixed lengths (the
   first ``--bucket-bytes`` of the standard library split on blank lines, at most 65 tokens), random batches vs
   ``LengthBucketSampler`` vs random batches packed into full rows (``PackCollate``, attention kept inside each
   document); the same real tokens in all, so the time ratio is what padding costs (the packed case also pays
   for an explicit attention mask where the others use SDPA's causal kernel).
   ``padding_fraction`` is the share of padded positions.

Cases: ``DataLoader defaults`` (num_workers=0: the baseline), ``DataLoader num_workers=1`` (not persistent),
``make_loader auto`` (the settings printed above the tables), ``make_loader num_workers=<cores>``.

Run: ``.venv/bin/python benchmarks/bench_data.py`` or ``memtrain bench data`` (about 30 s on 2 CPUs).
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

_HERE = Path(__file__).resolve().parent
for _path in (_HERE.parent, _HERE):  # the repo root (memtrain) and benchmarks/ (runner), when run directly
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

import numpy as np  # noqa: E402
import torch  # noqa: E402
from runner import Case, Result, common_args, print_json_if_asked, run_side_by_side  # noqa: E402
from torch.utils.data import BatchSampler, DataLoader, Dataset, RandomSampler  # noqa: E402

from memtrain.data import (  # noqa: E402
    LengthBucketSampler,
    PackCollate,
    PackedBatch,
    PadCollate,
    TokenDocuments,
    make_loader,
    resolve_loader_settings,
    stdlib_corpus,
    stdlib_documents,
)
from memtrain.models import GPT, GPT_PRESETS  # noqa: E402


class HashedWindows(Dataset):
    """Byte windows mapped to ``vocab`` ids by a rolling hash in pure Python: a CPU-bound transform per example."""

    def __init__(self, tokens: np.ndarray, window: int, vocab: int = 32000):
        self.tokens, self.window, self.vocab = tokens, window, vocab

    def __len__(self) -> int:
        return len(self.tokens) // self.window

    def __getitem__(self, i: int) -> torch.Tensor:
        raw = self.tokens[i * self.window: (i + 1) * self.window].tobytes()
        ids, h = [], 0
        for byte in raw:  # a stand-in for tokenisation or augmentation: Python-level work on every byte
            h = (h * 31 + byte) % 1_000_003
            ids.append(h % self.vocab)
        return torch.tensor(ids)


def forever(loader: Any) -> Iterator[Any]:
    """Epoch after epoch through one loader (``set_epoch`` on a bucketing sampler, as a training loop does)."""
    epoch = 0
    while True:
        if hasattr(loader.batch_sampler, "set_epoch"):
            loader.batch_sampler.set_epoch(epoch)
        yield from loader
        epoch += 1


def loading_case(name: str, build: Any, *, batches: int, step_s: float, batch_size: int, window: int) -> Case:
    def setup():
        batch_iter = forever(build())

        def step() -> dict[str, Any]:
            for _ in range(batches):
                batch = next(batch_iter)
                assert batch.shape == (batch_size, window), batch.shape
                if step_s:
                    time.sleep(step_s)  # the host waiting for the accelerator's step
            return {}

        return step

    return Case(name, setup)


def bucketing_case(name: str, docs: TokenDocuments, batch_sampler: Any, collate: Any = None) -> Case:
    """One step is one epoch: every case then trains on the same real tokens, and only the padding differs."""

    def setup():
        torch.manual_seed(0)
        model = GPT(GPT_PRESETS["gpt-tiny"])
        loader = make_loader(docs, batch_sampler=batch_sampler, collate_fn=collate or PadCollate(), num_workers=0)
        epochs = iter(range(10**9))

        def step() -> dict[str, Any]:
            if hasattr(batch_sampler, "set_epoch"):
                batch_sampler.set_epoch(next(epochs))
            padded = total = 0
            for batch in loader:
                segments = {"segments": batch.segments} if isinstance(batch, PackedBatch) else {}
                model(batch.x, batch.y, **segments).backward()
                padded += batch.y.numel() - batch.real_tokens
                total += batch.y.numel()
            model.zero_grad(set_to_none=True)
            return {"padding_fraction": padded / total, "batches": len(loader)}

        return step

    return Case(name, setup)


def batches_per_s(results: list[Result], batches: int) -> str:
    return "  ".join(f"{r.name}: {batches / r.median_s:.1f}" for r in results if r.median_s)


def main() -> None:
    parser = common_args(__doc__.splitlines()[0])
    parser.add_argument("--cores", type=int, default=2, help="CPUs to pin the benchmark (and its workers) to")
    parser.add_argument("--threads", type=int, default=1, help="torch threads of the training process")
    parser.add_argument("--batches", type=int, default=16, help="batches pulled per timed step")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--window", type=int, default=1024, help="bytes per example")
    parser.add_argument("--epoch-batches", type=int, default=16, help="batches per epoch (dataset size)")
    parser.add_argument("--step-ms", type=float, default=20.0, help="simulated accelerator time per batch")
    parser.add_argument("--bucket-bytes", type=int, default=2**15, help="text for the bucketing table's epoch")
    parser.add_argument("--tables", default="loading,step,bucketing", help="comma-separated subset to run")
    args = parser.parse_args()
    if args.device != "cpu":
        print(f"note: --device {args.device} ignored: data loading runs on the host", file=sys.stderr)

    if hasattr(os, "sched_setaffinity"):
        cpus = sorted(os.sched_getaffinity(0))[: args.cores]
        os.sched_setaffinity(0, cpus)  # workers inherit it
    # One thread by default: OpenMP threads that spin on a busy machine make gpt-tiny's step 20x slower.
    torch.set_num_threads(args.threads)
    tables = set(args.tables.split(","))

    tokens = stdlib_corpus(args.window * args.batch_size * args.epoch_batches)
    dataset = HashedWindows(tokens, args.window)
    print("make_loader auto settings on this machine:")
    print("  " + resolve_loader_settings().summary().replace("\n", "\n  "))

    def plain(num_workers: int) -> Any:
        return lambda: DataLoader(dataset, batch_size=args.batch_size, shuffle=True, num_workers=num_workers)

    def ours(**kwargs: Any) -> Any:
        return lambda: make_loader(dataset, batch_size=args.batch_size, shuffle=True, seed=0, **kwargs)

    builds = [("DataLoader defaults", plain(0)), ("DataLoader num_workers=1", plain(1)),
              ("make_loader auto", ours()), (f"make_loader num_workers={args.cores}", ours(num_workers=args.cores))]
    for key, title, step_s in (("loading", "data-loading", 0.0), ("step", "data-loading-with-step",
                                                                  args.step_ms / 1000)):
        if key not in tables:
            continue
        cases = [loading_case(name, build, batches=args.batches, step_s=step_s, batch_size=args.batch_size,
                              window=args.window) for name, build in builds]
        out = args.out if args.out and len(tables) == 1 else None
        results = run_side_by_side(cases, title=title, repeats=args.repeats, warmup=args.warmup, json_path=out,
                                   isolate=True,
                                   tokens_per_step=args.batches * args.batch_size * args.window)
        print(f"batches/s: {batches_per_s(results, args.batches)}\n")
        print_json_if_asked(args, out or Path("bench-results") / f"{title}.json")

    if "bucketing" in tables:
        docs = stdlib_documents(max_len=GPT_PRESETS["gpt-tiny"].seq_len + 1, max_bytes=args.bucket_bytes)
        random_batches = BatchSampler(RandomSampler(range(len(docs)), generator=torch.Generator().manual_seed(0)),
                                      args.batch_size, drop_last=False)
        cases = [bucketing_case("random batches", docs, random_batches),
                 bucketing_case("length-bucketed", docs, LengthBucketSampler(docs.lengths, args.batch_size)),
                 bucketing_case("random batches, packed", docs, random_batches,
                                PackCollate(seq_len=GPT_PRESETS["gpt-tiny"].seq_len))]
        out = args.out if args.out and len(tables) == 1 else None
        run_side_by_side(cases, title="data-bucketing", repeats=args.repeats, warmup=args.warmup, json_path=out)
        print_json_if_asked(args, out or Path("bench-results") / "data-bucketing.json")


if __name__ == "__main__":
    main()
