"""Tests of memtrain.planner: the search: every plan fits, more budget is never slower, fixed choices are kept, re-plans."""

from __future__ import annotations

import pytest
import torch
from helpers import MiB, fixed_cpu_profile, h100, planner_gpt, planner_llama

from memtrain import measure
from memtrain.choices import Choices, OptimizerChoice
from memtrain.errors import ConfigError
from memtrain.estimate import meta_model
from memtrain.planner import (
    TECHNIQUES,
    PlanSettings,
    apply_plan,
    plan,
    predictions,
)

transformers = pytest.importorskip("transformers")

H100 = h100()
CPU = fixed_cpu_profile()





# -- the choice ---------------------------------------------------------------------------------------------
def test_every_plan_fits_and_more_budget_is_never_slower(llama):
    loose = plan(llama, budget=None, seq_len=1024, global_batch_size=4, device_profile=H100)
    budgets = [int(f * loose.peak_bytes) for f in (0.3, 0.45, 0.55, 0.7, 0.85, 1.1)] + [None]
    speeds = []
    for budget in budgets:
        try:
            p = plan(llama, budget=budget, seq_len=1024, global_batch_size=4, device_profile=H100)
        except ConfigError as e:
            assert not speeds or speeds[-1] == 0.0, (budget, str(e))  # once one fits, every larger one does
            speeds.append(0.0)
            continue
        if budget is not None:
            assert p.peak_bytes <= p.usable_bytes <= budget, (budget, p.peak_bytes, p.usable_bytes)
        speeds.append(p.tokens_per_s)
    assert speeds == sorted(speeds), list(zip(budgets, speeds, strict=True))
    assert speeds[-1] > speeds[2] > 0, list(zip(budgets, speeds, strict=True))  # a tight budget costs time


def test_no_limit_plans_no_technique(llama):
    """Nothing recomputed or offloaded, one forward a step, the optimizer on the device; the loss is whichever is
    faster (torch's chunked linear cross-entropy can be faster than materialising the logits)."""
    p = plan(llama, budget=None, seq_len=1024, global_batch_size=4, device_profile=H100)
    s = p.settings
    assert (s.checkpointing, s.optimizer, s.micro_batch_size, s.accumulation) == ("none", "device", 4, 1), s
    loss = next(r for r in p.reasons if r.startswith("loss"))
    assert "slower" in loss or "as fast" in loss, loss
    assert p.peak_bytes == p.report.peak_bytes


def test_a_budget_below_the_model_state_offloads_the_optimizer():
    config = planner_llama(layers=4, hidden=1024, vocab_size=8192)
    n = sum(p.numel() for p in meta_model(config).parameters())
    state = 16 * n  # fp32 weights, gradients and AdamW's two moments
    no_lean_state = [t for t in TECHNIQUES if t not in ("optimizer-state", "step-in-backward")]
    p = plan(config, budget=int(0.8 * state), seq_len=1024, global_batch_size=2, device_profile=H100,
             techniques=no_lean_state)
    on_host = 1.0 if p.settings.optimizer != "device" else p.settings.offload_fraction  # all, or a share
    assert on_host > 0, p.summary()
    assert p.host_bytes >= 0.95 * 16 * n * on_host, (p.host_bytes, n, on_host)  # master, gradient, two moments
    assert p.peak_bytes <= 0.8 * state
    # With 8-bit or bf16 moments (or stepping in backward) the device keeps the optimizer, faster than the host.
    lean = plan(config, budget=int(0.8 * state), seq_len=1024, global_batch_size=2, device_profile=H100)
    s = lean.settings
    assert s.optimizer == "device" and (s.state_precision != "fp32" or s.step_in_backward), lean.summary()
    assert lean.tokens_per_s > p.tokens_per_s and lean.peak_bytes <= 0.8 * state


def test_a_tight_budget_recomputes_and_chunks_the_loss(llama):
    loose = plan(llama, budget=None, seq_len=1024, global_batch_size=4, device_profile=H100)
    tight = plan(llama, budget=int(0.6 * loose.peak_bytes), seq_len=1024, global_batch_size=4,
                 device_profile=H100, techniques=["checkpointing", "chunked-loss"])
    assert "recompute" in tight.settings.blocks or tight.settings.micro_batch_size < 4, tight.summary()
    assert tight.step_seconds > loose.step_seconds
    assert all(line for line in tight.reasons), tight.reasons


def test_a_cpu_plan_predicts_the_saved_bytes_measure_counts():
    model = planner_gpt(layers=4)
    loose = plan(model, budget=None, seq_len=128, global_batch_size=8, device="cpu", precision="fp32",
                 device_profile=CPU)
    p = plan(model, budget=int(0.7 * loose.peak_bytes), seq_len=128, global_batch_size=8, device="cpu",
             precision="fp32", device_profile=CPU)
    assert p.settings != loose.settings, p.summary()
    run = apply_plan(model, p)
    x = torch.randint(0, 256, (p.micro_batch_size, 128), generator=torch.Generator().manual_seed(0))
    measured = measure(lambda: model(x, x.clone(), reduction="sum"), model=model)  # summed, as the loop sums it
    assert measured.activation_bytes == p.activation_bytes, (measured.activation_bytes, p.activation_bytes)
    assert run.accumulator.steps == p.accumulation


# -- distributed ----------------------------------------------------------------------------------------------
def test_fsdp2_shards_the_state_and_the_plan_says_which_is_faster():
    config = planner_llama(layers=4, hidden=1024, vocab_size=8192)
    both = plan(config, budget=None, seq_len=1024, global_batch_size=8, world_size=4, fsdp=None,
                device_profile=H100)
    text = " ".join(both.reasons)
    assert "DDP" in text and "FSDP2" in text, both.reasons
    ddp = plan(config, budget=None, seq_len=1024, global_batch_size=8, world_size=4, fsdp=False,
               device_profile=H100)
    fsdp = plan(config, budget=None, seq_len=1024, global_batch_size=8, world_size=4, fsdp=True,
                device_profile=H100)
    assert (ddp.settings.distribution, fsdp.settings.distribution) == ("ddp", "fsdp2")
    assert fsdp.peak_bytes < ddp.peak_bytes, (fsdp.peak_bytes, ddp.peak_bytes)


def test_predictions_of_given_set_ups_rank_recompute_as_slower(llama):
    keep = PlanSettings(micro_batch_size=4, accumulation=1, blocks=("keep",) * 4, flavor="full",
                        chunked_loss=False, optimizer="device", distribution="none", compile=False,
                        precision="bf16-mixed")
    recompute = PlanSettings(micro_batch_size=4, accumulation=1, blocks=("recompute",) * 4, flavor="full",
                             chunked_loss=False, optimizer="device", distribution="none", compile=False,
                             precision="bf16-mixed")
    a, b = predictions(llama, [keep, recompute], seq_len=1024, global_batch_size=4, device_profile=H100)
    assert b.step_seconds > a.step_seconds and b.peak_bytes < a.peak_bytes, (a, b)


def test_fixed_choices_are_kept_and_the_rest_is_searched(llama):
    layout = ("recompute", "keep", "recompute", "keep")
    p = plan(llama, budget=None, seq_len=1024, global_batch_size=4, device_profile=H100,
             choices=Choices(checkpointing="blocks(RKRK)", chunked_loss=True,
                             optimizer=OptimizerChoice(placement="offload")))
    assert (p.settings.blocks, p.settings.chunked_loss, p.settings.optimizer) == (layout, True, "offload")
    assert p.settings.micro_batch_size == 4  # searched: the fastest, with no budget
    with pytest.raises(ConfigError, match="names 3 blocks, not 4"):
        plan(llama, budget=None, seq_len=1024, global_batch_size=4, device_profile=H100,
             choices=Choices(checkpointing="blocks(KKK)"))


def test_a_measured_overshoot_is_folded_into_a_replan(llama):
    first = plan(llama, budget=int(256 * MiB), seq_len=1024, global_batch_size=4, device_profile=H100)
    overshoot = first.usable_bytes - first.peak_bytes + 8 * MiB  # the first plan would not fit any more
    again = plan(llama, budget=int(256 * MiB), seq_len=1024, global_batch_size=4, device_profile=H100,
                 correction_bytes=overshoot)
    assert again.peak_bytes <= again.usable_bytes
    assert again.settings != first.settings
    assert again.peak_bytes - overshoot < first.peak_bytes, (again.peak_bytes, first.peak_bytes)
    assert any("measurement" in a for a in again.assumptions)
