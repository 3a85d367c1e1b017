"""plan: the chosen set-up fits its budget, more budget is never slower, apply_plan sets up what the plan says."""

from __future__ import annotations

import dataclasses
import json
import random
import re

import numpy as np
import pytest
import torch

from memtrain import measure
from memtrain.checkpointing import checkpointed_blocks
from memtrain.errors import ConfigError
from memtrain.estimate import _meta_model
from memtrain.loss import chunk_tokens_of
from memtrain.models import GPT, GPTConfig
from memtrain.optim_offload import CPUOffloadOptimizer
from memtrain.planner import (
    TECHNIQUES,
    DeviceProfile,
    PlanSettings,
    apply_plan,
    calibrate,
    known_gpu,
    plan,
    predictions,
)

transformers = pytest.importorskip("transformers")

H100 = known_gpu("NVIDIA H100 80GB HBM3")
# Fixed CPU figures: the tests do not depend on how fast (or how loaded) the machine running them is.
CPU = DeviceProfile(name="test cpu", matmul_flops=50e9, half_efficiency_tokens=256, attention_flops=10e9,
                    memory_bandwidth=10e9, op_overhead_s=5e-6, host_to_device=5e9, device_to_host=5e9,
                    cpu_adamw=5e8, host_bandwidth=10e9, interconnect=5e9, memory_bytes=None, source="test",
                    asynchronous=False)
MiB = 2**20


def _llama(layers: int = 4, hidden: int = 512, **overrides):
    kwargs = dict(hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                  num_attention_heads=8, num_key_value_heads=4, vocab_size=4096, max_position_embeddings=2048,
                  use_cache=False)
    kwargs.update(overrides)
    return transformers.LlamaConfig(**kwargs)


def _gpt(layers: int = 4) -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(n_layer=layers, n_head=4, n_embd=128, seq_len=128, vocab_size=256, dropout=0.0))


@pytest.fixture(scope="module")
def llama():
    return _llama()


# -- composition: a candidate's peak from per-block profiles equals a full estimate of it ---------------------
def test_composed_peaks_match_full_estimates_of_mixed_set_ups():
    """Random mixes of kept, recomputed (fully, selectively, inputs offloaded) and offloaded blocks, micro-batches,
    losses and optimizers (placement, moment precision, step in backward, partial offload), on a Llama shape whose
    sequence is a multiple of the loss's chunk: the composed peak is within 3% of a full estimate of the same
    set-up. (The profiles let the offloader move every saved tensor, the real one keeps those under 1 MiB: on a
    model this small, per-row statistics of a few KiB make up to about 2.5% of the peak.)"""
    from memtrain.planner import _Composer, _Config, _context, _estimate_of, _profiles

    config = _llama(layers=5, hidden=1024, vocab_size=8192)
    ctx = _context(config, 2048, 4, "cuda", "bf16-mixed", 1, True, True, H100)
    flavors = ["full", "selective", "offload-inputs"]
    composer = _Composer(ctx, {None: _profiles(ctx, flavors, True, None), "bf16": _profiles(ctx, flavors, True,
                                                                                         "bf16")})
    rng = random.Random(0)
    errors = []
    for _ in range(14):
        b = rng.choice([1, 2, 4])
        placement = rng.choice(["device", "device", "offload", "offload-bf16-weights"])
        lean = placement == "device"
        cfg = _Config(b, 4 // b, rng.choice(flavors), rng.random() < 0.5, placement, "none", False, "bf16-mixed",
                      rng.choice(["fp32", "bf16", "int8"]) if lean else "fp32",
                      lean and b == 4 and rng.random() < 0.5, rng.choice([0.0, 0.5]) if lean else 0.0)
        if cfg.offload_fraction:
            cfg = dataclasses.replace(cfg, state_precision="fp32", step_in_backward=False)
        o = rng.randint(0, 5) if rng.random() < 0.5 else 0
        r = rng.randint(0, 5 - o)
        composed = composer.rows(cfg, o, np.array([r]))[0][0]
        settings = cfg.settings(5, o, r)
        estimated, _ = _estimate_of(ctx, composer.profile(cfg.optimizer), settings)
        errors.append((composed / estimated - 1, settings.checkpointing, cfg))
    worst = max(errors, key=lambda e: abs(e[0]))
    assert abs(worst[0]) <= 0.03, f"composed vs full estimate: worst {100 * worst[0]:+.2f}% for {worst[1:]}"


def test_composed_peaks_with_accumulation_and_the_chunked_loss_match_the_full_estimate():
    """The chunked loss allocates the head's gradient at its first chunk and fills it over the rest: a streaming
    optimizer (or accumulation) lets it go when it lands, not when it is allocated; counted from its allocation,
    the composed peak falls one fp32 head weight short."""
    from memtrain.planner import _Composer, _Config, _context, _estimate_of, _profiles

    config = _llama(layers=5, hidden=1024, vocab_size=8192)
    ctx = _context(config, 2048, 4, "cuda", "bf16-mixed", 1, True, True, H100)
    composer = _Composer(ctx, {None: _profiles(ctx, ["full"], True, None)})
    for placement in ("offload", "device"):
        cfg = _Config(1, 4, "full", True, placement, "none", False, "bf16-mixed", "fp32", False, 0.0)
        composed = composer.rows(cfg, 0, np.array([0]))[0][0]
        estimated, _ = _estimate_of(ctx, composer.profile(placement), cfg.settings(5, 0, 0))
        assert abs(composed / estimated - 1) <= 0.01, (placement, composed / MiB, estimated / MiB)


def test_identical_blocks_are_traced_three_at_a_time():
    """Profiles from a copy holding the first five blocks and the last equal those of the whole model."""
    from memtrain.planner import _Composer, _Config, _context, _profiles, _traced_profiles

    ctx = _context(_llama(layers=9), 1024, 2, "cuda", "bf16-mixed", 1, True, True, H100)
    from memtrain.planner import _truncated

    truncated = _truncated(ctx.model, ctx.block_names)
    assert truncated is not None and truncated[1] == [0, 1, 2, 3, 4, 4, 4, 4, 5]
    whole = _Composer(ctx, {None: _traced_profiles(ctx, ["full", "offload-inputs"], True, None, None)})
    four = _Composer(ctx, {None: _profiles(ctx, ["full", "offload-inputs"], True, None)})
    for b in (1, 2):
        for chunked in (False, True):
            for flavor in ("full", "offload-inputs"):
                cfg = _Config(b, 2 // b, flavor, chunked, "device", "none", False, "bf16-mixed")
                for offload in (0, 3):
                    r = np.arange(10 - offload)
                    a, c = whole.rows(cfg, offload, r), four.rows(cfg, offload, r)
                    assert np.allclose(a[0], c[0]), (b, chunked, flavor, offload, a[0] - c[0])
                    assert np.allclose(a[2], c[2], rtol=1e-9), (b, chunked, flavor, offload, a[2] / c[2])


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
    config = _llama(layers=4, hidden=1024, vocab_size=8192)
    n = sum(p.numel() for p in _meta_model(config).parameters())
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


# -- apply_plan ---------------------------------------------------------------------------------------------
def test_apply_plan_builds_the_lean_optimizer_the_settings_say():
    from memtrain.optim import LeanAdamW

    model = _gpt(layers=4)
    settings = PlanSettings(8, 1, ("keep",) * 4, "full", False, "device", "none", False, "fp32",
                            state_precision="bf16", step_in_backward=True)
    run = apply_plan(model, settings, lr=1e-3, max_grad_norm=None)
    assert isinstance(run.optimizer, LeanAdamW) and run.optimizer.steps_in_backward
    x = torch.randint(0, 256, (8, 128), generator=torch.Generator().manual_seed(0))
    with run.accumulator.micro_batch(is_last=True):
        run.accumulator.backward(model(x, x, reduction="sum"), reduction="sum", items=x.numel())
    run.accumulator.step()
    state = next(iter(run.optimizer.state.values()))
    assert state["exp_avg"].dtype == torch.bfloat16
    run.optimizer.close()


def test_apply_plan_sets_up_exactly_what_the_settings_say():
    model = _gpt(layers=4)
    names = [f"blocks.{i}" for i in range(4)]
    settings = PlanSettings(2, 2, ("offload", "recompute", "recompute", "keep"), "selective", True, "offload",
                            "none", False, "fp32")
    run = apply_plan(model, settings, lr=1e-3)
    assert checkpointed_blocks(model) == names[:3]
    specs = [model.get_submodule(n)._memtrain_checkpoint for n in names[:3]]
    assert [s.policy for s in specs] == ["offload", "recompute", "recompute"]
    assert specs[1].selective is not None
    assert chunk_tokens_of(model) == 1024
    assert isinstance(run.optimizer, CPUOffloadOptimizer) and run.accumulator.steps == 2
    run.optimizer.close()
    plain = apply_plan(model, PlanSettings(4, 1, ("keep",) * 4, "full", False, "device", "none", False, "fp32"))
    assert checkpointed_blocks(model) == [] and chunk_tokens_of(model) is None
    assert type(plain.optimizer) is torch.optim.AdamW


def test_a_cpu_plan_predicts_the_saved_bytes_measure_counts():
    model = _gpt(layers=4)
    loose = plan(model, budget=None, seq_len=128, global_batch_size=8, device="cpu", precision="fp32",
                 device_profile=CPU)
    p = plan(model, budget=int(0.7 * loose.peak_bytes), seq_len=128, global_batch_size=8, device="cpu",
             precision="fp32", device_profile=CPU)
    assert p.settings != loose.settings, p.summary()
    run = apply_plan(model, p)
    x = torch.randint(0, 256, (p.micro_batch_size, 128), generator=torch.Generator().manual_seed(0))
    measured = measure(lambda: model(x, x.clone()), model=model)
    assert measured.activation_bytes == p.activation_bytes, (measured.activation_bytes, p.activation_bytes)
    assert run.accumulator.steps == p.accumulation


# -- distributed ----------------------------------------------------------------------------------------------
def test_fsdp2_shards_the_state_and_the_plan_says_which_is_faster():
    config = _llama(layers=4, hidden=1024, vocab_size=8192)
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


def test_an_fsdp2_rank_holds_every_saved_activation_beside_its_shard_of_the_state():
    """At the start of backward a rank holds all its saved activations and its shard of the weights and moments;
    the gradients FSDP2 shards do not exist yet (a shift that takes them off every moment plans below this)."""
    config = _llama(layers=16, hidden=1024, vocab_size=256, num_attention_heads=16, num_key_value_heads=16)
    numel = sum(p.numel() for p in _meta_model(config).parameters())
    p = plan(config, budget=None, seq_len=1024, global_batch_size=16, world_size=16, fsdp=True, device_profile=H100,
             techniques=[], micro_batch_size=1)
    at_least = p.activation_bytes + 12 * numel / 16  # fp32 weights and two fp32 moments, a sixteenth of each
    assert p.peak_bytes >= at_least, (p.peak_bytes / MiB, at_least / MiB)


def _per_rank_and_one_process(config, settings: PlanSettings, world: int, **kwargs):
    """The plan of ``settings`` over ``world`` ranks and of the same set-up in one process (the same micro-batch
    and accumulation: the same activations), both full estimates."""
    micro, acc = settings.micro_batch_size, settings.accumulation
    common = dict(budget=None, seq_len=64, device_profile=H100, precision=settings.precision, **kwargs)
    ranks = plan(config, global_batch_size=micro * acc * world, world_size=world,
                 fsdp=settings.distribution == "fsdp2", settings=settings, **common)
    one = plan(config, global_batch_size=micro * acc, settings=dataclasses.replace(settings, distribution="none"),
               **common)
    return ranks, one


@pytest.mark.parametrize("precision, gathered_bytes", [("bf16-mixed", 2), ("fp32", 4)])
def test_fsdp2_gathers_blocks_in_bf16_under_bf16_mixed(precision, gathered_bytes):
    """A rank holds its shard of the weights and AdamW's state and two blocks gathered whole (the one computing,
    the next one prefetched): in bf16 under bf16-mixed (FSDP2's MixedPrecisionPolicy), 2 bytes a parameter."""
    from memtrain.planner import _state_bytes

    config = _llama(layers=4, hidden=256, vocab_size=1024)
    model = _meta_model(config)
    blocks = [f"model.layers.{i}" for i in range(4)]
    world = 4
    # Accumulation keeps FSDP2's gradients unsharded: the whole difference is the shift of every moment.
    settings = PlanSettings(1, 2, ("recompute",) * 4, "full", False, "device", "fsdp2", False, precision)
    ranks, one = _per_rank_and_one_process(config, settings, world)
    state = _state_bytes(model, blocks, None, cuda=True)
    block_numel = max(sum(p.numel() for p in model.get_submodule(b).parameters()) for b in blocks)
    expected = -(state["parameters"] + state["state"]) * (1 - 1 / world) + 2 * gathered_bytes * block_numel
    assert ranks.peak_bytes - one.peak_bytes == pytest.approx(expected, abs=1), (
        (ranks.peak_bytes - one.peak_bytes) / MiB, expected / MiB)


def test_fsdp2_all_gathers_in_bf16_and_reduce_scatters_in_fp32():
    """Link time of a step on a slow interconnect: two all-gathers of the weights (bf16 under bf16-mixed) and one
    reduce-scatter of the fp32 gradients, per rank's share; halving the link speed adds exactly that much again."""
    config = _llama(layers=4, hidden=256, vocab_size=1024)
    numel = sum(p.numel() for p in _meta_model(config).parameters())
    world, acc = 4, 1
    settings = PlanSettings(1, acc, ("keep",) * 4, "full", False, "device", "fsdp2", False, "bf16-mixed")
    seconds = {}
    for link in (1e6, 2e6):  # bytes/s: so slow that no compute hides the collectives
        profile = dataclasses.replace(H100, interconnect=link)
        seconds[link] = plan(config, budget=None, seq_len=64, global_batch_size=world, world_size=world, fsdp=True,
                             settings=settings, device_profile=profile).step_seconds
    share = (world - 1) / world
    link_bytes = (2 * 2 * numel * acc + 4 * numel) * share  # 2 bf16 all-gathers + 1 fp32 reduce-scatter
    added = seconds[1e6] - seconds[2e6]  # the link time at 1e6 B/s less that at 2e6 B/s: half of it at 1e6
    assert added == pytest.approx(link_bytes / 2e6, rel=1e-6), (added, link_bytes / 2e6)


def test_ddp_gradients_are_its_buckets():
    """Under DDP each gradient is a view into its all-reduce bucket (gradient_as_bucket_view=True): the buckets
    exist from the start, but the step holds one copy of the gradients, not two. While accumulating (and at the
    first window, before the views exist) the earlier micro-batches' gradients are tensors of their own beside the
    buckets; an offloaded optimizer keeps them on the device until the step under DDP."""
    config = _llama(layers=4, hidden=256, vocab_size=1024)
    grads = 4 * sum(p.numel() for p in _meta_model(config).parameters())
    # All blocks recomputed, 64 tokens: the step (every gradient alive) is the one-process peak.
    for optimizer, acc, expected in (("device", 1, 0), ("device", 2, grads), ("offload", 1, grads),
                                     ("offload", 2, 2 * grads)):
        settings = PlanSettings(1, acc, ("recompute",) * 4, "full", False, optimizer, "ddp", False, "bf16-mixed")
        ranks, one = _per_rank_and_one_process(config, settings, 2)
        extra = ranks.peak_bytes - one.peak_bytes
        if expected:
            assert extra == expected, (optimizer, acc, extra / MiB, expected / MiB)
        else:  # the buckets exist in forward too, and the head's gradient counts beside them until the step
            assert 0 <= extra < grads / 2, (optimizer, acc, extra / MiB, grads / MiB)


@pytest.mark.parametrize("kwargs, fixed, match", [
    ({}, dict(optimizer="device", step_in_backward=True, offload_fraction=0.5), "no set-up can be built"),
    ({"world_size": 2}, dict(optimizer="device", step_in_backward=True), "no set-up can be built"),
    ({"world_size": 2, "fsdp": True}, dict(optimizer="device", state_precision="int8"), "no set-up can be built"),
    ({}, dict(optimizer="offload", state_precision="int8"), "offload_optimizer=True with state_precision='int8'"),
])
def test_fixed_optimizer_choices_that_cannot_go_together_are_one_clear_error(kwargs, fixed, match):
    from memtrain.planner import Fixed

    with pytest.raises(ConfigError, match=match) as info:  # was a raw ValueError, or a silent fp32 optimizer
        plan(_gpt(2), budget=2**30, seq_len=32, global_batch_size=8, device="cpu", precision="fp32",
             fixed=Fixed(**fixed), device_profile=CPU, **kwargs)
    assert "To resolve this error" in str(info.value)


# -- input and output ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("budget, match", [(-1, "positive"), (0, "positive"), ("lots", "not a size"),
                                           ("1KiB", "smaller than one block")])
def test_bad_budgets_are_one_clear_error(llama, budget, match):
    with pytest.raises(ConfigError, match=match) as info:
        plan(llama, budget=budget, seq_len=1024, global_batch_size=4, device_profile=H100)
    assert "To resolve this error" in str(info.value)


def test_bad_arguments_are_reported_together(llama):
    with pytest.raises(ConfigError) as info:
        plan(llama, budget="1GiB", seq_len=0, global_batch_size=4, device="tpu", precision="fp8",
             techniques=["magic"], device_profile=H100)
    assert len(info.value.problems) == 4, info.value.problems
    with pytest.raises(ConfigError, match="does not divide"):
        plan(llama, budget="1GiB", seq_len=1024, global_batch_size=6, micro_batch_size=4, device_profile=H100)


def test_nothing_fits_names_the_smallest_peak_and_what_would_fit(llama):
    with pytest.raises(ConfigError) as info:
        plan(llama, budget=40 * MiB, seq_len=1024, global_batch_size=4, device_profile=H100)
    message = str(info.value)
    assert "smallest predicted peak" in message and "To resolve this error" in message, message
    # One sequence's activations are what is over (the optimizer is offloaded): more ranks would not help.
    assert "a shorter sequence (at seq_len 1024 a micro-batch of 1 needs" in message and "FSDP2" not in message, message


def test_nothing_fits_over_fsdp2_ranks_names_a_rank_count_that_fits():
    config = _llama(layers=4, hidden=1024, vocab_size=8192)
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


def test_summary_and_json(llama):
    p = plan(llama, budget=int(160 * MiB), seq_len=1024, global_batch_size=4, device_profile=H100)
    table = p.summary()
    assert "choice:" in table and "runners-up" in table and "because:" in table, table
    doc = json.loads(json.dumps(p.to_dict()))
    assert set(doc) >= {"plan", "peak_bytes", "step_seconds", "tokens_per_s", "candidates", "reasons"}
    assert doc["plan"]["micro_batch_size"] == p.micro_batch_size and doc["candidates"]
    assert all(c["lost_because"] for c in doc["candidates"])


def test_predictions_of_given_set_ups_rank_recompute_as_slower(llama):
    keep = PlanSettings(4, 1, ("keep",) * 4, "full", False, "device", "none", False, "bf16-mixed")
    recompute = PlanSettings(4, 1, ("recompute",) * 4, "full", False, "device", "none", False, "bf16-mixed")
    a, b = predictions(llama, [keep, recompute], seq_len=1024, global_batch_size=4, device_profile=H100)
    assert b.step_seconds > a.step_seconds and b.peak_bytes < a.peak_bytes, (a, b)


# -- device figures -------------------------------------------------------------------------------------------
def test_calibration_is_cached_per_device(tmp_path, monkeypatch):
    import memtrain.planner as planner

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    calls = []
    real = planner._probe

    def counting(device, name):
        calls.append(name)
        return real(device, name)

    monkeypatch.setattr(planner, "_probe", counting)
    first = calibrate("cpu")
    second = calibrate("cpu")
    assert len(calls) == 1 and (tmp_path / "memtrain" / "calibration.json").is_file()
    assert first.matmul_flops == second.matmul_flops and "cached" in second.source
    assert first.matmul_flops > 0 and first.cpu_adamw > 0 and not first.asynchronous


def test_known_gpus_and_an_unknown_one():
    h200 = known_gpu("NVIDIA H200")
    assert h200.memory_bytes == int(141e9) and h200.host_to_device == 55e9 and "table" in h200.source
    with pytest.raises(ConfigError, match="--calibrate"):
        known_gpu("Voodoo 5")


def test_fixed_choices_are_kept_and_the_rest_is_searched(llama):
    from memtrain.planner import Fixed

    layout = ("recompute", "keep", "recompute", "keep")
    p = plan(llama, budget=None, seq_len=1024, global_batch_size=4, device_profile=H100,
             fixed=Fixed(blocks=layout, chunked_loss=True, optimizer="offload"))
    assert (p.settings.blocks, p.settings.chunked_loss, p.settings.optimizer) == (layout, True, "offload")
    assert p.settings.micro_batch_size == 4  # searched: the fastest, with no budget
    with pytest.raises(ConfigError, match="4 blocks"):
        plan(llama, budget=None, seq_len=1024, global_batch_size=4, device_profile=H100,
             fixed=Fixed(blocks=("keep",) * 3))


def test_a_measured_overshoot_is_folded_into_a_replan(llama):
    first = plan(llama, budget=int(256 * MiB), seq_len=1024, global_batch_size=4, device_profile=H100)
    overshoot = first.usable_bytes - first.peak_bytes + 8 * MiB  # the first plan would not fit any more
    again = plan(llama, budget=int(256 * MiB), seq_len=1024, global_batch_size=4, device_profile=H100,
                 correction_bytes=overshoot)
    assert again.peak_bytes <= again.usable_bytes
    assert again.settings != first.settings
    assert again.peak_bytes - overshoot < first.peak_bytes, (again.peak_bytes, first.peak_bytes)
    assert any("measurement" in a for a in again.assumptions)


# -- bytes over the host link, and what compile_model compiles ------------------------------------------------
def _offload_gpt() -> GPT:
    # Block inputs of 256 x 256 fp32 per example: 256 KiB at micro-batch 1, the offloader's 1 MiB at 4.
    torch.manual_seed(0)
    return GPT(GPTConfig(n_layer=2, n_head=4, n_embd=256, seq_len=256, vocab_size=256, dropout=0.0))


@pytest.mark.parametrize("micro", [1, 4])
def test_host_link_of_offloaded_activations_is_what_the_offloader_moves_at_that_micro_batch(micro):
    from memtrain.estimate import trace
    from memtrain.offload import MIN_BYTES_DEFAULT

    model = _offload_gpt()
    s = PlanSettings(micro, 2, ("offload", "offload"), "full", False, "device", "none", False, "fp32")
    (c,) = predictions(model, [s], seq_len=256, global_batch_size=2 * micro, device="cuda", device_profile=H100)
    # The full estimate's simulated offloader, with the real one's threshold, at the candidate's micro-batch.
    t = trace(model, (micro, 256), device="cuda", precision="fp32",
              checkpointing={"policies": dict.fromkeys(("blocks.0", "blocks.1"), "offload")},
              offload_min_bytes=MIN_BYTES_DEFAULT)
    assert t.offloaded_bytes > 0
    assert c.host_bytes == t.offloaded_bytes, (c.host_bytes, t.offloaded_bytes)
    link = c.host_link
    assert (link.activations_to_host, link.activations_to_device) == (2 * t.offloaded_bytes,) * 2, link
    assert (link.optimizer_to_host, link.optimizer_to_device) == (0, 0), link


def test_host_link_of_an_offloaded_optimizer_is_its_gradients_each_micro_batch_and_the_weights_once():
    model = _gpt(2)
    numel = sum(p.numel() for p in model.parameters() if p.requires_grad)
    s = PlanSettings(1, 3, ("keep", "keep"), "full", False, "offload", "none", False, "fp32")
    (c,) = predictions(model, [s], seq_len=32, global_batch_size=3, device="cuda", device_profile=H100)
    assert c.host_link.to_dict() == {"activations_to_host": 0, "activations_to_device": 0,
                                     "optimizer_to_host": 3 * 4 * numel, "optimizer_to_device": 4 * numel,
                                     "to_host": 12 * numel, "to_device": 4 * numel, "total": 16 * numel}


def test_a_plan_reports_its_host_link_bytes():
    model = _offload_gpt()
    s = PlanSettings(4, 1, ("offload", "keep"), "full", False, "offload", "none", False, "fp32")
    p = plan(model, budget=None, seq_len=256, global_batch_size=4, device_profile=H100, settings=s,
             host_budget="64GiB")
    (c,) = predictions(model, [s], seq_len=256, global_batch_size=4, device="cuda", device_profile=H100)
    assert p.host_link == c.host_link and p.host_link_bytes == c.host_link.total > 0
    assert all(r.host_link is not None for r in p.candidates)
    assert p.host_link.activations_to_host > 0 and p.host_link.optimizer_to_host > 0, p.host_link
    assert json.loads(json.dumps(p.to_dict()))["host_link"] == p.host_link.to_dict()
    assert "host link per step:" in p.summary(), p.summary()


def test_compiled_offloading_set_ups_time_the_code_around_the_blocks_eager(llama):
    # compile_model compiles an offloading set-up block by block: the embeddings, the head and the loss stay eager,
    # so compiling saves such a set-up its blocks' time only; a set-up without offload is compiled whole. With an
    # unlimited host link nothing waits on copies: the step is the blocks' time plus the rest's.
    from memtrain import planner

    fast_link = dataclasses.replace(H100, host_to_device=1e30, device_to_host=1e30)
    settings = {(kind, compiled): PlanSettings(2, 1, (kind,) * 4, "full", False, "device", "none", compiled,
                                               "bf16-mixed")
                for kind in ("keep", "offload") for compiled in (False, True)}
    seconds = {k: c.step_seconds for k, c in zip(settings, predictions(
        llama, list(settings.values()), seq_len=512, global_batch_size=2, device_profile=fast_link), strict=True)}
    ctx = planner._context(llama, 512, 2, "cuda", "bf16-mixed", 1, True, True, fast_link)
    composer = planner._composer_for(ctx, list(settings.values()))
    prof = composer.profile("device")

    def blocks_s(kind, compiled):
        a = composer.arrays(prof, kind, 2, compiled)
        return float(a.forward_s.sum() + a.backward_s.sum())

    for kind in ("keep", "offload"):
        gain = seconds[kind, False] - seconds[kind, True]
        blocks_gain = blocks_s(kind, False) - blocks_s(kind, True)
        if kind == "offload":
            assert gain == pytest.approx(blocks_gain, rel=1e-9), (gain, blocks_gain)
        else:  # compiled whole: the code around the blocks gains too
            assert gain > blocks_gain * (1 + 1e-6), (gain, blocks_gain)
    p = plan(llama, budget=None, seq_len=512, global_batch_size=2, device_profile=H100,
             settings=settings["offload", True])
    assert any("compile_model" in a and "eager" in a for a in p.assumptions), p.assumptions
