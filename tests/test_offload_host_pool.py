"""The pinned host pool: reused every step, bounded by the host budget (the rest stays on the device, said
once), checked against the free RAM before anything is allocated."""

from __future__ import annotations

import pytest
import torch
from offload_stream_model import (
    Chain,
    FakeTransport,
    assert_same_grads,
    chain_step,
    grads,
    offloader,
)

import memtrain.offload.offloader as offloader_mod
from memtrain.errors import MemtrainError
from memtrain.offload import ActivationOffloader


def test_pool_is_reused_every_step():
    torch.manual_seed(0)
    model = Chain()
    x = torch.randn(16, 8)
    transport = FakeTransport(lag=2)
    off = offloader(transport, slab_bytes=1024)  # small slabs: blocks span slab boundaries
    offsets = []
    for _ in range(3):
        start = len(transport.host_offsets)
        with off:
            loss = model(x).sum()
        loss.backward()
        offsets.append(transport.host_offsets[start:])
        assert off.stats().host_used_bytes == 0
    slabs_after_first = transport.slabs
    assert offsets[0] == offsets[1] == offsets[2], f"host blocks moved between steps: {offsets}"
    assert transport.slabs == slabs_after_first
    assert off.stats().host_reserved_bytes == transport.slabs * 1024


def test_host_budget_keeps_the_rest_on_device_and_warns_once():
    torch.manual_seed(0)
    model = Chain()
    x = torch.randn(16, 8)
    model(x).sum().backward()
    expected = grads(model)
    model.zero_grad(set_to_none=True)
    transport = FakeTransport(lag=1)
    off = offloader(transport, host_budget_bytes=2048, slab_bytes=1024)
    with pytest.warns(UserWarning, match="host budget") as record:
        for _ in range(2):
            model.zero_grad(set_to_none=True)
            with off:
                loss = model(x).sum()
            loss.backward()
    assert len(record) == 1, [str(w.message) for w in record]
    assert_same_grads(grads(model), expected)
    stats = off.stats()
    assert stats.host_peak_used_bytes <= 2048 and stats.host_reserved_bytes <= 2048, stats
    assert stats.over_budget_bytes > 0 and stats.offloaded_bytes > 0, stats


def test_a_pinning_failure_mid_forward_keeps_tensors_on_the_device_with_one_warning():
    """Host memory can run out after the up-front check (other processes pin too): the offloader keeps what it
    cannot pin on the device, as over its budget, and says so once."""
    torch.manual_seed(0)
    model = Chain()
    x = torch.randn(16, 8)
    expected = chain_step(model, x)
    transport = FakeTransport(lag=1, refuse_pinning_after=2)
    off = offloader(transport, slab_bytes=1024)  # each step needs more than the two slabs that can be pinned
    with pytest.warns(UserWarning, match="could not pin") as record:
        for _ in range(2):
            assert_same_grads(chain_step(model, x, off), expected)
    assert len(record) == 1, [str(w.message) for w in record]
    stats = off.stats()
    kept = dict(stats.kept)
    assert kept.get("pinning failed", 0) > 0 and stats.over_budget_bytes > 0, stats
    assert stats.offloaded_bytes > 0 and stats.host_reserved_bytes == 2 * 1024, stats


def test_budget_above_free_ram_raises_before_allocating():
    transport = FakeTransport()
    with pytest.raises(MemtrainError, match="To resolve this error") as e:
        ActivationOffloader(transport, host_budget_bytes=2**62)
    assert "available" in str(e.value) and transport.slabs == 0


def test_a_machine_that_does_not_say_its_free_ram_is_not_refused(monkeypatch):
    monkeypatch.setattr(offloader_mod, "available_host_bytes", lambda: None)
    transport = FakeTransport()
    off = ActivationOffloader(transport, host_budget_bytes=2**40)
    assert off.pool is not None and off.pool.capacity_bytes == 2**40 and transport.slabs == 0
    assert ActivationOffloader(transport).pool is not None and transport.slabs == 0  # the default budget too
