"""Issue 28's device check of the paths no other step of ``gpu_check.sh quick`` runs, one row each, in one JSON.

Each case runs in a fresh process (``gpu_plan.run_child``: its own CUDA context and allocator statistics, killed
past its limit with its children), so that one case's memory, crash or hang is not another's; the parent never
touches CUDA. The JSON (``--out``) is rewritten after every case: a run cut short keeps what it measured. A row:
the case, its status (``pass``, ``FAIL``, ``error``, ``skipped``; ``ran`` on a CPU, where no limit is
measurable), its limit in bytes, the allocator's peaks over the whole case (set-up included), allocated
(``max_memory_allocated``) and reserved (``max_memory_reserved``), ``num_alloc_retries`` (cudaMalloc retried after
the allocator freed its cache: a budget held only by thrashing), seconds a step, tokens/s, and each check.

Cases (``--cases``; by default param-offload, memtrain-train, pure-bf16, delayed-bf16-accumulation, qlora: the most
important first, since a case the deadline leaves no time for is skipped):

- ``param-offload``: docs/design.md's 1.1B Llama (batch 4 x 2048) inside 4 GiB, its blocks' weights streamed from host
  RAM (``gpu_offload_weights.run``: planned with ``Choices(offload_weights=True)``, ``WeightStreamer``). Checks:
  allocated and reserved peaks <= 4 GiB, no allocation retried.
- ``pure-bf16``: the 1.1B planned with ``Choices(pure_bf16=True)`` inside 8 GiB (bf16 weights, no fp32 master,
  stochastic rounding). Checks: allocated and reserved <= 8 GiB, no retry, the loss finite and falling.
- ``delayed-bf16-accumulation``: the 1.1B's layers (8 of its 22, batch 4 x 2048) with
  ``CPUOffloadOptimizer(delayed_update=True, device_dtype=torch.bfloat16)``, every block recomputed, the loss chunked, 2 micro-batches of 2 a step through
  ``GradientAccumulator`` (clipping on). Limit: the planner's peak for that set-up (``plan(settings=...)``,
  offload-bf16-weights; it has no delayed update) plus 10%. Checks: allocated <= limit, no retry, the loss finite
  and falling (each update lands one step late: two reach the weights of the last step).
- ``memtrain-train``: ``python -m memtrain train --hf-config <a Llama built here: 200M parameters, fp32 weights
  766 MiB> --budget 640MiB --max-steps 3``, in the case's process (``runpy``, as ``-m`` runs it) with
  ``torch.cuda.reset_peak_memory_stats`` (which the loop calls every step) wrapped to keep the running maximum, so
  the model's set-up counts. Checks: exit 0, metrics.jsonl's and report.json's ``peak_bytes`` <= budget, the whole
  process's allocated peak <= budget, no retry. A run that first puts the whole fp32 model on the device fails here.
- ``qlora``: the same command with ``--lora 16 --quantize-base nf4 --budget 512MiB``; skipped, with a line saying
  so, where bitsandbytes is not importable (``gpu_check.sh``'s header says how to carry its wheel).
- ``fsdp-offload``: ``--fsdp --offload-optimizer`` on one rank (issue 31): a process group of one, opened as memtrain
  train opens it on CUDA (cpu:gloo,cuda:nccl), ``apply_plan`` of FSDP2 with CPUOffloadPolicy over the 1.1B's layers
  (8 of 22, batch 4 x 2048), 3 steps clipped and 3 not (the skip flag). Checks: every shard and moment on the host,
  the shards pinned, the allocated peak below the fp32 weights, no retry, the loss finite and falling in both runs.

Run on a GPU: ``python benchmarks/gpu_paths.py --out bench-results/gpu_paths.json`` (about 2 minutes; the 1.1B
cases need about 25 GB of host RAM). Run anywhere: ``--small`` (tiny Llamas on this machine's CPU: every case end to
end; no peak is measurable there, so no case passes or fails a limit).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import math
import runpy
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

_HERE = Path(__file__).resolve().parent
for _path in (_HERE.parent, _HERE):  # the repo root (memtrain) and benchmarks/ (gpu_plan), when run directly
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

import torch  # noqa: E402
from gpu_offload_weights import alloc_retries  # noqa: E402
from gpu_plan import (  # noqa: E402
    SHAPES,
    Deadline,
    LlamaShape,
    _error,
    _kill_children,
    build_llama,
    environment,
    meta_llama,
    run_child,
    run_settings,
    weights_dtype,
    write_doc,
)

from memtrain.report import format_bytes, parse_bytes  # noqa: E402

# Most important first: a case the deadline leaves no time for is skipped (and recorded).
CASES = ("param-offload", "memtrain-train", "pure-bf16", "delayed-bf16-accumulation", "qlora", "fsdp-offload")
# Seconds each case's process may take at most (start-up, planning and building the 1.1B included).
CASE_LIMIT_S = {"param-offload": 70.0, "pure-bf16": 45.0, "delayed-bf16-accumulation": 45.0,
                "memtrain-train": 60.0, "qlora": 50.0, "fsdp-offload": 80.0}
MIN_CASE_S = 20.0  # a case that would start with less time left is skipped (recorded as such)
DELAYED_TOLERANCE = 0.10  # the delayed case's limit over the planner's peak for its set-up
# The delayed case's model: the 1.1B's layers, 8 of its 22 (0.5B parameters: less host RAM to pin, sooner built).
DELAYED_SHAPE = LlamaShape(hidden=2048, intermediate=5632, layers=8, heads=32, kv_heads=4, vocab=32000)
# memtrain-train's model: fp32 weights (766 MiB) over its budget, bf16 weights (383 MiB) well within it.
TRAIN_LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 1024,
               "intermediate_size": 2816, "num_hidden_layers": 12, "num_attention_heads": 16,
               "num_key_value_heads": 4, "vocab_size": 32000, "max_position_embeddings": 512,
               "tie_word_embeddings": False}
TINY_LLAMA = {**TRAIN_LLAMA, "hidden_size": 128, "intermediate_size": 344, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 2048, "max_position_embeddings": 256}
# (budget on CUDA, budget with --small, where a CPU budget is host RAM and only has to let a plan through)
BUDGETS = {"param-offload": ("4GiB", None), "pure-bf16": ("8GiB", None), "memtrain-train": ("640MiB", "16MiB"),
           "qlora": ("512MiB", "16MiB")}


# -- one row ---------------------------------------------------------------------------------------------------
def finish(row: dict[str, Any], checks: dict[str, bool | None]) -> dict[str, Any]:
    """Sets the row's checks and status: FAIL if a check failed, error if the case raised (and nothing failed),
    pass if every check held, ran if one could not be measured (a CPU)."""
    row["checks"] = checks
    if any(v is False for v in checks.values()):
        row["status"] = "FAIL"
    elif row.get("error"):
        row["status"] = "error"
    else:
        row["status"] = "ran" if any(v is None for v in checks.values()) else "pass"
    return row


def within(value: int | None, limit: int | None) -> bool | None:
    return None if value is None or limit is None else value <= limit


def losses_fall(losses: Sequence[float]) -> bool | None:
    """The loss finite at every step and lower at the last than at the first (the same batch every step)."""
    if len(losses) < 2:
        return None
    return all(math.isfinite(v) for v in losses) and losses[-1] < losses[0]


def peak_checks(row: dict[str, Any], limit: int | None, *, reserved: bool = True) -> dict[str, bool | None]:
    checks = {"allocated <= limit": within(row.get("peak_allocated_bytes"), limit)}
    if reserved:
        checks["reserved <= limit"] = within(row.get("peak_reserved_bytes"), limit)
    retries = row.get("alloc_retries")
    checks["num_alloc_retries == 0"] = None if retries is None else retries == 0
    return checks


# -- the cases (each in its own process) -----------------------------------------------------------------------
def case_param_offload(small: bool) -> dict[str, Any]:
    import gpu_offload_weights

    args = gpu_offload_weights.parse_args(["--small"] if small else ["--budget", BUDGETS["param-offload"][0]])
    got = gpu_offload_weights.run(args)
    row = {"limit_bytes": got.get("budget_bytes"), "plan": got.get("plan"),
           "predicted_peak_bytes": got.get("predicted_peak_bytes"), "peak_allocated_bytes":
           got.get("run_peak_allocated_bytes"), "peak_reserved_bytes": got.get("run_peak_reserved_bytes"),
           "alloc_retries": got.get("alloc_retries"), "step_s": got.get("median_s"),
           "tokens_per_s": got.get("tokens_per_s"), "losses": got.get("losses"), "error": got.get("error")}
    return finish(row, {**peak_checks(row, row["limit_bytes"]),
                        "loss finite and falling": losses_fall(row.get("losses") or [])})


def case_pure_bf16(small: bool) -> dict[str, Any]:
    from memtrain.choices import Choices
    from memtrain.planner import plan

    device = _device(small)
    shape, seq_len, batch = _workload(small)
    budget = BUDGETS["pure-bf16"][small]
    row: dict[str, Any] = {"limit_bytes": parse_bytes(budget) if budget else None}
    p = plan(meta_llama(shape, seq_len), budget=budget, seq_len=seq_len, global_batch_size=batch,
             device=device.type, choices=Choices(pure_bf16=True))
    row.update(plan=p.settings.to_dict(), predicted_peak_bytes=p.peak_bytes)
    before = alloc_retries(device)
    _run_into(row, lambda: run_settings(p.settings, shape, seq_len=seq_len, device=device, warmup=1, repeats=2,
                                        lr=1e-4), device, before)
    return finish(row, {**peak_checks(row, row["limit_bytes"]), "loss finite and falling":
                        losses_fall(row.get("losses") or [])})


def case_delayed(small: bool) -> dict[str, Any]:
    from memtrain.planner import PlanSettings, plan

    device = _device(small)
    shape, seq_len, batch = _workload(small)
    shape = shape if small else DELAYED_SHAPE
    micro, windows = batch // 2, 2
    settings = PlanSettings(micro_batch_size=micro, accumulation=windows, blocks=("recompute",) * shape.layers,
                            flavor="full", chunked_loss=True, optimizer="offload-bf16-weights",
                            distribution="none", compile=False, precision="bf16-mixed")
    row: dict[str, Any] = {"plan": {**settings.to_dict(), "delayed_update": True}}
    predicted = plan(meta_llama(shape, seq_len), budget=None, seq_len=seq_len, global_batch_size=batch,
                     device=device.type, settings=settings).peak_bytes
    row.update(predicted_peak_bytes=predicted, limit_bytes=int(predicted * (1 + DELAYED_TOLERANCE)))
    before = alloc_retries(device)
    _run_into(row, lambda: train_delayed(settings, shape, seq_len, device, steps=4), device, before)
    return finish(row, {**peak_checks(row, row.get("limit_bytes"), reserved=False),
                        "loss finite and falling": losses_fall(row.get("losses") or [])})


def train_delayed(settings: Any, shape: Any, seq_len: int, device: torch.device, *, steps: int) -> dict[str, Any]:
    """The Llama ``shape``, bf16 on the device, under ``CPUOffloadOptimizer(delayed_update=True)`` (the fp32 master in host
    RAM): ``steps`` steps of ``settings.accumulation`` micro-batches on one repeated batch. Returns the losses,
    seconds a step (the first, which allocates, left out), the set-up's allocated peak and the whole run's peaks."""
    from memtrain.accumulation import GradientAccumulator
    from memtrain.loss import language_model_loss
    from memtrain.optim import CPUOffloadOptimizer
    from memtrain.planner import configure_model
    from memtrain.precision import MixedPrecision

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    # Built in bf16, as gpu_plan.run_settings builds an offload-bf16-weights plan's model: fp32 first would peak at
    # twice the weights the set-up keeps (the master is then taken from bf16 weights: the same maths after).
    model = build_llama(shape, seq_len, device, weights_dtype(settings))
    configure_model(model, settings)  # every block recomputed, the loss chunked
    opt = CPUOffloadOptimizer(model.named_parameters(), delayed_update=True, device_dtype=torch.bfloat16, lr=1e-4,
                              betas=(0.9, 0.95), weight_decay=0.0)
    acc = GradientAccumulator(model, opt, steps=settings.accumulation, max_grad_norm=1.0)
    setup_peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    precision = MixedPrecision("bf16-mixed", device.type)
    g = torch.Generator().manual_seed(1)
    batch = settings.micro_batch_size * settings.accumulation
    x = torch.randint(0, shape.vocab, (batch, seq_len), generator=g).to(device)
    y = torch.randint(0, shape.vocab, (batch, seq_len), generator=g).to(device)
    losses, seconds = [], []
    for _ in range(steps):
        _sync(device)
        t0 = time.perf_counter()
        for i, (xb, yb) in enumerate(zip(x.split(settings.micro_batch_size), y.split(settings.micro_batch_size),
                                         strict=True)):
            with acc.micro_batch(is_last=i == settings.accumulation - 1):
                with precision.autocast():
                    loss = language_model_loss(model, xb, yb)
                acc.backward(loss, reduction="sum", items=yb.numel())
        losses.append(acc.step().loss)
        _sync(device)
        seconds.append(time.perf_counter() - t0)
    opt.synchronize()  # the last delayed update lands before the peaks are read
    opt.close()
    step_s = statistics.median(seconds[1:]) if len(seconds) > 1 else None
    return {"losses": losses, "seconds": seconds, "median_s": step_s, "setup_peak_allocated_bytes": setup_peak,
            "tokens_per_s": batch * seq_len / step_s if step_s else None,
            "run_peak_allocated_bytes": torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None,
            "run_peak_reserved_bytes": torch.cuda.max_memory_reserved(device) if device.type == "cuda" else None}


def _run_into(row: dict[str, Any], run: Callable[[], dict[str, Any]], device: torch.device,
              retries_before: int | None) -> None:
    """Runs a training case into ``row``: its whole-run peaks, step time, losses and allocation retries, or the
    error it raised (an out-of-memory error is a result too)."""
    try:
        got = run()
        row.update(peak_allocated_bytes=got.get("run_peak_allocated_bytes"),
                   peak_reserved_bytes=got.get("run_peak_reserved_bytes"), step_s=got.get("median_s"),
                   tokens_per_s=got.get("tokens_per_s"), losses=got.get("losses"))
        if "setup_peak_allocated_bytes" in got:
            row["setup_peak_allocated_bytes"] = got["setup_peak_allocated_bytes"]
    except Exception as e:  # noqa: BLE001 - recorded in the row, which is the result
        row["error"] = _error(e)
    after = alloc_retries(device)
    row["alloc_retries"] = None if after is None or retries_before is None else after - retries_before


def _device(small: bool) -> torch.device:
    return torch.device("cpu" if small or not torch.cuda.is_available() else "cuda")


def _workload(small: bool) -> tuple[Any, int, int]:
    """(shape, tokens a sequence, sequences a step): docs/design.md's 1.1B at 4 x 2048, or a tiny Llama."""
    return (SHAPES["tiny"], 64, 4) if small else (SHAPES["1.1b"], 2048, 4)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# -- memtrain train, end to end --------------------------------------------------------------------------------
class PeakTracker:
    """The whole process's allocator peaks, although the training loop resets them every step: while installed,
    ``torch.cuda.reset_peak_memory_stats`` first folds the peaks so far into a running maximum."""

    def __init__(self) -> None:
        self.allocated: int | None = None
        self.reserved: int | None = None

    def read(self) -> None:
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            self.allocated = max(self.allocated or 0, torch.cuda.max_memory_allocated())
            self.reserved = max(self.reserved or 0, torch.cuda.max_memory_reserved())

    @contextlib.contextmanager
    def installed(self) -> Iterator[PeakTracker]:
        original = torch.cuda.reset_peak_memory_stats

        def reset(device: Any = None) -> None:
            self.read()
            original(device)

        torch.cuda.reset_peak_memory_stats = torch.cuda.memory.reset_peak_memory_stats = reset
        try:
            yield self
        finally:
            torch.cuda.reset_peak_memory_stats = torch.cuda.memory.reset_peak_memory_stats = original
            self.read()


def train_argv(case: str, small: bool, config: Path, out: Path) -> list[str]:
    """``memtrain train``'s arguments for ``case`` (memtrain-train or qlora)."""
    budget = BUDGETS[case][small]
    argv = ["train", "--hf-config", str(config), "--budget", budget, "--max-steps", "3", "--out", str(out),
            "--no-progress", "--seq-len", "64" if small else "256", "--global-batch-size", "8" if small else "16"]
    return argv + (["--lora", "16", "--quantize-base", "nf4"] if case == "qlora" else [])


def run_memtrain(argv: Sequence[str]) -> int:
    """``python -m memtrain ARGV`` in this process (``runpy``, as ``-m`` runs it); its exit status."""
    saved = sys.argv
    sys.argv = ["memtrain", *argv]
    try:
        runpy.run_module("memtrain", run_name="__main__", alter_sys=True)
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    finally:
        sys.argv = saved
    return 0


def case_memtrain_train(small: bool, case: str = "memtrain-train") -> dict[str, Any]:
    budget = BUDGETS[case][small]
    limit = parse_bytes(budget)
    row: dict[str, Any] = {"limit_bytes": limit}
    device = _device(small)
    with tempfile.TemporaryDirectory(prefix="memtrain-gpu-paths-") as tmp:
        config = Path(tmp) / "llama.json"
        config.write_text(json.dumps(TINY_LLAMA if small else TRAIN_LLAMA))
        run_dir = Path(tmp) / "run"  # not in $OUT: the run folder's files would count against the 8 that return
        argv = train_argv(case, small, config, run_dir)
        row["command"] = "python3 -m memtrain " + " ".join(argv)
        print(f"-- {case}: {row['command']}", flush=True)
        before = alloc_retries(device)
        with PeakTracker().installed() as peaks:
            row["exit"] = run_memtrain(argv)
        after = alloc_retries(device)
        row.update(peak_allocated_bytes=peaks.allocated, peak_reserved_bytes=peaks.reserved,
                   alloc_retries=None if after is None or before is None else after - before)
        row.update(run_folder_figures(run_dir))
    if row["exit"] != 0:
        row["error"] = f"memtrain train exited {row['exit']}"
    measured = device.type == "cuda"
    return finish(row, {
        "exit 0": row["exit"] == 0,
        "metrics.jsonl peak_bytes <= budget": within(row.get("metrics_peak_bytes"), limit) if measured else None,
        "report.json peak_bytes <= budget": within(row.get("report_peak_bytes"), limit) if measured else None,
        "whole process allocated <= budget": within(row["peak_allocated_bytes"], limit),
        "num_alloc_retries == 0": None if row["alloc_retries"] is None else row["alloc_retries"] == 0,
    })


def run_folder_figures(run_dir: Path) -> dict[str, Any]:
    """From the run folder: metrics.jsonl's largest ``peak_bytes``, its losses and step time, and report.json's
    measured ``peak_bytes`` (at the plan check) with the plan it chose."""
    out: dict[str, Any] = {}
    metrics_path, report_path = run_dir / "metrics.jsonl", run_dir / "report.json"
    if metrics_path.is_file():
        lines = [json.loads(line) for line in metrics_path.read_text().splitlines() if line.strip()]
        peaks = [m["peak_bytes"] for m in lines if m.get("peak_bytes") is not None]
        rates = [m["tokens_per_s"] for m in lines[1:] if m.get("tokens_per_s")]  # the first step allocates
        out.update(metrics_peak_bytes=max(peaks) if peaks else None, losses=[m.get("loss") for m in lines],
                   tokens_per_s=statistics.median(rates) if rates else None)
    if report_path.is_file():
        report = json.loads(report_path.read_text())
        out["report_peak_bytes"] = (report.get("measurement") or {}).get("peak_bytes")
        prediction = report.get("prediction") or {}
        out.update(plan=prediction.get("settings"), predicted_peak_bytes=prediction.get("peak_bytes"))
    return out


# -- FSDP2's host offload on one rank ---------------------------------------------------------------------------
def case_fsdp_offload(small: bool) -> dict[str, Any]:
    """``--fsdp --offload-optimizer`` on the one GPU there is: a process group of one rank, opened as ``memtrain
    train`` opens it on CUDA (cpu:gloo,cuda:nccl), and ``apply_plan`` of FSDP2 with the optimizer offloaded
    (CPUOffloadPolicy, pinned shards, torch's fused AdamW on the host). The 1.1B's layers (8 of 22) at 4 x 2048,
    every block recomputed, 3 steps clipped, then 3 unclipped (the step's skip flag, made on the device, read by
    the host step). Checks: every shard and its moments on the host (pinned on CUDA), the device's allocated peak
    below the fp32 weights it no longer holds, no retry, the loss finite and falling in both runs."""
    import os
    import socket

    import torch.distributed as dist

    device = _device(small)
    shape, seq_len, batch = _workload(small)
    shape = shape if small else DELAYED_SHAPE
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    dist.init_process_group("cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo", rank=0, world_size=1)
    row: dict[str, Any] = {}
    try:
        before = alloc_retries(device)
        _run_into(row, lambda: train_fsdp_offload(shape, seq_len, batch, device, row), device, before)
    finally:
        dist.destroy_process_group()
    return finish(row, {**peak_checks(row, row.get("fp32_weight_bytes"), reserved=False),
                        "shards and moments on the host": row.get("on_host"),
                        "shards pinned": row.get("pinned") if device.type == "cuda" else None,
                        "loss finite and falling (clipped)": losses_fall(row.get("losses") or []),
                        "loss finite and falling (skip flag)": losses_fall(row.get("losses_unclipped") or [])})


def train_fsdp_offload(shape: Any, seq_len: int, batch: int, device: torch.device,
                       row: dict[str, Any]) -> dict[str, Any]:
    """Two runs of 3 steps (clipped, then not) under ``apply_plan`` of FSDP2 with the optimizer offloaded; what
    they measured goes into ``row`` too (where the shards are, the fp32 weights' bytes)."""
    from memtrain.loss import language_model_loss
    from memtrain.planner import PlanSettings, apply_plan

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    settings = PlanSettings(micro_batch_size=batch, accumulation=1, blocks=("recompute",) * shape.layers,
                            flavor="full", chunked_loss=True, optimizer="offload", distribution="fsdp2",
                            compile=False, precision="bf16-mixed" if device.type == "cuda" else "fp32",
                            offload_weights=True)
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, shape.vocab, (batch, seq_len), generator=g).to(device)
    y = torch.randint(0, shape.vocab, (batch, seq_len), generator=g).to(device)
    out: dict[str, Any] = {}
    for key, clip in (("losses", 1.0), ("losses_unclipped", None)):
        model = build_llama(shape, seq_len, "cpu")  # on the host: FSDP2 places each block as it shards it
        row["fp32_weight_bytes"] = 4 * sum(p.numel() for p in model.parameters())
        run = apply_plan(model, settings, lr=1e-4, max_grad_norm=clip, device=device)
        losses, seconds = [], []
        for _ in range(3):
            _sync(device)
            t0 = time.perf_counter()
            with run.accumulator.micro_batch(is_last=True):
                with run.precision.autocast():
                    loss = language_model_loss(run.train_model, x, y)
                run.accumulator.backward(loss, reduction="sum", items=y.numel())
            losses.append(run.accumulator.step().loss)
            _sync(device)
            seconds.append(time.perf_counter() - t0)
        out[key] = losses
        if clip is not None:
            out["median_s"] = statistics.median(seconds[1:])
            out["tokens_per_s"] = batch * seq_len / out["median_s"]
            shards = [p.to_local() for p in model.parameters()]
            moments = [v.to_local() for p in model.parameters() for v in run.optimizer.state[p].values() if v.dim()]
            row["on_host"] = bool(moments) and all(t.device.type == "cpu" for t in shards + moments)
            row["pinned"] = all(t.is_pinned() for t in shards)
        del run, model
    row["losses_unclipped"] = out.pop("losses_unclipped")
    out["run_peak_allocated_bytes"] = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    out["run_peak_reserved_bytes"] = torch.cuda.max_memory_reserved(device) if device.type == "cuda" else None
    return out


CASE_FUNCTIONS: dict[str, Callable[[bool], dict[str, Any]]] = {
    "param-offload": case_param_offload,
    "pure-bf16": case_pure_bf16,
    "delayed-bf16-accumulation": case_delayed,
    "memtrain-train": case_memtrain_train,
    "qlora": lambda small: case_memtrain_train(small, "qlora"),
    "fsdp-offload": case_fsdp_offload,
}


def skip_reason(case: str) -> str | None:
    """Why ``case`` cannot run here (checked in the parent, which spends no process on it), or None."""
    if case == "qlora" and importlib.util.find_spec("bitsandbytes") is None:
        return ("skipped: bitsandbytes is not importable here (QLoRA's 4-bit base needs it); carry its wheel as "
                "benchmarks/gpu_check.sh's header says")
    return None


# -- the table -------------------------------------------------------------------------------------------------
def _mib(v: int | None) -> str:
    return "-" if v is None else format_bytes(v)


def format_table(rows: list[dict[str, Any]]) -> str:
    header = ("case", "status", "limit", "allocated", "reserved", "retries", "s/step", "tokens/s")
    lines = [header]
    notes = []
    for r in rows:
        lines.append((r["case"], r["status"], _mib(r.get("limit_bytes")), _mib(r.get("peak_allocated_bytes")),
                      _mib(r.get("peak_reserved_bytes")), "-" if r.get("alloc_retries") is None else
                      str(r["alloc_retries"]), "-" if r.get("step_s") is None else f"{r['step_s']:.3f}",
                      "-" if r.get("tokens_per_s") is None else f"{r['tokens_per_s']:,.0f}"))
        failed = [name for name, held in (r.get("checks") or {}).items() if held is False]
        if failed or r.get("error"):
            notes.append(f"  {r['case']}: " + "; ".join([*(f"{c}: NO" for c in failed),
                                                         *([r["error"]] if r.get("error") else [])]))
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    table = ["  ".join(v.ljust(w) for v, w in zip(line, widths, strict=True)).rstrip() for line in lines]
    return "\n".join(table + (["failed:", *notes] if notes else []))


# -- main ------------------------------------------------------------------------------------------------------
def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--small", action="store_true", help="tiny Llamas on this machine's CPU (a smoke run)")
    parser.add_argument("--cases", default=",".join(CASES), help=f"comma-separated, in order (default "
                        f"{','.join(CASES)})")
    parser.add_argument("--deadline", type=float, help="seconds the whole run may take: a case that would start "
                        f"with less than {MIN_CASE_S:.0f} s left is skipped (recorded), the last one is cut to fit")
    parser.add_argument("--case", choices=CASES, help=argparse.SUPPRESS)  # the child process: this one case
    parser.add_argument("--out", type=Path, default=Path("bench-results/gpu_paths.json"), help="the JSON file "
                        "(default bench-results/gpu_paths.json)")
    args = parser.parse_args(argv)
    args.cases = [c.strip() for c in args.cases.split(",") if c.strip()]
    unknown = [c for c in args.cases if c not in CASES]
    if unknown or not args.cases:
        parser.error(f"--cases {','.join(unknown) or '(none)'}: the cases are {', '.join(CASES)}")
    return args


def run_case_here(case: str, small: bool) -> dict[str, Any]:
    """The child's part: ``case`` in this process; an exception becomes the row's error."""
    started = time.perf_counter()
    try:
        row = CASE_FUNCTIONS[case](small)
    except Exception as e:  # noqa: BLE001 - planning failed, or the model could not be built: a result too
        row = finish({"error": _error(e)}, {})
        row["status"] = "error"
    row.update(case=case, case_s=time.perf_counter() - started)
    return row


def run_cases(args: argparse.Namespace, doc: dict[str, Any]) -> None:
    """Each case in a fresh process (or skipped, with why), its row appended to ``doc`` and written at once."""
    clock = Deadline(args.deadline)
    for case in args.cases:
        why = skip_reason(case)
        if why is None and clock.left() < MIN_CASE_S:
            why = f"skipped: {clock.left():.0f} s left of --deadline {args.deadline:.0f}"
        if why is not None:
            row: dict[str, Any] = {"case": case, "status": "skipped", "why": why}
            print(f"== {case}: {why}", flush=True)
        else:
            print(f"== {case}: a fresh process ==", flush=True)
            child_argv = ["--case", case] + (["--small"] if args.small else [])
            got, error = run_child(child_argv, min(CASE_LIMIT_S[case], clock.left()), script=__file__)
            row = got or {"case": case, "status": "error", "error": error or "no result"}
        doc["rows"].append(row)
        write_doc(args.out, doc)  # after every case: a run cut short keeps what it measured


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.case:
        write_doc(args.out, run_case_here(args.case, args.small))
        return 0
    doc: dict[str, Any] = {"title": "gpu_paths", **environment(_device(args.small), touch_cuda=False),
                           "small": args.small, "rows": []}
    previous = signal.signal(signal.SIGTERM, _kill_children)  # gpu_check.sh's timeout ends the case's process too
    try:
        run_cases(args, doc)
    finally:
        signal.signal(signal.SIGTERM, previous)
    print(f"\n== gpu_paths on {doc['device']} ==")
    print(format_table(doc["rows"]))
    print("allocated, reserved: the allocator's peaks over the whole case, set-up included; retries: "
          f"num_alloc_retries\nresults: {args.out}")
    return 1 if any(r["status"] in ("FAIL", "error") for r in doc["rows"]) else 0


if __name__ == "__main__":
    sys.exit(main())
