"""Which examples each optimizer step uses: ``StepBatches``, a sampler that depends only on (seed, step), so that a
resumed run, a retried step and every rank see what an uninterrupted run sees."""

from __future__ import annotations

import sys
from collections.abc import Iterator

import torch
from torch.utils.data import Sampler


class StepBatches(Sampler[list[int]]):
    """Micro-batches of example indices, from optimizer step ``start`` on; depends only on (seed, step).

    Step ``s`` uses examples ``[s*G, (s+1)*G)`` of an endless stream of per-epoch shuffles (G: the global batch);
    rank ``r`` takes its slice, cut into micro-batches. Resuming at step ``s`` or retrying a step with a smaller
    micro-batch therefore sees exactly the examples an uninterrupted run sees.
    """

    def __init__(self, num_examples: int, global_batch: int, micro_batch: int, *, seed: int, start: int = 0,
                 rank: int = 0, world: int = 1):
        self.n, self.global_batch, self.micro_batch = num_examples, global_batch, micro_batch
        self.seed, self.start, self.rank, self.world = seed, start, rank, world
        self._perms: dict[int, torch.Tensor] = {}

    def _perm(self, epoch: int) -> torch.Tensor:
        if epoch not in self._perms:
            self._perms = {epoch: torch.randperm(self.n, generator=torch.Generator().manual_seed(self.seed + epoch))}
        return self._perms[epoch]

    def step_indices(self, step: int) -> list[int]:
        first = step * self.global_batch
        out = [int(self._perm(i // self.n)[i % self.n]) for i in range(first, first + self.global_batch)]
        share = self.global_batch // self.world
        return out[self.rank * share:(self.rank + 1) * share]

    def __iter__(self) -> Iterator[list[int]]:
        step = self.start
        while True:
            mine = self.step_indices(step)
            for i in range(0, len(mine), self.micro_batch):
                yield mine[i:i + self.micro_batch]
            step += 1

    def __len__(self) -> int:  # endless; DataLoader only asks for len() when someone calls len(loader)
        return sys.maxsize
