"""Loader settings checked against the machine, automatic choices with their reasons, every problem at once, and
make_loader applying them (a seeded order that does not depend on the machine)."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import BatchSampler, DataLoader

from memtrain.data.loader import Machine, make_loader, resolve_loader_settings
from memtrain.errors import ConfigError

TWO_CPUS = Machine(cpus=2, accelerator=None)

ONE_CPU = Machine(cpus=1, accelerator=None)

BIG_GPU_BOX = Machine(cpus=32, accelerator="cuda")


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
