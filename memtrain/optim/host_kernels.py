"""Fused host AdamW steps: one C++ pass over memory per element for the lean moments and pure bf16.

Trade-off: torch's per-op CPU path moves every element through memory once per op (BF16StateAdamW's passes are
five multi-tensor ops, about 92 bytes a parameter; bitsandbytes' CPU 8-bit step dequantises whole pieces to fp32 and
back), so the host step, the bottleneck of an offloaded optimizer, ran at 0.03-0.11x of torch's fused fp32 AdamW
while its moments are smaller. ``csrc/host_adamw.cpp`` reads and writes each element once (20 bytes a parameter with
bf16 moments, 16 with int8, 14 for pure bf16), on torch's intra-op threads, vectorised by the compiler. The price is
a compiler at first use: the kernel is built by ``torch.utils.cpp_extension`` (g++ and ninja, about 20 s once) and
cached in torch's extension folder; where that fails, the optimizers keep their multi-tensor path and one warning
says why (``kernel_status``). ``MEMTRAIN_HOST_KERNELS=0`` turns the kernels off.

Numerics: torch's fused AdamW arithmetic in fp32 (bitsandbytes' for the 8-bit state, with its absmax block scale
and nearest-code rounding); every bf16 value written is rounded stochastically with counter-based noise, so a step is
a function of its inputs and its keys: any thread split gives the same bits and a resumed run rounds as the straight
one. ``benchmarks/bench_host_step.py`` (``memtrain bench host_step``) times them beside torch's fused fp32 AdamW.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from memtrain.device import active_simulation

logger = logging.getLogger(__name__)

_SOURCE = Path(__file__).resolve().parent / "csrc" / "host_adamw.cpp"
# Compiler flags per torch's CPU capability: the kernel is built for this machine's vector width (and named after
# it, so that a home folder shared by different machines keeps one build per width).
_ARCH_FLAGS = {
    "AVX512": ["-mavx2", "-mfma", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mprefer-vector-width=512"],
    "AVX2": ["-mavx2", "-mfma"],
}
_lock = threading.Lock()
_module: Any = None
_reason: str | None = None  # why the kernels are off, once a build was tried
_off = False  # inside multi_tensor_path


def kernel_status() -> tuple[bool, str]:
    """(whether the fused host kernels run, a one-line reason): builds them at the first call."""
    module = _load()
    if module is not None:
        return True, f"fused host kernels built for {_capability()} ({_SOURCE.name})"
    return False, _reason or "not built"


@contextmanager
def multi_tensor_path() -> Iterator[None]:
    """Within it, host steps take the optimizers' multi-tensor path, the one a GPU runs: benchmarks time the two
    side by side, and tests count that path's ops on the CPU."""
    global _off
    before, _off = _off, True
    try:
        yield
    finally:
        _off = before


def runs_fused(p: torch.Tensor) -> bool:
    """Whether ``p``'s AdamW step takes the fused host kernel: a plain host tensor (not the simulated device's memory,
    which steps as a GPU would; not a tensor subclass such as FSDP2's DTensor shards, whose storage the kernels
    cannot address: they take torch's multi-tensor ops), the kernels built, and not inside ``multi_tensor_path``."""
    if _off or p.device.type != "cpu" or type(p) not in (torch.Tensor, torch.nn.Parameter):
        return False
    sim = active_simulation()
    if sim is not None and sim.holds(p):
        return False
    return _load() is not None


def expected() -> bool:
    """Whether host steps will take the fused kernels, without building them (the memory model's question): not
    turned off, and no build has failed in this process."""
    return not _off and _reason is None and os.environ.get("MEMTRAIN_HOST_KERNELS", "1") != "0"


def kernels() -> Any:
    """The built extension (``adamw_lean_``, ``adamw_int8_``); call ``runs_fused`` first."""
    module = _load()
    assert module is not None, "memtrain.optim.host_kernels.kernels() before runs_fused()"
    return module


def _capability() -> str:
    try:
        return torch.backends.cpu.get_cpu_capability()
    except (AttributeError, RuntimeError):
        return "DEFAULT"


def _load() -> Any:
    global _module, _reason
    if _module is not None or _reason is not None:
        return _module
    with _lock:
        if _module is not None or _reason is not None:
            return _module
        if os.environ.get("MEMTRAIN_HOST_KERNELS", "1") == "0":
            _reason = "MEMTRAIN_HOST_KERNELS=0: the multi-tensor host step runs"
            return None
        try:
            _module = _build()
        except Exception as e:  # noqa: BLE001 - any build failure: say why once, keep the multi-tensor path
            lines = str(e).strip().splitlines() or [type(e).__name__]
            first = next((line for line in lines if "error:" in line), lines[-1]).strip()[:200]  # the compiler's
            _reason = (f"the fused host AdamW kernels could not be built ({type(e).__name__}: {first}); the host "
                       "step runs torch's multi-tensor ops, several times slower. To resolve this, install g++ and "
                       "ninja (pip install ninja), or set MEMTRAIN_HOST_KERNELS=0 to silence this")
            logger.warning("memtrain: %s", _reason)
    return _module


def _build() -> Any:
    from torch.utils import cpp_extension

    capability = _capability()
    flags = ["-O3", "-fopenmp", "-fno-math-errno", "-ffp-contract=off", *_ARCH_FLAGS.get(capability, [])]
    # ninja installed by pip lands beside the interpreter, which need not be on PATH (a venv run without activating).
    bin_dir = str(Path(sys.executable).parent)
    path = os.environ.get("PATH", "")
    if bin_dir not in path.split(os.pathsep):
        os.environ["PATH"] = bin_dir + os.pathsep + path
    # Named after the source's digest: two checkouts (or versions) of memtrain never rebuild each other's kernel;
    # and built in a folder of this torch's: two torches (two venvs) never rebuild each other's either.
    digest = hashlib.sha256(_SOURCE.read_bytes()).hexdigest()[:10]
    name = f"memtrain_host_adamw_{capability.lower()}_{digest}"
    root = Path(os.environ.get("TORCH_EXTENSIONS_DIR") or Path.home() / ".cache" / "torch_extensions")
    build = root / ("torch-" + re.sub(r"[^0-9A-Za-z.]+", "_", torch.__version__)) / name
    build.mkdir(parents=True, exist_ok=True)
    _clear_stale_lock(build / "lock")
    return cpp_extension.load(name=name, sources=[str(_SOURCE)], extra_cflags=flags, extra_ldflags=["-fopenmp"],
                              build_directory=str(build), verbose=False)


STALE_LOCK_S = 600  # a build takes about a minute: a lock this old was left by a process killed while building


def _clear_stale_lock(lock: Path) -> None:
    """Removes the build's lock where the process that took it died while building (a kill -9, an out-of-memory
    kill): torch's build waits for a lock to go away, forever, and knows no owner to check."""
    try:
        age = time.time() - lock.stat().st_mtime
    except FileNotFoundError:
        return
    if age > STALE_LOCK_S:
        logger.warning("memtrain: removing %s, left %.0f s ago by a build of the host kernels that did not finish "
                       "(its process was killed)", lock, age)
        lock.unlink(missing_ok=True)


def as_flag(t: torch.Tensor | None) -> torch.Tensor | None:
    """A scale or inf flag as the kernels read it: a one-element fp32 host tensor (or None)."""
    return t if t is None or t.dtype == torch.float32 else t.float()


def hyperparameters(group: dict[str, Any]) -> tuple[float, ...]:
    """The kernels' hyper-parameter arguments (lr, beta1, beta2, eps, weight_decay) from an optimizer's group."""
    beta1, beta2 = group["betas"]
    return float(group["lr"]), float(beta1), float(beta2), float(group["eps"]), float(group["weight_decay"])


def step_int8(p: torch.Tensor, state: dict[str, Any], config: dict[str, Any]) -> None:
    """A host tensor's 8-bit AdamW step in one fused pass: bitsandbytes' arithmetic and state layout (``state``, its
    step count already advanced; ``config`` from its ``get_config``), each block decoded, stepped and encoded to the
    nearest code once."""
    _, table1 = code_tables(state["qmap1"])
    _, table2 = code_tables(state["qmap2"])
    beta1, beta2 = config["betas"][:2]
    kernels().adamw_int8_(p.data, p.grad.contiguous(), state["state1"], state["state2"], state["absmax1"],
                          state["absmax2"], state["qmap1"], state["qmap2"], table1, table2,
                          float(config["lr"]), float(beta1), float(beta2), float(config["eps"]),
                          float(config["weight_decay"]), float(state["step"]))


# -- the 8-bit state's code books -----------------------------------------------------------------------------
# id(code book) -> (the code book, its version, midpoints, table): a step reads the tables of its optimizer's two code
# books (bitsandbytes shares them between parameters) with no op dispatched.
_CODE_TABLES: dict[int, tuple[torch.Tensor, int, torch.Tensor, torch.Tensor]] = {}


def code_tables(qmap: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(256 midpoints, the last +inf; a 65,536-entry int64 table) of a sorted 256-entry code book, for the kernel's
    nearest-code encoding: the table maps a value's top 16 bits to the lowest code any value with those bits can be
    nearest to (low 32 bits) and the midpoint above it (its fp32 bits, high 32 bits); one comparison with that
    midpoint then decides. Cached per code book.

    Raises:
        ValueError: a code book with two midpoints inside one 16-bit interval of [-1, 1] (bitsandbytes' dynamic
            maps have none): the kernel would round some values to a farther code.
    """
    cached = _CODE_TABLES.get(id(qmap))
    if cached is not None and cached[0] is qmap and cached[1] == qmap._version:
        return cached[2], cached[3]
    code = qmap.detach().to("cpu", torch.float32).contiguous()
    bounds = torch.cat([(code[:-1] + code[1:]) / 2, torch.tensor([float("inf")])])  # +inf: nothing above the last
    top = torch.arange(1 << 16, dtype=torch.int64)
    low = (top << 16).to(torch.int32).view(torch.float32)  # the interval's end nearer to zero
    high = ((top << 16) | 0xFFFF).to(torch.int32).view(torch.float32).clamp(-1, 1)  # the end farther from it
    inside = low.abs() <= 1  # intervals of values the kernel encodes (x / absmax is clamped to [-1, 1])
    ends = torch.stack([torch.bucketize(low, bounds[:-1]), torch.bucketize(high, bounds[:-1])])
    first, last = ends.min(dim=0).values, ends.max(dim=0).values
    if bool(((last - first > 1) & inside).any()):
        raise ValueError("a code book with midpoints closer than a bf16 interval: the fused 8-bit step needs "
                         "bitsandbytes' dynamic maps")
    code_of = first.where(inside, torch.zeros_like(first))
    above = bounds.view(torch.int32).to(torch.int64) & 0xFFFFFFFF  # each midpoint's bits, as an unsigned 32-bit value
    table = (code_of | (above[code_of] << 32)).contiguous()
    _CODE_TABLES[id(qmap)] = (qmap, qmap._version, bounds, table)
    return bounds, table
