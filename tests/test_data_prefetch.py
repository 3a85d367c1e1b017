"""The device prefetcher: the loader's batches, in its order, nested tensors moved and the structure kept."""

from __future__ import annotations

from collections import namedtuple
from dataclasses import dataclass

import pytest
import torch

from memtrain.data.buckets import LengthBucketSampler
from memtrain.data.collate import PadCollate, TokenBatch
from memtrain.data.documents import TokenDocuments
from memtrain.data.loader import Machine, make_loader, resolve_loader_settings
from memtrain.data.prefetch import DevicePrefetcher, map_tensors
from memtrain.device import simulate
from memtrain.device.ledger import BLOCK, round_up
from memtrain.errors import ConfigError

TWO_CPUS = Machine(cpus=2, accelerator=None)

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


LAGS = [0, 1, 3, None]


def _tensors(batch) -> list[torch.Tensor]:
    found: list[torch.Tensor] = []
    map_tensors(found.append, batch)
    return found


def check_prefetcher_on_the_simulated_device(lag: int | None) -> None:
    """Each batch is equal to the loader's when handed out (an unfinished copy reads NaN or all bits set), and the
    device holds at most three batches: the caller's last one, the one handed out, the next one copying."""
    batches = nested_batches()
    batch_bytes = max(sum(round_up(t.numel() * t.element_size(), BLOCK) for t in _tensors(b)) for b in batches)
    with simulate("16MiB", lag=lag) as acc:
        prefetcher = DevicePrefetcher(batches, "cpu")
        assert prefetcher.stream is not None, "the simulated device has streams: the side-stream path must run"
        handed_out = iter(prefetcher)
        for i, host in enumerate(batches):
            moved = next(handed_out)  # the caller holds one batch at a time (zip would keep the one before)
            pairs = list(zip(_tensors(host), _tensors(moved), strict=True))
            assert all(a is not b for a, b in pairs), "a batch was handed out without its copy"
            differ = [j for j, (a, b) in enumerate(pairs) if not torch.equal(a, b)]
            assert not differ, f"lag {lag}: batch {i} handed out before its copy landed (tensors {differ} differ)"
            assert moved["step"] == i and moved["pair"].b[1] == "tag"
            del pairs
        assert next(handed_out, None) is None, "more batches than the loader's"
        peak = acc.max_memory_reserved()
        assert peak <= 3 * batch_bytes, f"lag {lag}: {peak} bytes reserved for batches of {batch_bytes} bytes"


@pytest.mark.parametrize("lag", LAGS, ids=[f"lag{lag}" for lag in LAGS])
def test_prefetcher_on_the_simulated_device_hands_out_each_batch_after_its_copy(lag):
    check_prefetcher_on_the_simulated_device(lag)


def test_a_prefetcher_that_does_not_wait_for_the_copy_is_caught(monkeypatch):
    """The compute stream not waiting for the copy's event: at lag 0 the copies ran at once, so it cannot show."""
    copy_next = DevicePrefetcher._copy_next

    def no_wait(self, batches):
        ready, batch, _ = copy_next(self, batches)
        return ready, batch, None  # no event: wait_event(None) waits for nothing

    monkeypatch.setattr(DevicePrefetcher, "_copy_next", no_wait)
    caught = set()
    for lag in LAGS:
        try:
            check_prefetcher_on_the_simulated_device(lag)
        except AssertionError:
            caught.add(lag)
    assert caught == {1, 3, None}, f"caught at lags {sorted(caught, key=str)}"


def test_a_device_that_is_not_one_is_a_config_error():
    with pytest.raises(ConfigError, match="not a torch device"):
        resolve_loader_settings(device="gpu")
    with pytest.raises(ConfigError, match="not a torch device"):
        DevicePrefetcher([], "gpu")
