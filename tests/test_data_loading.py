"""Data loading: validated loader settings, the device prefetcher, length bucketing, document datasets.

The corpus part of memtrain/data.py (ByteWindows, builtin_corpus) is tested in tests/test_data.py.
"""

from __future__ import annotations

import json
import re
from collections import namedtuple
from dataclasses import dataclass

import numpy as np
import pytest
import torch
from torch.utils.data import BatchSampler, DataLoader, RandomSampler

from memtrain.data import (
    DevicePrefetcher,
    LengthBucketSampler,
    Machine,
    PackCollate,
    PackedBatch,
    PadCollate,
    TokenBatch,
    TokenDocuments,
    make_loader,
    map_tensors,
    resolve_loader_settings,
    stdlib_documents,
)
from memtrain.errors import ConfigError
from memtrain.models import GPT, GPT_PRESETS

TWO_CPUS = Machine(cpus=2, accelerator=None)
ONE_CPU = Machine(cpus=1, accelerator=None)
BIG_GPU_BOX = Machine(cpus=32, accelerator="cuda")


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


# -- settings --------------------------------------------------------------------------------------------------
def test_auto_settings_on_two_cpus_keep_one_cpu_for_training_and_do_not_pin():
    s = resolve_loader_settings(machine=TWO_CPUS)
    assert (s.num_workers, s.pin_memory, s.prefetch_factor, s.persistent_workers) == (1, False, 2, True), s
    assert "2 usable CPUs" in s.reasons[0] and "one kept for the training loop" in s.reasons[0], s.reasons
    assert any("pin_memory=False, because: no accelerator" in r for r in s.reasons), s.reasons
    assert s.hints == ()


def test_auto_settings_on_one_cpu_use_no_workers_and_say_why():
    s = resolve_loader_settings(machine=ONE_CPU)
    assert (s.num_workers, s.prefetch_factor, s.persistent_workers) == (0, None, False), s
    assert "compete with the training loop" in s.summary(), s.summary()


def test_auto_settings_with_an_accelerator_pin_cap_workers_and_share_cpus_between_ranks():
    s = resolve_loader_settings(machine=BIG_GPU_BOX)
    assert (s.num_workers, s.pin_memory) == (8, True), s
    assert "capped at 8" in s.reasons[0], s.reasons
    assert not resolve_loader_settings(machine=BIG_GPU_BOX, device="cpu").pin_memory  # batches stay on the host
    per_rank = resolve_loader_settings(machine=Machine(16, "cuda", local_world_size=4))
    assert per_rank.num_workers == 3, per_rank  # 16 CPUs / 4 ranks, one kept for each rank's training loop
    assert "4 local processes" in per_rank.reasons[0], per_rank.reasons


@pytest.mark.parametrize("kwargs, needle", [
    ({"num_workers": 0, "persistent_workers": True}, "persistent_workers=True needs worker processes"),
    ({"num_workers": 0, "prefetch_factor": 4}, "prefetch_factor=4 needs worker processes"),
    ({"pin_memory": True}, "pin_memory=True, but no accelerator is present"),
    ({"num_workers": -1}, "num_workers=-1 must be 'auto' or an integer >= 0"),
    ({"num_workers": True}, "num_workers=True must be"),
    ({"prefetch_factor": 0}, "prefetch_factor=0 must be 'auto' or an integer >= 1"),
    ({"pin_memory": "yes"}, "pin_memory='yes' must be"),
    ({"device": "cuda"}, "this machine's accelerator is None"),
])
def test_contradictory_or_invalid_settings_raise_one_error_naming_the_fix(kwargs, needle):
    with pytest.raises(ConfigError) as info:
        resolve_loader_settings(machine=TWO_CPUS, **kwargs)
    assert needle in str(info.value), str(info.value)
    assert "To resolve this error" in str(info.value) or "must be" in str(info.value), str(info.value)


def test_every_problem_is_reported_at_once():
    with pytest.raises(ConfigError) as info:
        make_loader(list(range(8)), batch_size=0, num_workers=0, persistent_workers=True, prefetch_factor=2,
                    pin_memory=True, machine=TWO_CPUS)
    assert len(info.value.problems) == 4, info.value.problems


def test_pin_memory_true_with_cpu_device_is_an_error_even_with_an_accelerator():
    with pytest.raises(ConfigError, match="batches go to cpu"):
        resolve_loader_settings(machine=BIG_GPU_BOX, device="cpu", pin_memory=True)


def test_flags_that_cannot_apply_after_auto_chose_no_workers_are_reported_not_dropped():
    s = resolve_loader_settings(machine=ONE_CPU, persistent_workers=True, prefetch_factor=4)
    assert (s.num_workers, s.persistent_workers, s.prefetch_factor) == (0, False, None), s
    assert len(s.hints) == 2 and all("does not apply" in h for h in s.hints), s.hints
    assert s.summary().count("Hint: ") == 2, s.summary()


def test_valid_but_poor_choices_get_a_hint():
    many = resolve_loader_settings(machine=TWO_CPUS, num_workers=6)
    assert many.num_workers == 6 and "exceeds" in many.hints[0], many.hints
    unpinned = resolve_loader_settings(machine=BIG_GPU_BOX, pin_memory=False)
    assert not unpinned.pin_memory and "cannot overlap" in unpinned.hints[0], unpinned.hints


def test_plain_dataloader_fails_or_silently_accepts_what_make_loader_reports():
    # The founding document's flags: torch raises a bare ValueError for one, and only warns for the other.
    with pytest.raises(ValueError, match="persistent_workers"):
        DataLoader(list(range(4)), num_workers=0, persistent_workers=True)
    with pytest.raises(ConfigError, match="To resolve this error, pass num_workers >= 1"):
        make_loader(list(range(4)), batch_size=2, num_workers=0, persistent_workers=True, machine=TWO_CPUS)


@pytest.mark.parametrize("kwargs, needle", [
    ({"batch_size": 4, "batch_sampler": BatchSampler(range(8), 4, False)}, "batch_size cannot apply"),
    ({"batch_size": 4, "shuffle": True, "sampler": range(8)}, "shuffle=True with a sampler"),
    ({"batch_size": 16, "drop_last": True}, "fewer than one batch of 16"),
    ({}, "no batch_size"),
])
def test_make_loader_rejects_contradictory_batching(kwargs, needle):
    with pytest.raises(ConfigError, match=needle):
        make_loader(list(range(8)), num_workers=0, machine=TWO_CPUS, **kwargs)


def test_make_loader_applies_every_resolved_setting_and_keeps_the_reasons():
    loader = make_loader(list(range(8)), batch_size=2, machine=TWO_CPUS)
    s = loader.memtrain_settings
    assert (loader.num_workers, loader.pin_memory, loader.prefetch_factor, loader.persistent_workers) == \
        (s.num_workers, s.pin_memory, s.prefetch_factor, s.persistent_workers) == (1, False, 2, True)


def test_seeded_order_repeats_exactly_whatever_the_worker_settings():
    data = torch.arange(40).reshape(20, 2)

    def epochs(**kwargs):
        loader = make_loader(data, batch_size=4, shuffle=True, seed=7, machine=TWO_CPUS, **kwargs)
        return [torch.cat(list(loader)) for _ in range(3)]

    with_worker = epochs()  # auto: one persistent worker
    for other in (epochs(), epochs(num_workers=0), epochs(num_workers=1, persistent_workers=False)):
        assert all(torch.equal(a, b) for a, b in zip(with_worker, other, strict=True)), (with_worker, other)
    # The negative: torch's own seeded shuffle changes from epoch 2 with persistent workers (the workers' base
    # seed is drawn from the same generator, once per new iterator), so the order would depend on the machine.
    plain = [DataLoader(data, batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(7),
                        num_workers=n, persistent_workers=n > 0) for n in (0, 1)]
    plain_epochs = [[torch.cat(list(loader)) for _ in range(2)] for loader in plain]
    assert torch.equal(plain_epochs[0][0], plain_epochs[1][0]) and not torch.equal(plain_epochs[0][1],
                                                                                     plain_epochs[1][1])
    assert not torch.equal(with_worker[0], with_worker[1]), "the second epoch must be a new shuffle"
    assert not torch.equal(with_worker[0], torch.cat(list(make_loader(
        data, batch_size=4, shuffle=True, seed=8, num_workers=0, machine=TWO_CPUS)))), "another seed, same order"


# -- prefetcher ------------------------------------------------------------------------------------------------
Pair = namedtuple("Pair", "a b")


@dataclass
class Holder:
    t: torch.Tensor
    name: str


def nested_batches() -> list:
    g = torch.Generator().manual_seed(0)
    return [{"x": torch.randn(2, 3, generator=g), "pair": Pair(torch.full((2,), i), [torch.ones(1) * i, "tag"]),
             "holder": Holder(torch.tensor([i]), f"b{i}"), "step": i} for i in range(5)]


def test_prefetcher_on_cpu_passes_the_loaders_batches_through_unchanged():
    batches = nested_batches()
    out = list(DevicePrefetcher(batches, "cpu"))
    assert len(out) == len(batches) and all(a is b for a, b in zip(out, batches, strict=True))


def test_prefetcher_yields_the_same_batches_in_the_same_order_as_the_loader():
    loader = make_loader(TokenDocuments.from_texts([f"document {i} " * (i + 1) for i in range(30)]),
                         batch_sampler=LengthBucketSampler([9 * (i + 1) + 1 for i in range(30)], 4, seed=3),
                         collate_fn=PadCollate(), machine=TWO_CPUS)
    direct = list(loader)
    prefetched = list(DevicePrefetcher(loader, "cpu"))
    assert len(prefetched) == len(direct) == len(DevicePrefetcher(loader, "cpu")) == 8
    for a, b in zip(direct, prefetched, strict=True):
        assert isinstance(b, TokenBatch) and torch.equal(a.x, b.x) and torch.equal(a.y, b.y), (a, b)


def test_prefetcher_moves_nested_tensors_and_keeps_the_structure():
    # "meta" exercises the copying path (a device other than the CPU without streams) on any machine.
    out = list(DevicePrefetcher(nested_batches(), "meta"))
    for i, batch in enumerate(out):
        assert batch["x"].device.type == "meta" and batch["x"].shape == (2, 3)
        assert isinstance(batch["pair"], Pair) and batch["pair"].a.device.type == "meta"
        assert batch["pair"].b[0].device.type == "meta" and batch["pair"].b[1] == "tag"
        assert isinstance(batch["holder"], Holder) and batch["holder"].t.device.type == "meta"
        assert batch["holder"].name == f"b{i}" and batch["step"] == i  # non-tensors pass through, in order


def test_map_tensors_reaches_every_tensor():
    seen = []
    map_tensors(seen.append, nested_batches()[0])
    assert len(seen) == 4, seen


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: the side-stream path")
def test_prefetcher_on_cuda_copies_on_a_side_stream_and_matches_the_loader():
    data = torch.randn(64, 256, 256)
    loader = make_loader(data, batch_size=8, num_workers=0, device="cuda")
    assert loader.memtrain_settings.pin_memory
    prefetcher = DevicePrefetcher(loader, "cuda")
    for host, dev in zip(loader, prefetcher, strict=True):
        dev = dev @ dev  # compute on the current stream while the next copy runs on the side stream
        assert torch.allclose((host.cuda() @ host.cuda()), dev), "a batch was read before its copy landed"


# -- bucketing -------------------------------------------------------------------------------------------------
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


def test_padded_batch_gives_the_same_loss_as_each_document_alone():
    torch.manual_seed(0)
    model = GPT(GPT_PRESETS["gpt-tiny"]).eval()
    docs = TokenDocuments.from_texts(["def f(x):\n    return x\n", "a = 1\n", "class A:\n    pass\n\n# end"])
    batch = PadCollate()([docs[i] for i in range(len(docs))])
    assert batch.real_tokens == int((docs.lengths - 1).sum()) and 0 < batch.padding_fraction < 1
    with torch.no_grad():
        padded = model(batch.x, batch.y, reduction="sum")
        alone = sum(model(d[None, :-1], d[None, 1:], reduction="sum") for d in (docs[i] for i in range(len(docs))))
        unmasked = model(batch.x, torch.where(batch.y == -100, 0, batch.y), reduction="sum")
    assert torch.allclose(padded, alone, rtol=1e-5), (padded.item(), alone.item())
    assert not torch.allclose(unmasked, alone, rtol=1e-3), "padding must be excluded from the loss"


# -- documents -------------------------------------------------------------------------------------------------
def test_jsonl_documents_round_trip(tmp_path):
    texts = ["first document", "", "ünïcode ✓ text", "x", "a\n\nparagraphs stay in one document"]
    path = tmp_path / "docs.jsonl"
    path.write_text("".join(json.dumps({"text": t, "id": i}) + "\n" for i, t in enumerate(texts)) + "\n")
    docs = TokenDocuments.from_file(path)
    kept = [t.encode() for t in texts if len(t.encode()) >= 2]  # a document needs one (input, target) pair
    assert [bytes(docs[i].tolist()) for i in range(len(docs))] == kept
    assert isinstance(docs.tokens, np.ndarray) and docs.tokens.dtype == np.uint8 and docs.starts.dtype == np.int64


def test_split_holds_out_the_last_documents_sharing_the_tokens():
    docs = TokenDocuments.from_texts([f"doc {i}" for i in range(20)])
    train, val = docs.split(0.1)
    assert (len(train), len(val)) == (18, 2) and train.tokens is docs.tokens is val.tokens
    assert bytes(val[1].tolist()) == b"doc 19"
    with pytest.raises(ConfigError, match="1 documents make 0 training"):
        TokenDocuments.from_texts(["only one"]).split(0.5)


def test_text_file_splits_on_blank_lines(tmp_path):
    path = tmp_path / "docs.txt"
    path.write_bytes(b"one\ntwo\n\n\nthree\n  \t\nfour five\n")
    docs = TokenDocuments.from_file(path)
    assert [bytes(docs[i].tolist()) for i in range(len(docs))] == [b"one\ntwo\n", b"three\n", b"four five\n"]


def test_long_documents_are_cut_without_losing_a_next_token_pair():
    text = "".join(chr(97 + i % 26) for i in range(100))
    docs = TokenDocuments.from_texts([text, "short"], max_len=16)
    assert docs.lengths.max() == 16 and len(docs) == 8, docs.lengths  # ceil(99 / 15) = 7 pieces, then "short"
    pairs = [(int(a), int(b)) for i in range(7) for a, b in zip(docs[i][:-1], docs[i][1:], strict=True)]
    raw = text.encode()
    assert pairs == list(zip(raw[:-1], raw[1:], strict=True))


@pytest.mark.parametrize("line, needle", [("not json", "docs.jsonl: 1 bad line(s): line 2: not valid JSON"),
                                          ('{"body": "x"}', 'docs.jsonl: 1 bad line(s): line 2: "text" is missing')])
def test_bad_jsonl_lines_are_named(tmp_path, line, needle):
    path = tmp_path / "docs.jsonl"
    path.write_text(json.dumps({"text": "fine"}) + "\n" + line + "\n")
    with pytest.raises(ConfigError, match=re.escape(needle)):
        TokenDocuments.from_file(path)


def test_byte_documents_refuse_prompt_completion_records(tmp_path):
    """Bytes carry no loss mask: the prompt would be trained on as text, so a tokenizer's reader must take it."""
    path = tmp_path / "docs.jsonl"
    path.write_text(json.dumps({"text": "fine"}) + "\n" + json.dumps({"prompt": "Q", "completion": "A"}) + "\n")
    with pytest.raises(ConfigError, match=r"1 prompt/completion record\(s\).*tokenize_file"):
        TokenDocuments.from_file(path)


def test_empty_or_missing_files_raise(tmp_path):
    with pytest.raises(ConfigError, match="no such file"):
        TokenDocuments.from_file(tmp_path / "missing.jsonl")
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(ConfigError, match="holds no records"):
        TokenDocuments.from_file(tmp_path / "empty.jsonl")
    with pytest.raises(ConfigError, match="max_len=1 must be an integer >= 2"):
        TokenDocuments.from_texts(["abc"], max_len=1)


def test_a_device_that_is_not_one_is_a_config_error():
    from memtrain.data import DevicePrefetcher, resolve_loader_settings

    with pytest.raises(ConfigError, match="not a torch device"):
        resolve_loader_settings(device="gpu")
    with pytest.raises(ConfigError, match="not a torch device"):
        DevicePrefetcher([], "gpu")


# -- packing ---------------------------------------------------------------------------------------------------
def pairs_of(batch) -> list[tuple[int, int]]:
    """Every real (input, target) pair of a batch, sorted."""
    real = batch.y != -100
    return sorted(zip(batch.x[real].tolist(), batch.y[real].tolist(), strict=True))


def test_packing_holds_every_pair_once_and_pads_far_less_than_padding(mixed_documents):
    docs = [mixed_documents[i] for i in range(400)]
    padded, packed = PadCollate()(docs), PackCollate(seq_len=128)(docs)
    assert isinstance(packed, PackedBatch) and packed.x.shape[1] == 128
    assert packed.real_tokens == padded.real_tokens == sum(len(d) - 1 for d in docs)
    assert pairs_of(packed) == pairs_of(padded)
    print(f"padding fraction: padded to the longest {padded.padding_fraction:.1%}, packed {packed.padding_fraction:.1%}")
    assert packed.padding_fraction < 0.05 < padded.padding_fraction
    # positions restart at every document, and each row's segments run 0, 1, 2, ... in order
    starts = torch.ones_like(packed.segments, dtype=torch.bool)
    starts[:, 1:] = packed.segments[:, 1:] != packed.segments[:, :-1]
    assert torch.equal(packed.positions == 0, starts)
    assert bool((packed.segments.diff(dim=1) >= 0).all())


def test_a_document_longer_than_a_row_is_cut_into_row_sized_pieces():
    batch = PackCollate(seq_len=4)([torch.arange(1, 11)])  # 9 pairs: pieces of 4, 4 and 1
    assert batch.real_tokens == 9 and batch.x.shape == (3, 4)
    assert pairs_of(batch) == [(i, i + 1) for i in range(1, 10)]


def test_packed_rows_give_the_loss_and_gradients_of_the_documents_padded():
    """With segments, attention stays inside each document: packing changes the layout, not the result."""
    texts = ["def f(x):\n    return x\n", "a = 1\n", "class A:\n    pass\n\n# end", "import os\nos.sep\n",
             "x = [i * i for i in range(10)]\n"]
    docs = TokenDocuments.from_texts(texts)
    examples = [docs[i] for i in range(len(docs))]
    padded, packed = PadCollate()(examples), PackCollate(seq_len=64)(examples)
    assert packed.x.shape[0] < padded.x.shape[0]

    def loss_and_grads(batch, **kwargs):
        torch.manual_seed(0)
        model = GPT(GPT_PRESETS["gpt-tiny"])
        loss = model(batch.x, batch.y, reduction="sum", **kwargs)
        loss.backward()
        return loss.detach(), {n: p.grad for n, p in model.named_parameters()}

    want, want_grads = loss_and_grads(padded)
    got, got_grads = loss_and_grads(packed, segments=packed.segments)
    assert torch.allclose(got, want, rtol=1e-5), (got.item(), want.item())
    for name, grad in want_grads.items():
        assert torch.allclose(got_grads[name], grad, rtol=1e-4, atol=1e-6), name
    # Control: without segments a document attends to the ones packed before it, and the loss changes.
    leaky, _ = loss_and_grads(packed)
    assert not torch.allclose(leaky, want, rtol=1e-3)


def test_packing_bad_input_is_a_config_error():
    with pytest.raises(ConfigError, match="seq_len must be an integer >= 1"):
        PackCollate(seq_len=0)
    with pytest.raises(ConfigError, match="each needs >= 2 tokens"):
        PackCollate(seq_len=8)([torch.tensor([1])])
    batch = PackCollate(seq_len=8)([torch.tensor([1, 2, 3])])
    with pytest.raises(ConfigError, match="segments of shape"):
        GPT(GPT_PRESETS["gpt-tiny"])(batch.x, segments=batch.segments[:, :4])


# -- tokenised text (a model folder's tokenizer: tests/conftest.py builds one) ----------------------------------
@pytest.fixture(scope="module")
def tokenizer(hf_model_dir):
    from memtrain.hf import load_tokenizer

    return load_tokenizer(hf_model_dir)


def write_jsonl(path, records) -> None:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))


def test_a_text_file_is_tokenised_per_blank_line_document_with_an_eos(tmp_path, tokenizer):
    from memtrain.data import tokenize_file

    path = tmp_path / "docs.txt"
    path.write_text("def f(x):\n    return x\n\n\n  \nclass A:\n    pass\n")
    docs = tokenize_file(path, tokenizer)
    assert len(docs) == 2 and docs.loss_mask is None and docs.tokens.dtype == np.int32
    eos = tokenizer.eos_token_id
    assert docs[0].tolist() == tokenizer.encode("def f(x):\n    return x") + [eos]
    assert docs[1].tolist() == tokenizer.encode("class A:\n    pass\n") + [eos]


def test_prompt_completion_records_put_the_loss_on_the_completion_only(tmp_path, tokenizer, hf_model_dir):
    """The model's loss on packed rows equals the cross-entropy over exactly the completions' tokens (and their
    EOS): prompt positions carry label -100 and count nowhere, not in the loss nor in its divisor."""
    from memtrain.data import Document, PackedRows, tokenize_file
    from memtrain.hf import load_pretrained

    records = [{"prompt": "Q: what is os.path?\nA:", "completion": " a module"},
               {"text": "import sys\n"},
               {"prompt": "def add(a, b):\n", "completion": "    return a + b\n"}]
    path = tmp_path / "docs.jsonl"
    write_jsonl(path, records)
    docs = tokenize_file(path, tokenizer)
    first = docs[0]
    assert isinstance(first, Document)
    prompt, completion = tokenizer.encode(records[0]["prompt"]), tokenizer.encode(records[0]["completion"])
    assert first.tokens.tolist() == prompt + completion + [tokenizer.eos_token_id]
    assert first.labels.tolist() == [-100] * len(prompt) + completion + [tokenizer.eos_token_id]
    assert (docs[1].labels == docs[1].tokens).all()  # a "text" record: the loss on every token
    rows = PackedRows(docs, seq_len=64)
    x, y, positions = (torch.stack(t) for t in zip(*[rows[i] for i in range(len(rows))], strict=True))
    completions = sum(len(tokenizer.encode(r.get("completion", r.get("text")))) + 1 for r in records)
    # every completion token and EOS is a target; so is every token of the "text" record but its first
    assert int((y != -100).sum()) == rows.real_tokens == completions - 1
    model = load_pretrained(hf_model_dir)
    with torch.no_grad():
        loss = model(input_ids=x, labels=y, shift_labels=y, position_ids=positions).loss
        logits = model(input_ids=x, position_ids=positions).logits
    keep = y != -100
    want = torch.nn.functional.cross_entropy(logits[keep].float(), y[keep])
    torch.testing.assert_close(loss, want, rtol=1e-5, atol=0)


def test_bad_jsonl_lines_are_all_reported_with_their_numbers(tmp_path, tokenizer):
    from memtrain.data import tokenize_file

    path = tmp_path / "bad.jsonl"
    write_jsonl(path, [{"text": "fine"}, '{"text": "no end', {"prompt": "p"}, "", {"txt": "typo"},
                       {"text": 3}, "[1, 2]", {"prompt": "p", "completion": None}])
    with pytest.raises(ConfigError) as e:
        tokenize_file(path, tokenizer)
    message = str(e.value)
    assert "6 bad line(s)" in message and len(e.value.problems) == 1, message
    for needle in ("line 2: not valid JSON", 'line 3: "completion" is missing', 'line 5: "text" is missing',
                   'line 6: "text" is int, not a string', "line 7: a JSON list, not an object",
                   'line 8: "completion" is NoneType, not a string'):
        assert needle in message, (needle, message)
    assert not list(tmp_path.glob(".*.npz"))  # nothing cached


def test_tokenised_data_is_cached_by_the_file_and_the_tokenizer(tmp_path, tokenizer):
    from memtrain.data import token_cache_path, tokenize_file

    class Counting:
        """The tokenizer, counting its calls."""

        def __init__(self, inner):
            self.inner, self.calls = inner, 0

        def __getattr__(self, name):
            return getattr(self.inner, name)

        def __call__(self, *args, **kwargs):
            self.calls += 1
            return self.inner(*args, **kwargs)

    path = tmp_path / "docs.txt"
    path.write_text("a = 1\n\nb = 2\n")
    counting = Counting(tokenizer)
    first = tokenize_file(path, counting)
    cache = token_cache_path(path, tokenizer)
    assert cache.is_file() and cache.parent == tmp_path and counting.calls == 1
    again = tokenize_file(path, counting)
    assert counting.calls == 1 and np.array_equal(again.tokens, first.tokens)  # read from the cache
    path.write_text("a = 1\n\nb = 3\n")  # an edit: another key
    assert token_cache_path(path, tokenizer) != cache
    tokenize_file(path, counting)
    assert counting.calls == 2
    elsewhere = tmp_path / "cache"
    tokenize_file(path, counting, cache_dir=elsewhere)
    assert len(list(elsewhere.glob("*.npz"))) == 1


def test_a_large_file_shows_a_progress_bar(tmp_path, tokenizer, capsys):
    from memtrain.data import tokenize_file

    path = tmp_path / "docs.txt"
    path.write_text("\n\n".join(f"x{i} = {i}" for i in range(50)))
    tokenize_file(path, tokenizer, batch_size=10, progress=True)
    assert "tokenising docs.txt" in capsys.readouterr().err


def test_packed_rows_are_full_fixed_size_rows_holding_every_pair_once(mixed_documents):
    from memtrain.data import PackedRows

    docs = TokenDocuments(mixed_documents.tokens, mixed_documents.starts[:500], mixed_documents.lengths[:500])
    rows = PackedRows(docs, seq_len=96)
    batches = list(DataLoader(rows, batch_size=8))
    assert all(b.input_ids.shape == b.labels.shape == b.position_ids.shape == (len(b.labels), 96) for b in batches)
    want = sorted((int(a), int(b)) for i in range(len(docs)) for a, b in zip(docs[i][:-1], docs[i][1:], strict=True))
    got = sorted((int(a), int(b)) for batch in batches for xs, ys in zip(batch.input_ids, batch.labels, strict=True)
                 for a, b in zip(xs, ys, strict=True) if b != -100)
    assert got == want
    assert rows.real_tokens == len(want) and rows.padding_fraction < 0.05, rows.padding_fraction
    first = rows[0]  # positions restart at 0 where a document starts (where the previous one ended)
    starts = (first.position_ids == 0).nonzero().flatten().tolist()
    assert starts[0] == 0 and len(starts) >= 1
    with pytest.raises(ConfigError, match="seq_len must be an integer >= 1"):
        PackedRows(docs, seq_len=0)


def test_pad_collate_masks_a_documents_prompt_for_length_bucketing():
    from memtrain.data import Document

    doc = Document(torch.tensor([5, 6, 7, 8]), torch.tensor([-100, -100, 7, 8]))
    batch = PadCollate()([doc, torch.tensor([1, 2])])
    assert batch.y.tolist() == [[-100, 7, 8], [2, -100, -100]] and batch.real_tokens == 3
    assert PackCollate(seq_len=4)([doc]).y.tolist() == [[-100, 7, 8, -100]]


def test_hf_collate_gives_the_trainer_shifted_labels(tokenizer, tmp_path):
    from memtrain.data import hf_collate, tokenized_rows

    path = tmp_path / "docs.txt"
    path.write_text("\n\n".join(f"value_{i} = {i * i}" for i in range(40)))
    train, val = tokenized_rows(path, tokenizer, seq_len=16, val_fraction=0.1)
    assert len(train) and len(val)
    batch = hf_collate([train[0], train[1]])
    assert set(batch) == {"input_ids", "labels", "shift_labels", "position_ids"}
    assert batch["shift_labels"] is batch["labels"] and batch["input_ids"].shape == (2, 16)
