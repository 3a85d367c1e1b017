"""The state of a run: a checkpoint whose state does not load is skipped for the previous one; the random
generators come back per rank, the device's for the device the rank computes on."""

from __future__ import annotations

import dataclasses
import json
import random
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import memtrain.device
from memtrain import ConfigError, MemtrainError
from memtrain.run import RunCheckpoints, restore_run_state, resume_run, save_run_state
from memtrain.run.identity import RunIdentity
from memtrain.run.state import CheckpointExtra, restore_rng, rng_state

# A checkpoint's "run" and "extra" exactly as train() wrote them before they were types (memtrain at 2a0098d: a
# tiny GPT, 2 steps; the model's shapes cut to three): a run folder of then must resume now.
RUN_JSON = (
    '{"seed": 0, "global_batch_size": 4, "world_size": 1, "seq_len": 32, "data": {"examples": 59, "sha256": '
    '"239dc1009cde947b81fcfd6671ed5e37c7d56c8218a43a18cf0e3a3548baa409", "of": "token stream"}, "model": {"class": '
    '"GPT", "shapes": {"wte.weight": [256, 32], "wpe.weight": [32, 32], "blocks.0.ln_1.weight": [32]}}, "precision": '
    '"fp32", "lr": 0.003, "warmup_steps": 0, "min_lr_ratio": 0.1, "weight_decay": 0.1, "grad_clip": 1.0, "fsdp": '
    'false, "lr_schedule": "cosine", "adam_betas": [0.9, 0.95], "adam_eps": 1e-08, "offload_optimizer": false, '
    '"optimizer": "device"}')
_SETTINGS_JSON = (
    '{"micro_batch_size": 4, "accumulation": 1, "flavor": "full", "chunked_loss": true, "optimizer": "device", '
    '"distribution": "none", "compile": false, "precision": "fp32", "state_precision": "fp32", "step_in_backward": '
    'false, "offload_fraction": 0.0, "pure_bf16": false, "offload_weights": false, "blocks": ["keep", "keep"], '
    '"checkpointing": "none"}')
EXTRA_JSON = (
    '{"plan_check": {"log": "plan check at step 2: predicted saved activations 536.25 KiB, measured 536.25 KiB '
    '(+0.0%)", "what": "saved activations", "predicted_bytes": 549120, "measured_bytes": 549120, "relative_error": '
    '0.0, "over_budget": false, "step": 2, "replanning": false, "peak_bytes": 1079544}, "plan_settings": '
    + _SETTINGS_JSON + ', "plan_request": {"budget": null, "host_budget": null, "safety_margin": 0.05, '
    '"micro_batch_size": null, "choices": {"checkpointing": null, "offload_activations": null, "optimizer": '
    '{"placement": null, "state_precision": null, "step_in_backward": null, "offload_fraction": null}, '
    '"chunked_loss": null, "compile": false, "pure_bf16": false, "offload_weights": null}}, "correction_bytes": 0, '
    '"replans": [{"step": 3, "why": "out of memory", "settings": ' + _SETTINGS_JSON + ', "correction_bytes": 1024, '
    '"estimated_peak_before": 2000000, "estimated_peak_after": 1000000}]}')
# The same bookkeeping as a checkpoint holds it now: the plan in force as its run shape, block count and the Choices
# that fix it (PlanSettings.to_dict). A replan's record is kept as it was written.
_CHOICES_SETTINGS_JSON = (
    '{"micro_batch_size": 4, "accumulation": 1, "distribution": "none", "precision": "fp32", "n_blocks": 2, '
    '"choices": {"checkpointing": "none", "offload_activations": false, "optimizer": {"placement": "device", '
    '"state_precision": "fp32", "step_in_backward": false, "offload_fraction": 0.0, "name": null, "kwargs": null}, '
    '"chunked_loss": true, "compile": false, "pure_bf16": false, "offload_weights": false, "tiled_mlp": false}}')
EXTRA_JSON_NOW = EXTRA_JSON.replace('"plan_settings": ' + _SETTINGS_JSON, '"plan_settings": ' + _CHOICES_SETTINGS_JSON)


def _two_checkpoints(root: Path) -> RunCheckpoints:
    checkpoints = RunCheckpoints(root, keep=3)
    run = json.loads(RUN_JSON)
    checkpoints.save(1, {"w": torch.ones(3), "scheduler": {"last_epoch": 1}, "run": run})
    checkpoints.save(2, {"w": torch.full((3,), 2.0), "scheduler": {"last_epoch": 2}, "run": run})
    return checkpoints


def test_a_checkpoint_whose_state_does_not_load_is_skipped(tmp_path):
    checkpoints = _two_checkpoints(tmp_path)
    tried = []

    def restore(step, state):
        tried.append(step)
        if step == 2:
            raise KeyError("optimizer")

    run = RunIdentity.from_dict(json.loads(RUN_JSON))
    step, _, skipped = resume_run(checkpoints, run, restore)
    assert step == 1 and tried == [2, 1] and "its state does not load (KeyError" in skipped[0]
    with pytest.raises(MemtrainError, match="no checkpoint in .* can be resumed"):
        resume_run(checkpoints, run, lambda step, state: (_ for _ in ()).throw(ValueError("nope")))


# -- the run's identity and the loop's bookkeeping: types in memory, the same JSON on disk ----------------------
def test_the_json_of_a_checkpoint_reads_as_types_and_writes_back_byte_for_byte():
    run, extra = RunIdentity.from_dict(json.loads(RUN_JSON)), CheckpointExtra.from_dict(json.loads(EXTRA_JSON))
    assert json.dumps(run.to_dict()) == RUN_JSON, run.to_dict()
    # The plan of then reads as the same set-up, written now as the choices that fix it.
    assert EXTRA_JSON_NOW != EXTRA_JSON and json.dumps(extra.to_dict()) == EXTRA_JSON_NOW, extra.to_dict()
    assert CheckpointExtra.from_dict(json.loads(EXTRA_JSON_NOW)) == extra
    assert run.data.examples == 59 and run.model.shapes["wte.weight"] == (256, 32) and run.adam_betas == (0.9, 0.95)
    assert extra.plan_settings.micro_batch_size == 4 and extra.replans[0]["why"] == "out of memory"
    with pytest.raises(TypeError, match="seed"):
        RunIdentity.from_dict({**json.loads(RUN_JSON), "seeds": 1})  # an unknown field is no identity


def test_a_checkpoint_written_before_the_types_resumes_and_refuses_another_run(tmp_path):
    """The run identity a checkpoint of then holds is compared with this run's typed one: equal, it resumes
    (automatic lr and warm-up, None here, are not compared); another seed or other data is refused, named."""
    checkpoints = _two_checkpoints(tmp_path)
    now = RunIdentity.from_dict(json.loads(RUN_JSON))
    restored = []
    step, state, skipped = resume_run(checkpoints, dataclasses.replace(now, lr=None, warmup_steps=None),
                                      lambda step, state: restored.append(step))
    assert (step, restored, skipped) == (2, [2], []) and state["run"] == json.loads(RUN_JSON)
    data = dataclasses.replace(now.data, sha256="0" * 64)
    with pytest.raises(ConfigError) as info:
        resume_run(checkpoints, dataclasses.replace(now, seed=1, data=data, lr=1e-3), lambda step, state: None)
    assert [p.split(":")[1].strip()[:10] for p in info.value.problems] == ["seed=1 now", "the traini", "lr=0.001 n"]
    assert "pass seed=0" in info.value.problems[0] and "SHA-256 of the token stream 000000000000 now" in str(info.value)


def test_save_run_state_writes_the_types_as_the_json_of_now(tmp_path):
    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    for root, run, extra in ((tmp_path / "typed", RunIdentity.from_dict(json.loads(RUN_JSON)),
                              CheckpointExtra.from_dict(json.loads(EXTRA_JSON))),):
        save_run_state(RunCheckpoints(root), 1, 2, model, optimizer, scheduler, None, _Counters(), run, extra)
        meta = json.loads((root / "checkpoints" / "step-0000001" / "meta.json").read_text())
        assert json.dumps(meta["state"]["run"]) == RUN_JSON and json.dumps(meta["state"]["extra"]) == EXTRA_JSON_NOW


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
                   _Counters(), RunIdentity.from_dict(json.loads(RUN_JSON)),
                   CheckpointExtra.from_dict(json.loads(EXTRA_JSON)))
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


def test_a_rank_the_checkpoint_has_no_generators_for_keeps_its_own(monkeypatch):
    """A resume on more ranks than the run had (the identity allows it: the state reshards): rank 1 of a one-rank
    checkpoint keeps the generators the run seeded it with, and rank 0 gets the checkpoint's."""
    torch.manual_seed(5)
    saved = {"ranks": [rng_state(torch.device("cpu"))]}
    expected = torch.rand(3)
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_rank", lambda: 1)
    torch.manual_seed(7)
    own = torch.rand(3)
    torch.manual_seed(7)
    restore_rng(saved, torch.device("cpu"))
    assert torch.equal(torch.rand(3), own)
    monkeypatch.setattr(dist, "get_rank", lambda: 0)
    restore_rng(saved, torch.device("cpu"))
    assert torch.equal(torch.rand(3), expected)
