"""Tests of memtrain.planner: the reasons: when nothing fits, the error names the smallest peak and what would fit."""

from __future__ import annotations

import re

import pytest
from helpers import MiB, h100, planner_llama

from memtrain.choices import Choices
from memtrain.errors import ConfigError
from memtrain.planner import (
    PlanSettings,
    plan,
)

transformers = pytest.importorskip("transformers")

H100 = h100()




def test_nothing_fits_names_the_smallest_peak_and_what_would_fit(llama):
    with pytest.raises(ConfigError) as info:
        plan(llama, budget=100 * MiB, seq_len=1024, global_batch_size=4, device_profile=H100)
    message = str(info.value)
    assert "smallest predicted peak" in message and "To resolve this error" in message, message
    # (Above the 64 MiB of cuBLAS workspaces, which no sequence length shrinks.) One sequence's activations are what is over (the optimizer is offloaded): more ranks would not help.
    assert "a shorter sequence (at seq_len 1024 a micro-batch of 1 needs" in message and "FSDP2" not in message, message


def test_nothing_fits_over_fsdp2_ranks_names_a_rank_count_that_fits():
    config = planner_llama(layers=4, hidden=1024, vocab_size=8192)
    kwargs = dict(budget=400 * MiB, seq_len=128, fsdp=True, device_profile=H100)
    with pytest.raises(ConfigError) as info:  # the model state alone is 415 MB a rank over 2 ranks
        plan(config, global_batch_size=2, world_size=2, **kwargs)
    found = re.search(r"FSDP2 over at least (\d+) GPUs", str(info.value))
    assert found and int(found.group(1)) > 2, str(info.value)
    ranks = int(found.group(1))
    fits = plan(config, global_batch_size=ranks, world_size=ranks, **kwargs)
    assert fits.peak_bytes <= 0.95 * 400 * MiB, (ranks, fits.peak_bytes)
    with pytest.raises(ConfigError) as info:  # one sequence's activations over the budget: no rank count helps
        plan(config, global_batch_size=2, world_size=2, **{**kwargs, "budget": 40 * MiB})
    assert "FSDP2 over" not in str(info.value) and "a larger budget" in str(info.value), str(info.value)


def test_a_fixed_set_up_that_cannot_fit_is_a_clear_error(llama):
    fixed = PlanSettings(4, 1, ("keep",) * 4, "full", False, "device", "none", False, "bf16-mixed")
    loose = plan(llama, budget=None, seq_len=1024, global_batch_size=4, settings=fixed, device_profile=H100)
    assert loose.settings == fixed and "as asked" in loose.reasons[0]
    with pytest.raises(ConfigError, match="the set-up asked for"):
        plan(llama, budget=int(0.5 * loose.peak_bytes), seq_len=1024, global_batch_size=4, settings=fixed,
             device_profile=H100)


def test_a_fixed_checkpointing_layout_says_it_was_asked_for(llama):
    chosen = plan(llama, budget=4096 * MiB, seq_len=128, global_batch_size=2, micro_batch_size=2,
                  device_profile=H100, choices=Choices(checkpointing="all"))
    line = next(r for r in chosen.reasons if r.startswith("checkpointing"))
    assert line.endswith("blocks recomputed (as asked)"), line
