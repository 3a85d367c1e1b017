"""The device seam and the simulated accelerator: its streams poison what is read before it is waited, its ledger
counts device and pinned bytes as the allocators do."""

from __future__ import annotations

import subprocess
import sys
import threading

import pytest
import torch

from memtrain.device import accelerator, active_simulation, default_device, simulate
from memtrain.device.ledger import BLOCK, next_power_of_two
from memtrain.errors import ConfigError

LAGS = (0, 1, 3, None)


def test_the_plain_cpu_has_no_streams_and_copies_at_once():
    acc = accelerator("cpu")
    assert not acc.has_streams and acc.new_stream() is None and acc.kind == "cpu"
    dst = torch.zeros(3)
    acc.copy_(dst, torch.ones(3), stream=acc.new_stream())
    assert dst.tolist() == [1.0, 1.0, 1.0]
    assert accelerator("meta").kind == "cpu"


def test_a_side_stream_copy_is_poisoned_until_an_event_after_it_is_waited():
    with simulate("1MiB", lag=None) as acc:
        side = acc.new_stream()
        src = acc.place(torch.arange(4.0))
        acc.wait_stream(side, acc.current_stream())
        dst = acc.to_host(src, stream=side)
        assert torch.isnan(dst).all()
        event = acc.record_event(side)
        assert not acc.query(event)
        done = threading.Thread(target=acc.synchronize_event, args=(event,))  # the host waits on another thread
        done.start()
        done.join()
        assert acc.query(event) and dst.tolist() == [0.0, 1.0, 2.0, 3.0]


@pytest.mark.parametrize("lag", LAGS)
def test_a_stream_runs_at_most_lag_copies_behind(lag):
    with simulate("1MiB", lag=lag) as acc:
        side = acc.new_stream()
        hosts = [torch.full((2,), float(i)) for i in range(5)]
        dsts = [acc.empty((2,), torch.float32) for _ in hosts]
        for d, h in zip(dsts, hosts, strict=True):
            acc.copy_(d, h, stream=side)
        done = sum(not torch.isnan(d).any() for d in dsts)
        assert done == (5 if lag == 0 else 5 - min(lag, 5) if lag is not None else 0)
        acc.wait_stream(acc.current_stream(), side)  # the compute stream waits: every copy ran
        assert [d[0].item() for d in dsts] == [0.0, 1.0, 2.0, 3.0, 4.0]


@pytest.mark.parametrize("lag", LAGS)
def test_a_copy_of_data_compute_wrote_after_the_last_wait_reads_it_unfinished(lag):
    with simulate("1MiB", lag=lag) as acc:
        side = acc.new_stream()
        w = acc.place(torch.ones(4))
        y = w * 3  # written on the compute stream, after any wait of the side stream
        racy = acc.to_host(y, stream=side)
        acc.wait_stream(side, acc.current_stream())
        ordered = acc.to_host(y, stream=side)
        acc.synchronize()
        assert ordered.tolist() == [3.0] * 4
        # lag 0: compute is never behind the host, so the missing wait does no harm
        assert torch.isnan(racy).all() == (lag != 0)


@pytest.mark.parametrize("lag", [1, 3, None])
def test_a_source_freed_before_its_copy_ran_poisons_unless_the_stream_use_was_recorded(lag):
    with simulate("1MiB", lag=lag) as acc:
        side = acc.new_stream()
        acc.wait_stream(side, acc.current_stream())
        lost, kept = acc.place(torch.ones(8)), acc.place(torch.full((8,), 2.0))
        acc.wait_stream(side, acc.current_stream())
        out_kept = acc.to_host(kept, stream=side)
        acc.record_stream(kept, side)
        out_lost = acc.to_host(lost, stream=side)  # last: still queued at every lag > 0
        del lost, kept
        acc.synchronize()
        assert torch.isnan(out_lost).all() and out_kept.tolist() == [2.0] * 8


def test_the_ledger_counts_device_storages_in_512_byte_blocks_and_leaves_host_work_out():
    with simulate("1MiB") as acc:
        w = acc.place(torch.ones(10))  # 40 bytes -> one block
        assert acc.memory_allocated() == BLOCK
        y = w.exp()  # made from a device tensor: device memory
        assert acc.memory_allocated() == 2 * BLOCK
        host = torch.ones(1000) * 2  # host work: not counted
        with acc.compute():
            mask = torch.ones(300)  # a factory inside a step: device memory
            with acc.host():
                host2 = torch.ones(300)
        assert acc.memory_allocated() == 2 * BLOCK + 1536
        del y, mask, host, host2
        assert acc.memory_allocated() == BLOCK and acc.max_memory_allocated() == 2 * BLOCK + 1536
        acc.reset_peak_memory_stats()
        assert acc.max_memory_allocated() == BLOCK


def test_a_step_over_the_capacity_raises_torchs_out_of_memory_error():
    with simulate("4KiB") as acc:
        w = acc.place(torch.ones(512))  # 2 KiB
        with pytest.raises(torch.OutOfMemoryError, match="simulated device out of memory"):
            torch.cat([w, w])  # 4 KiB more
        assert acc.memory_stats()["num_ooms"] == 1
        with pytest.raises(torch.OutOfMemoryError):
            acc.place(torch.ones(2048))


@pytest.mark.parametrize("lag", [1, None])
def test_a_block_freed_with_a_use_recorded_on_compute_stays_reserved_until_compute_passed_it(lag):
    with simulate("1MiB", lag=lag) as acc:
        side = acc.new_stream()
        for _ in range(4):  # the streamer's old pattern: allocate on the side stream, hand over, free
            block = acc.empty((256,), torch.float32, stream=side)  # 1 KiB
            acc.record_stream(block, acc.current_stream())
            block.add_(1)  # one compute op uses it
            del block
        stats = acc.memory_stats()
        assert stats["allocated_bytes.all.current"] == 0
        held = 4 * 1024 if lag is None else 2 * 1024  # lag 1: the last free is one op ahead of compute
        assert acc.max_memory_reserved() == held
        acc.synchronize()
        assert acc.memory_stats()["reserved_bytes.all.current"] == 0


def test_held_blocks_are_freed_by_a_retry_before_out_of_memory():
    with simulate("4KiB", lag=None) as acc:
        block = acc.empty((768,), torch.float32)  # 3 KiB
        acc.record_stream(block, acc.current_stream())
        block.add_(1)  # compute, still queued when the block is freed
        del block
        again = acc.empty((768,), torch.float32)  # fits only once the held block is released
        assert acc.memory_stats()["num_alloc_retries"] == 1 and again.numel() == 768


def test_resized_storages_are_counted_and_come_back_poisoned():
    with simulate("1MiB") as acc:
        t = acc.empty((256,), torch.float32)
        t.fill_(1.0)
        acc.resize_storage(t, 0)
        assert acc.memory_allocated() == 0
        acc.resize_storage(t, 1024)
        assert acc.memory_allocated() == 1024 and torch.isnan(t).all()


def test_pinned_memory_is_rounded_up_to_a_power_of_two_and_a_host_buffer_is_exact():
    with simulate("1MiB") as acc:
        a = acc.pinned_empty((750,), torch.float32)  # 3000 bytes
        b = acc.host_buffer(750, torch.float32)
        assert acc.host_pinned_bytes() == (next_power_of_two(3000) + 3000,) * 2 == (7096, 7096)
        del a
        assert acc.host_pinned_bytes() == (3000, 7096)
        del b
    with simulate("1MiB", host_capacity="4KiB") as acc, pytest.raises(RuntimeError, match="pinned host memory"):
        acc.pinned_empty((1200,), torch.float32)


def test_simulate_is_one_at_a_time_and_ends_with_its_block():
    with simulate("1MiB") as acc:
        assert accelerator() is acc and accelerator("cpu") is acc and default_device() == torch.device("cpu")
        with pytest.raises(ConfigError, match="already active"), simulate("1MiB"):
            pass
    assert active_simulation() is None and accelerator().kind in ("cpu", "cuda", "xpu")


def _in_a_process(env: dict[str, str], code: str) -> subprocess.CompletedProcess[str]:
    import os

    return subprocess.run([sys.executable, "-c", code], env={**os.environ, **env}, capture_output=True, text=True,
                          timeout=120)


def test_the_environment_variable_puts_every_command_on_the_simulated_device():
    run = _in_a_process({"MEMTRAIN_SIMULATED_DEVICE": "192MiB", "MEMTRAIN_SIMULATED_LAG": "none"},
                        "from memtrain.device import accelerator; a = accelerator(); "
                        "print(a.kind, a.total_memory, a.lag, a.has_streams)")
    assert run.returncode == 0, run.stderr
    assert run.stdout.split() == ["simulated", str(192 * 2**20), "None", "True"]
    bad = _in_a_process({"MEMTRAIN_SIMULATED_DEVICE": "lots"},
                        "from memtrain.device import accelerator; accelerator()")
    assert bad.returncode != 0 and "MEMTRAIN_SIMULATED_DEVICE='lots'" in bad.stderr


def test_a_view_of_device_data_taken_after_the_wait_is_not_a_write():
    with simulate("1MiB", lag=None) as acc:
        side = acc.new_stream()
        y = acc.place(torch.ones(8)) * 2
        acc.wait_stream(side, acc.current_stream())
        half = y[:4]  # a view: no new data, nothing for the side stream to wait for
        out = acc.to_host(half, stream=side)
        acc.synchronize()
        assert out.tolist() == [2.0] * 4


def test_a_device_the_machine_lacks_is_refused_in_one_line():
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(ConfigError, match="does not exist on this machine"):
        accelerator("cuda")


def test_a_queued_copy_into_a_parameter_runs_and_a_failed_block_still_ends_the_simulation():
    with simulate("1MiB", lag=None) as acc:
        side = acc.new_stream()
        weight = acc.place(torch.nn.Parameter(torch.zeros(4)))
        acc.copy_(weight, torch.ones(4), stream=side)
        acc.synchronize()  # with grad enabled: the queued copy writes a leaf that requires grad
        assert weight.tolist() == [1.0] * 4
        assert acc.host_pinned_bytes()[0] == 0
        acc.to_host(weight, stream=side)  # asynchronous: from torch's pinned cache, rounded up
        assert acc.host_pinned_bytes()[1] == 16
    with pytest.raises(ValueError), simulate("1MiB"):
        raise ValueError
    assert active_simulation() is None


@pytest.mark.parametrize("lag", LAGS)
def test_a_copy_back_over_weights_compute_read_after_the_last_wait_is_a_race(lag):
    from memtrain.device.simulated import SimulatedRaceError

    with simulate("1MiB", lag=lag) as acc:
        side = acc.new_stream()
        weight = acc.place(torch.ones(4))
        acc.wait_stream(side, acc.current_stream())
        acc.copy_(weight, torch.zeros(4), stream=side)  # nothing read it since the wait: fine
        acc.wait_stream(acc.current_stream(), side)
        _ = weight * 2  # backward reads the weights ...
        if lag == 0:  # ... and compute is never behind the host: no harm
            acc.copy_(weight, torch.full((4,), 2.0), stream=side)
            return
        with pytest.raises(SimulatedRaceError, match="wait for the compute stream"):
            acc.copy_(weight, torch.full((4,), 2.0), stream=side)  # ... the copy back did not wait for them


def test_releasing_a_block_with_a_copy_into_it_queued_is_a_race_not_a_crash():
    from memtrain.device.simulated import SimulatedRaceError

    with simulate("1MiB", lag=None) as acc:
        side = acc.new_stream()
        block = acc.empty((256,), torch.float32)
        acc.wait_event(acc.record_event(), side)
        acc.copy_(block, torch.ones(256), stream=side)
        with pytest.raises(SimulatedRaceError, match="still queued"):
            acc.resize_storage(block, 0)
        acc.synchronize()


def test_to_device_on_a_side_stream_allocates_on_compute_and_needs_its_event():
    with simulate("1MiB", lag=None) as acc:
        side = acc.new_stream()
        moved = acc.to_device(torch.arange(3.0), stream=side)
        assert torch.isnan(moved).all()
        acc.wait_event(acc.record_event(side))
        assert moved.tolist() == [0.0, 1.0, 2.0] and acc.memory_allocated() == BLOCK


def test_a_tensor_freed_after_record_stream_is_no_longer_allocated_but_stays_reserved():
    with simulate("1MiB", lag=None) as acc:
        side = acc.new_stream()
        grad = acc.place(torch.full((256,), 3.0))  # 1 KiB
        acc.wait_stream(side, acc.current_stream())
        host = acc.to_host(grad, stream=side)
        acc.record_stream(grad, side)
        del grad  # the optimizer's hook frees the device gradient once its copy is queued
        assert acc.memory_allocated() == 0 and acc.memory_stats()["reserved_bytes.all.current"] == 1024
        acc.synchronize()
        assert host.tolist() == [3.0] * 256 and acc.memory_stats()["reserved_bytes.all.current"] == 0
