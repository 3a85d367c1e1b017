"""The device the cost model prices a step on: ``DeviceProfile``, the table of known GPUs, and the calibration
probe (cached per device) behind ``calibrate`` and ``device_profile``.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import platform
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from memtrain.device import Accelerator, accelerator, active_simulation
from memtrain.errors import ConfigError
from memtrain.files import atomic_write_bytes
from memtrain.measure import available_host_bytes
from memtrain.message import words
from memtrain.optim import cpu_step_rate


# -- the device ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class DeviceProfile:
    """What the cost model needs to know of a machine: rates, each in its own unit.

    Matmul time is ``flops / (matmul_flops * m / (m + half_efficiency_tokens))`` for ``m`` tokens per matmul,
    memory-bound work ``bytes / memory_bandwidth``, and every operator call costs ``op_overhead_s``.
    """

    name: str
    matmul_flops: float  # FLOP/s of large matmuls in the compute dtype (a CPU probe: fp32; see matmul_flops_bf16)
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
    cpu_adamw_pure: float | None = None  # ... of pure bf16 (bf16 weights, no master, bf16 moments)
    # FLOP/s of the same matmuls in bf16 and fp16, where matmul_flops is fp32's (a CPU probe): a CPU without AMX
    # runs them slower than fp32 (converted to fp32 inside), one with AMX faster. None: matmul_flops is already the
    # 16-bit rate (a GPU's table or probe, bf16) or was not measured.
    matmul_flops_bf16: float | None = None
    matmul_flops_fp16: float | None = None
    # Bytes/s of elementwise work in bf16 and fp16 on a CPU: about fp32's time per element (its kernels compute in
    # fp32), so about half fp32's bytes/s, where a GPU's halves the time with the bytes. None: as memory_bandwidth.
    memory_bandwidth_bf16: float | None = None
    memory_bandwidth_fp16: float | None = None

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def for_precision(self, precision: str) -> DeviceProfile:
        """The figures of a step computed under ``precision``: its matmuls at the rate measured in its 16-bit
        dtype where the profile has one (a CPU's), else as they are."""
        rates = {"bf16-mixed": (self.matmul_flops_bf16, self.memory_bandwidth_bf16),
                 "fp16-mixed": (self.matmul_flops_fp16, self.memory_bandwidth_fp16)}.get(precision, (None, None))
        return dataclasses.replace(self, matmul_flops=rates[0] or self.matmul_flops,
                                   memory_bandwidth=rates[1] or self.memory_bandwidth) if any(rates) else self


# Known GPUs: bf16 dense tensor-core FLOP/s from the vendor's datasheet, HBM bandwidth, pinned host-link bandwidth
# (PCIe 5: 55 GB/s measured on an H200, docs/design.md "Host ceilings"; PCIe 4: 25 GB/s), NVLink bus
# bandwidth for all-reduce (PCIe-only cards: about 20 GB/s). The fractions of them that eager PyTorch reaches
# (matmuls 60%, attention 45%, elementwise 70%) are fitted to docs/design.md's H200 anchors for the 1.1B Llama
# (no savings 45.4k tokens/s, Hugging Face checkpointing 36.5k, torch.compile 56.5k):
# `python benchmarks/bench_plan.py --anchors` prints the predictions.
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
    from the H200 host of docs/design.md's "Host ceilings" (4.2 G params/s on 16 threads).

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
                      "memtrain plan --calibrate on that machine (a few seconds of probes, cached), "
                      f"{words('or pass device_profile=.', 'or pass --gpu with one of the names it knows')}")


def _cache_path() -> Path:
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(root) / "memtrain" / "calibration.json"


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)

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

    Under a simulated device (``MEMTRAIN_SIMULATED_DEVICE``) a CUDA device is that device: this CPU's rates with the
    simulated capacity.

    Raises:
        ConfigError: a CUDA device asked for where torch sees none.
    """
    device = torch.device(device)
    simulation = active_simulation() if device.type == "cuda" else None
    if simulation is not None:
        cpu = calibrate("cpu", cache=cache, refresh=refresh)
        return dataclasses.replace(
            cpu, name=f"simulated device on {cpu.name}", memory_bytes=simulation.total_memory,
            source=f"simulated device ({simulation.total_memory} bytes; MEMTRAIN_SIMULATED_DEVICE) with this CPU's "
                   f"rates: {cpu.source}")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError("calibrate(device='cuda'), but torch sees no CUDA device. To resolve this error, run it on "
                          "the GPU machine, or plan with the table of known GPUs "
                          f"{words('(device_profile=None)', '(memtrain plan --gpu NAME)')}.")
    name = _device_name(device)
    key = f"{name} | torch {torch.__version__}"
    path = _cache_path()
    if cache and not refresh and path.is_file():
        try:
            cached = json.loads(path.read_text()).get(key)
            # A CPU's figures cached before its 16-bit matmuls were measured would rate them as fp32's, and host
            # steps cached before the fused host kernels (no pure bf16 rate) several times too slow: probed again.
            if cached and (device.type != "cpu" or cached.get("matmul_flops_bf16")) and "cpu_adamw_pure" in cached:
                return DeviceProfile(**{**cached, "source": f"{cached.get('source', 'probe')}, cached in {path}"})
        except (OSError, ValueError, TypeError):
            pass  # an unreadable cache is measured again and rewritten
    # The probe draws random tensors: with the generators forked, a run that probes (a fresh machine) draws the same
    # dropout masks and data order as one that reads the cache (its resume after a kill).
    with torch.random.fork_rng(devices=[] if device.type == "cpu" else [device.index or 0],
                               device_type=device.type if device.type != "cpu" else "cuda"):
        profile = probe(device, name)
    if cache:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            entries = json.loads(path.read_text()) if path.is_file() else {}
            entries[key] = profile.to_dict()
            atomic_write_bytes(path, json.dumps(entries, indent=2).encode())
        except (OSError, ValueError):
            pass  # a read-only home: the figures are used, not kept
    return profile


def probe(device: torch.device, name: str) -> DeviceProfile:
    # The CPU's probe measures the CPU itself, simulated device or not: its own sizes, fp32, copies within RAM.
    acc = accelerator(device) if device.type != "cpu" else Accelerator()
    cuda = acc.has_streams
    sync = acc.synchronize
    dtype = torch.bfloat16 if cuda else torch.float32
    peak, half = _matmul_rate(device, dtype, sync)
    # A CPU's 16-bit matmuls, measured beside its fp32 ones: autocast runs them in bf16 (fp16), at a rate that is
    # the CPU's own (AMX: faster than fp32; AVX-512 without it: slower, converted to fp32 inside).
    half_rates = {} if cuda else {d: _half_matmul_rate(d) for d in (torch.bfloat16, torch.float16)}
    half_bandwidth = {}
    b, h, t, d = (4, 16, 2048, 128) if cuda else (1, 4, 512, 64)
    q = torch.randn(b, h, t, d, device=device, dtype=dtype)
    seconds = _timed(lambda: torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True), sync)
    attention = 4.0 * b * h * t * t * d * 0.5 / seconds
    big = torch.empty((1 << 28) if cuda else (1 << 24), device=device, dtype=torch.float32)
    seconds = _timed(lambda: big.add_(1.0), sync)
    bandwidth = 2 * big.numel() * 4 / seconds
    for half_dtype in half_rates:  # the same elementwise kernel in 16 bits, beside fp32's
        small = big[: big.numel() // 2].view(half_dtype)  # the same element count in the same memory
        half_bandwidth[half_dtype] = 2 * small.numel() * 2 / _timed(lambda small=small: small.add_(1.0), sync)
    # Per-op cost as a training step pays it: small ops recorded by autograd, forward and backward.
    tiny = torch.zeros(8, device=device, requires_grad=True)

    def chain() -> None:
        y = tiny
        for _ in range(200):
            y = y * 1.0001
        y.sum().backward()

    overhead = _timed(chain, sync) / 401  # 200 multiplies, their 200 backward ops, the sum's
    host = acc.pinned_empty((1 << 26) if cuda else (1 << 24), torch.uint8)
    if cuda:
        dev = torch.empty_like(host, device=device)
        h2d = host.numel() / _timed(lambda: acc.copy_(dev, host), sync)
        d2h = host.numel() / _timed(lambda: acc.copy_(host, dev), sync)
    else:  # the "device" is the host: an offload is a copy within RAM
        other = torch.empty_like(host)
        h2d = d2h = host.numel() / _timed(lambda: other.copy_(host), sync)
    n = 1 << 22
    p = torch.zeros(n, requires_grad=True)
    p.grad = torch.randn(n)
    adam = torch.optim.AdamW([p], lr=1e-3, fused=True)
    cpu_adamw = n / _timed(adam.step, lambda: None)

    lean = {}
    for precision in ("bf16", "int8"):
        try:
            lean[precision] = cpu_step_rate(precision, n_params=1 << 20)
        except ConfigError:
            lean[precision] = None  # int8 without bitsandbytes: not a candidate anyway
    lean["pure"] = cpu_step_rate("bf16", n_params=1 << 20, pure_bf16=True)
    host_copy = torch.empty(n)
    host_bandwidth = 2 * n * 4 / _timed(lambda: host_copy.copy_(p.grad), lambda: None)
    table = None
    if cuda:
        try:
            table = known_gpu(name)
        except ConfigError:
            table = None
    memory = acc.total_memory if cuda else available_host_bytes()
    return DeviceProfile(name=name, matmul_flops=peak, half_efficiency_tokens=half, attention_flops=attention,
                         memory_bandwidth=bandwidth, op_overhead_s=overhead, host_to_device=h2d, device_to_host=d2h,
                         cpu_adamw=cpu_adamw, host_bandwidth=host_bandwidth,
                         interconnect=table.interconnect if table is not None else (20e9 if cuda else 5e9),
                         memory_bytes=memory, source=_probe_source(), asynchronous=cuda, cpu_adamw_bf16=lean["bf16"],
                         cpu_adamw_int8=lean["int8"], cpu_adamw_pure=lean["pure"],
                         matmul_flops_bf16=half_rates.get(torch.bfloat16),
                         matmul_flops_fp16=half_rates.get(torch.float16),
                         memory_bandwidth_bf16=half_bandwidth.get(torch.bfloat16),
                         memory_bandwidth_fp16=half_bandwidth.get(torch.float16))


def _half_matmul_rate(dtype: torch.dtype) -> float | None:
    """A CPU's peak FLOP/s of 16-bit matmuls (None where this torch has no such CPU kernel). Sizes up to 2048 tokens:
    a CPU without 16-bit units runs them a few times slower than fp32, and the probe stays a few seconds."""
    try:
        return _matmul_rate(torch.device("cpu"), dtype, lambda: None, sizes=(128, 512, 2048))[0]
    except RuntimeError:
        return None


def _matmul_rate(device: torch.device, dtype: torch.dtype, sync: Callable[[], None],
                 sizes: tuple[int, ...] | None = None) -> tuple[float, float]:
    """(peak FLOP/s, tokens at which half of it is reached) of (m, dim) x (dim, dim) matmuls in ``dtype``."""
    cuda = device.type == "cuda"
    dim = 4096 if cuda else 1024
    weight = torch.randn(dim, dim, device=device, dtype=dtype)
    rates = []
    for m in sizes or ((512, 2048, 8192, 32768) if cuda else (128, 512, 2048, 8192)):
        x = torch.randn(m, dim, device=device, dtype=dtype)
        seconds = _timed(lambda x=x: x @ weight, sync, repeats=5)
        rates.append((m, 2.0 * m * dim * dim / seconds))
    # rate(m) = peak * m / (m + half) is 1/rate = 1/peak + (half/peak) / m: a straight line in 1/m, fitted by least
    # squares over the sizes (robust to one noisy size, unlike the largest rate alone).
    slope, intercept = np.polyfit([1.0 / m for m, _ in rates], [1.0 / r for _, r in rates], 1)
    if intercept > 0 and slope >= 0:
        return float(1.0 / intercept), float(slope / intercept)
    return max(r for _, r in rates), 0.0  # no size effect measurable: the best rate at any size


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


def planning_device(device: torch.device | str) -> str:
    """The planner's name for the device a run trains on: ``"cuda"`` for one with streams and an allocator (CUDA,
    ROCm, XPU, the simulated device of ``MEMTRAIN_SIMULATED_DEVICE``), ``"cpu"`` for the plain CPU."""
    return "cuda" if accelerator(torch.device(device)).has_streams else "cpu"


def device_profile(device: str | torch.device, *, calibrated: bool = False) -> DeviceProfile:
    """The figures a plan for ``device`` uses: a probe on the CPU (always) or with ``calibrated``, else the table
    of known GPUs for the CUDA device present (or, with no GPU here, an H100's: say which with
    ``device_profile=known_gpu(...)``). Under a simulated device a plan for ``"cuda"`` is a plan for it
    (``calibrate``: this CPU's rates, the simulated capacity)."""
    device = torch.device(device)
    if device.type == "cpu" or calibrated or (device.type == "cuda" and active_simulation() is not None):
        return calibrate(device)
    if torch.cuda.is_available():
        name = torch.cuda.get_device_name(device)
        return known_gpu(name, memory_bytes=torch.cuda.get_device_properties(device).total_memory)
    return known_gpu("NVIDIA H100 (assumed: no GPU on this machine)")
