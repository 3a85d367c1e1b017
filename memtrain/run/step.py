"""One optimizer step of the training loop (``one_step``) and its figures (``StepFigures``: a line of
metrics.jsonl), over batches that carry the count of their labels (``CountedBatch``, counted on the host before the
copy to the device: the loss gathers only those positions without waiting for the device).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, fields
from typing import Any, NamedTuple

import torch
from torch import nn

from memtrain.checkpointing import checkpoint_spec
from memtrain.device import accelerator
from memtrain.loss import language_model_loss
from memtrain.measure import MemoryMeter, optimizer_state_bytes

IGNORE_INDEX = -100  # the label of a position that carries no loss (a prompt, padding)


def unpack_batch(batch: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(inputs, targets, position ids or None) of a batch of windows ``(x, y)`` or packed rows."""
    x, y, *rest = batch
    return x, y, (rest[0] if rest else None)


class CountedBatch(NamedTuple):
    """A loader's batch with the number of its labels that count (not -100), read on the host."""

    batch: Any
    kept: int


class CountedBatches:
    """``loader``'s batches as ``CountedBatch``es: each batch's labels counted where they are, on the host, before
    ``DevicePrefetcher`` copies them (a count on the device would make the host wait for it)."""

    def __init__(self, loader: Iterable[Any]):
        self.loader = loader

    def __len__(self) -> int:
        return len(self.loader)  # type: ignore[arg-type]

    def __iter__(self) -> Iterator[CountedBatch]:
        for batch in self.loader:
            _, y, _ = unpack_batch(batch)
            yield CountedBatch(batch, int((y != IGNORE_INDEX).sum()))


def kept_share(data: Sequence[Any], rows: int = 256) -> float:
    """The share of label positions that count (not -100) in ``data``'s rows (``(x, y)`` or ``(x, y, positions)``),
    read from up to ``rows`` of them spread over it: what the chunked loss runs its head on (``plan(kept_share=)``).
    1.0 where none counts (no time to follow: the accumulator refuses such batches)."""
    n = len(data)
    picked = range(0, n, max(1, -(-n // rows)))  # at most ``rows`` of them
    kept = total = 0
    for i in picked:
        y = torch.as_tensor(data[i][1])
        kept, total = kept + int((y != IGNORE_INDEX).sum()), total + y.numel()
    return kept / total if kept else 1.0


@dataclass
class StepFigures:
    """One optimizer step's figures: its line of metrics.jsonl (``to_dict``), the plan check's measurement and
    the progress bar's text."""

    step: int  # counted from 1
    loss: float
    grad_norm: float
    skipped: bool
    tokens: int  # this rank's tokens in the step (the line holds tokens_per_s instead)
    seconds: float  # the step's time (forward, backward, optimizer; the line holds tokens_per_s instead)
    activation_bytes: int | None  # saved for backward in the first micro-batch (None: not measured)
    parameter_bytes: int
    gradient_bytes: int
    optimizer_state_bytes: int
    model_state_bytes: int
    peak_bytes: int | None  # the accelerator allocator's peak over the step (a simulated one's too; None on the CPU)
    # What the allocator held at most over the step, its cache included: what runs out on a GPU (None on the CPU)
    peak_reserved_bytes: int | None = None
    tokens_per_s: float = 0.0  # all ranks' tokens over the step's time
    lr: float = 0.0  # the learning rate the step used
    eval_loss: float | None = None  # on the steps that evaluate (the line has no eval_loss on the others)

    def to_dict(self) -> dict[str, Any]:
        """The line of metrics.jsonl: every figure but ``tokens`` and ``seconds``, ``eval_loss`` where it was
        measured."""
        line = {f.name: getattr(self, f.name) for f in fields(self) if f.name not in ("tokens", "seconds", "eval_loss")}
        if self.eval_loss is not None:
            line["eval_loss"] = self.eval_loss
        return line


def one_step(s: Any, step: int, device: torch.device, check_stop: Callable[[], None]) -> StepFigures:
    """One optimizer step: ``s.accumulation`` micro-batches, then the accumulator's boundary. The first
    micro-batch's saved bytes are counted (not while activations are offloaded: saved-tensor hooks do not stack,
    so the meter stays out; on an accelerator the allocator peak is the figure then).

    On an accelerator the step waits for the device once, at its end (its time must include the optimizer's
    kernels); the peak is read from the allocator's counters, which need no wait. The step runs inside
    ``acc.compute()``: what a simulated device counts as its work (a no-op on a real one).

    ``s`` is the run's ``memtrain.train.Session``: its model, optimizer, accumulator, precision and batches
    (``CountedBatch``es: the loss's head sees only the positions whose label counts, unless the step is compiled).
    """
    acc = accelerator(device)
    measuring = not offloads_blocks(s.model)
    t0 = time.perf_counter()
    if acc.tracks_memory:
        acc.reset_peak_memory_stats()
    tokens = 0
    # synchronize=False: the meter must not stall the queue twice per step; it counts saved bytes on the host.
    meter = MemoryMeter(s.model, s.optimizer, synchronize=False)
    with acc.compute():
        for i in range(s.accumulation):
            check_stop()  # a stop asked for now abandons the step here, between micro-batches
            # Already on the device: DevicePrefetcher copied it during the previous compute. The loader's own work
            # (sampling, collating) is host memory.
            with acc.host():
                counted = next(s.batches)
                x, y, positions = unpack_batch(counted.batch)
            kept = None if s.in_force.settings.compile else counted.kept  # a compiled graph takes one size
            with s.acc.micro_batch(is_last=i == s.accumulation - 1):
                # The meter counts what autograd saves in the first micro-batch: the figure checkpointing cuts.
                with meter if i == 0 and measuring else contextlib.nullcontext(), s.precision.autocast():
                    loss = language_model_loss(s.train_model, x, y, positions, kept=kept)
                items = (y != -100).sum()
                s.acc.backward(loss, reduction="sum", items=items)  # token-count-correct over the window and ranks
            tokens += y.numel()
        report = meter.report()
        result = s.acc.step()  # unscale -> clip -> optimizer step -> scheduler -> zero_grad, once
    if acc.has_streams:
        acc.synchronize()  # the step's one wait: its time includes the optimizer's kernels
    seconds = time.perf_counter() - t0
    state_bytes = optimizer_state_bytes(s.optimizer)
    return StepFigures(
        step=step + 1,
        loss=result.loss,
        grad_norm=result.grad_norm,
        skipped=result.skipped,
        tokens=tokens,
        seconds=seconds,
        activation_bytes=report.activation_bytes if measuring else None,
        parameter_bytes=report.parameter_bytes,
        gradient_bytes=report.gradient_bytes,
        optimizer_state_bytes=state_bytes,
        model_state_bytes=report.parameter_bytes + report.gradient_bytes + state_bytes,
        peak_bytes=acc.max_memory_allocated() if acc.tracks_memory else None,
        peak_reserved_bytes=acc.max_memory_reserved() if acc.tracks_memory else None,
    )


def offloads_blocks(model: nn.Module) -> bool:
    """Whether any checkpointed block of ``model`` offloads its activations (the meter then stays out)."""
    spec_offloaders = [checkpoint_spec(m) for m in model.modules()]
    return any(spec is not None and spec.offloader is not None and spec.offloader.enabled for spec in spec_offloaders)
