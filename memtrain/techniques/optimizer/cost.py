"""The optimizer's share of a candidate's bytes and seconds, as the planner's cost model (``memtrain.planner.cost``)
composes them: its state and step temporaries on the device, its host bytes, which gradients leave the device as they
land, the step's seconds on the device and on the host, and the bytes it moves over the host link.

``OptimizerShare`` is built once per configuration key (``OptimizerShare.key``) and profiles; the composer asks it
for figures and never reads the optimizer's setting fields itself. Not imported by this package's ``__init__``:
``memtrain.optim`` imports ``memtrain.techniques``, and this module imports ``memtrain.optim``. The planner's types
(profiles, device profile, problem, configuration) are ``Any`` here: the planner imports the techniques.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from memtrain.optim import offloaded_mask, optimizer_memory
from memtrain.techniques.optimizer.named import NamedOptimizer

# Bytes a device AdamW step reads and writes per parameter, by moment precision: fused fp32 AdamW reads p, g,
# m, v and writes p, m, v (28); BF16StateAdamW runs it on fp32 copies of the moments, copied in, rounded with
# noise and copied back a pass at a time (92: its docstring counts them); bitsandbytes' 8-bit step moves 2 bytes of
# each moment and a scale per 256. (Assumptions; the CPU uses measured rates.)
_STEP_BYTES = {"fp32": 28.0, "bf16": 92.0, "int8": 20.0}
# Kernel launches per parameter tensor: fused AdamW steps every tensor in a few multi-tensor launches;
# BF16StateAdamW one step-counter add, then 5 multi-tensor ops a pass of 2**24 elements (bench_optim_ops.py
# prints them): the 1.1B Llama's 201 tensors take 66 passes, 331 ops, about 1.6 a tensor; bitsandbytes steps per
# tensor.
_STEP_OPS = {"fp32": 0.05, "bf16": 2.0, "int8": 2.0}
# How much faster (a fraction of the step) lean moments must be than fp32 ones to be chosen for speed alone.
LEAN_MARGIN = 0.05
# A host step's rate relative to torch's fused fp32 AdamW's, where the probe did not measure it (a --gpu plan's host):
# the fused host kernels (memtrain.optim.host_kernels) side by side with it on 2 threads, 96M parameters (beyond the
# L3 cache, as a model's host step is): `memtrain bench host_step -- --params 96M` printed, in three runs, bf16 moments
# 1.22x, 1.23x and 1.24x, pure bf16 1.43x, 1.45x and 1.33x with bf16 moments, 1.14x and 1.18x with fp32 ones, and
# bitsandbytes' 8-bit layout 0.93x (its encoding through 64-bit table entries; 0.79x and 0.81x before it).
_CPU_RATE = {"fp32": 1.0, "bf16": 1.22, "int8": 0.93}
_PURE_CPU_RATE = {"fp32": 1.14, "bf16": 1.44}
# Pure bf16 (PureBF16AdamW) on a device (its multi-tensor path): per parameter, the bf16 weight and gradient copied
# into fp32 (read 4, write 8), the moments too where they are bf16 (4, 8), the fused kernel on the fp32 copies (28),
# the rounding noise added to the weight and bf16 moments (read 12 + 12, write 12 with bf16 moments; a third
# without), the mask (24 or 8) and the copies back (12 + 6, or 4 + 2): about 136 bytes with bf16 moments, 76 with
# fp32 ones (fp32 moments are stepped in place).
_PURE_STEP_BYTES = {"fp32": 76.0, "bf16": 136.0}
# A named class on the device (an assumption: no kernel of its own is measured there): it reads the weight and the
# gradient, writes the weight, and reads and writes its state once; multi-tensor kernels, a few launches a tensor.
_NAMED_STEP_OPS = 0.2
_BUCKET_BYTES = 4 * (1 << 25)  # CPUOffloadOptimizer.bucket_numel fp32 parameters: the last bucket's copy back
_IN_BACKWARD_OPS = 4  # extra small ops per parameter tensor of step-in-backward's hooks


def _round_to(device: str) -> int:
    """Bytes the device's allocator rounds each state tensor up to."""
    return 512 if device == "cuda" else 1


def weights_profile(placement: str, pure_bf16: bool) -> str | None:
    """Which profiles a configuration reads, by the dtype of its device weights: "bf16" where the offloaded optimizer
    keeps bf16 device weights (an fp32 master on the host) or pure bf16 trains bf16 weights; None (the model's own
    dtype) otherwise."""
    return "bf16" if placement == "offload-bf16-weights" or pure_bf16 else None


def space_profiles(space: Any) -> list[str | None]:
    """The profiles the search's ``space`` reads (``weights_profile``): the model's own dtype unless only pure bf16
    set-ups are searched, and bf16 where a placement keeps bf16 device weights or pure bf16 trains them."""
    return ([None] if not space.pure_bf16 else []) + (
        ["bf16"] if "offload-bf16-weights" in space.placements or space.pure_bf16 else [])


def profile_key(cfg: Any) -> str | None:
    """``weights_profile`` of a configuration (or ``PlanSettings``)."""
    return weights_profile(cfg.optimizer, cfg.pure_bf16)


def ranked_seconds(seconds: np.ndarray, column: Callable[[str], np.ndarray]) -> np.ndarray:
    """The seconds a candidate table ranks its rows by: lean moments change the numerics (moments rounded or
    quantised), so on speed alone they must beat fp32 moments by ``LEAN_MARGIN``, more than a probe's noise, or plans
    would flip between runs on one machine (the fused host kernels step bf16 moments about as fast as fp32 ones).
    ``column(name)``: each row's value of a configuration field."""
    lean = column("state_precision") != "fp32"
    return np.where(lean, seconds * (1 + LEAN_MARGIN), seconds)


def step_temp_after_backward(s: Any, step_temp_bytes: float) -> float:
    """The step's temporaries at the end of the step: none where each parameter steps in backward (they came during
    it)."""
    return 0 if s.step_in_backward else step_temp_bytes


def named_state_bytes(prof: Any, named: NamedOptimizer, round_to: int) -> float:
    """A named class's device state over every trainable parameter (the probe's, rounded as the allocator does)."""
    key = ("named state bytes", named, round_to)
    if key not in prof.memo:
        prof.memo[key] = float(sum(named.state_bytes(shape, dt, round_to) for shape, (_, dt) in zip(
            prof.trainable_shapes, prof.trainable_params, strict=True)))
    return prof.memo[key]


def full_state_bytes(prof: Any, named: NamedOptimizer, device: str) -> float:
    """The whole optimizer's device state over every trainable parameter (what FSDP2 shards): AdamW's as traced, a
    named class's measured (``named_state_bytes``)."""
    return prof.adamw_state_bytes if named.is_adamw else named_state_bytes(prof, named, _round_to(device))


def host_step_rate(dev: Any, cfg: Any) -> float:
    """Parameters per second of the host's AdamW step with ``cfg``'s moments: the probe's measured rate where it
    has one, else fused fp32 AdamW's rate scaled by the measured ratio (``_CPU_RATE``, ``_PURE_CPU_RATE``)."""
    if not cfg.optimizer_class.is_adamw:  # another class: fused AdamW's rate over its measured time ratio
        return dev.cpu_adamw / cfg.optimizer_class.step_time_ratio()
    if cfg.pure_bf16:
        measured_pure = dev.cpu_adamw_pure if cfg.state_precision == "bf16" else None
        return measured_pure or dev.cpu_adamw * _PURE_CPU_RATE[cfg.state_precision]
    measured = {"fp32": dev.cpu_adamw, "bf16": dev.cpu_adamw_bf16, "int8": dev.cpu_adamw_int8}[cfg.state_precision]
    return measured or dev.cpu_adamw * _CPU_RATE[cfg.state_precision]


def _named_step_bytes(prof: Any, named: NamedOptimizer) -> float:
    """Bytes a named class's device step moves per parameter: weight and gradient read, weight written (fp32), and
    its measured state read and written."""
    key = ("named step bytes", named)
    if key not in prof.memo:
        state = sum(named.state_bytes(shape, dt) for shape, (_, dt) in zip(prof.trainable_shapes,
                                                                          prof.trainable_params, strict=True))
        prof.memo[key] = 12.0 + 2 * state / max(prof.trainable_numel, 1)
    return prof.memo[key]


class OptimizerShare:
    """The optimizer's share of one configuration's figures over one set of profiles: its bytes
    (``memtrain.optim.optimizer_memory``), which gradients leave the device as they land, its step's seconds and its
    bytes over the host link. Built once per ``key`` (the configuration fields it reads) and profiles.

    Args:
        ctx: the planner's problem (device, device profile, block names, gradient clipping).
        prof: the profiles of the configuration's device weights (``profile_key``).
        cfg: a configuration; only the fields ``key`` names are read, so every configuration of one key may share it.
    """

    def __init__(self, ctx: Any, prof: Any, cfg: Any):
        self.ctx, self.prof, self.cfg = ctx, prof, cfg
        self.memory = optimizer_memory(prof.trainable_params, state_precision=cfg.state_precision,
                                       offload_fraction=cfg.host_fraction, step_in_backward=cfg.step_in_backward,
                                       accumulation_steps=cfg.accumulation, device_type=ctx.device,
                                       pure_bf16=cfg.pure_bf16, named=cfg.optimizer_class,
                                       shapes=prof.trainable_shapes, round_to=_round_to(ctx.device))
        leaving = np.array(offloaded_mask([n for n, _ in prof.trainable_params], cfg.host_fraction), dtype=bool)
        if cfg.step_in_backward and cfg.accumulation == 1:
            leaving[:] = True
        blocks = prof.trainable_blocks
        n = len(ctx.block_names)
        # A block's gradients leave when all of its parameters' do (a block split by a partial offload stays).
        in_block = blocks >= 0
        counts = np.bincount(blocks[in_block], minlength=n)
        self.block_leaves = (counts > 0) & (np.bincount(blocks[in_block & leaving], minlength=n) == counts)
        """Per block: whether its gradients leave the device as they land (streamed to the host, or stepped in
        backward)."""
        other = blocks < 0
        self.other_leaves = bool(other.any() and leaving[other].all())
        """Whether the head's and the embeddings' gradients leave the device as they land."""

    @staticmethod
    def key(cfg: Any) -> tuple[Any, ...]:
        """The configuration fields a share reads: configurations equal in them share one."""
        return (cfg.state_precision, cfg.host_fraction, cfg.step_in_backward, cfg.accumulation, cfg.pure_bf16,
                cfg.optimizer_class)

    @property
    def device_state_bytes(self) -> float:
        """The optimizer state on the device, alive the whole step."""
        return self.memory.device_state_bytes

    @property
    def device_gradient_bytes(self) -> float:
        """Every device-stepped parameter's gradient: with accumulation, the earlier micro-batches' are alive from
        the start of a micro-batch."""
        return self.memory.device_gradient_bytes

    @property
    def host_bytes(self) -> float:
        """Host RAM the optimizer takes (state, master weights, gradient buffers) per rank."""
        return self.memory.host_bytes

    @property
    def step_temp_in_backward(self) -> float:
        """The step's temporaries during backward: stepping in backward, they come there (an upper bound: at its
        peak)."""
        return self.memory.device_step_temp_bytes if self.cfg.step_in_backward else 0

    @property
    def step_temp_after_backward(self) -> float:
        """The step's temporaries after backward (``step_temp_after_backward``)."""
        return step_temp_after_backward(self.cfg, self.memory.device_step_temp_bytes)

    def link(self, shards: int) -> tuple[float, float]:
        """(bytes of gradients to the host per micro-batch, bytes of weights back per step) of the parameters whose
        step runs on the host (``memtrain.optim.offloaded_mask``, whole tensors): both in the device weights' dtype;
        ``shards``: the ranks FSDP2 shards them over (1 without FSDP2)."""
        cfg, prof = self.cfg, self.prof
        if cfg.host_fraction == 0:
            return 0.0, 0.0
        key = ("offloaded parameter bytes", cfg.host_fraction)
        if key not in prof.memo:
            mask = offloaded_mask([n for n, _ in prof.trainable_params], cfg.host_fraction)
            prof.memo[key] = float(sum(n * d.itemsize for (n, d), m in zip(prof.trainable_params, mask, strict=True)
                                       if m))
        device_bytes = prof.memo[key]
        if shards > 1:
            device_bytes /= shards  # each rank's shard
        return device_bytes, device_bytes

    def step_seconds(self, backward_s: np.ndarray, shards: int) -> np.ndarray:
        """The step after the last backward, per row: the device's part (memory-bound) and the host's (the offloaded
        share), which run side by side. ``backward_s``: a micro-batch's backward seconds; ``shards``: the ranks
        FSDP2 shards the parameters over (1 without FSDP2)."""
        ctx, prof, cfg = self.ctx, self.prof, self.cfg
        dev = ctx.device_profile
        numel = float(prof.trainable_numel)
        if shards > 1:
            numel /= shards
        on_host = numel * cfg.host_fraction
        on_device = numel - on_host
        if ctx.device == "cuda":
            tensors = len(prof.trainable_params) * (1 - cfg.host_fraction)
            step_bytes = (_PURE_STEP_BYTES if cfg.pure_bf16 else _STEP_BYTES)[cfg.state_precision]
            ops = _STEP_OPS["bf16" if cfg.pure_bf16 else cfg.state_precision]
            if not cfg.optimizer_class.is_adamw:
                step_bytes, ops = _named_step_bytes(prof, cfg.optimizer_class), _NAMED_STEP_OPS
            device_part = max(step_bytes * on_device / dev.memory_bandwidth, ops * tensors * dev.op_overhead_s)
        else:  # the "device" is the host: its own AdamW rate
            device_part = on_device / host_step_rate(dev, cfg)
        device_part = device_part + 0 * backward_s
        if on_host == 0:
            return device_part
        grad_bytes, _ = self.link(shards)
        # Gradients stream to the host during each micro-batch's backward, the host adds later micro-batches in;
        # after the last backward: the norms (clipping), the CPU step, then the last bucket's weights cross back.
        d2h = np.maximum(0.0, grad_bytes / dev.device_to_host - backward_s) * cfg.accumulation
        host_adds = (cfg.accumulation - 1) * 12 * on_host / dev.host_bandwidth
        norms = 4 * on_host / dev.host_bandwidth if ctx.grad_clip else 0.0
        last_bucket = min(grad_bytes, _BUCKET_BYTES * grad_bytes / (4 * on_host))
        host_part = d2h + host_adds + norms + on_host / host_step_rate(dev, cfg) + last_bucket / dev.host_to_device
        return np.maximum(device_part, host_part)

    def in_backward_seconds(self, dev: Any) -> float:
        """What stepping in backward adds to a step, on ``dev`` (the device profile at the compute precision): one
        backward pass (clipping by the previous window's norm, the fp16 inf check on the device), its steps in
        ``step_seconds`` like the ordinary step's; on top, per tensor: its gradient's norm read in the hook, the inf
        flag, the clip multiply and an optimizer call of its own (a few small ops each). So it is never faster than
        the ordinary step: the search takes it for the memory it saves. 0 for the ordinary step."""
        if not self.cfg.step_in_backward:
            return 0.0
        tensors = len(self.prof.trainable_params)
        return tensors * _IN_BACKWARD_OPS * dev.op_overhead_s + 4.0 * self.prof.trainable_numel / dev.memory_bandwidth
