"""Tests of each technique's share of a candidate's bytes and seconds (``memtrain.techniques.optimizer.cost``,
``memtrain.techniques.weight_offload``): on one small model, the figures the planner's cost model asks them for equal
the formulas it computed itself before they moved (issue 30), written out here."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from helpers import h100, planner_llama

from memtrain.optim import offloaded_mask, optimizer_memory

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def composer():
    from memtrain.planner.cost import Composer
    from memtrain.planner.search import problem_of
    from memtrain.planner.tracing import build_profiles

    ctx = problem_of(planner_llama(layers=3, hidden=256), 128, 4, "cuda", "bf16-mixed", 1, True, True, h100())
    return Composer(ctx, {None: build_profiles(ctx, ["full"], True, None)})


def _configuration(**fields):
    from memtrain.planner.settings import Configuration

    base = dict(micro_batch_size=2, accumulation=2, flavor="full", chunked_loss=False, optimizer="device",
                distribution="none", compile=False, precision="bf16-mixed")
    return Configuration(**{**base, **fields})


CONFIGURATIONS = {
    "partial offload": dict(offload_fraction=0.5),
    "step in backward, bf16 moments": dict(accumulation=1, step_in_backward=True, state_precision="bf16"),
    "offloaded with streamed weights": dict(optimizer="offload", offload_weights=True),
    "pure bf16": dict(pure_bf16=True, state_precision="bf16"),
}


@pytest.mark.parametrize("name", list(CONFIGURATIONS))
def test_the_optimizers_share_equals_the_old_formulas(composer, name):
    from memtrain.techniques.optimizer import cost

    ctx, cfg = composer.ctx, _configuration(**CONFIGURATIONS[name])
    prof = composer.profiles[None]
    share = composer.share(prof, cfg)
    assert composer.share(prof, dataclasses.replace(cfg, micro_batch_size=1)) is share  # one per key
    memory = optimizer_memory(prof.trainable_params, state_precision=cfg.state_precision,
                              offload_fraction=cfg.host_fraction, step_in_backward=cfg.step_in_backward,
                              accumulation_steps=cfg.accumulation, device_type="cuda", pure_bf16=cfg.pure_bf16,
                              named=cfg.optimizer_class, shapes=prof.trainable_shapes, round_to=512)
    assert share.memory == memory
    assert share.device_state_bytes == memory.device_state_bytes and share.host_bytes == memory.host_bytes
    temp = memory.device_step_temp_bytes
    assert (share.step_temp_in_backward, share.step_temp_after_backward) == (
        (temp, 0) if cfg.step_in_backward else (0, temp))

    # Which gradients leave the device as they land.
    mask = offloaded_mask([n for n, _ in prof.trainable_params], cfg.host_fraction)
    leaving = np.array(mask) | (cfg.step_in_backward and cfg.accumulation == 1)
    blocks = prof.trainable_blocks
    for i in range(len(ctx.block_names)):
        assert share.block_leaves[i] == leaving[blocks == i].all(), i
    assert share.other_leaves == bool(leaving[blocks < 0].all())

    # The host link: the host-stepped parameters' bytes, a rank's shard under FSDP2.
    host = float(sum(n * d.itemsize for (n, d), m in zip(prof.trainable_params, mask, strict=True) if m))
    assert share.link(1) == (host, host) and share.link(4) == (host / 4, host / 4)

    # The step's seconds: the device's part, and the host's beside it.
    dev = ctx.device_profile
    backward = np.array([0.01, 0.2])
    numel = float(prof.trainable_numel)
    on_host = numel * cfg.host_fraction
    on_device = numel - on_host
    state = "bf16" if cfg.pure_bf16 else cfg.state_precision
    step_bytes = (cost._PURE_STEP_BYTES if cfg.pure_bf16 else cost._STEP_BYTES)[cfg.state_precision]
    device_part = max(step_bytes * on_device / dev.memory_bandwidth,
                      cost._STEP_OPS[state] * len(prof.trainable_params) * (1 - cfg.host_fraction) * dev.op_overhead_s)
    expected = device_part + 0 * backward
    if on_host:
        d2h = np.maximum(0.0, host / dev.device_to_host - backward) * cfg.accumulation
        host_part = (d2h + (cfg.accumulation - 1) * 12 * on_host / dev.host_bandwidth + 4 * on_host / dev.host_bandwidth
                     + on_host / cost.host_step_rate(dev, cfg)
                     + min(host, cost._BUCKET_BYTES * host / (4 * on_host)) / dev.host_to_device)
        expected = np.maximum(expected, host_part)
    np.testing.assert_array_equal(share.step_seconds(backward, 1), expected)
    extra = (len(prof.trainable_params) * cost._IN_BACKWARD_OPS * dev.op_overhead_s
             + 4.0 * prof.trainable_numel / dev.memory_bandwidth) if cfg.step_in_backward else 0.0
    assert share.in_backward_seconds(dev) == extra


def test_parameter_offloads_share_equals_the_old_formulas(composer):
    from memtrain.techniques.weight_offload import (
        WEIGHTS_IN_FLIGHT,
        streamed_weight_bytes,
        weights_host_bytes,
        weights_micro_seconds,
        weights_shift,
    )

    ctx, prof = composer.ctx, composer.profiles[None]
    on = _configuration(optimizer="offload", offload_weights=True)
    off = _configuration(optimizer="offload")
    blocks = float(np.sum(prof.block_parameter_bytes))
    assert (streamed_weight_bytes(prof, on), streamed_weight_bytes(prof, off)) == (blocks, 0.0)
    assert weights_shift(prof, on) == WEIGHTS_IN_FLIGHT * float(np.max(prof.block_parameter_bytes)) - blocks
    assert weights_shift(prof, off) == 0.0
    assert weights_host_bytes(prof, on) == 0.0
    assert weights_host_bytes(prof, dataclasses.replace(on, optimizer="offload-bf16-weights")) == blocks

    micro, moved, stall, grads = np.array([0.001, 0.5]), np.array([3e6, 0.0]), np.array([0.002, 0.0]), 5e6
    dev = ctx.device_profile
    fwd = bwd = np.zeros((2, len(ctx.block_names)))

    def memo(key, make):
        assert key == "weights stall"
        return stall

    assert weights_micro_seconds(ctx, prof, off, micro, fwd, bwd, memo, dev, moved, grads) is micro
    expected = np.maximum(micro + stall, np.maximum((moved + 2 * blocks) / dev.host_to_device,
                                                    (moved + grads) / dev.device_to_host))
    np.testing.assert_array_equal(weights_micro_seconds(ctx, prof, on, micro, fwd, bwd, memo, dev, moved, grads),
                                  expected)
