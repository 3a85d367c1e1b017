"""Length bucketing: far less padding than random batches, every example once per epoch, the costliest batch
first, seeded, and disjoint equal shares for the ranks."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.utils.data import BatchSampler, RandomSampler

from memtrain.data.buckets import LengthBucketSampler
from memtrain.data.collate import PadCollate
from memtrain.data.documents import TokenDocuments, stdlib_documents
from memtrain.data.loader import Machine, make_loader
from memtrain.errors import ConfigError

TWO_CPUS = Machine(cpus=2, accelerator=None)


@pytest.fixture(scope="module")
def mixed_documents() -> TokenDocuments:
    """Real text of mixed lengths: 1 MiB of the standard library split on blank lines, at most 129 tokens."""
    return stdlib_documents(max_len=129, max_bytes=2**20)


def padding(lengths: np.ndarray, batches: list[list[int]]) -> tuple[int, int]:
    """(padded positions, all positions) when each batch pads its documents' pairs to its longest."""
    padded = total = 0
    for batch in batches:
        pairs = lengths[batch] - 1
        total += int(pairs.max()) * len(pairs)
        padded += int(pairs.max()) * len(pairs) - int(pairs.sum())
    return padded, total


def test_bucketing_cuts_padded_tokens_by_at_least_30_percent_against_random_batches(mixed_documents):
    lengths, batch_size = mixed_documents.lengths, 16
    random_batches = [list(b) for b in BatchSampler(
        RandomSampler(range(len(lengths)), generator=torch.Generator().manual_seed(0)), batch_size, False)]
    bucketed = list(LengthBucketSampler(lengths, batch_size, seed=0))
    random_pad, random_total = padding(lengths, random_batches)
    bucket_pad, bucket_total = padding(lengths, bucketed)
    cut = 1 - bucket_pad / random_pad
    print(f"padded positions: random {random_pad} of {random_total} ({random_pad / random_total:.1%}), bucketed "
          f"{bucket_pad} of {bucket_total} ({bucket_pad / bucket_total:.1%}): {cut:.1%} fewer")
    assert cut >= 0.30, f"bucketing cut padding by {cut:.1%} only ({random_pad} -> {bucket_pad} padded positions)"


def test_collate_reports_the_padding_the_sampler_saves(mixed_documents):
    subset = TokenDocuments(mixed_documents.tokens, mixed_documents.starts[:800], mixed_documents.lengths[:800])
    fractions = {}
    for name, batch_sampler in (
        ("random", BatchSampler(RandomSampler(range(800), generator=torch.Generator().manual_seed(0)), 16, False)),
        ("bucketed", LengthBucketSampler(subset.lengths, 16, seed=0)),
    ):
        batches = list(make_loader(subset, batch_sampler=batch_sampler, collate_fn=PadCollate(), num_workers=0,
                                   machine=TWO_CPUS))
        assert sum(b.real_tokens for b in batches) == int((subset.lengths - 1).sum())
        fractions[name] = sum(b.padding_fraction * b.y.numel() for b in batches) / sum(b.y.numel() for b in batches)
    assert fractions["bucketed"] < 0.7 * fractions["random"], fractions


def test_every_example_once_per_epoch_and_epochs_differ(mixed_documents):
    n = 1001  # not a multiple of the batch size: the last batch of a mega-batch is partial
    sampler = LengthBucketSampler(mixed_documents.lengths[:n], 8, mega_batch_factor=10, seed=1)
    orders = []
    for epoch in range(3):
        sampler.set_epoch(epoch)
        batches = list(sampler)
        flat = [i for b in batches for i in b]
        assert sorted(flat) == list(range(n)), f"epoch {epoch}: {len(flat)} yielded, {len(set(flat))} distinct"
        assert len(batches) == len(sampler) and max(map(len, batches)) == 8
        orders.append(flat)
    assert orders[0] != orders[1] != orders[2]


def test_the_costliest_batch_comes_first(mixed_documents):
    lengths = mixed_documents.lengths[:2000]
    for epoch in range(3):
        sampler = LengthBucketSampler(lengths, 8, seed=2)
        sampler.set_epoch(epoch)
        costs = [len(b) * int(lengths[b].max()) for b in sampler]
        assert costs[0] == max(costs), (costs[0], max(costs))


def test_seeded_runs_repeat_exactly_and_another_seed_differs(mixed_documents):
    lengths = mixed_documents.lengths[:3000]

    def run(seed: int, epoch: int) -> list[list[int]]:
        sampler = LengthBucketSampler(lengths, 8, seed=seed)
        sampler.set_epoch(epoch)
        return list(sampler)

    assert run(5, 2) == run(5, 2)
    assert run(5, 2) != run(6, 2) and run(5, 2) != run(5, 3)


@pytest.mark.parametrize("n, drop_last", [(1000, False), (1001, False), (1001, True)])
def test_two_ranks_get_disjoint_shares_and_step_the_same_number_of_times(mixed_documents, n, drop_last):
    lengths = mixed_documents.lengths[:n]
    ranks = [list(LengthBucketSampler(lengths, 8, seed=4, drop_last=drop_last, rank=r, world_size=2))
             for r in range(2)]
    shares = [[i for b in batches for i in b] for batches in ranks]
    assert len(ranks[0]) == len(ranks[1]), [len(r) for r in ranks]
    assert [len(b) for b in ranks[0]] == [len(b) for b in ranks[1]], "ranks must hold equal batch shapes"
    overlap = set(shares[0]) & set(shares[1])
    if drop_last:
        assert not overlap and all(len(b) == 8 for b in ranks[0] + ranks[1])
        assert len(shares[0]) + len(shares[1]) == n // 16 * 16
    elif n % 2 == 0:
        assert not overlap and sorted(shares[0] + shares[1]) == list(range(n)), f"overlap {sorted(overlap)}"
    else:  # one example repeated so that both ranks step equally, as DistributedSampler does
        assert len(overlap) <= 1 and set(shares[0]) | set(shares[1]) == set(range(n)), sorted(overlap)
    # Dealt from one sorted global batch, the ranks' batches have similar longest lengths at each step.
    gaps = [abs(int(lengths[a].max()) - int(lengths[b].max())) for a, b in zip(*ranks, strict=True)]
    assert np.median(gaps) <= 2, f"median gap in longest length between ranks: {np.median(gaps)}"


def test_sampler_takes_rank_and_world_size_from_torch_distributed(monkeypatch):
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.distributed, "get_rank", lambda: 1)
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda: 2)
    sampler = LengthBucketSampler(list(range(1, 9)), 2, seed=0)
    assert (sampler.rank, sampler.world_size, len(sampler)) == (1, 2, 2)
    explicit = LengthBucketSampler(list(range(1, 9)), 2, seed=0, rank=1, world_size=2)
    assert list(sampler) == list(explicit)


def test_sampler_rejects_bad_arguments():
    with pytest.raises(ConfigError, match="rank=2 must be below world_size=2"):
        LengthBucketSampler([3, 4], 1, rank=2, world_size=2)
    with pytest.raises(ConfigError, match="fill no global batch"):
        LengthBucketSampler([3, 4, 5], 4, drop_last=True)
    with pytest.raises(ConfigError, match="batch_size=0"):
        LengthBucketSampler([3, 4], 0)
