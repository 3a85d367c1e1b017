"""Length bucketing: batches of examples of similar lengths (much less padding than random batches), the
costliest batch first, dealt out evenly to the ranks of a distributed run.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import numpy as np
import torch
from torch.utils.data import Sampler

from memtrain.errors import ConfigError
from memtrain.message import arg


def _distributed_rank_and_size() -> tuple[int, int]:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return 0, 1


class LengthBucketSampler(Sampler[list[int]]):
    """Batches of similar lengths: much less padding than random batches, at the price of some randomness.

    Each epoch: shuffle the examples (seed, epoch), cut them into mega-batches of ``mega_batch_factor`` global
    batches, sort each mega-batch by length, cut it into global batches, and shuffle the order of those batches.
    The global batch with the most padded tokens comes first, so an out-of-memory error shows at step 1, not hours
    in. With ``world_size`` ranks, a global batch of ``batch_size * world_size`` similar lengths is dealt out so
    each rank gets ``batch_size`` of them: ranks see disjoint examples and step the same number of times, with
    similar shapes at each step (no rank waits for a much longer batch).

    Every example is yielded exactly once per epoch on one rank. With ``world_size > 1`` and a dataset size that
    is not a multiple of ``world_size``, ``drop_last=False`` repeats up to ``world_size - 1`` examples (as
    ``DistributedSampler`` does) so that every rank steps the same number of times; ``drop_last=True`` instead
    drops the examples that do not fill a whole global batch (different ones each epoch).

    Args:
        lengths: each example's length in tokens (e.g. ``TokenDocuments.lengths``).
        batch_size: examples per batch on each rank.
        mega_batch_factor: global batches per sorted mega-batch; larger pads less and shuffles less.
        shuffle: False keeps the dataset order apart from sorting within mega-batches.
        seed: with ``set_epoch``, fixes the order: same seed and epoch, same batches.
        drop_last: drop (rather than pad out) examples that do not fill a whole global batch.
        rank, world_size: this process's share; default from ``torch.distributed`` when it is initialised.

    Example:
        >>> sampler = LengthBucketSampler([5, 1, 4, 2, 3, 6], batch_size=2, seed=0)
        >>> batches = list(sampler)
        >>> sorted(i for b in batches for i in b), batches[0]
        ([0, 1, 2, 3, 4, 5], [5, 0])
    """

    def __init__(self, lengths: Sequence[int] | np.ndarray, batch_size: int, *, mega_batch_factor: int = 50,
                 shuffle: bool = True, seed: int = 0, drop_last: bool = False, rank: int | None = None,
                 world_size: int | None = None):
        if rank is None or world_size is None:
            default_rank, default_size = _distributed_rank_and_size()
            rank = default_rank if rank is None else rank
            world_size = default_size if world_size is None else world_size
        self.lengths = np.asarray(lengths, dtype=np.int64)
        problems = []
        for name, value, low in (("batch_size", batch_size, 1), ("mega_batch_factor", mega_batch_factor, 1),
                                 ("world_size", world_size, 1), ("rank", rank, 0), ("seed", seed, 0)):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                problems.append(f"{arg(name, value)} must be an integer >= {low}. To resolve this error, pass e.g. "
                                f"{arg(name, max(low, 1))}.")
        if not problems and rank >= world_size:
            problems.append(f"rank={rank} must be below {arg('world_size', world_size)}. To resolve this error, pass "
                            "the rank and world size of torch.distributed (or leave both None to read them).")
        if self.lengths.ndim != 1 or len(self.lengths) == 0:
            problems.append(f"lengths has shape {self.lengths.shape}; it must list one length per example. To "
                            "resolve this error, pass a flat array of len(dataset) lengths.")
        elif not problems and drop_last and len(self.lengths) < batch_size * world_size:
            problems.append(f"{len(self.lengths)} examples fill no global batch of {batch_size} x {world_size} "
                            "ranks with drop_last=True. To resolve this error, lower batch_size or pass "
                            "drop_last=False.")
        ConfigError.raise_if(problems)
        self.batch_size, self.mega_batch_factor, self.shuffle = batch_size, mega_batch_factor, shuffle
        self.seed, self.drop_last, self.rank, self.world_size = seed, drop_last, rank, world_size
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        """Call before each epoch (as with ``DistributedSampler``): a new order, the same on every rank."""
        self.epoch = epoch

    def _epoch_order(self) -> np.ndarray:
        n, group = len(self.lengths), self.batch_size * self.world_size
        rng = np.random.default_rng([self.seed, self.epoch])
        order = rng.permutation(n) if self.shuffle else np.arange(n)
        if self.drop_last:
            return order[: n // group * group]
        return np.concatenate([order, np.resize(order, (-n) % self.world_size)])

    def global_batches(self) -> list[np.ndarray]:
        """This epoch's global batches (all ranks' examples), in order; rank ``r`` takes ``batch[r::world_size]``."""
        order, group = self._epoch_order(), self.batch_size * self.world_size
        mega = self.mega_batch_factor * group  # a multiple of the global batch, so batches never straddle two
        batches = []
        for start in range(0, len(order), mega):
            chunk = order[start: start + mega]
            chunk = chunk[np.argsort(-self.lengths[chunk], kind="stable")]
            batches += [chunk[i: i + group] for i in range(0, len(chunk), group)]
        # The costliest batch (rows per rank x longest example) first: an out-of-memory error shows at step 1.
        cost = [-(-len(b) // self.world_size) * int(self.lengths[b].max()) for b in batches]
        first = int(np.argmax(cost))
        rest = batches[:first] + batches[first + 1:]
        if self.shuffle:
            rng = np.random.default_rng([self.seed, self.epoch, 1])
            rest = [rest[i] for i in rng.permutation(len(rest))]
        return [batches[first], *rest]

    def __iter__(self) -> Iterator[list[int]]:
        # Sorted descending within a global batch, so dealing every world_size-th example gives each rank
        # similar lengths at the same step.
        for batch in self.global_batches():
            yield batch[self.rank:: self.world_size].tolist()

    def __len__(self) -> int:
        return -(-len(self._epoch_order()) // (self.batch_size * self.world_size))
