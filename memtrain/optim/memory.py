"""The byte model of ``build_optimizer``'s optimizers, predicted without building one (for ``estimate`` and the
planner), which parameters a partial offload puts on the host, and the host step's measured rate.

``optimizer_memory`` equals what ``memtrain.measure.optimizer_state_bytes`` counts for the built optimizer.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from memtrain.errors import ConfigError
from memtrain.message import arg
from memtrain.optim import host_kernels
from memtrain.optim.host_buffers import aligned, bucket_runs, sum_stage_numel
from memtrain.optim.moments import (
    BF16_CHUNK,
    INT8_BLOCK,
    INT8_CPU_CHUNK,
    INT8_MIN_NUMEL,
    NOISE_OFFSETS,
    QMAP_BYTES,
    check_precision,
    state_class,
)
from memtrain.optim.offload import CPUOffloadOptimizer
from memtrain.optim.pure_bf16 import PURE_BF16_CHUNK, PureBF16AdamW, check_pure_bf16_moments
from memtrain.techniques import SetUp, problems
from memtrain.techniques.optimizer import NamedOptimizer


# -- which parameters go to the host ------------------------------------------------------------------------
def offloaded_mask(numels: Sequence[int], fraction: float) -> list[bool]:
    """Which parameters (in registration order) a partial offload puts on the host: the shortest run of the
    *last* ones holding at least ``fraction`` of the elements. Their gradients land first in backward, so their
    CPU step starts earliest and the next forward needs their weights last.

    Raises:
        ConfigError: ``fraction`` outside [0, 1].
    """
    if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not 0.0 <= fraction <= 1.0:
        raise ConfigError(f"{arg('offload_fraction', fraction)} must be a number in [0, 1] (0: all state on the device, "
                          f"1: all on the host). To resolve this error, pass e.g. {arg('offload_fraction', 0.5)}.")
    total = sum(numels)
    mask = [False] * len(numels)
    if fraction <= 0 or total == 0:
        return mask
    held = 0
    for i in reversed(range(len(numels))):
        if held >= fraction * total:
            break
        mask[i] = True
        held += numels[i]
    return mask


# -- the byte model -----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class OptimizerMemory:
    """Bytes an optimizer built by ``build_optimizer`` holds, predicted without building it.

    Attributes:
        device_state_bytes: optimizer state on the device after the first step (moments, step counters, 8-bit
            scales and code books).
        device_gradient_bytes: the device gradients held between micro-batches of a window (0 for offloaded
            parameters, whose gradients stream to the host).
        device_gradient_peak_bytes: live device gradient bytes at the backward's peak: with step-in-backward and
            one micro-batch per step, the largest device parameter's gradient; else ``device_gradient_bytes``.
        device_step_temp_bytes: transient device bytes of the step (an upper bound: bf16 moments' fp32 chunk
            copies and rounding noise; step-in-backward's one pass adds none).
        host_state_bytes: optimizer state in host RAM (offloaded parameters).
        host_bytes: everything in host RAM: fp32 masters, gradient buffers, cast and gradient stage buffers
            (non-fp32 device weights), the sum stage (with accumulation, on a device with streams) and state.
        offloaded_params: parameters (tensors) whose state is on the host.
    """

    device_state_bytes: int
    device_gradient_bytes: int
    device_gradient_peak_bytes: int
    device_step_temp_bytes: int
    host_state_bytes: int
    host_bytes: int
    offloaded_params: int

    @property
    def state_bytes(self) -> int:
        """All optimizer state, device and host: what ``measure.optimizer_state_bytes`` counts."""
        return self.device_state_bytes + self.host_state_bytes


def _state_bytes(numel: int, dtype: torch.dtype, precision: str) -> int:
    """One parameter's state bytes, code books excluded (they are shared per optimizer)."""
    if precision == "fp32":
        return 4 + 2 * numel * torch.empty((), dtype=dtype).element_size()  # step (fp32 scalar), two moments
    if precision == "bf16":
        return 4 + 2 * numel * 2
    if numel < INT8_MIN_NUMEL:
        return 2 * numel * 4  # bitsandbytes' fp32 moments; its step counter is a Python int
    return 2 * numel + 2 * 4 * -(-numel // INT8_BLOCK)


def optimizer_memory(params: Sequence[tuple[int, torch.dtype]], *, state_precision: str = "fp32",
                     offload_fraction: float = 0.0, step_in_backward: bool = False, accumulation_steps: int = 1,
                     delayed_update: bool = False, device_type: str = "cuda", pure_bf16: bool = False,
                     named: NamedOptimizer | None = None, shapes: Sequence[tuple[int, ...]] | None = None,
                     round_to: int = 1) -> OptimizerMemory:
    """The bytes of ``build_optimizer(...)`` over trainable parameters ``(numel, dtype)`` in registration order.

    Pure: builds nothing, so it serves ``estimate`` and the planner on configs of any size. Bytes per parameter
    of state: fp32 8, bf16 4, int8 2 + 8/256 (tensors of at least 4,096 elements; smaller ones 8), plus 4 bytes of
    step counter per tensor (fp32 and bf16) and 2 KiB of code books per bitsandbytes optimizer.

    ``pure_bf16`` (``PureBF16AdamW``, weights given as bf16): fp32 moments take 8 bytes per parameter whatever the
    weights' dtype; the host keeps bf16 weights and bf16 gradient buffers (2 + 2 bytes per parameter), no fp32 master
    and no cast; the step's scratch holds fp32 copies of the weights and gradients (and of bf16 moments).

    ``named``: another optimizer class (``NamedOptimizer``; ``state_precision`` "fp32": its own state), whose state
    is measured by probe steps over each parameter's shape (``shapes``, in the order of ``params``; each state
    tensor rounded up to ``round_to``) and whose step scratch by one probe step; the host buffers are the same.

    Example:
        >>> m = optimizer_memory([(4096 * 4096, torch.float32)], state_precision="int8")
        >>> round(m.device_state_bytes / (4096 * 4096), 3)
        2.031
    """
    check_precision(state_precision)
    foreign = named is not None and not named.is_adamw
    if foreign:
        ConfigError.raise_if(problems(SetUp(optimizer=named, state_precision=state_precision, pure_bf16=pure_bf16)))
    shapes = list(shapes) if shapes is not None else [(int(n),) for n, _ in params]
    numels = [int(n) for n, _ in params]
    on_host = offloaded_mask(numels, offload_fraction)
    device = [(n, dt) for (n, dt), h in zip(params, on_host, strict=True) if not h]
    host = [(n, dt) for (n, dt), h in zip(params, on_host, strict=True) if h]
    if foreign:
        device_state = sum(named.state_bytes(s, dt, round_to)
                           for (_, dt), s, h in zip(params, shapes, on_host, strict=True) if not h)
        host_state = sum(named.state_bytes(s, torch.float32) for s, h in zip(shapes, on_host, strict=True) if h)
    else:
        device_state, host_state = _adamw_state(device, host, state_precision, step_in_backward, pure_bf16)
    grad_bytes = [n * torch.empty((), dtype=dt).element_size() for n, dt in device]
    peak = max(grad_bytes, default=0) if step_in_backward and accumulation_steps == 1 else sum(grad_bytes)
    if foreign:
        temp = -(-_named_step_temp(named, device, step_in_backward, device_type) // round_to) * round_to
    else:
        temp = _adamw_step_temp(device, state_precision, step_in_backward, device_type, pure_bf16)
    return OptimizerMemory(
        device_state_bytes=device_state, device_gradient_bytes=sum(grad_bytes), device_gradient_peak_bytes=peak,
        device_step_temp_bytes=temp, host_state_bytes=host_state,
        host_bytes=_host_bytes(host, host_state, accumulation_steps, delayed_update, device_type, pure_bf16),
        offloaded_params=len(host))


def _adamw_state(device: list[tuple[int, torch.dtype]], host: list[tuple[int, torch.dtype]], state_precision: str,
                 step_in_backward: bool, pure_bf16: bool) -> tuple[int, int]:
    """memtrain's AdamW's state bytes on the device and on the host (its moments by formula)."""

    def qmaps(groups: list[list[tuple[int, torch.dtype]]]) -> int:
        if state_precision != "int8":
            return 0
        return QMAP_BYTES * sum(any(n >= INT8_MIN_NUMEL for n, _ in g) for g in groups)

    moment_dtype = {True: torch.float32}  # pure bf16's fp32 moments are fp32 on bf16 weights
    device_state = sum(_state_bytes(n, moment_dtype.get(pure_bf16, dt), state_precision) for n, dt in device)
    # One optimizer over the device parameters, or one per parameter with step-in-backward.
    device_state += qmaps([[p] for p in device] if step_in_backward else [device])
    # CPUOffloadOptimizer: fp32 masters (state in fp32 terms), buckets in reverse registration order.
    host_state = sum(_state_bytes(n, torch.float32, state_precision) for n, _ in host)
    host_rev = list(reversed(host))
    host_state += qmaps([[host_rev[i] for i in run]
                         for run in bucket_runs([n for n, _ in host_rev], CPUOffloadOptimizer.bucket_numel)])
    return device_state, host_state


def _host_bytes(host: list[tuple[int, torch.dtype]], host_state: int, accumulation_steps: int,
                delayed_update: bool, device_type: str, pure_bf16: bool) -> int:
    """CPUOffloadOptimizer's host RAM: its state, fp32 masters, gradient buffers, cast and sum stages."""
    if not host:
        return 0
    aligned_numel = sum(aligned(n) for n, _ in host)
    cast = sum(aligned(n) * torch.empty((), dtype=dt).element_size() for n, dt in host if dt != torch.float32)
    # Non-fp32 device weights: a cast buffer in their dtype, also the gradient stage (a second one for a delayed
    # update, whose step overlaps the next backward).
    host_bytes = host_state + 4 * aligned_numel * (2 + bool(delayed_update)) + cast * (1 + bool(delayed_update))
    if pure_bf16:  # the bf16 weights themselves and bf16 gradient buffers: nothing to cast
        host_bytes = host_state + 2 * aligned_numel * (2 + bool(delayed_update))
    if device_type != "cpu" and accumulation_steps > 1:
        # The sum stage a later micro-batch's gradient lands in before it is added (two halves, pinned by the
        # first such micro-batch).
        host_bytes += 2 * sum_stage_numel([n for n, _ in host], CPUOffloadOptimizer.bucket_numel) \
            * (2 if pure_bf16 else 4)
    return host_bytes


def _named_step_temp(named: NamedOptimizer, device: list[tuple[int, torch.dtype]], step_in_backward: bool,
                     device_type: str) -> int:
    """A named class's step scratch on the device: the probe's bytes per element over what one step takes at once
    (every device parameter with the multi-tensor implementation, torch's default on CUDA; else the largest;
    with step-in-backward one parameter at a time)."""
    if not device:
        return 0
    asked = dict(named.kwargs).get("foreach")  # given: the class's own choice; else torch's default (CUDA: on)
    foreach = (bool(asked) if asked is not None else device_type != "cpu" and named.takes_foreach()) \
        and not step_in_backward
    per_element = max(named.step_scratch(dt, foreach=foreach) for dt in {dt for _, dt in device})
    at_once = sum(n for n, _ in device) if foreach else max(n for n, _ in device)
    return int(per_element * at_once)


def _adamw_step_temp(device: list[tuple[int, torch.dtype]], state_precision: str, step_in_backward: bool,
                     device_type: str, pure_bf16: bool) -> int:
    """memtrain's AdamW's step scratch on the device (an upper bound)."""
    largest = max((n for n, _ in device), default=0)
    if device_type == "cpu" and device and host_kernels.expected():
        # The fused host kernels step in place (memtrain.optim.host_kernels): no scratch, no noise table. int8's
        # small tensors keep fp32 moments and bitsandbytes' 32-bit step, a few fp32 temporaries of their size.
        small = max((n for n, _ in device if n < INT8_MIN_NUMEL), default=0)
        return 4 * 4 * small if state_precision == "int8" and not pure_bf16 else 0
    if pure_bf16:
        # PureBF16AdamW: one pass's fp32 copies of the weights and gradients (and of bf16 moments), as
        # BF16StateAdamW's scratch, and the same rounding-noise table.
        chunk = PURE_BF16_CHUNK.get(device_type, 1 << 20)
        padded = [-(-n // 16) * 16 for n, _ in device]
        scratch = min(max(padded, default=0) if step_in_backward else sum(padded), chunk)
        width = 4 if state_precision == "bf16" else 2
        return 4 * width * scratch + 2 * 4 * ((1 << max(min(largest, chunk) - 1, 1).bit_length()) + NOISE_OFFSETS) \
            if device else 0
    if state_precision == "bf16":
        # BF16StateAdamW: one pass's fp32 copies of both moments (its parameters cut at multiples of 16 elements,
        # one optimizer per parameter with step-in-backward), and the rounding-noise table it keeps per device
        # (a power of two over the longest piece, plus the offsets it reads at; built through one int32 temporary
        # of its size).
        chunk = BF16_CHUNK.get(device_type, 1 << 20)
        padded = [-(-n // 16) * 16 for n, _ in device]
        scratch = min(max(padded, default=0) if step_in_backward else sum(padded), chunk)
        return 8 * scratch + 2 * 4 * ((1 << max(min(largest, chunk) - 1, 1).bit_length()) + NOISE_OFFSETS)
    if state_precision == "int8" and device_type == "cpu":
        # bitsandbytes' CPU path dequantises what it steps to fp32 (moments, gradient, weights), a piece of at most
        # INT8_CPU_CHUNK elements at a time (AdamW8bit.update_step).
        return min(largest, INT8_CPU_CHUNK) * 4 * 4
    return 0


def host_step_probe(state_precision: str, n_params: int, *, pure_bf16: bool = False) -> torch.optim.Optimizer:
    """A host AdamW with moments in ``state_precision`` over ``n_params`` parameters in 4 tensors (bf16 weights and
    no master with ``pure_bf16``), their gradients set (seeded): what ``cpu_step_rate`` and
    benchmarks/bench_optim_state.py time."""
    check_precision(state_precision)
    cls, kwargs = state_class(state_precision, "cpu")
    dtype = torch.float32
    if pure_bf16:
        check_pure_bf16_moments(state_precision)
        cls, kwargs, dtype = PureBF16AdamW, {"state_precision": state_precision}, torch.bfloat16
    g = torch.Generator().manual_seed(0)
    params = [torch.randn(n_params // 4, generator=g).to(dtype) for _ in range(4)]
    for p in params:
        p.grad = (torch.randn(p.shape, generator=g) * 1e-3).to(dtype)
    return cls(params, lr=1e-4, **kwargs)


def cpu_step_rate(state_precision: str = "fp32", n_params: int = 1 << 22, repeats: int = 3, *,
                  pure_bf16: bool = False) -> float:
    """Parameters per second of one host AdamW step with moments in ``state_precision`` (the planner's rate of
    CPUOffloadOptimizer's CPU step: the fused host kernels of ``memtrain.optim.host_kernels`` where they are built),
    measured here on ``n_params`` parameters in 4 tensors: median of ``repeats`` steps after one warm-up (which
    creates the state)."""
    opt = host_step_probe(state_precision, n_params, pure_bf16=pure_bf16)
    params = opt.param_groups[0]["params"]
    opt.step()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        opt.step()
        times.append(time.perf_counter() - t0)
    return sum(p.numel() for p in params) / sorted(times)[len(times) // 2]
