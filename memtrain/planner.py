"""plan(): one byte budget in, the fastest training set-up that fits out, with a reason for every choice.

The search is over the choices memtrain's techniques give a training step: the micro-batch (and so the
accumulation), each block kept, recomputed (fully or selectively, its inputs optionally in host memory) or
offloaded, the loss whole or chunked, the optimizer on the device or on the CPU (with fp32 or bf16 device
weights), DDP or FSDP2, eager or compiled. It runs in three steps:

1. Profile. The step is traced on fake tensors (``memtrain.estimate.trace``) with every block of one kind, at
   two micro-batch sizes; each trace records, per block and phase, the bytes alive, the bytes saved and the work
   done (FLOPs, memory traffic, operator calls). A handful of traces, whatever the number of candidates.
2. Compose. Every candidate's peak is rebuilt from those per-block figures (forward, the head and loss, backward
   block by block, the optimizer step), its host bytes from the offloaded bytes and the optimizer state, and its
   step time from a cost model whose device figures come from a calibration probe or a table of known GPUs.
   Thousands of candidates cost milliseconds each.
3. Choose. The fastest candidate whose peak fits the budget less a safety margin, and whose host bytes fit the
   host, is confirmed by a full ``estimate`` of exactly that set-up; should the estimate disagree, the next one
   is tried.

``apply_plan(model, plan)`` then calls the public primitives in order, and ``train`` is plan -> apply -> loop.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
from torch import nn

from memtrain.errors import ConfigError, MemtrainError
from memtrain.estimate import Run, Trace, trace
from memtrain.measure import available_host_bytes
from memtrain.report import MemoryReport, format_bytes, parse_bytes

# The kinds a block can be, in plans: what it keeps for backward, and what it costs.
BlockKind = Literal["keep", "recompute", "offload"]
RecomputeFlavor = Literal["full", "selective", "offload-inputs"]
OptimizerPlacement = Literal["device", "offload", "offload-bf16-weights"]
Distribution = Literal["none", "ddp", "fsdp2"]

DEFAULT_SAFETY_MARGIN = 0.05  # of the budget, left for the allocator's fragmentation
_VERIFY_LIMIT = 16  # full estimates tried, fastest first, before giving up on the composed ranking
_VERIFY_BAND = 0.03  # candidates composed up to this much over the usable budget are estimated in full too,
_NEAR_MISSES = 3  # at most this many of them
_BUCKET_BYTES = 4 * (1 << 25)  # CPUOffloadOptimizer.bucket_numel fp32 parameters: the last bucket's copy back


# -- the device ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class DeviceProfile:
    """What the cost model needs to know of a machine: rates, each in its own unit.

    Matmul time is ``flops / (matmul_flops * m / (m + half_efficiency_tokens))`` for ``m`` tokens per matmul,
    memory-bound work ``bytes / memory_bandwidth``, and every operator call costs ``op_overhead_s``.
    """

    name: str
    matmul_flops: float  # FLOP/s of large matmuls in the compute dtype
    half_efficiency_tokens: float  # tokens per matmul (its M) at which half of matmul_flops is reached
    attention_flops: float  # FLOP/s of the fused attention kernels
    memory_bandwidth: float  # bytes/s read + written by elementwise work
    op_overhead_s: float  # seconds per operator call (kernel launch, eager dispatch)
    host_to_device: float  # bytes/s, pinned memory
    device_to_host: float  # bytes/s, pinned memory
    cpu_adamw: float  # parameters/s of the host's fused AdamW step (fp32)
    host_bandwidth: float  # bytes/s of the host's own memory (gradient sums and norms in host RAM)
    interconnect: float  # bytes/s of one rank's share of an all-reduce (bus bandwidth)
    memory_bytes: int | None  # the device's memory, the default budget
    source: str  # "probe" or "table ...": how these were found
    asynchronous: bool = True  # kernels run while the host dispatches the next ones (a GPU; not a CPU)
    cpu_adamw_bf16: float | None = None  # parameters/s of the host's step with bf16 moments (None: not measured)
    cpu_adamw_int8: float | None = None  # ... with bitsandbytes' 8-bit moments

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


# Known GPUs: bf16 dense tensor-core FLOP/s from the vendor's datasheet, HBM bandwidth, pinned host-link bandwidth
# (PCIe 5: 55 GB/s measured on an H200, DESIGN.md; PCIe 4: 25 GB/s), NVLink bus bandwidth for all-reduce (PCIe-only
# cards: about 20 GB/s). The fractions of them that eager PyTorch reaches (matmuls 60%, attention 45%, elementwise
# 70%) are fitted to DESIGN.md's H200 anchors for the 1.1B Llama (no savings 45.4k tokens/s, Hugging Face
# checkpointing 36.5k, torch.compile 56.5k): `python benchmarks/bench_plan.py --anchors` prints the predictions.
_KNOWN_GPUS: tuple[tuple[str, dict[str, float]], ...] = (
    ("H200", {"peak": 989e12, "hbm": 4.8e12, "link": 55e9, "nvlink": 370e9, "memory": 141e9}),
    ("H100", {"peak": 989e12, "hbm": 3.35e12, "link": 55e9, "nvlink": 370e9, "memory": 80e9}),
    ("A100", {"peak": 312e12, "hbm": 2.0e12, "link": 25e9, "nvlink": 230e9, "memory": 80e9}),
    ("L4", {"peak": 121e12, "hbm": 0.3e12, "link": 25e9, "nvlink": 20e9, "memory": 24e9}),
    ("4090", {"peak": 165e12, "hbm": 1.0e12, "link": 25e9, "nvlink": 20e9, "memory": 24e9}),
)


def known_gpu(name: str, *, memory_bytes: int | None = None, host: DeviceProfile | None = None) -> DeviceProfile:
    """The table's figures for a GPU whose name contains H200, H100, A100, L4 or 4090.

    Host figures (the CPU AdamW rate, host memory bandwidth) come from ``host`` (a CPU probe) when given, else
    from DESIGN.md's H200 host (4.2 G params/s on 16 threads).

    Raises:
        ConfigError: a GPU the table does not know (run ``memtrain plan --calibrate`` on it instead).
    """
    for key, figures in _KNOWN_GPUS:
        if key.lower() in name.lower():
            return DeviceProfile(
                name=name,
                matmul_flops=0.6 * figures["peak"],
                half_efficiency_tokens=256.0,
                attention_flops=0.45 * figures["peak"],
                memory_bandwidth=0.7 * figures["hbm"],
                op_overhead_s=8e-6,
                host_to_device=figures["link"],
                device_to_host=figures["link"],
                cpu_adamw=host.cpu_adamw if host is not None else 4.2e9,
                host_bandwidth=host.host_bandwidth if host is not None else 100e9,
                interconnect=figures["nvlink"],
                memory_bytes=memory_bytes if memory_bytes is not None else int(figures["memory"]),
                source=(f"table: {key} (bf16 dense {figures['peak'] / 1e12:.0f} TFLOP/s x 0.6, HBM "
                        f"{figures['hbm'] / 1e12:.2f} TB/s x 0.7, host link {figures['link'] / 1e9:.0f} GB/s, "
                        f"interconnect {figures['nvlink'] / 1e9:.0f} GB/s; not measured: run memtrain plan "
                        "--calibrate on the machine to measure them)"),
            )
    known = ", ".join(k for k, _ in _KNOWN_GPUS)
    raise ConfigError(f"the table of known GPUs has no {name!r} (it knows {known}). To resolve this error, run "
                      "memtrain plan --calibrate on that machine (a few seconds of probes, cached), or pass "
                      "device_profile=.")


def _cache_path() -> Path:
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(root) / "memtrain" / "calibration.json"


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    import platform

    return f"cpu: {platform.processor() or platform.machine()} ({torch.get_num_threads()} threads)"


def _timed(fn: Callable[[], Any], sync: Callable[[], None], repeats: int = 3) -> float:
    fn()  # warm-up
    sync()
    best = math.inf
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        sync()
        best = min(best, time.perf_counter() - start)
    return best


def calibrate(device: str | torch.device = "cuda", *, cache: bool = True, refresh: bool = False) -> DeviceProfile:
    """Measures this machine's rates with a few seconds of probes; cached per device name.

    Probes: matmuls at four token counts (the rate and the size at which it halves), fused attention, an
    elementwise kernel (memory bandwidth), a thousand tiny ops (per-op overhead), pinned copies each way, and a
    fused AdamW step on the CPU. The cache is ``$XDG_CACHE_HOME/memtrain/calibration.json`` (``~/.cache``).

    Raises:
        ConfigError: a CUDA device asked for where torch sees none.
    """
    device = torch.device(device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError("calibrate(device='cuda'), but torch sees no CUDA device. To resolve this error, run it on "
                          "the GPU machine, or plan with the table of known GPUs (device_profile=None).")
    name = _device_name(device)
    key = f"{name} | torch {torch.__version__}"
    path = _cache_path()
    if cache and not refresh and path.is_file():
        try:
            cached = json.loads(path.read_text()).get(key)
            if cached:
                return DeviceProfile(**{**cached, "source": f"{cached.get('source', 'probe')}, cached in {path}"})
        except (OSError, ValueError, TypeError):
            pass  # an unreadable cache is measured again and rewritten
    profile = _probe(device, name)
    if cache:
        try:
            from memtrain.files import atomic_write_bytes

            path.parent.mkdir(parents=True, exist_ok=True)
            entries = json.loads(path.read_text()) if path.is_file() else {}
            entries[key] = profile.to_dict()
            atomic_write_bytes(path, json.dumps(entries, indent=2).encode())
        except (OSError, ValueError):
            pass  # a read-only home: the figures are used, not kept
    return profile


def _probe(device: torch.device, name: str) -> DeviceProfile:
    cuda = device.type == "cuda"
    sync = (lambda: torch.cuda.synchronize(device)) if cuda else (lambda: None)
    dtype = torch.bfloat16 if cuda else torch.float32
    dim = 4096 if cuda else 1024
    weight = torch.randn(dim, dim, device=device, dtype=dtype)
    rates = []
    for m in ((512, 2048, 8192, 32768) if cuda else (128, 512, 2048, 8192)):
        x = torch.randn(m, dim, device=device, dtype=dtype)
        seconds = _timed(lambda x=x: x @ weight, sync, repeats=5)
        rates.append((m, 2.0 * m * dim * dim / seconds))
    # rate(m) = peak * m / (m + half) is 1/rate = 1/peak + (half/peak) / m: a straight line in 1/m, fitted by least
    # squares over the sizes (robust to one noisy size, unlike the largest rate alone).
    slope, intercept = np.polyfit([1.0 / m for m, _ in rates], [1.0 / r for _, r in rates], 1)
    if intercept > 0 and slope >= 0:
        peak, half = float(1.0 / intercept), float(slope / intercept)
    else:  # no size effect measurable: the best rate at any size
        peak, half = max(r for _, r in rates), 0.0
    b, h, t, d = (4, 16, 2048, 128) if cuda else (1, 4, 512, 64)
    q = torch.randn(b, h, t, d, device=device, dtype=dtype)
    seconds = _timed(lambda: torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True), sync)
    attention = 4.0 * b * h * t * t * d * 0.5 / seconds
    big = torch.empty((1 << 28) if cuda else (1 << 24), device=device, dtype=torch.float32)
    seconds = _timed(lambda: big.add_(1.0), sync)
    bandwidth = 2 * big.numel() * 4 / seconds
    # Per-op cost as a training step pays it: small ops recorded by autograd, forward and backward.
    tiny = torch.zeros(8, device=device, requires_grad=True)

    def chain() -> None:
        y = tiny
        for _ in range(200):
            y = y * 1.0001
        y.sum().backward()

    overhead = _timed(chain, sync) / 401  # 200 multiplies, their 200 backward ops, the sum's
    host = torch.empty((1 << 26) if cuda else (1 << 24), dtype=torch.uint8, pin_memory=cuda)
    if cuda:
        dev = torch.empty_like(host, device=device)
        h2d = host.numel() / _timed(lambda: dev.copy_(host, non_blocking=True), sync)
        d2h = host.numel() / _timed(lambda: host.copy_(dev, non_blocking=True), sync)
    else:  # the "device" is the host: an offload is a copy within RAM
        other = torch.empty_like(host)
        h2d = d2h = host.numel() / _timed(lambda: other.copy_(host), sync)
    n = 1 << 22
    p = torch.zeros(n, requires_grad=True)
    p.grad = torch.randn(n)
    adam = torch.optim.AdamW([p], lr=1e-3, fused=True)
    cpu_adamw = n / _timed(adam.step, lambda: None)
    from memtrain.optim import cpu_step_rate

    lean = {}
    for precision in ("bf16", "int8"):
        try:
            lean[precision] = cpu_step_rate(precision, n_params=1 << 20)
        except ConfigError:
            lean[precision] = None  # int8 without bitsandbytes: not a candidate anyway
    host_copy = torch.empty(n)
    host_bandwidth = 2 * n * 4 / _timed(lambda: host_copy.copy_(p.grad), lambda: None)
    table = None
    if cuda:
        try:
            table = known_gpu(name)
        except ConfigError:
            table = None
    memory = torch.cuda.get_device_properties(device).total_memory if cuda else available_host_bytes()
    return DeviceProfile(name=name, matmul_flops=peak, half_efficiency_tokens=half, attention_flops=attention,
                         memory_bandwidth=bandwidth, op_overhead_s=overhead, host_to_device=h2d, device_to_host=d2h,
                         cpu_adamw=cpu_adamw, host_bandwidth=host_bandwidth,
                         interconnect=table.interconnect if table is not None else (20e9 if cuda else 5e9),
                         memory_bytes=memory, source=_probe_source(), asynchronous=cuda, cpu_adamw_bf16=lean["bf16"],
                         cpu_adamw_int8=lean["int8"])


def _probe_source() -> str:
    """How the probe ran: other work on the machine lowers every rate it measures (seen here: 5-20x on 2 busy
    cores), so a probe taken under load says so."""
    try:
        load = os.getloadavg()[0]
    except (OSError, AttributeError):
        return "probe"
    cores = os.cpu_count() or 1
    busy = f"; probed under load {load:.1f} on {cores} cores: rates low, run memtrain plan --calibrate again when " \
           "the machine is idle" if load > 0.75 * cores else ""
    return f"probe (load {load:.1f} on {cores} cores{busy})"


def device_profile(device: str | torch.device, *, calibrated: bool = False) -> DeviceProfile:
    """The figures a plan for ``device`` uses: a probe on the CPU (always) or with ``calibrated``, else the table
    of known GPUs for the CUDA device present (or, with no GPU here, an H100's: say which with
    ``device_profile=known_gpu(...)``)."""
    device = torch.device(device)
    if device.type == "cpu" or calibrated:
        return calibrate(device)
    if torch.cuda.is_available():
        name = torch.cuda.get_device_name(device)
        return known_gpu(name, memory_bytes=torch.cuda.get_device_properties(device).total_memory)
    return known_gpu("NVIDIA H100 (assumed: no GPU on this machine)")


# -- the plan -----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class PlanSettings:
    """Every choice of one candidate: what ``apply_plan`` sets up."""

    micro_batch_size: int
    accumulation: int  # micro-batches per optimizer step on each rank
    blocks: tuple[BlockKind, ...]  # per block, in the model's order
    flavor: RecomputeFlavor  # how the recomputed blocks recompute
    chunked_loss: bool
    optimizer: OptimizerPlacement
    distribution: Distribution
    compile: bool
    precision: str = "bf16-mixed"  # compute precision (autocast): fp32, bf16-mixed, fp16-mixed
    state_precision: str = "fp32"  # AdamW's moments: fp32 (8 bytes/param), bf16 (4), int8 (about 2)
    step_in_backward: bool = False  # each parameter steps as its gradient is final, which is freed at once
    offload_fraction: float = 0.0  # with optimizer "device": this share of the parameters' state in host RAM

    @property
    def optimizer_text(self) -> str:
        """The optimizer in words, e.g. "device, int8 moments, step in backward"."""
        parts = [self.optimizer if not (self.optimizer == "device" and self.offload_fraction) else
                 f"{100 * self.offload_fraction:.0f}% offloaded"]
        if self.state_precision != "fp32":
            parts.append(f"{self.state_precision} moments")
        if self.step_in_backward:
            parts.append("step in backward")
        return ", ".join(parts)

    @property
    def checkpointing(self) -> str:
        """A short name: none, all, selective, all+offload-inputs, or counts per kind."""
        counts = {kind: self.blocks.count(kind) for kind in ("keep", "recompute", "offload")}
        n = len(self.blocks)
        flavor = {"full": "", "selective": " selective", "offload-inputs": " (inputs offloaded)"}[self.flavor]
        if counts["keep"] == n:
            return "none"
        if counts["recompute"] == n:
            return {"full": "all", "selective": "selective", "offload-inputs": "all+offload-inputs"}[self.flavor]
        if counts["offload"] == n:
            return "offload all"
        parts = [f"{counts['recompute']} recompute{flavor}" if counts["recompute"] else "",
                 f"{counts['offload']} offload" if counts["offload"] else "",
                 f"{counts['keep']} keep" if counts["keep"] else ""]
        return ", ".join(p for p in parts if p) + f" of {n}"

    def policies(self, names: Sequence[str]) -> dict[str, BlockKind]:
        """``apply_checkpointing(policies=)`` for the block names (in order)."""
        return dict(zip(names, self.blocks, strict=True))

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["blocks"] = list(self.blocks)
        out["checkpointing"] = self.checkpointing
        return out

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> PlanSettings:
        """The settings ``to_dict`` wrote (e.g. in a run's checkpoint).

        Raises:
            ConfigError: a dictionary that is not one (a missing or unknown field).
        """
        names = {f.name for f in dataclasses.fields(cls)}
        try:
            return cls(**{k: (tuple(v) if k == "blocks" else v) for k, v in d.items() if k in names})
        except TypeError as e:
            raise ConfigError(f"{d!r} is not a plan's settings ({e}). To resolve this error, pass what "
                              "PlanSettings.to_dict() wrote.") from None


@dataclass(frozen=True)
class Fixed:
    """Choices a plan keeps as given (a user's flags); None leaves that choice to the search."""

    blocks: tuple[BlockKind, ...] | None = None  # the checkpointing layout, one kind per block
    flavor: RecomputeFlavor | None = None  # how the recomputed blocks recompute
    chunked_loss: bool | None = None
    optimizer: OptimizerPlacement | None = None
    state_precision: str | None = None
    step_in_backward: bool | None = None
    offload_fraction: float | None = None
    compile: bool | None = None  # torch.compile the step (True), or not (False)

    @classmethod
    def of_choices(cls, *, n_blocks: int, device: str, checkpointing: Any = None, offload_activations: bool | None = None,
                   offload_optimizer: bool | None = None, chunked_loss: bool | None = None,
                   state_precision: str | None = None, step_in_backward: bool | None = None,
                   offload_fraction: float | None = None) -> tuple[Fixed, frozenset[str], list[str]]:
        """A user's choices (``TrainConfig``'s, a command's flags; None: the plan's) as the constraints of a plan.

        Returns:
            (the fixed choices, the ``TECHNIQUES`` the search may use, notes for choices that do nothing on
            ``device``).

        Raises:
            ConfigError: a checkpointing policy that is not one.
        """
        from memtrain.checkpointing import Checkpointing

        allowed, notes = set(TECHNIQUES), []
        cuda = device == "cuda"
        policy = None if checkpointing is None else Checkpointing.parse(checkpointing)
        offload = offload_activations
        if policy is not None and policy.offload_inputs:
            offload = True
        if offload and not cuda:
            notes.append("activation offload has no effect on a CPU-only run (no device memory to save): off")
            offload = False
            if policy is not None:
                policy = dataclasses.replace(policy, offload_inputs=False)
        blocks: tuple[BlockKind, ...] | None = None
        flavor: RecomputeFlavor | None = None
        if policy is not None:
            blocks = policy.block_policies(n_blocks)
            flavor = "selective" if policy.mode == "selective" else "full"
            if offload and "recompute" in blocks:
                flavor = "offload-inputs"  # the recomputed blocks' saved inputs wait in host memory
            elif offload:
                blocks = ("offload",) * n_blocks  # nothing recomputes: every block's activations go to the host
        elif offload:
            # Asked for, with the layout left open: every block recomputes and its saved input is offloaded.
            blocks, flavor = ("recompute",) * n_blocks, "offload-inputs"
        if offload is False:
            allowed.discard("offload-activations")
        optimizer: OptimizerPlacement | None = None
        if offload_optimizer is True:
            optimizer = "offload"
        elif offload_optimizer is False or offload_fraction is not None:
            optimizer = "device"
            if offload_fraction is None:
                offload_fraction = 0.0
        if state_precision is not None or step_in_backward:
            optimizer = optimizer or "device"  # lean moments and the in-backward step are device optimizers
        fixed = cls(blocks=blocks, flavor=flavor, chunked_loss=chunked_loss, optimizer=optimizer,
                    state_precision=state_precision, step_in_backward=step_in_backward,
                    offload_fraction=offload_fraction)
        return fixed, frozenset(allowed), notes


@dataclass(frozen=True)
class HostLink:
    """Bytes over the host link (PCIe, or NVLink-C2C) in one optimizer step, per rank, as the time model counts
    them: offloaded activations go out in each micro-batch's forward and come back in its backward; an offloaded
    optimizer's gradients (the device weights' dtype) go out in each micro-batch's backward and its new weights
    come back once a step. Small transfers (norms, flags, the loss) are not counted."""

    activations_to_host: int
    activations_to_device: int
    optimizer_to_host: int
    optimizer_to_device: int

    @property
    def to_host(self) -> int:
        return self.activations_to_host + self.optimizer_to_host

    @property
    def to_device(self) -> int:
        return self.activations_to_device + self.optimizer_to_device

    @property
    def total(self) -> int:
        return self.to_host + self.to_device

    def text(self) -> str:
        """E.g. "1.0 GiB to host, 512.0 MiB to device (activations 512.0 MiB each way; optimizer ...)"."""
        parts = []
        if self.activations_to_host or self.activations_to_device:
            parts.append(f"activations {format_bytes(self.activations_to_host)} out, "
                         f"{format_bytes(self.activations_to_device)} back")
        if self.optimizer_to_host or self.optimizer_to_device:
            parts.append(f"optimizer {format_bytes(self.optimizer_to_host)} gradients out, "
                         f"{format_bytes(self.optimizer_to_device)} weights back")
        return (f"{format_bytes(self.to_host)} to host, {format_bytes(self.to_device)} to device"
                + (f" ({'; '.join(parts)})" if parts else ""))

    def to_dict(self) -> dict[str, Any]:
        return {"activations_to_host": self.activations_to_host, "activations_to_device": self.activations_to_device,
                "optimizer_to_host": self.optimizer_to_host, "optimizer_to_device": self.optimizer_to_device,
                "to_host": self.to_host, "to_device": self.to_device, "total": self.total}


@dataclass(frozen=True)
class Candidate:
    """One candidate's predictions and, unless it was chosen, why it lost."""

    settings: PlanSettings
    peak_bytes: int  # per rank, on the device
    host_bytes: int  # per node (every rank's share)
    step_seconds: float
    tokens_per_s: float
    verified: bool  # the peak is a full estimate of this set-up (else composed from the profiles)
    lost_because: str = ""
    host_link: HostLink | None = None  # bytes over the host link per step, per rank

    def to_dict(self) -> dict[str, Any]:
        return {"settings": self.settings.to_dict(), "peak_bytes": self.peak_bytes, "host_bytes": self.host_bytes,
                "step_seconds": self.step_seconds, "tokens_per_s": self.tokens_per_s, "verified": self.verified,
                "lost_because": self.lost_because,
                "host_link": self.host_link.to_dict() if self.host_link is not None else None}


@dataclass(frozen=True)
class Plan:
    """The chosen set-up with its predictions, one reason per decision, and the runners-up.

    ``peak_bytes`` is a full ``estimate`` of exactly this set-up (per rank); ``activation_bytes`` the bytes saved
    for backward in one micro-batch (on the CPU exactly what ``measure`` counts).
    """

    settings: PlanSettings
    budget_bytes: int | None  # None: unlimited
    usable_bytes: int | None  # the budget less the safety margin
    host_budget_bytes: int | None
    peak_bytes: int
    host_bytes: int
    activation_bytes: int
    step_seconds: float
    tokens_per_s: float
    precision: str
    device: str  # "cuda" or "cpu"
    seq_len: int
    global_batch_size: int
    world_size: int
    block_names: tuple[str, ...]
    parameters: int
    reasons: tuple[str, ...]
    candidates: tuple[Candidate, ...]  # the runners-up, fastest first
    assumptions: tuple[str, ...]
    device_profile: DeviceProfile
    report: MemoryReport  # the estimate behind peak_bytes
    plan_seconds: float = 0.0  # how long planning took
    host_link: HostLink = HostLink(0, 0, 0, 0)  # bytes over the host link per step, per rank

    @property
    def host_link_bytes(self) -> int:
        """Bytes over the host link in one optimizer step, per rank, both directions (see ``host_link``)."""
        return self.host_link.total

    @property
    def micro_batch_size(self) -> int:
        return self.settings.micro_batch_size

    @property
    def accumulation(self) -> int:
        return self.settings.accumulation

    def summary(self) -> str:
        """The choice, its predictions and reasons, and the runners-up, as a table (returned, not printed)."""
        s = self.settings
        budget = "unlimited" if self.budget_bytes is None else (
            f"{format_bytes(self.budget_bytes)} (usable {format_bytes(self.usable_bytes)})")
        lines = [
            f"plan for {self.parameters / 1e6:.1f}M parameters, {self.global_batch_size} x {self.seq_len} tokens per "
            f"step, {self.precision}, on {self.device_profile.name} x {self.world_size}; budget {budget}",
            f"  choice: micro-batch {s.micro_batch_size} x {s.accumulation} accumulation, checkpointing "
            f"{s.checkpointing}, loss {'chunked' if s.chunked_loss else 'whole'}, optimizer {s.optimizer_text}, "
            f"{s.distribution if self.world_size > 1 else 'one process'}{', compiled' if s.compile else ''}",
            f"  predicted: peak {format_bytes(self.peak_bytes)} per rank, host {format_bytes(self.host_bytes)}, "
            f"step {self.step_seconds * 1e3:.1f} ms, {self.tokens_per_s:,.0f} tokens/s",
            *([f"  host link per step: {self.host_link.text()}"] if self.host_link.total else []),
            "  because:",
            *(f"    - {r}" for r in self.reasons),
        ]
        if self.candidates:
            rows = [("micro x acc", "checkpointing", "loss", "optimizer", "dist", "peak", "tokens/s", "lost because")]
            for c in self.candidates:
                cs = c.settings
                rows.append((f"{cs.micro_batch_size} x {cs.accumulation}", cs.checkpointing,
                             "chunked" if cs.chunked_loss else "whole",
                             cs.optimizer_text + (" +compile" if cs.compile else ""), cs.distribution,
                             format_bytes(c.peak_bytes) + ("" if c.verified else "*"), f"{c.tokens_per_s:,.0f}",
                             c.lost_because))
            widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
            lines.append("  runners-up (* composed from the block profiles, not a full estimate):")
            lines += ["    " + "  ".join(v.ljust(w) for v, w in zip(r, widths, strict=True)).rstrip() for r in rows]
        lines += [f"  assumes: {a}" for a in self.assumptions]
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: ``plan`` (the settings), the predictions, ``candidates``, reasons and assumptions."""
        return {
            "plan": self.settings.to_dict(),
            "peak_bytes": self.peak_bytes,
            "host_bytes": self.host_bytes,
            "activation_bytes": self.activation_bytes,
            "step_seconds": self.step_seconds,
            "tokens_per_s": self.tokens_per_s,
            "budget_bytes": self.budget_bytes,
            "usable_bytes": self.usable_bytes,
            "host_budget_bytes": self.host_budget_bytes,
            "precision": self.precision,
            "device": self.device,
            "seq_len": self.seq_len,
            "global_batch_size": self.global_batch_size,
            "world_size": self.world_size,
            "parameters": self.parameters,
            "blocks": list(self.block_names),
            "reasons": list(self.reasons),
            "candidates": [c.to_dict() for c in self.candidates],
            "assumptions": list(self.assumptions),
            "device_profile": self.device_profile.to_dict(),
            "plan_seconds": self.plan_seconds,
            "host_link": self.host_link.to_dict(),
            "estimate": self.report.to_dict(),
        }


# -- profiles: per-block figures from a few traces ------------------------------------------------------------
@dataclass
class _Work:
    """Work of a stretch of the step, affine in the micro-batch: value(b) = at1 + slope * (b - 1)."""

    matmul: tuple[float, float] = (0.0, 0.0)
    attention: tuple[float, float] = (0.0, 0.0)
    other: tuple[float, float] = (0.0, 0.0)
    ops: float = 0.0

    def seconds(self, b: int, tokens: int, device: DeviceProfile, compiled: bool) -> float:
        def at(pair: tuple[float, float]) -> float:
            return max(0.0, pair[0] + pair[1] * (b - 1))

        efficiency = tokens / (tokens + device.half_efficiency_tokens) if tokens > 0 else 1.0
        memory_bound = at(self.other) / device.memory_bandwidth
        overhead = self.ops * device.op_overhead_s
        if compiled:  # fused elementwise kernels and few launches (an assumption, stated in the plan)
            memory_bound, overhead = 0.5 * memory_bound, 0.1 * overhead
        work = at(self.matmul) / (device.matmul_flops * efficiency) + at(self.attention) / device.attention_flops
        work += memory_bound
        # A GPU runs while the host queues the next kernels: the slower of the two sets the pace. A CPU does both.
        return max(work, overhead) if device.asynchronous else work + overhead


def _affine(a: float, b: float) -> tuple[float, float]:
    return a, b - a


def _work(runs1: Sequence[Run], runs2: Sequence[Run]) -> _Work:
    def total(runs: Sequence[Run], attr: str) -> float:
        return float(sum(getattr(r, attr) for r in runs))

    return _Work(matmul=_affine(total(runs1, "matmul_flops"), total(runs2, "matmul_flops")),
                 attention=_affine(total(runs1, "attention_flops"), total(runs2, "attention_flops")),
                 other=_affine(total(runs1, "other_bytes"), total(runs2, "other_bytes")),
                 ops=total(runs1, "ops"))


@dataclass
class _Segments:
    """One trace cut into the model's parts: before the blocks, each block, the head and loss, after them."""

    pre_fwd: list[Run]
    block_fwd: list[list[Run]]
    tail_fwd: list[Run]
    tail_bwd: list[Run]
    block_bwd: list[list[Run]]
    post_bwd: list[Run]


def _segments(t: Trace) -> _Segments:
    names = {name: i for i, name in enumerate(t.blocks)}
    fwd = [r for r in t.runs if r.phase == "forward"]
    bwd = [r for r in t.runs if r.phase == "backward"]
    block_fwd: list[list[Run]] = [[] for _ in t.blocks]
    block_bwd: list[list[Run]] = [[] for _ in t.blocks]
    first = next(i for i, r in enumerate(fwd) if r.label in names)
    last = max(i for i, r in enumerate(fwd) if r.label in names)
    for r in fwd[first:last + 1]:
        if r.label in names:
            block_fwd[names[r.label]].append(r)
    bfirst = next(i for i, r in enumerate(bwd) if r.label in names)
    blast = max(i for i, r in enumerate(bwd) if r.label in names)
    for r in bwd[bfirst:blast + 1]:
        if r.label in names:
            block_bwd[names[r.label]].append(r)
    if any(not runs for runs in block_fwd) or any(not runs for runs in block_bwd):
        raise MemtrainError("plan: a block ran no forward or no backward in the traced step (is every block on the "
                            "path from the input to the loss?). To resolve this error, plan a model whose repeated "
                            "blocks all run, or choose the techniques yourself.")
    return _Segments(fwd[:first], block_fwd, fwd[last + 1:], bwd[:bfirst], block_bwd, bwd[blast + 1:])


class _Lines:
    """A peak as a function of the micro-batch ``b``: the upper envelope of lines ``a + slope * (b - 1)``, one
    per moment of a traced stretch (bytes alive there, at b = 1 and its growth per example)."""

    __slots__ = ("lines",)

    def __init__(self, lines: np.ndarray):
        self.lines = lines

    @classmethod
    def of(cls, at1: np.ndarray, at2: np.ndarray) -> _Lines:
        """Pairs two traced curves moment by moment and keeps the lines that are the highest for some b >= 1."""
        slope = at2 - at1
        order = np.lexsort((-slope, -at1))  # highest first, steepest first among equals
        keep, steepest = [], -math.inf
        for k in order:
            if slope[k] > steepest:
                keep.append(k)
                steepest = slope[k]
        return cls(np.stack([at1[keep], slope[keep]], axis=1))

    def at(self, b: int) -> float:
        return float(np.max(self.lines[:, 0] + self.lines[:, 1] * (b - 1)))


def _curve(runs: Sequence[Run], start: int, *, without_gradients: bool = False) -> np.ndarray:
    """Bytes alive at every moment of ``runs`` above ``start``; optionally less the gradients accumulated until
    then (where they would not stay: streamed to the host, or added into an earlier micro-batch's)."""
    if not runs:
        return np.zeros(1)
    values = np.concatenate([np.asarray(r.curve, dtype=np.float64) for r in runs]) - start
    if without_gradients:
        grads = sorted(g for r in runs for g in r.gradients)
        if grads:
            serials = np.concatenate([np.asarray(r.serials) for r in runs])
            cumulative = np.concatenate([[0.0], np.cumsum([n for _, n in grads])])
            # A gradient is let go just after it is accumulated: at its own allocation it is still there.
            values = values - cumulative[np.searchsorted([g for g, _ in grads], serials, side="left")]
    return values


def _lines(runs1: Sequence[Run], start1: int, runs2: Sequence[Run], start2: int, **kwargs: bool) -> _Lines:
    c1, c2 = _curve(runs1, start1, **kwargs), _curve(runs2, start2, **kwargs)
    if len(c1) != len(c2):  # the two traces took different paths: their peaks only
        c1, c2 = np.array([c1.max()]), np.array([c2.max()])
    return _Lines.of(c1, c2)


@dataclass
class _KindProfile:
    """One block kind (keep, recompute, offload) in one trace pair, per block. Net figures are affine in the
    micro-batch, (L, 2) arrays of (at b = 1, per example); peaks are envelopes (see _Lines)."""

    saved: np.ndarray  # bytes a block's forward leaves alive
    released: np.ndarray  # bytes its forward cached that die when forward ends (weight casts)
    backward_net: np.ndarray  # bytes its backward leaves alive less what it found (gradients - saved)
    offloaded: np.ndarray  # bytes it could move to the host (and back): every storage, whatever its size
    backward_net_streamed: np.ndarray  # the same where gradients do not stay (streamed or accumulated)
    forward_excess: list[_Lines]  # its forward's peak above its start
    backward_excess: list[_Lines]  # its backward's peak above its start
    backward_excess_streamed: list[_Lines]
    fwd_work: list[_Work]
    bwd_work: list[_Work]
    # Per block, the storages it could move, (n, 2) of (bytes at b = 1, per example), or None where the two
    # traces moved different storages (then all of ``offloaded`` moves): see _moved.
    offloaded_tensors: list[np.ndarray | None] = field(default_factory=list)


def _moved(tensors: np.ndarray, b: int) -> float:
    """Bytes the activation offloader moves of these storages at micro-batch ``b``: those of at least its
    ``min_bytes`` (``memtrain.offload.MIN_BYTES_DEFAULT``, what ``apply_plan`` gives it) at that size. The traces
    record every storage it could move (``offload_min_bytes=0``): one under the threshold at the traced
    micro-batches 1 and 2 can be over it at the candidate's."""
    from memtrain.offload import MIN_BYTES_DEFAULT

    sizes = tensors[:, 0] + tensors[:, 1] * (b - 1)
    return float(sizes[sizes >= MIN_BYTES_DEFAULT].sum())


@dataclass
class _TailProfile:
    """The model's code around the blocks for one loss (whole or chunked): nets affine, peaks envelopes."""

    pre: tuple[float, float]  # bytes alive at the first block's start above the fixed bytes
    tail_fwd_net: tuple[float, float]  # bytes alive when forward ends above the last block's end
    released_other: tuple[float, float]  # cast bytes of non-block code let go when forward ends
    tail_bwd_net: tuple[float, float]  # bytes alive when the last block's backward starts, above backward's start
    post_net: tuple[float, float]  # bytes alive when backward ends above the first block's backward end
    tail_bwd_net_streamed: tuple[float, float]
    post_net_streamed: tuple[float, float]
    tail_fwd_excess: _Lines  # the head and loss forward's peak above the last block's end
    tail_bwd_excess: _Lines  # the loss and head backward's peak above backward's start
    post_excess: _Lines  # after the blocks' backward (embeddings): the peak above its start
    tail_bwd_excess_streamed: _Lines
    post_excess_streamed: _Lines
    # Where the first block offloads its input: a model may hold that input (its embeddings) until its forward
    # returns, so those bytes leave in the head's stretch. (None until filled in by _traced_profiles.)
    tail_fwd_net_offloaded: tuple[float, float] | None
    tail_fwd_excess_offloaded: _Lines | None
    pre_work: _Work
    tail_fwd_work: _Work
    tail_bwd_work: _Work
    post_work: _Work


def _pair(x1: float, x2: float) -> tuple[float, float]:
    return float(x1), float(x2 - x1)


def _kind_profile(t1: Trace, t2: Trace) -> _KindProfile:
    s1, s2 = _segments(t1), _segments(t2)
    nets: list[list[tuple[float, float]]] = [[] for _ in range(5)]
    fexcess, bexcess, bexcess_streamed = [], [], []
    for f1, f2, b1, b2 in zip(s1.block_fwd, s2.block_fwd, s1.block_bwd, s2.block_bwd, strict=True):
        def net(runs: Sequence[Run]) -> tuple[float, ...]:
            fstart, bstart = runs[0].start_bytes, runs[2].start_bytes
            grads = sum(r.gradient_bytes for r in runs[3])
            bnet = runs[3][-1].end_bytes - bstart
            return (runs[1][-1].end_bytes - fstart, sum(r.released_bytes for r in runs[1]), bnet,
                    sum(r.offloaded_bytes for r in runs[1]), bnet - grads)

        one = net((f1[0], f1, b1[0], b1))
        two = net((f2[0], f2, b2[0], b2))
        for column, x, y in zip(nets, one, two, strict=True):
            column.append(_pair(x, y))
        fexcess.append(_lines(f1, f1[0].start_bytes, f2, f2[0].start_bytes))
        bexcess.append(_lines(b1, b1[0].start_bytes, b2, b2[0].start_bytes))
        bexcess_streamed.append(_lines(b1, b1[0].start_bytes, b2, b2[0].start_bytes, without_gradients=True))
    arrays = [np.array(c, dtype=np.float64) for c in nets]
    tensors: list[np.ndarray | None] = []
    for f1, f2 in zip(s1.block_fwd, s2.block_fwd, strict=True):
        one = np.array([n for r in f1 for n in r.offloaded_sizes], dtype=np.float64)
        two = np.array([n for r in f2 for n in r.offloaded_sizes], dtype=np.float64)
        tensors.append(np.stack([one, two - one], axis=1) if len(one) == len(two) else None)
    return _KindProfile(*arrays, forward_excess=fexcess, backward_excess=bexcess,
                        backward_excess_streamed=bexcess_streamed,
                        fwd_work=[_work(a, b) for a, b in zip(s1.block_fwd, s2.block_fwd, strict=True)],
                        bwd_work=[_work(a, b) for a, b in zip(s1.block_bwd, s2.block_bwd, strict=True)],
                        offloaded_tensors=tensors)


def _tail_nets(t: Trace, s: _Segments) -> tuple[float, ...]:
    last_end = s.block_fwd[-1][-1].end_bytes
    backward_start = (s.tail_bwd or s.block_bwd[-1])[0].start_bytes
    bwd_end = s.block_bwd[0][-1].end_bytes
    tail_net = s.block_bwd[-1][0].start_bytes - backward_start
    post_net = dict(t.report.phase_bytes)["backward"] - bwd_end
    return (s.block_fwd[0][0].start_bytes - t.fixed_bytes, t.forward_end_bytes - last_end,
            sum(r.released_bytes for r in (*s.pre_fwd, *s.tail_fwd)), tail_net, post_net,
            tail_net - sum(r.gradient_bytes for r in s.tail_bwd), post_net - sum(r.gradient_bytes for r in s.post_bwd))


def _tail_profile(t1: Trace, t2: Trace) -> _TailProfile:
    s1, s2 = _segments(t1), _segments(t2)

    def starts(s: _Segments) -> tuple[int, int, int]:
        return (s.block_fwd[-1][-1].end_bytes, (s.tail_bwd or s.block_bwd[-1])[0].start_bytes,
                s.block_bwd[0][-1].end_bytes)

    (last1, bwd1, end1), (last2, bwd2, end2) = starts(s1), starts(s2)
    return _TailProfile(
        *(_pair(x, y) for x, y in zip(_tail_nets(t1, s1), _tail_nets(t2, s2), strict=True)),
        tail_fwd_excess=_lines(s1.tail_fwd, last1, s2.tail_fwd, last2),
        tail_bwd_excess=_lines(s1.tail_bwd, bwd1, s2.tail_bwd, bwd2),
        post_excess=_lines(s1.post_bwd, end1, s2.post_bwd, end2),
        tail_bwd_excess_streamed=_lines(s1.tail_bwd, bwd1, s2.tail_bwd, bwd2, without_gradients=True),
        post_excess_streamed=_lines(s1.post_bwd, end1, s2.post_bwd, end2, without_gradients=True),
        tail_fwd_net_offloaded=None, tail_fwd_excess_offloaded=None,
        pre_work=_work(s1.pre_fwd, s2.pre_fwd), tail_fwd_work=_work(s1.tail_fwd, s2.tail_fwd),
        tail_bwd_work=_work(s1.tail_bwd, s2.tail_bwd), post_work=_work(s1.post_bwd, s2.post_bwd))


@dataclass
class _Profiles:
    """Everything composition needs, for one weights dtype."""

    kinds: dict[str, _KindProfile]  # "keep", "full", "selective", "offload-inputs", "offload"
    tails: dict[bool, _TailProfile]  # chunked loss or not
    fixed_bytes: int  # the traced fixed bytes (parameters, buffers, inputs at b=1, AdamW state, workspaces)
    input_bytes: tuple[float, float]  # the batch's own bytes, affine in b
    parameter_bytes: int  # in the traced dtype (bf16 where the device weights are)
    trainable_bytes: int  # the same for the parameters that get gradients (their gradients' bytes too)
    trainable_numel: int
    block_parameter_bytes: np.ndarray  # (L,)
    adamw_state_bytes: int
    traces: int
    trainable_params: list[tuple[int, torch.dtype]] = field(default_factory=list)  # registration order
    trainable_blocks: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))  # -1: no block


def _at(pair: Sequence[float] | np.ndarray, b: int) -> Any:
    if isinstance(pair, np.ndarray) and pair.ndim == 2:
        return pair[:, 0] + pair[:, 1] * (b - 1)
    return pair[0] + pair[1] * (b - 1)


# -- the search space and the composition -------------------------------------------------------------------
@dataclass(frozen=True)
class _Context:
    """The fixed inputs of one planning problem."""

    model: Any
    seq_len: int
    global_batch: int
    world: int
    device: str
    precision: str
    device_profile: DeviceProfile
    block_names: tuple[str, ...]
    chunkable: bool
    grad_clip: bool


@dataclass(frozen=True)
class _Config:
    """A candidate but for its block assignment (offloaded, recomputed and kept counts)."""

    micro_batch_size: int
    accumulation: int
    flavor: RecomputeFlavor
    chunked_loss: bool
    optimizer: OptimizerPlacement
    distribution: Distribution
    compile: bool

    precision: str = "bf16-mixed"
    state_precision: str = "fp32"
    step_in_backward: bool = False
    offload_fraction: float = 0.0

    def settings(self, n_blocks: int, offload: int, recompute: int) -> PlanSettings:
        return self.with_blocks(_assignment(n_blocks, offload, recompute))

    def with_blocks(self, blocks: tuple[BlockKind, ...]) -> PlanSettings:
        return PlanSettings(self.micro_batch_size, self.accumulation, blocks, self.flavor, self.chunked_loss,
                            self.optimizer, self.distribution, self.compile, self.precision, self.state_precision,
                            self.step_in_backward, self.offload_fraction)

    @property
    def host_fraction(self) -> float:
        """The share of the parameters whose optimizer state (and gradients) go to the host."""
        return 1.0 if self.optimizer != "device" else self.offload_fraction


def _assignment(n_blocks: int, offload: int, recompute: int) -> tuple[BlockKind, ...]:
    """Offloaded blocks first (they come back last in backward: the most time to prefetch), then the recomputed
    ones, then the kept ones (the last blocks' activations are the first backward frees)."""
    return (("offload",) * offload + ("recompute",) * recompute
            + ("keep",) * (n_blocks - offload - recompute))  # type: ignore[return-value]


@dataclass(frozen=True)
class _KindArrays:
    """One block kind's per-block figures at one micro-batch (bytes, seconds)."""

    saved: np.ndarray
    forward_excess: np.ndarray
    released: np.ndarray
    backward_excess: np.ndarray
    backward_net: np.ndarray
    offloaded: np.ndarray
    backward_excess_streamed: np.ndarray
    backward_net_streamed: np.ndarray
    forward_s: np.ndarray
    backward_s: np.ndarray


class _Composer:
    """Composes candidates from the profiles: for one configuration and one count of offloaded blocks, every count
    of recomputed blocks at once (numpy over the rows)."""

    _FIELDS = ("saved", "forward_excess", "released", "backward_excess", "backward_net", "offloaded",
               "backward_excess_streamed", "backward_net_streamed")

    def __init__(self, ctx: _Context, profiles: dict[Any, _Profiles]):
        self.ctx = ctx
        self.profiles = profiles
        self._cache: dict[tuple[Any, ...], _KindArrays] = {}
        self._optimizers: dict[tuple[Any, ...], tuple[Any, np.ndarray, bool]] = {}

    def optimizer(self, prof: _Profiles, cfg: _Config) -> tuple[Any, np.ndarray, bool]:
        """The optimizer's bytes (``memtrain.optim.optimizer_memory``), which blocks' gradients leave the device
        as they land (streamed to the host, or stepped in backward), and whether the head's and embeddings' do."""
        from memtrain.optim import offloaded_mask, optimizer_memory

        key = (id(prof), cfg.state_precision, cfg.host_fraction, cfg.step_in_backward, cfg.accumulation)
        if key not in self._optimizers:
            memory = optimizer_memory(prof.trainable_params, state_precision=cfg.state_precision,
                                      offload_fraction=cfg.host_fraction, step_in_backward=cfg.step_in_backward,
                                      accumulation_steps=cfg.accumulation, device_type=self.ctx.device)
            leaving = np.array(offloaded_mask([n for n, _ in prof.trainable_params], cfg.host_fraction), dtype=bool)
            if cfg.step_in_backward and cfg.accumulation == 1:
                leaving[:] = True
            blocks = prof.trainable_blocks
            n = len(self.ctx.block_names)
            # A block's gradients leave when all of its parameters' do (a block split by a partial offload stays).
            block_leaves = np.array([bool(leaving[blocks == i].all()) if (blocks == i).any() else False
                                     for i in range(n)])
            other = blocks < 0
            self._optimizers[key] = (memory, block_leaves, bool(other.any() and leaving[other].all()))
        return self._optimizers[key]

    def profile(self, optimizer: str) -> _Profiles:
        return self.profiles["bf16" if optimizer == "offload-bf16-weights" else None]

    def arrays(self, prof: _Profiles, kind: str, b: int, compiled: bool) -> _KindArrays:
        key = (id(prof), kind, b, compiled)
        if key not in self._cache:
            kp = prof.kinds[kind]
            tokens = b * self.ctx.seq_len
            dev = self.ctx.device_profile

            def value(name: str) -> np.ndarray:
                field_ = getattr(kp, name)
                return np.array([x.at(b) for x in field_]) if isinstance(field_, list) else _at(field_, b)

            values = {name: value(name) for name in self._FIELDS}
            if kp.offloaded_tensors:
                # What the offloader leaves on the device (under its threshold at this micro-batch) stays saved
                # until the block's backward frees it.
                moved = np.array([_moved(t, b) if t is not None else float(all_)
                                  for t, all_ in zip(kp.offloaded_tensors, values["offloaded"], strict=True)])
                stays = values["offloaded"] - moved
                values["offloaded"] = moved
                values["saved"] = values["saved"] + stays
                values["backward_net"] = values["backward_net"] - stays
                values["backward_net_streamed"] = values["backward_net_streamed"] - stays
            self._cache[key] = _KindArrays(
                **values,
                forward_s=np.array([w.seconds(b, tokens, dev, compiled) for w in kp.fwd_work]),
                backward_s=np.array([w.seconds(b, tokens, dev, compiled) for w in kp.bwd_work]),
            )
        return self._cache[key]

    def rows(self, cfg: _Config, offload: int, recompute: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(peak, host, seconds) per row, row k recomputing ``recompute[k]`` blocks after ``offload`` offloaded."""
        i = np.arange(len(self.ctx.block_names))[None, :]
        return self.assigned(cfg, np.broadcast_to(i < offload, (len(recompute), i.shape[1])),
                             (i >= offload) & (i < offload + recompute[:, None]))

    def picker(self, cfg: _Config, is_off: np.ndarray, is_rec: np.ndarray) -> Callable[[str], np.ndarray]:
        """A (rows, blocks) array of one ``_KindArrays`` field per assignment row: the offloaded kind's where
        ``is_off``, the recomputed kind's where ``is_rec``, the kept kind's elsewhere."""
        b, prof = cfg.micro_batch_size, self.profile(cfg.optimizer)
        # Blocks compiled one by one run their own code compiled whatever the set-up (see compile_model).
        keep = self.arrays(prof, "keep", b, cfg.compile)
        rec = self.arrays(prof, cfg.flavor, b, cfg.compile) if is_rec.any() else keep
        off = self.arrays(prof, "offload", b, cfg.compile) if is_off.any() else keep

        def pick(name: str) -> np.ndarray:
            return np.where(is_off, getattr(off, name), np.where(is_rec, getattr(rec, name), getattr(keep, name)))

        return pick

    def offloaded(self, cfg: _Config, pick: Callable[[str], np.ndarray]) -> np.ndarray:
        """Bytes each block moves to the host (and back) in one micro-batch, (rows, blocks): none on a CPU."""
        offloaded = pick("offloaded")
        return offloaded if self.ctx.device == "cuda" else np.zeros_like(offloaded)

    def host_link(self, s: PlanSettings) -> HostLink:
        """Bytes over the host link in one optimizer step of ``s`` (per rank): the figures the time model's
        ``_offload_stall`` and ``_optimizer_seconds`` take."""
        cfg = _config_of(s)
        kinds = np.array(s.blocks)[None, :]
        activations = float(self.offloaded(cfg, self.picker(cfg, kinds == "offload", kinds == "recompute")).sum())
        gradients, weights = _optimizer_link(self.ctx, self.profile(cfg.optimizer), cfg)
        return HostLink(round(activations * cfg.accumulation), round(activations * cfg.accumulation),
                        round(gradients * cfg.accumulation), round(weights))

    def assigned(self, cfg: _Config, is_off: np.ndarray, is_rec: np.ndarray) -> tuple[np.ndarray, ...]:
        """(peak, host, seconds) per row of a (rows, blocks) assignment: offloaded where ``is_off``, recomputed
        where ``is_rec``, kept elsewhere."""
        ctx, b = self.ctx, cfg.micro_batch_size
        prof = self.profile(cfg.optimizer)
        pick = self.picker(cfg, is_off, is_rec)
        tail = prof.tails[cfg.chunked_loss]
        # -- model state, one process (distributed ranks differ by _distributed_shift)
        memory, block_leaves, other_leaves = self.optimizer(prof, cfg)
        # A gradient that leaves the device as it lands (to the host, or stepped in backward), or is added into an
        # earlier micro-batch's and freed, does not stay: the "_streamed" figures.
        transient = block_leaves | (cfg.accumulation > 1)
        suffix = "_streamed" if (other_leaves or cfg.accumulation > 1) else ""
        saved, fexcess, released = pick("saved"), pick("forward_excess"), pick("released")
        bexcess = np.where(transient, pick("backward_excess_streamed"), pick("backward_excess"))
        bnet = np.where(transient, pick("backward_net_streamed"), pick("backward_net"))
        offloaded = self.offloaded(cfg, pick)
        fixed = (float(prof.fixed_bytes) + _at(prof.input_bytes, b) - prof.input_bytes[0] - prof.adamw_state_bytes
                 + memory.device_state_bytes)
        if cfg.accumulation > 1:
            fixed += memory.device_gradient_bytes  # the earlier micro-batches' gradients, alive from the start

        # -- forward, block by block; the head and loss; backward from the last block to the first
        start = fixed + _at(tail.pre, b)
        starts = start + np.cumsum(saved, axis=1) - saved
        peak = np.max(starts + fexcess, axis=1)
        tail_start = start + saved.sum(axis=1)
        # Whether the first block sends its input to the host (see _TailProfile.tail_fwd_net_offloaded).
        first_out = is_off[:, 0] | (is_rec[:, 0] & (cfg.flavor == "offload-inputs"))
        tail_excess = np.where(first_out, tail.tail_fwd_excess_offloaded.at(b), tail.tail_fwd_excess.at(b))
        tail_net = np.where(first_out, _at(tail.tail_fwd_net_offloaded, b), _at(tail.tail_fwd_net, b))
        peak = np.maximum(peak, tail_start + tail_excess)
        backward_start = tail_start + tail_net - _at(tail.released_other, b) - released.sum(axis=1)
        peak = np.maximum(peak, backward_start + getattr(tail, "tail_bwd_excess" + suffix).at(b))
        first_block = backward_start + _at(getattr(tail, "tail_bwd_net" + suffix), b)
        later = np.cumsum(bnet[:, ::-1], axis=1)[:, ::-1] - bnet  # what the blocks after each one left
        # Stepping in backward, the step's temporaries come during backward (an upper bound: at its peak).
        in_backward = memory.device_step_temp_bytes if cfg.step_in_backward else 0
        # FSDP2 frees the share of each gradient that other ranks own as it lands: at block i's backward the
        # gradients of the blocks after it (a lower bound: the head's are not counted before the end).
        sharded = _gradient_shard(ctx, cfg)
        grads = np.asarray(prof.block_parameter_bytes, dtype=float)
        landed = sharded * (np.cumsum(grads[::-1])[::-1] - grads)
        peak = np.maximum(peak, np.max(first_block[:, None] + later + bexcess - landed[None, :], axis=1) + in_backward)
        end_blocks = first_block + bnet.sum(axis=1)
        peak = np.maximum(peak, end_blocks + getattr(tail, "post_excess" + suffix).at(b) - sharded * grads.sum())
        after = end_blocks + _at(getattr(tail, "post_net" + suffix), b)
        peak = np.maximum(peak, after + (0 if cfg.step_in_backward else memory.device_step_temp_bytes)
                          - sharded * float(prof.trainable_bytes))
        peak = peak + _distributed_shift(ctx, prof, cfg)

        # -- host bytes (one node: every rank's share)
        host = (offloaded.sum(axis=1) + memory.host_bytes) * _ranks_per_node(ctx.world)

        # -- time
        fwd, bwd = pick("forward_s"), pick("backward_s")
        dev = ctx.device_profile
        tokens = b * ctx.seq_len
        # compile_model compiles block by block where an offloader's hooks must stay outside the compiled regions:
        # the embeddings, the last norm, the head and the loss then run eagerly.
        def rest(compiled: bool) -> float:
            return sum(w.seconds(b, tokens, dev, compiled)
                       for w in (tail.pre_work, tail.tail_fwd_work, tail.tail_bwd_work, tail.post_work))

        head = np.where(_compiled_per_block(cfg, is_off, is_rec), rest(False), rest(cfg.compile))
        micro = fwd.sum(axis=1) + bwd.sum(axis=1) + head
        if ctx.device == "cuda" and offloaded.any():
            micro = micro + _offload_stall(fwd, bwd, offloaded, dev)
        backward = bwd.sum(axis=1)
        seconds = (micro * cfg.accumulation + _optimizer_seconds(ctx, prof, cfg, backward)
                   + _communication_seconds(ctx, prof, cfg, backward + fwd.sum(axis=1)))
        if cfg.step_in_backward:
            # One backward pass (clipping by the previous window's norm, the fp16 inf check on the device), its
            # steps in _optimizer_seconds like the ordinary step's; on top, per tensor: its gradient's norm read in
            # the hook, the inf flag, the clip multiply and an optimizer call of its own (a few small ops each). So
            # it is never faster than the ordinary step: the search takes it for the memory it saves.
            tensors = len(prof.trainable_params)
            seconds = seconds + (tensors * _IN_BACKWARD_OPS * dev.op_overhead_s
                                 + 4.0 * prof.trainable_numel / dev.memory_bandwidth)
        return peak, host, seconds


def _compiled_per_block(cfg: _Config, is_off: np.ndarray, is_rec: np.ndarray) -> np.ndarray:
    """Per row: whether ``compile_model`` compiles this set-up block by block (compiled, with a block that
    offloads its activations or its saved input), leaving the code between the blocks eager."""
    offloads = is_off.any(axis=1) | (is_rec.any(axis=1) & (cfg.flavor == "offload-inputs"))
    return offloads & cfg.compile


_IN_BACKWARD_OPS = 4  # extra small ops per parameter tensor of step-in-backward's hooks


def _offload_stall(fwd: np.ndarray, bwd: np.ndarray, offloaded: np.ndarray, dev: DeviceProfile) -> np.ndarray:
    """Seconds backward waits for activations coming back, per row. Each block's copies leave when its forward
    ends and queue on the link (device -> host); in backward a block's tensors come back while it computes (two
    tensors ahead of use, so hardly earlier), on the other direction of the link, after their own copy out."""
    rows, L = fwd.shape
    t, link = np.zeros(rows), np.zeros(rows)
    out_done = np.zeros((rows, L))
    for i in range(L):
        t = t + fwd[:, i]
        moving = offloaded[:, i] > 0
        link = np.where(moving, np.maximum(link, t) + offloaded[:, i] / dev.device_to_host, link)
        out_done[:, i] = link
    clock, link, stall = t, np.zeros(rows), np.zeros(rows)
    for i in reversed(range(L)):
        moving = offloaded[:, i] > 0
        begin = np.maximum(np.maximum(clock, out_done[:, i]), link)
        back = begin + offloaded[:, i] / dev.host_to_device
        finish = np.maximum(clock + bwd[:, i], back)
        stall = stall + np.where(moving, finish - clock - bwd[:, i], 0.0)
        link = np.where(moving, back, link)
        clock = np.where(moving, finish, clock + bwd[:, i])
    return stall


def _ranks_per_node(world: int) -> int:
    """Ranks sharing one host's RAM: this machine's GPUs, or an 8-GPU node."""
    local = torch.cuda.device_count() if torch.cuda.is_available() else 8
    return max(1, min(world, local))


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
# A host step's rate relative to fp32 AdamW's, where the probe did not measure it (memtrain.optim.cpu_step_rate on
# this machine's 2 cores: bf16 about 3.5x and int8 about 30x slower).
_CPU_RATE = {"fp32": 1.0, "bf16": 0.3, "int8": 1 / 30}


def _optimizer_seconds(ctx: _Context, prof: _Profiles, cfg: _Config, backward_s: np.ndarray) -> np.ndarray:
    """The step after the last backward: the device's part (memory-bound) and the host's (the offloaded share),
    which run side by side."""
    dev = ctx.device_profile
    numel = float(prof.trainable_numel)
    if cfg.distribution == "fsdp2":
        numel /= ctx.world
    on_host = numel * cfg.host_fraction
    on_device = numel - on_host
    if ctx.device == "cuda":
        tensors = len(prof.trainable_params) * (1 - cfg.host_fraction)
        device_part = max(_STEP_BYTES[cfg.state_precision] * on_device / dev.memory_bandwidth,
                          _STEP_OPS[cfg.state_precision] * tensors * dev.op_overhead_s)
    else:  # the "device" is the host: its own AdamW rate
        rate = {"fp32": dev.cpu_adamw, "bf16": dev.cpu_adamw_bf16, "int8": dev.cpu_adamw_int8}[cfg.state_precision]
        device_part = on_device / (rate or dev.cpu_adamw * _CPU_RATE[cfg.state_precision])
    device_part = device_part + 0 * backward_s
    if on_host == 0:
        return device_part
    grad_bytes, _ = _optimizer_link(ctx, prof, cfg)
    # Gradients stream to the host during each micro-batch's backward, the host adds later micro-batches in;
    # after the last backward: the norms (clipping), the CPU step, then the last bucket's weights cross back.
    d2h = np.maximum(0.0, grad_bytes / dev.device_to_host - backward_s) * cfg.accumulation
    host_adds = (cfg.accumulation - 1) * 12 * on_host / dev.host_bandwidth
    norms = 4 * on_host / dev.host_bandwidth if ctx.grad_clip else 0.0
    last_bucket = min(grad_bytes, _BUCKET_BYTES * grad_bytes / (4 * on_host))
    host_part = d2h + host_adds + norms + on_host / dev.cpu_adamw + last_bucket / dev.host_to_device
    return np.maximum(device_part, host_part)


def _optimizer_link(ctx: _Context, prof: _Profiles, cfg: _Config) -> tuple[float, float]:
    """(bytes of gradients to the host per micro-batch, bytes of weights back per step) of the parameters whose
    step runs on the host (``memtrain.optim.offloaded_mask``, whole tensors): both in the device weights' dtype."""
    from memtrain.optim import offloaded_mask

    if cfg.host_fraction == 0:
        return 0.0, 0.0
    mask = offloaded_mask([n for n, _ in prof.trainable_params], cfg.host_fraction)
    device_bytes = float(sum(n * d.itemsize for (n, d), m in zip(prof.trainable_params, mask, strict=True) if m))
    if cfg.distribution == "fsdp2":
        device_bytes /= ctx.world  # each rank's shard
    return device_bytes, device_bytes


def _communication_seconds(ctx: _Context, prof: _Profiles, cfg: _Config, compute_s: np.ndarray) -> np.ndarray:
    n, dev = ctx.world, ctx.device_profile
    if cfg.distribution == "none" or n == 1:
        return 0.0 * compute_s
    share = (n - 1) / n
    grads = prof.trainable_bytes * share
    if cfg.distribution == "ddp":
        # One all-reduce per step, bucket by bucket during the last micro-batch's backward (2/3 of its compute).
        return np.maximum(0.0, 2 * grads / dev.interconnect - compute_s * 2 / 3)
    # All-gathers in forward and in backward (in bf16 under bf16-mixed), prefetched under compute; one fp32
    # reduce-scatter of the gradients.
    params = prof.parameter_bytes * _gathered_ratio(ctx, prof) * share
    gathers = 2 * params / dev.interconnect
    return np.maximum(0.0, gathers - 0.9 * compute_s) * cfg.accumulation + grads / dev.interconnect


def fsdp2_param_dtype(precision: str) -> torch.dtype | None:
    """The dtype FSDP2 gathers and computes a block's parameters in under ``precision`` (its
    ``MixedPrecisionPolicy.param_dtype``): bf16 under bf16-mixed, as torchtitan does, which halves the all-gather
    traffic and the gathered blocks' bytes; the gradients are reduce-scattered in fp32 into the fp32 shards the
    optimizer steps. None (the parameters' own dtype) under fp32 and fp16-mixed.

    NOTE: fp16-mixed keeps fp32 gathers. With fp16 parameters the whole residual stream would be fp16 (FSDP2 casts
    each block's inputs; the embeddings would return fp16), where autocast keeps it fp32: an activation beyond
    fp16's 65504 would be inf in forward, which the GradScaler (it scales the loss's gradient) cannot prevent, so
    every step would be skipped.
    """
    return torch.bfloat16 if precision == "bf16-mixed" else None


def _gathered_ratio(ctx: _Context, prof: _Profiles) -> float:
    """Bytes of a parameter as FSDP2 gathers it over its bytes as traced (1, or 0.5 for fp32 weights gathered in
    bf16)."""
    dtype = fsdp2_param_dtype(ctx.precision)
    if dtype is None or not prof.trainable_params:
        return 1.0
    traced = sum(n * d.itemsize for n, d in prof.trainable_params)
    gathered = sum(n * (dtype if d.is_floating_point else d).itemsize for n, d in prof.trainable_params)
    return gathered / traced


def _gathered_block_bytes(ctx: _Context, prof: _Profiles) -> float:
    """The largest block's parameters as FSDP2 gathers them (``fsdp2_param_dtype``)."""
    return float(prof.block_parameter_bytes.max()) * _gathered_ratio(ctx, prof)


def _distributed_shift(ctx: _Context, prof: _Profiles, cfg: _Config | PlanSettings) -> float:
    """What DDP or FSDP2 changes at every moment of a one-process step of the same set-up, per rank (bytes); the
    gradients FSDP2 shards exist only from their backward on (``_gradient_shard``)."""
    n = ctx.world
    if cfg.distribution == "none" or n == 1:
        return 0.0
    grads = float(prof.trainable_bytes)
    if cfg.distribution == "ddp":
        # DDP's flat all-reduce buckets exist from its construction on, and each gradient becomes a view into its
        # bucket (gradient_as_bucket_view=True) when the reducer copies it in, in the backward that syncs: the
        # gradients landing there are no extra bytes (_gradient_shard). zero_grad(set_to_none=True) drops the
        # views each step, so a window's earlier micro-batches (no sync) accumulate into tensors of their own:
        # a device optimizer's trace counts those already; an offloaded one's streams them, but not under DDP.
        return grads * (2 if cfg.optimizer != "device" and cfg.accumulation > 1 else 1)
    # FSDP2: parameters and state sharded, the block computed and the next one (prefetched) gathered whole.
    shift = -(prof.parameter_bytes + prof.adamw_state_bytes) * (1 - 1 / n)
    return shift + 2 * _gathered_block_bytes(ctx, prof)


def _gradient_shard(ctx: _Context, cfg: _Config | PlanSettings) -> float:
    """The share of the gradients a one-process step holds as they land that a rank does not hold beside what
    ``_distributed_shift`` adds: FSDP2 reduce-scatters each block's as it lands, unless accumulation keeps them
    unsharded between micro-batches; under DDP, in the backward that syncs, each one becomes a view into the
    buckets the shift counts (an offloaded optimizer's trace never holds them)."""
    if ctx.world == 1 or cfg.accumulation > 1:
        return 0.0
    if cfg.distribution == "ddp":
        return 1.0 if cfg.optimizer == "device" else 0.0
    return 1 - 1 / ctx.world if cfg.distribution == "fsdp2" else 0.0


def _rank_peak(ctx: _Context, prof: _Profiles, s: PlanSettings, t: Trace) -> float:
    """A rank's peak from a one-process trace: each run's peak less the sharded share of the gradients that had
    landed before it, the step's after all of them; then the shift every moment has."""
    sharded = _gradient_shard(ctx, s)
    if not sharded or not t.runs:
        return t.report.peak_bytes + _distributed_shift(ctx, prof, s)
    landed, peak = 0, 0.0
    for run in t.runs:
        peak = max(peak, run.peak_bytes - sharded * landed)
        landed += run.gradient_bytes
    step = t.runs[-1].end_bytes + (0 if s.step_in_backward else t.step_temp_bytes)
    peak = max(peak, step - sharded * landed)
    if t.report.peak_bytes > max(max(r.peak_bytes for r in t.runs), step):  # a moment outside the runs: as is
        peak = max(peak, t.report.peak_bytes)
    return peak + _distributed_shift(ctx, prof, s)


class _Results:
    """Every composed candidate as columns, ranked fastest first (then the smaller peak)."""

    def __init__(self, n_blocks: int):
        self.n_blocks = n_blocks
        self.configs: list[_Config] = []
        self._parts: list[tuple[np.ndarray, ...]] = []
        self.explicit: dict[int, PlanSettings] = {}  # rows with their own block layout
        self.searched = False  # some rows came from a search (around a fixed layout), not one given set-up

    def add(self, cfg: _Config, offload: int, recompute: np.ndarray, peak: np.ndarray, host: np.ndarray,
            seconds: np.ndarray) -> None:
        if not self.configs or self.configs[-1] is not cfg:
            self.configs.append(cfg)
        index = len(self.configs) - 1
        self._parts.append((np.full(len(recompute), index), np.full(len(recompute), offload), recompute, peak, host,
                            seconds))

    def add_settings(self, cfg: _Config, settings: PlanSettings, peak: np.ndarray, host: np.ndarray,
                     seconds: np.ndarray) -> None:
        """One candidate with any per-block assignment (not only offloaded, then recomputed, then kept)."""
        self.explicit[sum(len(part[0]) for part in self._parts)] = settings
        self.add(cfg, settings.blocks.count("offload"), np.array([settings.blocks.count("recompute")]), peak, host,
                 seconds)

    def finish(self) -> None:
        cols = [np.concatenate(c) for c in zip(*self._parts, strict=True)]
        self.config, self.offload, self.recompute, self.peak, self.host, self.seconds = cols
        self.order = np.lexsort((self.peak, self.seconds))

    def settings(self, k: int) -> PlanSettings:
        if k in self.explicit:
            return self.explicit[k]
        return self.configs[int(self.config[k])].settings(self.n_blocks, int(self.offload[k]), int(self.recompute[k]))

    def column(self, name: str) -> np.ndarray:
        """A field of each row's configuration, e.g. "optimizer"."""
        values = np.array([getattr(c, name) for c in self.configs], dtype=object)
        return values[self.config]

    def first(self, mask: np.ndarray) -> int | None:
        """The fastest row where ``mask`` holds."""
        hits = np.flatnonzero(mask[self.order])
        return int(self.order[hits[0]]) if len(hits) else None


# -- plan() -------------------------------------------------------------------------------------------------
def budget_bytes(value: Any, name: str = "budget") -> int | None:
    """A budget as bytes: an int, a size such as ``"24GiB"`` / ``"8000MB"``, or None / ``"unlimited"`` (None).

    Raises:
        ConfigError: a negative, zero, non-finite or unparsable value (naming ``name``).
    """
    problems: list[str] = []
    out = _budget(value, name, problems)
    ConfigError.raise_if(problems)
    return out


def _budget(value: Any, name: str, problems: list[str]) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool):
        problems.append(f"{name}={value!r} is not a size. To resolve this error, pass bytes or a size such as "
                        "'24GiB'.")
        return None
    if isinstance(value, (int, float)):
        if value == math.inf:
            return None
        if not math.isfinite(value) or value <= 0:
            problems.append(f"{name}={value!r} must be a positive number of bytes. To resolve this error, pass "
                            "e.g. parse_bytes('24GiB'), or None for no limit.")
            return None
        return int(value)
    if isinstance(value, str):
        if value.strip().lower() in ("none", "unlimited", "inf"):
            return None
        try:
            return parse_bytes(value)
        except ConfigError as e:
            problems.append(f"{name}: {e}")
            return None
    problems.append(f"{name}={value!r} is not a size. To resolve this error, pass bytes or a size such as '24GiB'.")
    return None


_KIND_CHECKPOINTING: dict[str, Any] = {
    "keep": "none",
    "full": {"every": 1},
    "selective": {"every": 1, "selective": ("matmul", "attention")},
    "offload-inputs": {"every": 1, "offload": True},
}


_LEAD = 5  # blocks kept in front by _truncated


def _truncated(model: nn.Module, blocks: Sequence[str]) -> tuple[nn.Module, list[int]] | None:
    """A copy of ``model`` keeping only its first ``_LEAD`` blocks and its last, and the block of that copy each
    block of the model is profiled by: when the blocks are the children of one ModuleList (or Sequential) and
    structurally identical (same class, parameter and buffer shapes), the interior blocks' profiles are the same,
    and tracing six costs what tracing eighty would. Several in front: in backward the offloader fetches two
    records ahead, and tensors every block shares (rotary tables) come first, so the first blocks differ; the
    last two in front must profile alike (``_traced_profiles`` checks) for the last to stand for the interior.
    None where the model's blocks are not of that kind."""
    if len(blocks) <= _LEAD + 1:
        return None
    parents = {name.rpartition(".")[0] for name in blocks}
    modules = dict(model.named_modules())
    container = modules.get(parents.pop()) if len(parents) == 1 else None
    if not isinstance(container, (nn.ModuleList, nn.Sequential)) or len(container) != len(blocks):
        return None

    def signature(m: nn.Module) -> tuple[Any, ...]:
        return (type(m), tuple((n, tuple(p.shape), p.dtype, p.requires_grad) for n, p in m.named_parameters()),
                tuple((n, tuple(b.shape), b.dtype) for n, b in m.named_buffers()))

    if len({signature(m) for m in container}) != 1:
        return None
    from memtrain.estimate import _meta_model

    copy = _meta_model(model)
    parent_name = next(iter({name.rpartition(".")[0] for name in blocks}))
    holder_name, _, attr = parent_name.rpartition(".")
    holder = dict(copy.named_modules())[holder_name]
    kept = getattr(holder, attr)
    # NOTE: the config keeps its layer count: Hugging Face models loop over self.layers[:num_hidden_layers], and
    # every submodule shares the one config object (a copy would part them: e.g. use_cache off in one only).
    setattr(holder, attr, type(kept)([*list(kept)[:_LEAD], kept[len(kept) - 1]]))
    return copy, list(range(_LEAD - 1)) + [_LEAD - 1] * (len(blocks) - _LEAD) + [_LEAD]


def _state_bytes(model: nn.Module, blocks: Sequence[str], weights: str | None, cuda: bool) -> dict[str, Any]:
    """The model's state as a trace counts it (parameters in the traced dtype, rounded as the allocator does, and
    AdamW's state), without tracing."""
    from memtrain.estimate import _optimizer_bytes, _round

    dtype = torch.bfloat16 if weights == "bf16" else None
    round_to = 512 if cuda else 1
    params = list(dict.fromkeys(model.parameters()))
    as_traced = {id(p): (p.detach().to(dtype) if dtype is not None and p.is_floating_point() else p.detach())
                 for p in params}
    trainable = [as_traced[id(p)] for p in params if p.requires_grad]
    buffers = list(dict.fromkeys(model.buffers()))
    modules = dict(model.named_modules())
    block_of = {id(p): i for i, name in enumerate(blocks) for p in modules[name].parameters()}
    return {
        "rounded": sum(_round(t.numel() * t.element_size(), round_to) for t in (*as_traced.values(), *buffers)),
        "parameters": sum(t.numel() * t.element_size() for t in as_traced.values()),
        "trainable": sum(t.numel() * t.element_size() for t in trainable),
        "numel": sum(t.numel() for t in trainable),
        "state": _optimizer_bytes(trainable, "adamw", round_to, cuda)[0],
        "blocks": np.array([sum(as_traced[id(p)].numel() * as_traced[id(p)].element_size()
                                for p in modules[name].parameters() if p.requires_grad) for name in blocks],
                           dtype=np.float64),
        "params": [(t.numel(), t.dtype) for t in trainable],
        "param_blocks": np.array([block_of.get(id(p), -1) for p in params if p.requires_grad], dtype=np.int64),
    }


def _profiles(ctx: _Context, flavors: Sequence[str], offload: bool, weights: str | None) -> _Profiles:
    """Traces the step with every block of one kind, at micro-batches 1 and 2, and cuts the traces into
    per-block profiles (two traces a kind). Identical blocks are traced three of them (see _truncated)."""
    truncated = _truncated(ctx.model, ctx.block_names)
    if truncated is not None:
        try:
            return _traced_profiles(ctx, flavors, offload, weights, truncated)
        except MemtrainError:
            # A model whose forward needs every block (it indexes them by its config), or whose interior blocks
            # do not profile alike: trace it whole.
            pass
    return _traced_profiles(ctx, flavors, offload, weights, None)


def _traced_profiles(ctx: _Context, flavors: Sequence[str], offload: bool, weights: str | None,
                     truncated: tuple[nn.Module, list[int]] | None) -> _Profiles:
    traced_model, index = truncated if truncated is not None else (ctx.model, list(range(len(ctx.block_names))))
    from memtrain.checkpointing import find_blocks

    traced_blocks = find_blocks(traced_model)
    kinds = {k: _KIND_CHECKPOINTING[k] for k in ("keep", *flavors)}
    if offload:
        kinds["offload"] = {"policies": dict.fromkeys(traced_blocks, "offload")}
    if ctx.chunkable and not flavors:
        kinds["keep-chunked"] = "none"  # no recomputed kind to carry the chunked loss: a trace of its own for it
    traces: dict[str, tuple[Trace, Trace]] = {}
    for kind, checkpointing in kinds.items():
        # The kept and offloaded traces carry the whole loss, the others the chunked one (where the model has it):
        # the loss's own figures do not depend on the blocks' kind.
        chunked = ctx.chunkable and kind not in ("keep", "offload")
        first, second = (trace(traced_model, (b, ctx.seq_len), device=ctx.device, precision=ctx.precision,
                               checkpointing=checkpointing, chunked_loss=chunked, optimizer="adamw",
                               weights_dtype=weights, runs=True, offload_min_bytes=0) for b in (1, 2))
        # offload_min_bytes=0: every storage the offloader could move is recorded with its size, and _moved keeps
        # those at least its threshold at the candidate's micro-batch.
        traces[kind] = (first, second)
    keep1, _ = traces["keep"]
    chunked_kept = next((k for k in kinds if k in ("full", "selective", "keep-chunked")), "")
    whole_shift = _input_shift(traces, "keep", "offload")
    chunked_shift = _input_shift(traces, chunked_kept, "offload-inputs")
    tails = {False: _tail_profiles(traces, "keep", "offload", whole_shift or chunked_shift)}
    if ctx.chunkable:
        tails[True] = _tail_profiles(traces, chunked_kept, "offload-inputs", chunked_shift or whole_shift)
    cuda = ctx.device == "cuda"
    full = _state_bytes(ctx.model, ctx.block_names, weights, cuda)
    fixed = keep1.fixed_bytes
    if truncated is not None:  # the fixed bytes of the whole model: its parameters and state, not the copy's
        part = _state_bytes(traced_model, traced_blocks, weights, cuda)
        fixed += (full["rounded"] + full["state"]) - (part["rounded"] + part["state"])
    input_bytes = ctx.seq_len * 8  # int64 token ids, one example
    kind_profiles = {k: _kind_profile(*pair) for k, pair in traces.items()}
    if truncated is not None and not all(_alike(kp, _LEAD - 2, _LEAD - 1) for kp in kind_profiles.values()):
        raise _NotRepresentative  # the interior does not repeat: trace the whole model
    return _Profiles(
        kinds={k: _expand(kp, index) for k, kp in kind_profiles.items()},
        tails=tails,
        fixed_bytes=fixed,
        input_bytes=(float(input_bytes), float(input_bytes)),
        parameter_bytes=full["parameters"],
        trainable_bytes=full["trainable"],
        trainable_numel=full["numel"],
        block_parameter_bytes=full["blocks"],
        adamw_state_bytes=full["state"],
        traces=2 * len(kinds),
        trainable_params=full["params"],
        trainable_blocks=full["param_blocks"],
    )


def _tail_profiles(traces: dict[str, tuple[Trace, Trace]], kept: str | None, offloaded: str | None,
                   shift: tuple[float, float] | None = None) -> _TailProfile:
    """The loss's profile from a trace whose first block keeps its input (``kept``) and, for the head's forward,
    from one whose first block offloads it (``offloaded``). With only one of them, ``shift`` (how much less the
    other loss's forward end holds when the input is offloaded) stands in for the missing one."""
    kept = kept if kept in traces else None
    offloaded = offloaded if offloaded in traces else None
    base = _tail_profile(*traces[kept or offloaded])  # type: ignore[index]
    if kept is not None and offloaded is not None:
        other = _tail_profile(*traces[offloaded])
        base.tail_fwd_net_offloaded, base.tail_fwd_excess_offloaded = other.tail_fwd_net, other.tail_fwd_excess
        return base
    d1, slope = shift if shift is not None else (0.0, 0.0)
    if kept is None:  # traced with the input offloaded: the kept case holds it again
        d1, slope = -d1, -slope
        base.tail_fwd_net_offloaded, base.tail_fwd_excess_offloaded = base.tail_fwd_net, base.tail_fwd_excess
        base.tail_fwd_net = (base.tail_fwd_net[0] + d1, base.tail_fwd_net[1] + slope)
        base.tail_fwd_excess = _Lines(base.tail_fwd_excess.lines + np.array([d1, slope]))
        return base
    base.tail_fwd_net_offloaded = (base.tail_fwd_net[0] + d1, base.tail_fwd_net[1] + slope)
    base.tail_fwd_excess_offloaded = _Lines(base.tail_fwd_excess.lines + np.array([d1, slope]))
    return base


def _input_shift(traces: dict[str, tuple[Trace, Trace]], kept: str, offloaded: str) -> tuple[float, float] | None:
    """What offloading the first block's input changes in the forward end of one loss, when both were traced."""
    if kept not in traces or offloaded not in traces:
        return None
    a, b = _tail_profile(*traces[kept]), _tail_profile(*traces[offloaded])
    return b.tail_fwd_net[0] - a.tail_fwd_net[0], b.tail_fwd_net[1] - a.tail_fwd_net[1]


class _NotRepresentative(MemtrainError):
    """The truncated copy's leading blocks did not settle into the interior's profile."""


def _alike(kp: _KindProfile, i: int, j: int) -> bool:
    """Blocks ``i`` and ``j`` have the same profile (bytes, peaks at micro-batches 1 and 2, work)."""
    for f in dataclasses.fields(kp):
        value = getattr(kp, f.name)
        if isinstance(value, np.ndarray):
            if not np.array_equal(value[i], value[j]):
                return False
        elif isinstance(value[i], _Lines):
            if any(value[i].at(b) != value[j].at(b) for b in (1, 2)):
                return False
        elif value[i] is None or isinstance(value[i], np.ndarray):  # offloaded_tensors
            if (value[i] is None) != (value[j] is None) or (value[i] is not None
                                                            and not np.array_equal(value[i], value[j])):
                return False
        elif value[i] != value[j]:
            return False
    return True


def _expand(kp: _KindProfile, index: list[int]) -> _KindProfile:
    """A profile of the traced blocks, for every block of the model (``index``: which traced block each is)."""
    if index == list(range(len(index))):
        return kp
    fields = {f.name: getattr(kp, f.name) for f in dataclasses.fields(kp)}
    return _KindProfile(**{name: value[index] if isinstance(value, np.ndarray) else [value[i] for i in index]
                           for name, value in fields.items()})


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


TECHNIQUES = ("checkpointing", "selective", "offload-activations", "chunked-loss", "offload-optimizer",
              "bf16-weights", "optimizer-state", "step-in-backward")


def plan(
    model_or_hf_config: Any,
    *,
    budget: int | str | None,
    seq_len: int,
    global_batch_size: int,
    device: str = "cuda",
    precision: str = "bf16-mixed",
    world_size: int = 1,
    fsdp: bool | None = False,
    host_budget: int | str | None = None,
    compile: bool = False,
    micro_batch_size: int | None = None,
    safety_margin: float = DEFAULT_SAFETY_MARGIN,
    grad_clip: bool = True,
    techniques: Iterable[str] | None = None,
    device_profile: DeviceProfile | None = None,
    settings: PlanSettings | None = None,
    fixed: Fixed | None = None,
    correction_bytes: int = 0,
) -> Plan:
    """The fastest set-up whose predicted peak fits ``budget`` (per rank), with a reason for each choice.

    Pure: nothing is allocated on a device and the model is not modified (it may live on the meta device, or be
    a Hugging Face config). A 1.1B Llama plans in a few seconds (``memtrain plan``'s output says how long).

    Args:
        model_or_hf_config: an ``nn.Module`` (any device) or a Hugging Face ``PretrainedConfig``.
        budget: device bytes per rank (an int, or a size such as ``"24GiB"``); None for no limit.
        seq_len: tokens per example.
        global_batch_size: examples per optimizer step, over all ranks.
        device: ``"cuda"`` or ``"cpu"`` (a CPU plan leaves out activation and optimizer offload, which would only
            copy within RAM).
        precision: ``"fp32"``, ``"bf16-mixed"`` or ``"fp16-mixed"`` (compute; weights stay fp32 unless the plan
            puts bf16 weights on the device with an offloaded fp32 master).
        world_size: ranks; the global batch is split over them.
        fsdp: True plans FSDP2, False DDP, None both (the reasons say which fits faster). Ignored for one rank.
        host_budget: host RAM the plan may use (one node, all ranks); None: the RAM available now.
        compile: also consider ``torch.compile``d set-ups.
        micro_batch_size: fix the micro-batch (the plan chooses the rest); None chooses it too.
        safety_margin: the fraction of ``budget`` left free for the allocator's fragmentation.
        grad_clip: the run clips gradients (the offloaded optimizer then steps after backward).
        techniques: allow only some of ``TECHNIQUES``; None allows all.
        device_profile: the device's rates; None probes the CPU, or takes the table of known GPUs for CUDA.
        settings: no search: predict exactly this set-up (e.g. one chosen by hand), which must fit ``budget``.
        fixed: choices the search keeps as given (a checkpointing layout, the loss, the optimizer placement).
        correction_bytes: added to every predicted peak: what a measurement showed the prediction missed (a
            re-plan after the device disagreed).

    Returns:
        A ``Plan``: ``.settings`` for ``apply_plan``, the predictions, the reasons and the runners-up.

    Raises:
        ConfigError: a bad argument (every problem at once), or nothing fits: the error names the smallest peak
            found and what would make it fit.

    Example:
        >>> from memtrain.models import GPT, GPT_PRESETS
        >>> p = plan(GPT(GPT_PRESETS["gpt-tiny"]), budget=None, seq_len=64, global_batch_size=8, device="cpu")
        >>> p.settings.checkpointing, p.settings.micro_batch_size  # no limit: nothing recomputed, one forward
        ('none', 8)
    """
    started = time.perf_counter()
    problems: list[str] = []
    budget_bytes = _budget(budget, "budget", problems)
    host_budget_bytes = _budget(host_budget, "host_budget", problems)
    for name, value in (("seq_len", seq_len), ("global_batch_size", global_batch_size), ("world_size", world_size)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            problems.append(f"{name}={value!r} must be an integer >= 1.")
    if micro_batch_size is not None and (isinstance(micro_batch_size, bool) or not isinstance(micro_batch_size, int)
                                         or micro_batch_size < 1):
        problems.append(f"micro_batch_size={micro_batch_size!r} must be an integer >= 1, or None to choose it.")
    if device not in ("cuda", "cpu"):
        problems.append(f"device={device!r} is not one of 'cuda', 'cpu'.")
    if precision not in ("fp32", "bf16-mixed", "fp16-mixed"):
        problems.append(f"precision={precision!r} is not one of fp32, bf16-mixed, fp16-mixed.")
    if isinstance(safety_margin, bool) or not isinstance(safety_margin, (int, float)) or not 0 <= safety_margin < 0.9:
        problems.append(f"safety_margin={safety_margin!r} must be a fraction in [0, 0.9), e.g. 0.05.")
    allowed = set(TECHNIQUES if techniques is None else techniques)
    if allowed - set(TECHNIQUES):
        problems.append(f"techniques: unknown {sorted(allowed - set(TECHNIQUES))}; known: {list(TECHNIQUES)}.")
    ConfigError.raise_if(problems)
    per_rank, remainder = divmod(global_batch_size, world_size)
    if remainder:
        problems.append(f"global_batch_size={global_batch_size} does not split over world_size={world_size} ranks. "
                        f"To resolve this error, pass a multiple of {world_size}.")
    elif micro_batch_size is not None and per_rank % micro_batch_size:
        problems.append(f"micro_batch_size={micro_batch_size} does not divide the {per_rank} examples each rank "
                        f"takes per step. To resolve this error, pass one of {_divisors(per_rank)}.")
    ConfigError.raise_if(problems)

    if settings is not None:
        precision = settings.precision
    ctx = _context(model_or_hf_config, seq_len, global_batch_size, device, precision, world_size,
                   "chunked-loss" in allowed, grad_clip, device_profile)
    blocks, cuda = ctx.block_names, device == "cuda"
    modules = dict(ctx.model.named_modules())
    largest_block = max(sum(p.numel() * p.element_size() for p in modules[b].parameters()) for b in blocks)
    if budget_bytes is not None and budget_bytes < largest_block:
        raise ConfigError(f"budget {format_bytes(budget_bytes)} is smaller than one block's parameters "
                          f"({format_bytes(largest_block)}): no set-up computes a block in it. To resolve this error, "
                          "pass a larger budget (e.g. the GPU's memory), or shard the model over more GPUs (FSDP2).")
    flavors: list[RecomputeFlavor] = []
    if "checkpointing" in allowed:
        flavors.append("full")
        if "selective" in allowed:
            flavors.append("selective")
        if cuda and "offload-activations" in allowed:
            flavors.append("offload-inputs")
    offload_blocks = cuda and "offload-activations" in allowed
    placements: list[OptimizerPlacement] = ["device"]
    if cuda and "offload-optimizer" in allowed:
        placements.append("offload")
        if "bf16-weights" in allowed and precision == "bf16-mixed":
            placements.append("offload-bf16-weights")
    states = ["fp32"]
    if "optimizer-state" in allowed:
        states.append("bf16")
        if _int8_runs(device):
            states.append("int8")
    distributions: list[Distribution] = ["none"] if world_size == 1 else (
        ["fsdp2"] if fsdp else ["ddp"] if fsdp is False else ["ddp", "fsdp2"])
    L = len(blocks)
    results = _Results(L)
    losses = [False, True] if ctx.chunkable else [False]
    fixed = fixed if fixed is not None else Fixed()
    if fixed != Fixed():
        _check_fixed(fixed, L, cuda, ctx.chunkable, precision)
        if fixed.blocks is not None:
            offload_blocks = "offload" in fixed.blocks
            flavors = [fixed.flavor or "full"] if "recompute" in fixed.blocks else []
        elif fixed.flavor is not None:
            flavors = [fixed.flavor]
        if fixed.chunked_loss is not None:
            losses = [fixed.chunked_loss]
        if fixed.optimizer is not None:
            placements = [fixed.optimizer]
        if fixed.state_precision is not None:
            states = [fixed.state_precision]
    if settings is not None:
        _check_settings(settings, L, per_rank, cuda, world_size, ctx.chunkable, precision)
        composer = _composer_for(ctx, [settings])
        _add_given(composer, results, settings)
        placements = []  # nothing to search
    else:
        profiles: dict[Any, _Profiles] = {None: _profiles(ctx, flavors, offload_blocks, None)}
        if "offload-bf16-weights" in placements:
            profiles["bf16"] = _profiles(ctx, flavors, offload_blocks, "bf16")
        composer = _Composer(ctx, profiles)
    micros = [micro_batch_size] if micro_batch_size is not None else _divisors(per_rank)
    choices = _optimizer_choices(placements, states, distributions, allowed, cuda, fixed)
    for placement, state, in_backward, fraction, dist in choices:
        for compiled in ([fixed.compile] if fixed.compile is not None else [False, True] if compile else [False]):
            for chunked in losses:
                for b in micros:
                    if in_backward and per_rank // b > 1 and not fixed.step_in_backward:
                        # With accumulation the earlier micro-batches' gradients stay: no bytes saved, so the search
                        # skips it; asked for, it steps in the last micro-batch's backward.
                        continue
                    for flavor in flavors or ["full"]:
                        cfg = _Config(b, per_rank // b, flavor, chunked, placement, dist, compiled, precision, state,
                                      in_backward, fraction)
                        if fixed.blocks is not None:
                            _add_given(composer, results, cfg.with_blocks(fixed.blocks), explicit=False)
                            continue
                        for o in (range(L + 1) if offload_blocks else [0]):
                            # Without recomputed blocks every flavor is the same set-up: the first has it.
                            lowest = 0 if flavor == (flavors or ["full"])[0] else 1
                            recompute = np.arange(lowest, (L - o + 1) if flavors else 1)
                            if len(recompute):
                                results.add(cfg, o, recompute, *composer.rows(cfg, o, recompute))
    if not results._parts:  # the fixed choices rule out every set-up
        chosen = {k: v for k, v in (("optimizer", fixed.optimizer), ("state_precision", fixed.state_precision),
                                    ("step_in_backward", fixed.step_in_backward),
                                    ("offload_fraction", fixed.offload_fraction),
                                    ("micro_batch_size", micro_batch_size)) if v is not None}
        given = ", ".join(f"{k}={v!r}" for k, v in chosen.items()) or "the techniques allowed"
        ranks = f" with world_size={world_size}{' (FSDP2)' if fsdp else ''}" if world_size > 1 or fsdp else ""
        why = ["a partial offload keeps fp32 moments and steps after backward"]
        if world_size > 1 or fsdp:
            why = ["step_in_backward and offload_fraction act on gradients before DDP or FSDP2 reduces them (one "
                   "process only)", *why, "FSDP2 shards fp32 moments only"]
        raise ConfigError(
            f"no set-up can be built from {given}{ranks}: {', '.join(why)}. To resolve this error, drop one of the "
            "fixed choices (leave it to the plan).")
    results.finish()
    results.peak = results.peak + correction_bytes
    # The host RAM to check against: the budget given, or this machine's when the plan is for this machine.
    here = device == "cpu" or torch.cuda.is_available()
    host_limit = host_budget_bytes if host_budget_bytes is not None else (available_host_bytes() if here else None)
    usable = None if budget_bytes is None else int(budget_bytes * (1 - safety_margin))
    return _choose(ctx, composer, results, budget_bytes, usable, host_limit, host_budget_bytes, safety_margin, started,
                   correction_bytes)


_PARTIAL_FRACTIONS = (0.25, 0.5, 0.75)  # partial optimizer offloads the search tries


def _int8_runs(device: str) -> bool:
    """Whether bitsandbytes' 8-bit AdamW is installed (the lowbit extra) and has kernels for ``device``.

    NOTE: found, not imported: importing bitsandbytes takes seconds (it loads torch.compile's machinery), which a
    plan that never picks int8 moments should not pay; apply_plan imports it when it does.
    """
    import importlib.util

    from memtrain.optim import INT8_DEVICES

    return device in INT8_DEVICES and importlib.util.find_spec("bitsandbytes") is not None


def _optimizer_choices(placements: Sequence[OptimizerPlacement], states: Sequence[str],
                       distributions: Sequence[Distribution], allowed: set[str], cuda: bool,
                       fixed: Fixed) -> list[tuple[OptimizerPlacement, str, bool, float, Distribution]]:
    """(placement, moment precision, step in backward, partial offload fraction, distribution) to search."""
    out: list[tuple[OptimizerPlacement, str, bool, float, Distribution]] = []
    in_backward = [False] + ([True] if "step-in-backward" in allowed else [])
    if fixed.step_in_backward is not None:
        in_backward = [fixed.step_in_backward]
    fractions = [0.0] + (list(_PARTIAL_FRACTIONS) if cuda and "offload-optimizer" in allowed else [])
    if fixed.offload_fraction is not None:
        fractions = [fixed.offload_fraction]
    for dist in distributions:
        for placement in placements:
            if placement != "device":
                # CPUOffloadOptimizer: fp32 state on the host; FSDP2 shards the state itself and needs none.
                if dist != "fsdp2":
                    out.append((placement, "fp32", False, 0.0, dist))  # host_fraction is 1 for these
                continue
            for state in states:
                if dist == "fsdp2" and state != "fp32":
                    continue  # torch's AdamW on FSDP2's sharded parameters
                for sib in in_backward:
                    for fraction in fractions:
                        if dist != "none" and (sib or fraction):
                            continue  # both would act on gradients before DDP averages them
                        if fraction and (sib or state != "fp32"):
                            continue  # a partial offload keeps fp32 moments and steps after backward
                        out.append((placement, state, sib, fraction, dist))
    return out


def _check_fixed(f: Fixed, n_blocks: int, cuda: bool, chunkable: bool, precision: str) -> None:
    problems = []
    if f.blocks is not None and (len(f.blocks) != n_blocks or any(k not in ("keep", "recompute", "offload")
                                                                  for k in f.blocks)):
        problems.append(f"the checkpointing layout has {len(f.blocks)} entries {sorted(set(f.blocks))}: the model "
                        f"has {n_blocks} blocks, each 'keep', 'recompute' or 'offload'.")
    if not cuda and ((f.blocks is not None and "offload" in f.blocks) or f.flavor == "offload-inputs"):
        problems.append("activation offload on a CPU only copies within RAM. To resolve this error, drop it "
                        "(offload_activations) for a CPU run.")
    # NOTE: a fixed optimizer offload is planned on the CPU too (CPUOffloadOptimizer runs there, the same code
    # path as on a GPU); the search never proposes one there.
    if f.chunked_loss and not chunkable:
        problems.append("chunked_loss=True, but memtrain cannot chunk this model's loss (see memtrain.loss). To "
                        "resolve this error, pass chunked_loss=False (or leave it to the plan).")
    if f.optimizer in ("offload", "offload-bf16-weights"):
        extra = {k: v for k, v in (("state_precision", f.state_precision), ("step_in_backward", f.step_in_backward),
                                   ("offload_fraction", f.offload_fraction))
                 if v not in (None, "fp32", False, 0.0, 1.0)}
        if extra:
            given = ", ".join(f"{k}={v!r}" for k, v in extra.items())
            problems.append(f"offload_optimizer=True with {given}: the offloaded optimizer keeps fp32 moments in "
                            "host RAM and steps after backward. To resolve this error, drop one of them.")
    if f.optimizer == "offload-bf16-weights" and precision != "bf16-mixed":
        problems.append(f"bf16 device weights need precision bf16-mixed, not {precision}.")
    ConfigError.raise_if(problems)


def _context(model_or_hf_config: Any, seq_len: int, global_batch_size: int, device: str, precision: str,
             world_size: int, chunk_allowed: bool, grad_clip: bool, device_profile_: DeviceProfile | None) -> _Context:
    from memtrain.checkpointing import find_blocks
    from memtrain.estimate import _meta_model
    from memtrain.loss import supports_chunked_loss

    meta = _meta_model(model_or_hf_config)
    blocks = tuple(find_blocks(meta))
    if not blocks:
        raise ConfigError(f"plan: no repeated blocks found in {type(meta).__name__}, so nothing can be checkpointed "
                          "or offloaded block by block. To resolve this error, plan a model with an nn.ModuleList "
                          "of blocks (or Hugging Face _no_split_modules), or choose the techniques yourself.")
    dev = device_profile_ if device_profile_ is not None else device_profile(device)
    return _Context(model=meta, seq_len=seq_len, global_batch=global_batch_size, world=world_size, device=device,
                    precision=precision, device_profile=dev, block_names=blocks,
                    chunkable=chunk_allowed and supports_chunked_loss(meta), grad_clip=grad_clip)


def _composer_for(ctx: _Context, given: Sequence[PlanSettings]) -> _Composer:
    """Profiles of just the kinds the given set-ups use."""
    flavors = sorted({s.flavor for s in given if "recompute" in s.blocks})
    offload = any("offload" in s.blocks for s in given)
    profiles: dict[Any, _Profiles] = {}
    if any(s.optimizer != "offload-bf16-weights" for s in given):
        profiles[None] = _profiles(ctx, flavors, offload, None)
    if any(s.optimizer == "offload-bf16-weights" for s in given):
        profiles["bf16"] = _profiles(ctx, flavors, offload, "bf16")
    return _Composer(ctx, profiles)


def _config_of(s: PlanSettings) -> _Config:
    return _Config(s.micro_batch_size, s.accumulation, s.flavor, s.chunked_loss, s.optimizer, s.distribution,
                   s.compile, s.precision, s.state_precision, s.step_in_backward, s.offload_fraction)


def _add_given(composer: _Composer, results: _Results, s: PlanSettings, *, explicit: bool = True) -> None:
    """One candidate with its own block layout; ``explicit``: it was given whole (nothing was searched)."""
    cfg = _config_of(s)
    kinds = np.array(s.blocks)[None, :]
    results.add_settings(cfg, s, *composer.assigned(cfg, kinds == "offload", kinds == "recompute"))
    results.searched |= not explicit


def predictions(model_or_hf_config: Any, given: Sequence[PlanSettings], *, seq_len: int, global_batch_size: int,
                device: str = "cuda", world_size: int = 1, grad_clip: bool = True,
                device_profile: DeviceProfile | None = None) -> list[Candidate]:
    """The peak, host bytes and step time the planner predicts for each given set-up, composed from one set of
    profiles (no search, no full estimates): what it ranks candidates by. ``benchmarks/bench_plan.py`` sets them
    beside measured step times.

    Raises:
        ConfigError: set-ups of different precisions, or one the model or device cannot take.
    """
    precisions = {s.precision for s in given}
    if len(precisions) != 1:
        raise ConfigError(f"predictions: the set-ups have precisions {sorted(precisions)}; one profile serves one. "
                          "To resolve this error, ask for one precision at a time.")
    ctx = _context(model_or_hf_config, seq_len, global_batch_size, device, precisions.pop(), world_size, True,
                   grad_clip, device_profile)
    per_rank = global_batch_size // world_size
    for s in given:
        _check_settings(s, len(ctx.block_names), per_rank, device == "cuda", world_size, ctx.chunkable, s.precision)
    composer = _composer_for(ctx, given)
    results = _Results(len(ctx.block_names))
    for s in given:
        _add_given(composer, results, s)
    results.finish()
    tokens = global_batch_size * seq_len
    return [Candidate(results.settings(k), int(results.peak[k]), int(results.host[k]), float(results.seconds[k]),
                      tokens / float(results.seconds[k]), False, host_link=composer.host_link(results.settings(k)))
            for k in range(len(given))]


def _check_settings(s: PlanSettings, n_blocks: int, per_rank: int, cuda: bool, world: int, chunkable: bool,
                    precision: str) -> None:
    """ConfigError for a hand-made set-up the model, batch or device cannot take."""
    problems = []
    if not isinstance(s, PlanSettings):
        raise ConfigError(f"settings={s!r} must be a PlanSettings (e.g. plan(...).settings, or "
                          "dataclasses.replace of one).")
    if len(s.blocks) != n_blocks or any(k not in ("keep", "recompute", "offload") for k in s.blocks):
        problems.append(f"settings.blocks has {len(s.blocks)} entries {sorted(set(s.blocks))}: the model has "
                        f"{n_blocks} blocks, each 'keep', 'recompute' or 'offload'.")
    if s.micro_batch_size * s.accumulation != per_rank:
        problems.append(f"micro_batch_size {s.micro_batch_size} x accumulation {s.accumulation} is not the "
                        f"{per_rank} examples each rank takes per step. To resolve this error, pass a micro-batch "
                        f"among {_divisors(per_rank)} with the accumulation that makes {per_rank}.")
    if not cuda and ("offload" in s.blocks or s.flavor == "offload-inputs"):
        problems.append("activation offload on a CPU only copies within RAM. To resolve this error, plan it for "
                        "device='cuda'.")
    if s.optimizer == "offload-bf16-weights" and precision != "bf16-mixed":
        problems.append(f"bf16 device weights need precision bf16-mixed, not {precision}.")
    if (s.distribution == "none") != (world == 1):
        problems.append(f"distribution {s.distribution!r} with world_size={world}: one process is 'none', "
                        "several 'ddp' or 'fsdp2'.")
    if s.distribution == "fsdp2" and s.optimizer != "device":
        problems.append("FSDP2 with an offloaded optimizer: FSDP2 shards the optimizer state itself, and "
                        "CPUOffloadOptimizer needs whole parameters. To resolve this error, keep the optimizer on "
                        "the device with FSDP2, or use DDP.")
    if s.chunked_loss and not chunkable:
        problems.append("chunked_loss=True, but memtrain cannot chunk this model's loss (see memtrain.loss).")
    if s.state_precision not in ("fp32", "bf16", "int8"):
        problems.append(f"state_precision={s.state_precision!r} is not one of fp32, bf16, int8.")
    if not 0.0 <= s.offload_fraction <= 1.0 or (s.offload_fraction and s.optimizer != "device"):
        problems.append(f"offload_fraction={s.offload_fraction!r}: a share in [0, 1] of a device optimizer's state "
                        "(optimizer 'offload' already puts all of it on the host).")
    if (s.step_in_backward or s.offload_fraction) and world > 1:
        problems.append("step_in_backward and offload_fraction act on gradients before DDP averages them: one "
                        "process only.")
    ConfigError.raise_if(problems)


def _estimate_of(ctx: _Context, prof: _Profiles, s: PlanSettings) -> tuple[float, Trace]:
    """A full estimate of exactly this set-up (one process, then the distributed shift): the peak and the trace."""
    checkpointing: dict[str, Any] = {"policies": s.policies(ctx.block_names)}
    if s.flavor == "selective":
        checkpointing["selective"] = ("matmul", "attention")
    if s.flavor == "offload-inputs" and "recompute" in s.blocks:
        checkpointing["offload"] = True
    t = trace(ctx.model, (s.micro_batch_size, ctx.seq_len), device=ctx.device, precision=ctx.precision,
              checkpointing=checkpointing, chunked_loss=s.chunked_loss,
              optimizer="adamw" if s.optimizer == "device" else "adamw-offload", accumulation=s.accumulation,
              state_precision=s.state_precision, offload_fraction=s.offload_fraction,
              step_in_backward=s.step_in_backward,
              weights_dtype="bf16" if s.optimizer == "offload-bf16-weights" else None,
              runs=_gradient_shard(ctx, s) > 0)  # when the sharded gradients' moments matter
    return _rank_peak(ctx, prof, s, t), t


def _choose(ctx: _Context, composer: _Composer, results: _Results, budget_bytes: int | None, usable: int | None,
            host_limit: int | None, host_budget: int | None, margin: float, started: float,
            correction_bytes: int = 0) -> Plan:
    """The fastest row that fits, confirmed by a full estimate (the next is tried when the estimate disagrees)."""
    fits_host = results.host <= host_limit if host_limit is not None else np.ones(len(results.host), bool)
    fits = fits_host & (results.peak <= usable if usable is not None else True)
    # Composition errs on the high side where a step's structure changes with the micro-batch (the loss's chunk
    # count, what is large enough to offload): a few faster candidates just over the budget get a full estimate
    # too, on a quota of their own.
    band = fits_host & (results.peak <= usable * (1 + _VERIFY_BAND) if usable is not None else True)
    verified: dict[int, tuple[float, Trace]] = {}
    chosen, tries, near_misses = None, 0, 0
    # A full estimate above its composed peak says what composition missed for that shape of candidate (the
    # same configuration, with or without offloaded blocks): later ones of that shape carry the deficit.
    deficit: dict[tuple[int, bool], float] = {}
    for k in results.order[band[results.order]]:
        k = int(k)
        shape = (int(results.config[k]), bool(results.offload[k]))
        composed = results.peak[k] + deficit.get(shape, 0.0)
        near_miss = usable is not None and composed > usable
        if usable is not None and composed > usable * (1 + _VERIFY_BAND):
            continue
        if (near_misses >= _NEAR_MISSES) if near_miss else (tries >= _VERIFY_LIMIT):
            if tries >= _VERIFY_LIMIT:
                break
            continue
        s = results.settings(k)
        peak, t = _estimate_of(ctx, composer.profile(s.optimizer), s)
        verified[k] = peak + correction_bytes, t
        near_misses, tries = near_misses + near_miss, tries + (not near_miss)
        if usable is None or verified[k][0] <= usable:
            chosen = k
            break
        deficit[shape] = max(deficit.get(shape, 0.0), verified[k][0] - results.peak[k])
    if chosen is None:
        _raise_nothing_fits(ctx, composer, results, verified, budget_bytes, usable, host_limit, host_budget, margin,
                            fits_host)
    s = results.settings(chosen)
    peak, t = verified[chosen]
    tokens_per_step = ctx.global_batch * ctx.seq_len
    seconds = float(results.seconds[chosen])
    fits_verified = fits.copy()
    for k, (p, _) in verified.items():
        fits_verified[k] = usable is None or p <= usable
    return Plan(
        settings=s, budget_bytes=budget_bytes, usable_bytes=usable, host_budget_bytes=host_budget,
        peak_bytes=int(peak), host_bytes=int(results.host[chosen]), activation_bytes=t.report.activation_bytes,
        step_seconds=seconds, tokens_per_s=tokens_per_step / seconds, precision=ctx.precision, device=ctx.device,
        seq_len=ctx.seq_len, global_batch_size=ctx.global_batch, world_size=ctx.world, block_names=ctx.block_names,
        parameters=int(sum(p.numel() for p in dict.fromkeys(ctx.model.parameters()))),
        reasons=tuple(_reasons(ctx, results, chosen, peak, fits_verified, fits_host, usable, host_limit)),
        candidates=tuple(_runners_up(ctx, composer, results, chosen, verified, fits_verified, fits_host, usable,
                                     host_limit)),
        assumptions=tuple(_assumptions(ctx, margin, composer, host_limit) + (
            [f"every predicted peak includes {format_bytes(correction_bytes)} that a measurement on this device "
             "showed the estimate missing"] if correction_bytes else [])), device_profile=ctx.device_profile, report=t.report,
        plan_seconds=time.perf_counter() - started, host_link=composer.host_link(s),
    )


def _family(s: PlanSettings) -> tuple[Any, ...]:
    kinds = set(s.blocks)
    shape = "none" if kinds == {"keep"} else "all" if kinds == {"recompute"} else "mixed"
    return shape, s.flavor if "recompute" in kinds else "-", "offload" in kinds, s.chunked_loss, s.optimizer_text, \
        s.micro_batch_size, s.distribution, s.compile


def _slower(ratio: float) -> str:
    """A step-time ratio in words: "3.2% slower", or "as fast (within 0.1%)"."""
    return f"{100 * (ratio - 1):.1f}% slower" if ratio >= 1.001 else "as fast (within 0.1%)"


def _why_lost(results: _Results, k: int, chosen: int, peak: float, fits: np.ndarray, fits_host: np.ndarray,
              usable: int | None, host_limit: int | None) -> str:
    if not fits_host[k]:
        return f"host RAM: needs {format_bytes(int(results.host[k]))} of {format_bytes(host_limit)}"
    if not fits[k]:
        return f"over budget by {format_bytes(int(peak - (usable or 0)))}"
    return _slower(results.seconds[k] / results.seconds[chosen])


def _runners_up(ctx: _Context, composer: _Composer, results: _Results, chosen: int,
                verified: dict[int, tuple[float, Trace]], fits: np.ndarray, fits_host: np.ndarray, usable: int | None,
                host_limit: int | None) -> list[Candidate]:
    """Up to three faster candidates that do not fit and five slower ones that do, one of each family (the shape
    of the checkpointing, the loss, the optimizer, the micro-batch, ...), each with why it lost."""
    tokens_per_step = ctx.global_batch * ctx.seq_len
    seen = {_family(results.settings(chosen))}
    faster: list[Candidate] = []
    slower: list[Candidate] = []
    for k in results.order:
        k = int(k)
        if k == chosen:
            continue
        s = results.settings(k)
        family = _family(s)
        if family in seen:
            continue
        is_faster = results.seconds[k] < results.seconds[chosen]
        if not is_faster and not (fits[k] and fits_host[k]):
            continue  # slower and does not fit: nothing to learn from it
        group = faster if is_faster else slower
        if len(group) >= (3 if is_faster else 5):
            if len(slower) >= 5:
                break
            continue
        seen.add(family)
        peak = verified[k][0] if k in verified else float(results.peak[k])
        group.append(Candidate(s, int(peak), int(results.host[k]), float(results.seconds[k]),
                               tokens_per_step / float(results.seconds[k]), k in verified,
                               _why_lost(results, k, chosen, peak, fits, fits_host, usable, host_limit),
                               composer.host_link(s)))
    return faster + slower


def _reasons(ctx: _Context, results: _Results, chosen: int, peak: float, fits: np.ndarray, fits_host: np.ndarray,
             usable: int | None, host_limit: int | None) -> list[str]:
    """One line per decision: what was chosen, and what the best alternative to that one decision costs."""
    s = results.settings(chosen)
    budget_text = "no budget" if usable is None else f"the usable {format_bytes(usable)}"
    if results.explicit and not results.searched:  # nothing was searched: the set-up was given
        return [f"precision {ctx.precision}, checkpointing {s.checkpointing}, loss "
                f"{'chunked' if s.chunked_loss else 'whole'}, optimizer {s.optimizer_text}, micro-batch "
                f"{s.micro_batch_size} x {s.accumulation} accumulation (as asked: no search)",
                f"predicted peak {format_bytes(int(peak))} per rank (a full estimate of this set-up) within "
                f"{budget_text}"]
    seconds = results.seconds[chosen]

    def alternative(mask: np.ndarray, what: str) -> str:
        best_fit = results.first(mask & fits)
        if best_fit is not None:
            return f"{what} would be {_slower(results.seconds[best_fit] / seconds)}"
        smallest = int(np.flatnonzero(mask)[np.argmin(results.peak[mask])]) if mask.any() else None
        if smallest is None:
            return ""
        if not fits_host[smallest] and (usable is None or results.peak[smallest] <= usable):
            return f"{what} would need {format_bytes(int(results.host[smallest]))} of host RAM"
        return f"{what} would peak at {format_bytes(int(results.peak[smallest]))} at least, over {budget_text}"

    same = {name: results.column(name) == getattr(s, name) for name in
            ("micro_batch_size", "chunked_loss", "optimizer", "distribution", "compile", "flavor")}
    keep_all = (results.offload == 0) & (results.recompute == 0)
    reasons = [f"precision {ctx.precision} (requested)"]
    n_recompute, n_offload = s.blocks.count("recompute"), s.blocks.count("offload")
    others = same["micro_batch_size"] & same["chunked_loss"] & same["optimizer"] & same["distribution"] & \
        same["compile"]
    if n_recompute == n_offload == 0:
        reasons.append(f"checkpointing none, because: keeping every activation fits {budget_text} and recomputing "
                       "or offloading a block only costs time")
    else:
        fewer = others & same["flavor"] & (results.offload + results.recompute < n_recompute + n_offload)
        what = {"full": "recomputed", "selective": "recomputed selectively (matmul and attention outputs kept)",
                "offload-inputs": "recomputed, their inputs in pinned host memory"}[s.flavor]
        parts = [f"{n_recompute} of {len(s.blocks)} blocks {what}" if n_recompute else "",
                 f"{n_offload} with every activation in pinned host memory" if n_offload else ""]
        why = alternative(others & keep_all, "keeping every block's activations")
        fewest = alternative(fewer & ~keep_all, "fewer blocks") if fewer.any() else ""
        reasons.append(f"checkpointing: {', '.join(p for p in parts if p)}, because: {why}"
                       + (f"; {fewest}" if fewest else ""))
    if ctx.chunkable:
        other = alternative(~same["chunked_loss"], "the whole-logits loss" if s.chunked_loss else "the chunked loss")
        reasons.append(("loss 1024 tokens of logits at a time (chunked)" if s.chunked_loss else
                        "loss on the whole logits") + (f", because: {other}" if other else ""))
    else:
        reasons.append("loss on the whole logits: memtrain does not chunk this model's loss")
    names = {"device": "AdamW on the device",
             "offload": "AdamW on the CPU (CPUOffloadOptimizer: fp32 master and state in host RAM)",
             "offload-bf16-weights": "AdamW on the CPU with bf16 weights on the device (fp32 master in host RAM)"}
    placement, state = results.column("optimizer"), results.column("state_precision")
    in_backward, fraction = results.column("step_in_backward"), results.column("offload_fraction")
    plain = (placement == "device") & (state == "fp32") & (in_backward == False) & (fraction == 0)  # noqa: E712
    text = names[s.optimizer]
    details = [f"{s.state_precision} moments ({ {'bf16': 4, 'int8': 2}[s.state_precision]} bytes/param, not 8)"
               if s.state_precision != "fp32" else "",
               ("each parameter stepping in backward, its gradient freed at once"
                + (" (one backward pass: clipped by the previous step's norm, the first step unclipped)"
                   if ctx.grad_clip else "")) if s.step_in_backward else "",
               f"{100 * s.offload_fraction:.0f}% of the state in host RAM" if s.offload_fraction else ""]
    if any(details):
        text += " with " + ", ".join(d for d in details if d)
    elif s.optimizer == "device":
        text += " (fused, fp32 moments)"
    alternatives = []
    if not plain[chosen]:
        alternatives.append(alternative(plain, "fused fp32 AdamW on the device"))
    alternatives += [alternative(placement == o, names[o].split(" (")[0]) for o in names
                     if o != s.optimizer and o != "device" and (placement == o).any()]
    if plain[chosen] and (~plain & (placement == "device")).any():
        alternatives.append(alternative(~plain & (placement == "device"), "a leaner device optimizer"))
    alternatives = [a for a in alternatives if a]
    reasons.append(f"optimizer {text}"
                   + (f", because: {'; '.join(alternatives)}" if alternatives else
                      ("" if ctx.device == "cuda" else ": on a CPU an offload only copies within RAM")))
    per_rank = ctx.global_batch // ctx.world
    other = alternative(~same["micro_batch_size"], "a smaller micro-batch" if s.micro_batch_size == per_rank else
                        "another micro-batch")
    reasons.append(f"micro-batch {s.micro_batch_size} x {s.accumulation} accumulation = {per_rank} examples per "
                   f"rank per step" + (f", because: {other}" if other else ""))
    if ctx.world > 1:
        other = alternative(~same["distribution"], "FSDP2" if s.distribution == "ddp" else "DDP")
        reasons.append(f"{'DDP' if s.distribution == 'ddp' else 'FSDP2'} over {ctx.world} ranks"
                       + (f", because: {other}" if other else " (as asked)"))
    if s.compile or (~same["compile"]).any():
        other = alternative(~same["compile"], "eager" if s.compile else "torch.compile")
        per_block = s.compile and ("offload" in s.blocks or (s.flavor == "offload-inputs" and "recompute" in s.blocks))
        reasons.append(("torch.compile" if s.compile else "eager")
                       + (" block by block (the blocks offload activations: the offloader stays outside the compiled "
                          "regions, and the embeddings, last norm, head and loss run eager)" if per_block else "")
                       + (f", because: {other}" if other else ""))
    reasons.append(f"predicted peak {format_bytes(int(peak))} per rank (a full estimate of this set-up) within "
                   f"{budget_text}")
    return reasons


def _flops(rate: float) -> str:
    return f"{rate / 1e12:.1f} TFLOP/s" if rate >= 1e12 else f"{rate / 1e9:.1f} GFLOP/s"


def _assumptions(ctx: _Context, margin: float, composer: _Composer, host_limit: int | None) -> list[str]:
    dev = ctx.device_profile
    out = [
        f"device figures: {dev.source}: matmuls {_flops(dev.matmul_flops)} (half of it at "
        f"{dev.half_efficiency_tokens:.0f} tokens), attention {_flops(dev.attention_flops)}, memory "
        f"{dev.memory_bandwidth / 1e9:.1f} GB/s, {dev.op_overhead_s * 1e6:.1f} us per op, host link "
        f"{dev.host_to_device / 1e9:.1f} GB/s, CPU AdamW {dev.cpu_adamw / 1e9:.2f} G params/s",
        f"safety margin {100 * margin:.0f}% of the budget for the allocator's fragmentation",
        "the runners-up's peaks are composed from per-block profiles (marked *); the chosen peak is a full estimate",
        "step time: matmul and attention FLOPs at the rates above, other ops by their memory traffic, a fixed cost "
        "per op; offloaded activations queue on the host link; the offloaded optimizer steps after backward",
    ]
    if ctx.world > 1:
        gathered = "in bf16 " if fsdp2_param_dtype(ctx.precision) == torch.bfloat16 else ""
        out.append("distributed memory by formula on a one-process estimate: DDP's gradients are views into its "
                   "all-reduce buckets (a second copy while accumulating); FSDP2 shards parameters and optimizer "
                   f"state (gradients too without accumulation), two blocks gathered {gathered}at a time, "
                   f"gradients reduced in fp32; host RAM is one node's ({_ranks_per_node(ctx.world)} ranks)")
    if host_limit is None:
        out.append("host RAM not checked (planned for another machine): pass host_budget to check it")
    out.append("compiled set-ups: memory as eager (compiled graphs keep no more), elementwise traffic halved, a "
               "tenth of the per-op overhead; where blocks offload activations only the blocks are compiled "
               "(compile_model), the code around them (embeddings, last norm, head, loss) is timed eager")
    traces = sum(p.traces for p in composer.profiles.values())
    out.append(f"profiles from {traces} traced steps")
    return out


def _raise_nothing_fits(ctx: _Context, composer: _Composer, results: _Results,
                        verified: dict[int, tuple[float, Trace]], budget_bytes: int | None, usable: int | None,
                        host_limit: int | None, host_budget: int | None, margin: float, fits_host: np.ndarray) -> None:
    """The ConfigError when no candidate fits: the smallest peak found, and what would make a plan fit."""
    assert usable is not None or host_limit is not None
    if results.explicit and not results.searched:
        s = results.settings(0)
        peak = verified[0][0] if 0 in verified else float(results.peak[0])
        where = (f"needs {format_bytes(int(results.host[0]))} of host RAM, more than {format_bytes(host_limit)}"
                 if not fits_host[0] else f"peaks at {format_bytes(int(peak))} per rank, over the usable "
                 f"{format_bytes(usable)} ({format_bytes(budget_bytes)} less the {100 * margin:.0f}% margin)")
        raise ConfigError(
            f"the set-up asked for (micro-batch {s.micro_batch_size}, checkpointing {s.checkpointing}, loss "
            f"{'chunked' if s.chunked_loss else 'whole'}, optimizer {s.optimizer_text}) {where}. To resolve this error, "
            "leave the choices to the plan (drop the fixed micro-batch or techniques), or raise the budget.")
    peaks = results.peak.copy()
    for k, (p, _) in verified.items():
        peaks[k] = p
    k = int(np.argmin(peaks))
    s = results.settings(k)
    fits_device = peaks <= usable if usable is not None else np.ones(len(peaks), bool)
    hints = []
    if fits_device.any():
        least = float(results.host[fits_device].min())
        hints.append(f"more host RAM: the set-ups that fit the device need {format_bytes(int(least))} of host memory "
                     f"or more, beyond the {format_bytes(host_limit)} "
                     f"{'of host_budget' if host_budget is not None else 'available now'}")
    else:
        assert usable is not None
        prof = composer.profile(s.optimizer)
        shards = ctx.world if s.distribution == "fsdp2" else 1  # the smallest peak's model state is per rank
        weights = prof.parameter_bytes / (2 if s.optimizer == "offload-bf16-weights" else 1) / shards
        state = weights + (0 if s.optimizer != "device" else
                           (prof.adamw_state_bytes + prof.trainable_bytes) / shards)
        if ctx.device == "cuda":
            # FSDP2 shards parameters, gradients and optimizer state; the activations of a rank stay.
            full = prof.parameter_bytes + prof.adamw_state_bytes + prof.trainable_bytes
            room = usable - (peaks[k] - state) - 2 * _gathered_block_bytes(ctx, prof)
            if room > 0:  # more ranks cannot shrink a rank's activations
                ranks = max(math.ceil(full / room), ctx.world + 1)
                hints.append(f"FSDP2 over at least {ranks} GPUs (memtrain plan --nproc N --fsdp: parameters, "
                             "gradients and optimizer state sharded over the ranks)")
        activations = peaks[k] - state
        if weights < usable:
            if activations > usable - state:  # not a length: the activations are not linear in it (fixed buffers)
                hints.append(f"a shorter sequence (at seq_len {ctx.seq_len} a micro-batch of "
                             f"{s.micro_batch_size} needs {format_bytes(int(activations))} beside the model state's "
                             f"{format_bytes(int(state))})")
        else:
            hints.append(f"a larger budget: the weights alone take {format_bytes(int(weights))} on the device")
        if not hints:
            hints.append(f"a larger budget: a micro-batch of {s.micro_batch_size} alone needs "
                         f"{format_bytes(int(activations))} beside the model state")
    raise ConfigError(
        f"no set-up fits: the smallest predicted peak is {format_bytes(int(peaks[k]))} per rank (micro-batch "
        f"{s.micro_batch_size}, checkpointing {s.checkpointing}, loss {'chunked' if s.chunked_loss else 'whole'}, "
        f"optimizer {s.optimizer_text}{'' if fits_host[k] else ', more host RAM than there is'})"
        + (f", but the budget {format_bytes(budget_bytes)} less the {100 * margin:.0f}% safety margin leaves "
           f"{format_bytes(usable)}" if usable is not None else "")
        + f". To resolve this error, try {'; or '.join(hints)}."
    )


# -- apply_plan ---------------------------------------------------------------------------------------------
@dataclass
class PlannedRun:
    """What ``apply_plan`` set up: the model (configured in place), the module the loop calls (wrapped for
    DDP/FSDP2 and compiled as planned), the optimizer, the accumulator and the precision."""

    settings: PlanSettings
    model: nn.Module
    train_model: nn.Module
    optimizer: torch.optim.Optimizer
    accumulator: Any  # GradientAccumulator
    precision: Any  # MixedPrecision
    blocks: list[str] = field(default_factory=list)


def apply_plan(model: nn.Module, plan: Plan | PlanSettings, *, lr: float = 3e-4,
               betas: tuple[float, float] = (0.9, 0.95), weight_decay: float = 0.0,
               max_grad_norm: float | None = 1.0,
               scheduler: Callable[[torch.optim.Optimizer], Any] | None = None) -> PlannedRun:
    """Configures ``model`` in place as ``plan`` says and builds the optimizer and accumulator it asks for.

    In order: checkpointing (per-block policies, selective, offloaded inputs), the chunked loss, an offloaded
    optimizer (``CPUOffloadOptimizer``, which takes the fp32 master and then makes the device weights bf16 where
    the plan says), DDP (each gradient a view into its all-reduce bucket) or FSDP2 (blocks gathered in
    ``fsdp2_param_dtype``, gradients reduced in fp32), ``torch.compile``, a device optimizer
    (``torch.optim.AdamW(fused=True)`` or ``memtrain.optim.build_optimizer``'s lean variants), the
    ``GradientAccumulator``.

    Args:
        model: the model the plan was made for, on its training device.
        plan: from ``plan(...)``.
        lr, betas, weight_decay: AdamW's hyper-parameters.
        max_grad_norm: clipping in the accumulator's step (None: none).
        scheduler: builds an LR scheduler from the optimizer (e.g. ``lambda o: LambdaLR(o, f)``).

    Raises:
        ConfigError: the model does not match the plan (other blocks), or the plan needs torch.distributed
            initialised with ``plan.world_size`` ranks.
    """
    from memtrain.accumulation import GradientAccumulator
    from memtrain.precision import MixedPrecision

    s = plan.settings if isinstance(plan, Plan) else plan
    names = _check_blocks(model, s, plan.block_names if isinstance(plan, Plan) else None)
    device = next(model.parameters()).device
    precision = MixedPrecision(s.precision, device.type)  # type: ignore[arg-type]
    wrapped = configure_model(model, s)
    train_model: nn.Module = model
    world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
    if (s.distribution == "none") != (world == 1):
        raise ConfigError(f"apply_plan: the plan's distribution is {s.distribution!r}, and this process group has "
                          f"{world} rank(s). To resolve this error, plan with world_size equal to torchrun's "
                          "--nproc_per_node.")
    hyper = {"lr": lr, "betas": betas, "weight_decay": weight_decay}
    # An offloaded optimizer before DDP (which buckets the weights as they are): it may cast them to bf16. A device
    # optimizer after FSDP2, whose sharded parameters it must hold.
    optimizer = _planned_optimizer(model, s, precision, world, hyper) if s.optimizer != "device" else None
    if s.distribution == "fsdp2":
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        # bf16-mixed: blocks gathered (and computed) in bf16, gradients reduce-scattered in fp32 into the fp32
        # shards the optimizer steps; autocast still runs the fp32 ops (norms, softmax, the loss) in fp32.
        gathered = fsdp2_param_dtype(s.precision)
        policy = MixedPrecisionPolicy(param_dtype=gathered, reduce_dtype=torch.float32 if gathered else None)
        modules = dict(model.named_modules())
        for name in names:
            fully_shard(modules[name], mp_policy=policy)
        fully_shard(model, mp_policy=policy)
    elif s.distribution == "ddp":
        ids = [device.index] if device.type == "cuda" else None
        # Each p.grad is a view into DDP's all-reduce bucket: one copy of the gradients, not two.
        train_model = nn.parallel.DistributedDataParallel(model, device_ids=ids, gradient_as_bucket_view=True)
    if s.compile:
        from memtrain.checkpointing import compile_model

        # Per block where blocks offload their activations (saved-tensor hooks cannot be traced), else whole.
        train_model = compile_model(train_model)
    if optimizer is None:
        optimizer = _planned_optimizer(model, s, precision, world, hyper)
    accumulator = GradientAccumulator(train_model, optimizer, steps=s.accumulation, scaler=precision.scaler,
                                      scheduler=scheduler(optimizer) if scheduler is not None else None,
                                      max_grad_norm=max_grad_norm)
    return PlannedRun(settings=s, model=model, train_model=train_model, optimizer=optimizer, accumulator=accumulator,
                      precision=precision, blocks=wrapped)


def configure_model(model: nn.Module, settings: PlanSettings) -> list[str]:
    """The model's part of ``apply_plan``, in place: checkpointing per block (recompute / offload, the
    flavor), the chunked loss, no KV cache. Undoes what an earlier plan set, so a re-plan calls it again.
    Returns the wrapped blocks' names.

    Raises:
        ConfigError: the model's blocks are not the plan's.
    """
    from memtrain.checkpointing import apply_checkpointing, remove_checkpointing
    from memtrain.loss import apply_chunked_loss, remove_chunked_loss

    names = _check_blocks(model, settings, None)
    wrapped: list[str] = []
    if settings.blocks:  # no blocks detected: checkpointing the user applied by hand stays
        remove_checkpointing(model)
    if "recompute" in settings.blocks or "offload" in settings.blocks:
        wrapped = apply_checkpointing(
            model, policies=settings.policies(names),
            selective=("matmul", "attention") if settings.flavor == "selective" else None,
            offload=settings.flavor == "offload-inputs")
    remove_chunked_loss(model)
    if settings.chunked_loss:
        apply_chunked_loss(model)
    config = getattr(model, "config", None)
    if getattr(config, "use_cache", False):
        config.use_cache = False  # a KV cache only holds memory in training (the plan's estimate has none)
    return wrapped


def _check_blocks(model: nn.Module, s: PlanSettings, planned: tuple[str, ...] | None) -> list[str]:
    from memtrain.checkpointing import find_blocks

    names = find_blocks(model)
    if len(names) != len(s.blocks) or (planned is not None and tuple(names) != planned):
        raise ConfigError(f"apply_plan: the model's {len(names)} blocks {names[:3]}... are not the plan's "
                          f"{len(s.blocks)} (made for another model). To resolve this error, plan this model.")
    return names


def _planned_optimizer(model: nn.Module, s: PlanSettings, precision: Any, world: int,
                       hyper: dict[str, Any]) -> torch.optim.Optimizer:
    """AdamW as the plan places it, over the parameters that require grad (a LoRA model's adapters)."""
    trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    if s.optimizer == "device" and s.state_precision == "fp32" and not s.step_in_backward and not s.offload_fraction:
        # fused: one kernel per step (CUDA and CPU), and the same kernel CPUOffloadOptimizer runs on the host.
        return torch.optim.AdamW([p for _, p in trainable], fused=True, **hyper)
    if s.optimizer == "device":
        from memtrain.optim import build_optimizer

        return build_optimizer(trainable, state_precision=s.state_precision, offload_fraction=s.offload_fraction,
                               step_in_backward=s.step_in_backward, grad_scaler=precision.scaler,
                               world_size=world, **hyper)
    from memtrain.optim_offload import CPUOffloadOptimizer

    # NOTE: under DDP, gradients stay on the device until the step: DDP averages them after the hooks that would
    # have copied them to the host. In one process they stream to the host during backward.
    # offload-bf16-weights: the fp32 master takes the weights' full digits, then the device copy becomes bf16.
    bf16 = torch.bfloat16 if s.optimizer == "offload-bf16-weights" else None
    return CPUOffloadOptimizer(trainable, offload_gradients=world == 1, grad_scaler=precision.scaler,
                               device_dtype=bf16, **hyper)


__all__ = ["Candidate", "DeviceProfile", "Fixed", "Plan", "PlanSettings", "PlannedRun", "apply_plan", "budget_bytes",
           "calibrate", "configure_model", "device_profile", "fsdp2_param_dtype", "known_gpu", "plan", "predictions"]
