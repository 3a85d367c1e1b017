"""The GPU-speed contract (docs/design.md), counted on the CPU: one figure per set-up the planner can choose.

No GPU is lent to most sessions, so what decides GPU speed is counted where it can be, on the CPU, and bounded
by ``tests/test_contract.py``:

(a) graph breaks under ``torch.compile`` caused by memtrain: the set-up is built by ``apply_plan`` with
    ``compile=True`` (``torch.compile`` forced to the ``aot_eager`` backend: the same Dynamo capture, no C++
    compiler), one step runs, and Dynamo's counters are read. Breaks caused by memtrain are those over the same
    model compiled with no technique (reason by reason); ``graphs`` 0 means the forward ran eager. Activation
    offload runs through a ``CpuTransport`` (``offload_activations`` is a no-op without CUDA): the same hooks.
    Bound: 0 breaks, at least one graph (or ``apply_plan`` refuses the pairing with a ``ConfigError``).
(b) host syncs per optimizer step on ``GradientAccumulator``'s path (every ``acc.backward`` of a 2-micro-batch
    window and ``acc.step``): calls of ``.item()``, ``.cpu()``, ``.tolist()``, ``bool(t)``, ``float(t)``,
    ``int(t)``, ``nonzero`` and ``torch.cuda.synchronize``, counted by patching them (``count_syncs``). On a
    GPU each is the host waiting for the device. Bound (``sync_bound``): at most 1 with clipping or the fp16
    scaler, 0 without; 1 for the optimizers that read once by design (a host step waits for its gradients and
    needs the window's item count on the host; bitsandbytes' 8-bit step takes no device skip flag, so a
    non-finite window is refused by one read); a partial host offload reads twice (a known shortfall).
(c) aten ops per parameter tensor per optimizer step (a ``TorchDispatchMode`` count of ``optimizer.step()``,
    after the step that creates the state; ops that may launch a kernel: views, allocations and profiler markers
    apart), for each moment precision against ``torch.optim.AdamW(fused=True)`` on the same parameters. Bound
    (``ops_bound``): within 2x fused AdamW's for fp32 moments; 3x for bf16 moments (fused AdamW on fp32 copies:
    the copy in, the rounding noise, the mask and the copy out are 4 more multi-tensor ops, constant in the number
    of tensors); 1 op per tensor for int8 moments (bitsandbytes' kernels step one tensor each).
(d) bytes over the host link per optimizer step for each offload mode: activations through a counting
    ``CpuTransport`` (both directions), the offloaded optimizer through ``CPUOffloadOptimizer``'s gradient landings
    and weight copies back, against the planner's prediction: ``predictions(...)[0].host_link`` (``HostLink``: the
    bytes its time model queues on the link, each direction). Bound: equal, each direction.

Run: ``python benchmarks/bench_contract.py`` (about a minute on 2 CPU cores); ``--json`` prints the figures as
JSON; ``--only graph_breaks,syncs,ops,link_bytes`` runs some sections.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import functools
import json
import sys
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any
from unittest import mock

_ROOT = Path(__file__).resolve().parent.parent
if str(_ROOT) not in sys.path:
    sys.path.insert(0, str(_ROOT))

import torch  # noqa: E402

from memtrain.errors import ConfigError, MemtrainError  # noqa: E402
from memtrain.measure import KernelOps, count_host_syncs  # noqa: E402
from memtrain.models import GPT, GPTConfig  # noqa: E402
from memtrain.planner import HostLink, PlanSettings, apply_plan, predictions  # noqa: E402

SECTIONS = ("graph_breaks", "syncs", "ops", "link_bytes")


# -- set-ups -----------------------------------------------------------------------------------------------------
def settings(blocks: tuple[str, ...], flavor: str = "full", *, chunked_loss: bool = False, optimizer: str = "device",
             compile: bool = False, precision: str = "fp32", state_precision: str = "fp32",
             step_in_backward: bool = False, micro_batch_size: int = 2, accumulation: int = 1) -> PlanSettings:
    return PlanSettings(micro_batch_size=micro_batch_size, accumulation=accumulation, blocks=blocks, flavor=flavor,
                        chunked_loss=chunked_loss, optimizer=optimizer, distribution="none",
                        # type: ignore[arg-type]
                        compile=compile, precision=precision, state_precision=state_precision, step_in_backward=step_in_backward)


def tiny_gpt(n_layer: int = 2, n_embd: int = 32, seq_len: int = 16, vocab_size: int = 64) -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(n_layer=n_layer, n_embd=n_embd, n_head=2, seq_len=seq_len, vocab_size=vocab_size))


def train_step(run: Any, x: torch.Tensor, y: torch.Tensor, accumulation: int,
               around_backward: Callable[[], contextlib.AbstractContextManager[Any]] = contextlib.nullcontext,
               around_step: Callable[[], contextlib.AbstractContextManager[Any]] = contextlib.nullcontext) -> None:
    """One optimizer step through the planned run's accumulator: ``accumulation`` micro-batches of a summed loss."""
    acc = run.accumulator
    for i, (xb, yb) in enumerate(zip(x.chunk(accumulation), y.chunk(accumulation), strict=True)):
        with acc.micro_batch(is_last=i == accumulation - 1):
            with run.precision.autocast():
                loss = run.train_model(xb, yb) * yb.numel()  # GPT returns the mean: summed over the tokens
            with around_backward():
                acc.backward(loss, reduction="sum", items=yb.numel())
    with around_step():
        acc.step()


def _close(run: Any) -> None:
    close = getattr(run.optimizer, "close", None)
    if callable(close):
        close()


# -- (a) graph breaks ----------------------------------------------------------------------------------------------
class CountingTransport:
    """memtrain.offload.CpuTransport with the bytes each way counted: what would cross the host link."""

    def __init__(self) -> None:
        from memtrain.offload import CpuTransport

        self._inner = CpuTransport()
        self.device = self._inner.device
        self.to_host_bytes = 0
        self.to_device_bytes = 0

    def allocate_host(self, nbytes: int) -> torch.Tensor:
        return self._inner.allocate_host(nbytes)

    def copy_to_host(self, src: torch.Tensor, segments: Any, tag: int) -> Any:
        self.to_host_bytes += sum(host.numel() for _, host in segments)  # uint8 slabs: numel is bytes
        return self._inner.copy_to_host(src, segments, tag)

    def copy_to_device(self, segments: Any, nbytes: int, tag: int) -> tuple[torch.Tensor, Any]:
        self.to_device_bytes += nbytes
        return self._inner.copy_to_device(segments, nbytes, tag)

    def wait(self, event: Any) -> None:
        self._inner.wait(event)

    def query(self, event: Any) -> bool:
        return self._inner.query(event)


@contextlib.contextmanager
def cpu_offload(transports: list[CountingTransport] | None = None, min_bytes: int | None = None) -> Iterator[None]:
    """``apply_checkpointing``'s offloader built on a counting CPU transport (the real one is a no-op without
    CUDA), so that the CPU runs the offload hooks a GPU run would. ``min_bytes`` defaults to the real default."""
    import memtrain.checkpointing.wrap as checkpointing
    from memtrain.offload import MIN_BYTES_DEFAULT, ActivationOffloader

    def offload_activations(**_: Any) -> ActivationOffloader:
        transport = CountingTransport()
        if transports is not None:
            transports.append(transport)
        return ActivationOffloader(transport, min_bytes=min_bytes or MIN_BYTES_DEFAULT,  # type: ignore[arg-type]
                                   host_budget_bytes=2**30)

    with mock.patch.object(checkpointing, "offload_activations", offload_activations):
        yield


@contextlib.contextmanager
def compile_backend(backend: str = "aot_eager") -> Iterator[None]:
    """Every ``torch.compile`` call (``nn.Module.compile`` too) with ``backend``: Dynamo's capture, and its graph
    breaks, are the same; the CPU needs no C++ toolchain and minutes of Inductor."""
    original = torch.compile

    @functools.wraps(original)
    def compile(*args: Any, **kwargs: Any) -> Any:
        kwargs["backend"] = backend
        return original(*args, **kwargs)

    with mock.patch.object(torch, "compile", compile):
        yield


@dataclass
class CompileCount:
    setup: str
    graphs: int = 0
    breaks: int = 0
    memtrain_breaks: int = 0  # over the same model compiled with no technique, reason by reason
    reasons: list[str] = field(default_factory=list)
    refused: str | None = None  # apply_plan's ConfigError: the pairing is refused, nothing runs eager silently
    error: str | None = None  # the count could not be made as designed (see _dynamo_counts)


GRAPH_BREAK_SETUPS: dict[str, dict[str, Any]] = {
    "no technique": dict(blocks=("keep", "keep")),
    "checkpointing all": dict(blocks=("recompute", "recompute")),
    "checkpointing every 2": dict(blocks=("recompute", "keep")),
    "checkpointing selective": dict(blocks=("recompute", "recompute"), flavor="selective"),
    "all + offload inputs": dict(blocks=("recompute", "recompute"), flavor="offload-inputs"),
    "offload blocks": dict(blocks=("offload", "offload")),
    "chunked loss": dict(blocks=("keep", "keep"), chunked_loss=True),
    "CPUOffloadOptimizer hooks": dict(blocks=("keep", "keep"), optimizer="offload"),
}


def _dynamo_counts(name: str, setup: dict[str, Any]) -> tuple[CompileCount, collections.Counter[str]]:
    import torch._dynamo
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    count = CompileCount(name)
    model = tiny_gpt()
    x = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
    transports: list[CountingTransport] = []
    try:
        with compile_backend(), cpu_offload(transports, min_bytes=1):
            run = apply_plan(model, settings(**setup, compile=True), max_grad_norm=1.0)
            train_step(run, x, x, 1)
    except ConfigError as e:
        count.refused = str(e).splitlines()[0]
        return count, collections.Counter()
    except (MemtrainError, RuntimeError) as e:
        count.error = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
        return count, collections.Counter()
    _close(run)
    offloads = "offload" in setup["blocks"] or setup.get("flavor") == "offload-inputs"
    if offloads and not any(t.to_host_bytes for t in transports):
        # Either the offloader is not the CPU transport's (then it is a no-op here and nothing it does is traced),
        # or compiled regions' saved tensors bypass its hooks: an offload that silently does nothing.
        count.error = ("no activation crossed the counting CPU transport: the compiled set-up offloads nothing "
                       "(saved tensors bypass the offload hooks), or apply_checkpointing no longer builds its "
                       "offloader through memtrain.checkpointing.wrap.offload_activations, which cpu_offload() patches")
    reasons = collections.Counter({reason.splitlines()[0]: n for reason, n in counters["graph_break"].items()})
    count.graphs = int(counters["stats"]["unique_graphs"])
    count.breaks = sum(reasons.values())
    count.reasons = sorted(reasons)
    return count, reasons


def graph_breaks() -> list[CompileCount]:
    """(a): Dynamo's graphs and breaks per set-up, and the breaks over the no-technique baseline's."""
    out = []
    base: collections.Counter[str] | None = None
    for name, setup in GRAPH_BREAK_SETUPS.items():
        count, reasons = _dynamo_counts(name, setup)
        base = reasons if base is None else base
        count.memtrain_breaks = sum((reasons - base).values())
        out.append(count)
    torch._dynamo.reset()
    return out


# -- (b) host syncs ----------------------------------------------------------------------------------------------
@contextlib.contextmanager
def count_syncs(calls: collections.Counter[tuple[str, str]] | None = None
                ) -> Iterator[collections.Counter[tuple[str, str]]]:
    """``memtrain.measure.count_host_syncs`` on the loop's thread, added into ``calls`` keyed by (call, caller
    file:line) (a new Counter by default): on the CPU each read is counted as the sync it is on a GPU."""
    calls = collections.Counter() if calls is None else calls
    with count_host_syncs() as syncs:
        yield calls
    for site, n in syncs.sites.items():
        call, where = site.split(" ", 1)
        calls[(call.split(".")[-1].strip("_"), where)] += n


@dataclass
class SyncCount:
    setup: str
    clip: bool
    syncs: int | None = None
    sites: dict[str, int] = field(default_factory=dict)
    error: str | None = None


SYNC_SETUPS: dict[str, dict[str, Any]] = {
    "device fused AdamW": dict(),
    "ComposedOptimizer fp32 (partial host offload)": dict(state_precision="fp32", offload_fraction=0.5),
    "ComposedOptimizer bf16": dict(state_precision="bf16"),
    "ComposedOptimizer int8": dict(state_precision="int8"),
    "step in backward": dict(step_in_backward=True),
    "CPUOffloadOptimizer": dict(optimizer="offload"),
    "CPUOffloadOptimizer, bf16 weights": dict(optimizer="offload-bf16-weights", precision="bf16-mixed"),
    "fp16 scaler, device fused AdamW": dict(precision="fp16-mixed"),
    "fp16 scaler, CPUOffloadOptimizer": dict(precision="fp16-mixed", optimizer="offload"),
}


def _sync_run(name: str, setup: dict[str, Any], clip: bool, accumulation: int = 2) -> SyncCount:
    count = SyncCount(name, clip)
    setup = dict(setup)
    fraction = setup.pop("offload_fraction", 0.0)
    s = dataclasses.replace(settings(("keep", "keep"), accumulation=accumulation, micro_batch_size=1, **setup),
                            offload_fraction=fraction)
    model = tiny_gpt()
    x = torch.randint(0, 64, (accumulation, 16), generator=torch.Generator().manual_seed(1))
    try:
        run = apply_plan(model, s, max_grad_norm=1.0 if clip else None)
        train_step(run, x, x, accumulation)  # creates the optimizer state; the first step's one-off syncs
        calls: collections.Counter[tuple[str, str]] = collections.Counter()
        # The accumulator's path only: every acc.backward and acc.step (forward is the model's).
        train_step(run, x, x, accumulation, lambda: count_syncs(calls), lambda: count_syncs(calls))
    except (MemtrainError, ImportError, RuntimeError) as e:
        count.error = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
        return count
    finally:
        with contextlib.suppress(NameError):
            _close(run)
    count.sites = {f"{call} {where}": n for (call, where), n in sorted(calls.items())}
    count.syncs = sum(calls.values())
    return count


# Set-ups that read the window once whatever the options: the host step waits for its gradients and needs the
# window's item count on the host; bitsandbytes' 8-bit step takes no device skip flag (a non-finite window is
# refused by one read instead).
READS_ONCE = ("CPUOffloadOptimizer", "int8")
# NOTE: a known shortfall, not the contract: ComposedOptimizer with a host part reads the window's numbers, then its
# device norms (a second blocking copy, after the first drained the device's queue: a round trip, not a stall).
# One read would need the device norms copied with the window's numbers. Bounded at what it does.
READS_TWICE = ("partial host offload",)


def sync_bound(setup: str, clip: bool) -> int:
    """Host syncs allowed per optimizer step (DESIGN's contract, with the READS_ONCE and READS_TWICE exceptions)."""
    if any(k in setup for k in READS_TWICE):
        return 2
    return 1 if clip or "fp16" in setup or any(k in setup for k in READS_ONCE) else 0


def ops_bound(optimizer: str, fused_per_tensor: float) -> float:
    """Kernel ops allowed per parameter tensor per step: 2x fused AdamW, 3x with bf16 moments, 1 with int8."""
    if optimizer.endswith("int8"):
        return 1.0
    return (3.0 if optimizer.endswith("bf16") else 2.0) * fused_per_tensor


def sync_cases() -> list[tuple[str, bool]]:
    """(set-up, clipping) pairs: with and without clipping, but the fp16 set-ups only with it (their bound is 1
    either way; with clipping the scaler's check and the norm must share it)."""
    return [(name, clip) for name in SYNC_SETUPS for clip in (True, False) if clip or "fp16" not in name]


def host_syncs() -> list[SyncCount]:
    """(b): syncs per optimizer step on the accumulator's path."""
    return [_sync_run(name, SYNC_SETUPS[name], clip) for name, clip in sync_cases()]


# -- (c) aten ops per parameter tensor ----------------------------------------------------------------------------
@dataclass
class OpsCount:
    optimizer: str
    tensors: int
    ops: int | None = None
    ops_per_tensor: float | None = None
    over_fused: float | None = None
    views: int | None = None
    top: dict[str, int] = field(default_factory=dict)
    error: str | None = None


def _optimizer_for(kind: str, named: list[tuple[str, torch.nn.Parameter]]) -> torch.optim.Optimizer:
    from memtrain.optim import build_optimizer

    hyper = dict(lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1)
    if kind == "torch fused AdamW":
        return torch.optim.AdamW([p for _, p in named], fused=True, **hyper)  # type: ignore[arg-type]
    return build_optimizer(named, state_precision=kind.split()[-1], **hyper)  # type: ignore[arg-type]


OPS_OPTIMIZERS = ("torch fused AdamW", "ComposedOptimizer fp32", "ComposedOptimizer bf16", "ComposedOptimizer int8")


def optimizer_ops() -> list[OpsCount]:
    """(c): aten ops of one ``optimizer.step()`` (the second: the state exists) per parameter tensor."""
    out: list[OpsCount] = []
    for kind in OPS_OPTIMIZERS:
        model = tiny_gpt(n_embd=64)
        named = [(n, p) for n, p in model.named_parameters()]
        count = OpsCount(kind, len(named))
        try:
            optimizer = _optimizer_for(kind, named)
            g = torch.Generator().manual_seed(2)
            for step in range(2):
                for _, p in named:
                    p.grad = torch.randn(p.shape, generator=g)
                if step == 0:
                    optimizer.step()
                    continue
                with KernelOps() as counter:
                    optimizer.step()
        except (MemtrainError, ImportError, RuntimeError) as e:
            count.error = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
            out.append(count)
            continue
        count.ops = counter.total
        count.views = counter.views
        count.ops_per_tensor = counter.total / len(named)
        packets: collections.Counter[str] = collections.Counter()
        for op, n in counter.kernels.items():
            packets[op.rsplit(".", 1)[0]] += n  # aten._foreach_add_.Scalar -> aten._foreach_add_
        count.top = dict(packets.most_common(6))
        out.append(count)
    fused = out[0].ops_per_tensor
    for c in out:
        if c.ops_per_tensor is not None and fused:
            c.over_fused = c.ops_per_tensor / fused
    return out


# -- (d) bytes over the host link ----------------------------------------------------------------------------------
@dataclass
class LinkCount:
    setup: str
    to_host_bytes: int | None = None
    to_device_bytes: int | None = None
    predicted_to_host: int | None = None
    predicted_to_device: int | None = None
    error: str | None = None

    @property
    def measured_bytes(self) -> int | None:
        if self.to_host_bytes is None or self.to_device_bytes is None:
            return None
        return self.to_host_bytes + self.to_device_bytes

    @property
    def predicted_bytes(self) -> int | None:
        if self.predicted_to_host is None or self.predicted_to_device is None:
            return None
        return self.predicted_to_host + self.predicted_to_device


# The activation-offload workload: block inputs of batch 4 x 256 x 256 fp32 (1 MiB, the offloader's default
# smallest storage), so that what moves is decided by the same rule the estimate simulates.
LINK_SHAPE = dict(n_layer=2, n_embd=256, seq_len=256, vocab_size=256)
LINK_BATCH, LINK_ACCUMULATION = 8, 2

LINK_SETUPS: dict[str, dict[str, Any]] = {
    "activations: all + offload inputs": dict(blocks=("recompute", "recompute"), flavor="offload-inputs"),
    "activations: offload blocks": dict(blocks=("offload", "offload")),
    "activations: 1 offload, 1 recompute": dict(blocks=("offload", "recompute")),
    "optimizer: CPUOffloadOptimizer": dict(blocks=("keep", "keep"), optimizer="offload"),
    "optimizer: CPUOffloadOptimizer, bf16 weights": dict(blocks=("keep", "keep"), optimizer="offload-bf16-weights",
                                                         precision="bf16-mixed"),
    # The last parameters holding half the elements (memtrain.optim.offloaded_mask) step on the host.
    "optimizer: 50% offloaded": dict(blocks=("keep", "keep"), offload_fraction=0.5),
}


@contextlib.contextmanager
def count_optimizer_link(totals: dict[str, int]) -> Iterator[None]:
    """CPUOffloadOptimizer's gradients landing on the host (device -> host) and its weights copied back (host ->
    device), counted in bytes of the device tensors that cross."""
    from memtrain.optim.gradient_landing import GradientLanding
    from memtrain.optim.host_stepper import HostStepper

    land, copy_back = GradientLanding.land, HostStepper.copy_to_device

    def counted_land(self: Any, slot: Any, *, free: bool) -> int | None:
        grad = slot.device.grad
        if grad is not None:
            totals["to_host"] += grad.numel() * grad.element_size()
        return land(self, slot, free=free)

    def counted_copy_back(self: Any, slots: list[Any]) -> None:
        totals["to_device"] += sum(s.device.numel() * s.device.element_size() for s in slots)
        return copy_back(self, slots)

    with mock.patch.object(GradientLanding, "land", counted_land), \
            mock.patch.object(HostStepper, "copy_to_device", counted_copy_back):
        yield


def predicted_link(model: torch.nn.Module, s: PlanSettings, *, seq_len: int, batch: int) -> HostLink:
    """The planner's bytes over the host link in one optimizer step of ``s``: ``Candidate.host_link``, the figures
    its time model queues on the link (not derived again here)."""
    (candidate,) = predictions(model, [s], seq_len=seq_len, global_batch_size=batch, device="cuda")
    assert candidate.host_link is not None
    return candidate.host_link


def link_bytes() -> list[LinkCount]:
    """(d): bytes over the host link per optimizer step, measured in the CPU transports, beside the planner's."""
    out = []
    for name, setup in LINK_SETUPS.items():
        count = LinkCount(name)
        setup = dict(setup)
        fraction = setup.pop("offload_fraction", 0.0)
        s = dataclasses.replace(settings(**setup, micro_batch_size=LINK_BATCH // LINK_ACCUMULATION,
                                         accumulation=LINK_ACCUMULATION), offload_fraction=fraction)
        # The optimizer's bytes depend on the parameters only: the smaller model will do.
        offloads_activations = "offload" in s.blocks or s.flavor == "offload-inputs"
        shape = LINK_SHAPE if offloads_activations else dict(seq_len=16, vocab_size=64)
        model = tiny_gpt(**shape)
        g = torch.Generator().manual_seed(1)
        x = torch.randint(0, shape["vocab_size"], (LINK_BATCH, shape["seq_len"]), generator=g)
        transports: list[CountingTransport] = []
        totals = {"to_host": 0, "to_device": 0}
        try:
            link = predicted_link(model, s, seq_len=shape["seq_len"], batch=LINK_BATCH)
            count.predicted_to_host, count.predicted_to_device = link.to_host, link.to_device
            with cpu_offload(transports):
                run = apply_plan(model, s, max_grad_norm=1.0)
            train_step(run, x, x, LINK_ACCUMULATION)  # the offloader records the backward order; state created
            for t in transports:
                t.to_host_bytes = t.to_device_bytes = 0
            with count_optimizer_link(totals):
                train_step(run, x, x, LINK_ACCUMULATION)
            _close(run)
        except (MemtrainError, RuntimeError) as e:
            count.error = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
            out.append(count)
            continue
        except AttributeError as e:  # count_optimizer_link's hooks into CPUOffloadOptimizer
            count.error = (f"CPUOffloadOptimizer changed ({e}): count_optimizer_link wraps its _land (gradients to "
                           "the host) and _copy_to_device (weights back); update it to the new methods")
            out.append(count)
            continue
        count.to_host_bytes = totals["to_host"] + sum(t.to_host_bytes for t in transports)
        count.to_device_bytes = totals["to_device"] + sum(t.to_device_bytes for t in transports)
        out.append(count)
    return out


# -- the table -----------------------------------------------------------------------------------------------------
def _table(header: tuple[str, ...], rows: list[tuple[Any, ...]]) -> str:
    text = [tuple(str(v) for v in header)] + [tuple("-" if v is None else str(v) for v in r) for r in rows]
    widths = [max(len(r[i]) for r in text) for i in range(len(header))]
    return "\n".join("  ".join(v.ljust(w) for v, w in zip(r, widths, strict=True)).rstrip() for r in text)


def format_report(doc: dict[str, Any]) -> str:
    parts = []
    if "graph_breaks" in doc:
        parts.append("(a) graph breaks under torch.compile (aot_eager), one step; bound: 0 caused by memtrain, "
                     ">= 1 graph\n" + _table(
                         ("set-up", "graphs", "breaks", "by memtrain", "refused"),
                         [(c["setup"], c["graphs"], c["breaks"], c["memtrain_breaks"], c["error"] or c["refused"])
                          for c in doc["graph_breaks"]]))
    if "syncs" in doc:
        parts.append("(b) host syncs per optimizer step (2 micro-batches: acc.backward x2 + acc.step); bound: <= 1 "
                     "with clipping or fp16, 0 without; 1 where READS_ONCE, 2 where READS_TWICE\n" + _table(
                         ("set-up", "clip", "syncs", "where"),
                         [(c["setup"], "yes" if c["clip"] else "no", c["syncs"],
                           c["error"] or "; ".join(f"{k} x{n}" for k, n in c["sites"].items()))
                          for c in doc["syncs"]]))
    if "ops" in doc:
        parts.append("(c) aten ops that may launch a kernel (views, allocations, profiler marks apart) per parameter "
                     "tensor per optimizer step; bound: <= 2x torch fused AdamW (bf16 3x, int8 1 per tensor)\n" + _table(
            ("optimizer", "tensors", "ops", "ops/tensor", "x fused", "views", "most frequent"),
            [(c["optimizer"], c["tensors"], c["ops"],
              None if c["ops_per_tensor"] is None else f"{c['ops_per_tensor']:.2f}",
              None if c["over_fused"] is None else f"{c['over_fused']:.1f}x", c["views"],
              c["error"] or ", ".join(f"{k.split('.')[-1]} {n}" for k, n in c["top"].items()))
             for c in doc["ops"]]))
    if "link_bytes" in doc:
        parts.append(f"(d) bytes over the host link per optimizer step (activations: GPT {LINK_SHAPE}, batch "
                     f"{LINK_BATCH} in {LINK_ACCUMULATION} micro-batches, fp32; the optimizer: a 2-layer GPT of width "
                     "32); bound: measured == the plan's HostLink, each direction\n" + _table(
                         ("set-up", "to host", "predicted", "to device", "predicted", "measured/predicted"),
                         [(c["setup"], c["to_host_bytes"], c["predicted_to_host"], c["to_device_bytes"],
                           c["predicted_to_device"],
                           c["error"] or (f"{c['measured_bytes'] / c['predicted_bytes']:.3f}"
                                          if c["predicted_bytes"] else None))
                          for c in doc["link_bytes"]]))
    return "\n\n".join(parts)


def collect(sections: tuple[str, ...] = SECTIONS) -> dict[str, Any]:
    """The contract's figures as a JSON-ready document, one list per section."""
    doc: dict[str, Any] = {"torch": torch.__version__, "threads": torch.get_num_threads()}
    if "graph_breaks" in sections:
        doc["graph_breaks"] = [asdict(c) for c in graph_breaks()]
    if "syncs" in sections:
        doc["syncs"] = [asdict(c) for c in host_syncs()]
    if "ops" in sections:
        doc["ops"] = [asdict(c) for c in optimizer_ops()]
    if "link_bytes" in sections:
        doc["link_bytes"] = [{**asdict(c), "measured_bytes": c.measured_bytes, "predicted_bytes": c.predicted_bytes}
                             for c in link_bytes()]
    return doc


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print the figures as JSON (the table goes to stderr)")
    parser.add_argument("--only", default=",".join(SECTIONS), help=f"comma-separated sections of {SECTIONS}")
    args = parser.parse_args(argv)
    sections = tuple(s.strip() for s in args.only.split(",") if s.strip())
    unknown = [s for s in sections if s not in SECTIONS]
    if unknown:
        print(f"error: --only {unknown} names no section. To resolve this error, pick from {SECTIONS}.",
              file=sys.stderr)
        return 2
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the offload no-op's and torch.compile's notes, not figures
        doc = collect(sections)
    print(format_report(doc), file=sys.stderr if args.json else sys.stdout)
    if args.json:
        print(json.dumps(doc, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
