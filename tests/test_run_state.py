"""The state of a run: a checkpoint whose state does not load is skipped for the previous one; the random
generators come back per rank, the device's for the device the rank computes on."""

from __future__ import annotations

import random
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import memtrain.device
from memtrain import MemtrainError
from memtrain.run import RunCheckpoints, restore_run_state, resume_run, save_run_state
from memtrain.run.state import restore_rng, rng_state


def _two_checkpoints(root: Path) -> RunCheckpoints:
    checkpoints = RunCheckpoints(root, keep=3)
    checkpoints.save(1, {"w": torch.ones(3), "scheduler": {"last_epoch": 1}})
    checkpoints.save(2, {"w": torch.full((3,), 2.0), "scheduler": {"last_epoch": 2}})
    return checkpoints


def test_a_checkpoint_whose_state_does_not_load_is_skipped(tmp_path):
    checkpoints = _two_checkpoints(tmp_path)
    tried = []

    def restore(step, state):
        tried.append(step)
        if step == 2:
            raise KeyError("optimizer")

    step, _, skipped = resume_run(checkpoints, {}, restore)
    assert step == 1 and tried == [2, 1] and "its state does not load (KeyError" in skipped[0]
    with pytest.raises(MemtrainError, match="no checkpoint in .* can be resumed"):
        resume_run(checkpoints, {}, lambda step, state: (_ for _ in ()).throw(ValueError("nope")))


# -- the random generators: each rank's own, the device it computes on --------------------------------------------
class _Counters:
    """A stand-in accumulator: save_run_state only needs its state dict."""

    def state_dict(self):
        return {"steps": 0}

    def load_state_dict(self, state):
        pass


def _save_and_read(root: Path | None, read_from: Path) -> dict:
    """save_run_state of a tiny run (writing into ``root`` where given: rank 0), then the checkpoint read back."""
    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    save_run_state(RunCheckpoints(root) if root is not None else None, 1, 2, model, optimizer, scheduler, None,
                   _Counters(), {}, {})
    if dist.is_available() and dist.is_initialized():
        dist.barrier()
    step, state, _ = RunCheckpoints(read_from).load_latest()
    return state


def test_a_checkpoint_gives_back_the_generators_it_saved(tmp_path):
    torch.manual_seed(3)
    random.seed(3)
    torch.rand(5)
    state = _save_and_read(tmp_path, tmp_path)
    expected = torch.rand(4), random.random()
    torch.manual_seed(99)
    random.seed(99)
    restore_rng(state["rng"])
    assert torch.equal(torch.rand(4), expected[0]) and random.random() == expected[1]


class _FakeAccelerator:
    """An accelerator module with ``count`` devices, each with its own generator state (a tensor of its index)."""

    def __init__(self, count: int, current: int):
        self.count, self.current = count, current
        self.states = {i: torch.tensor([i], dtype=torch.uint8) for i in range(count)}

    def get_rng_state(self, device):
        return self.states[self._index(device)].clone()

    def set_rng_state(self, state, device):
        self.states[self._index(device)] = state.clone()

    def set_rng_state_all(self, states):  # what torch.cuda does: one per device, from 0
        for i, state in enumerate(states):
            self.set_rng_state(state, i)

    def get_rng_state_all(self):
        return [self.get_rng_state(i) for i in range(self.count)]

    def current_device(self):
        return self.current

    def is_available(self):
        return True

    def device_count(self):
        return self.count

    def _index(self, device):
        index = device if isinstance(device, int) else device.index
        if not 0 <= index < self.count:
            raise IndexError(f"device {index} of {self.count}")  # torch.cuda: "invalid device ordinal"
        return index


def _use(monkeypatch, fake: _FakeAccelerator) -> None:
    monkeypatch.setattr(memtrain.device, "_REAL", {})  # the seam keeps one accelerator per device: a new machine
    monkeypatch.setattr(torch.accelerator, "is_available", lambda: True)
    monkeypatch.setattr(torch.accelerator, "current_accelerator", lambda: torch.device("cuda"))
    monkeypatch.setattr(torch.accelerator, "current_device_index", lambda: fake.current)
    monkeypatch.setattr(torch, "get_device_module", lambda kind=None: fake)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # what the old code asked
    for name in ("get_rng_state", "set_rng_state", "get_rng_state_all", "set_rng_state_all"):
        monkeypatch.setattr(torch.cuda, name, getattr(fake, name))


def test_the_device_generator_saved_is_the_current_devices_and_restores_on_a_machine_with_fewer(tmp_path,
                                                                                                 monkeypatch):
    """A rank computing on device 3 of 4 saves device 3's generator; resumed on a machine with one device, that
    state goes to the device the rank computes on now (no IndexError for the devices it lacks)."""
    four = _FakeAccelerator(4, current=3)
    four.states[3] = torch.tensor([42], dtype=torch.uint8)  # what the run's dropout left on its device
    _use(monkeypatch, four)
    state = _save_and_read(tmp_path, tmp_path)
    one = _FakeAccelerator(1, current=0)
    _use(monkeypatch, one)
    restore_rng(state["rng"])
    assert one.states[0].tolist() == [42]


def test_a_checkpoint_of_the_old_format_restores_on_a_machine_with_fewer_devices(monkeypatch):
    """The format before per-rank generators: every CUDA device's generator as rank 0's process saw them."""
    one = _FakeAccelerator(1, current=0)
    _use(monkeypatch, one)
    old = {"torch": torch.get_rng_state(), "python": random.getstate(),
           "cuda": [torch.tensor([7 + i], dtype=torch.uint8) for i in range(4)]}
    restore_rng(old)
    assert one.states[0].tolist() == [7]


def test_the_generator_saved_and_restored_is_the_one_of_the_device_the_run_computes_on(monkeypatch):
    """A Python train() on cuda:2 whose current device was left at 0: cuda:2's generator, not the current one's."""
    four = _FakeAccelerator(4, current=0)
    four.states[2] = torch.tensor([42], dtype=torch.uint8)
    _use(monkeypatch, four)
    saved = rng_state(torch.device("cuda", 2))
    assert saved["device"].tolist() == [42]
    four.states[2] = torch.tensor([0], dtype=torch.uint8)
    restore_rng({"ranks": [saved]}, torch.device("cuda", 2))
    assert four.states[2].tolist() == [42] and four.states[0].tolist() == [0]
    assert rng_state(torch.device("cpu"))["device"] is None  # a CPU run has no device generator to save


def test_a_checkpoint_of_the_old_format_gives_every_rank_its_state_under_torchrun(monkeypatch):
    """Before per-rank generators a checkpoint held one state, which every rank restored: rank 1 must not be told
    that the run had another number of processes."""
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_rank", lambda: 1)
    torch.manual_seed(5)
    old = {"torch": torch.get_rng_state(), "python": random.getstate(), "cuda": []}
    expected = torch.rand(3)
    torch.manual_seed(0)
    restore_rng(old)
    assert torch.equal(torch.rand(3), expected)


WORLD = 2


def _each_rank_restores_its_own(rank: int, init_file: str, root: str, results) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD,
                            timeout=timedelta(seconds=60))
    try:
        torch.manual_seed(100 + rank)  # ranks whose generators differ (their dropout masks did)
        random.seed(100 + rank)
        state = _save_and_read(Path(root) if rank == 0 else None, Path(root))
        expected = torch.rand(4), random.random()
        torch.manual_seed(0)
        random.seed(0)
        restore_run_state(1, state, torch.nn.Linear(2, 2), *_fresh_optimizer_and_scheduler(), None, _Counters())
        results[rank] = bool(torch.equal(torch.rand(4), expected[0]) and random.random() == expected[1])
    finally:
        dist.destroy_process_group()


def _fresh_optimizer_and_scheduler():
    optimizer = torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1)
    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)


@pytest.mark.skipif(not dist.is_available(), reason="torch built without torch.distributed")
def test_under_torchrun_each_rank_restores_its_own_generators(tmp_path):
    results = mp.Manager().dict()
    mp.spawn(_each_rank_restores_its_own, args=(str(tmp_path / "init"), str(tmp_path / "run"), results),
             nprocs=WORLD, join=True)
    assert dict(results) == {0: True, 1: True}, dict(results)
