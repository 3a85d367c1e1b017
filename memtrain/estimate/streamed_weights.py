"""Parameter offload in ``estimate``: what streaming the blocks' weights from host memory changes in a step's
report. The weights are alive through a whole step without it, so the change is the same at every moment: the
blocks' weights leave the device but for the blocks in flight (``memtrain.offload.WeightStreamer``)."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from memtrain.checkpointing import find_blocks
from memtrain.choices import Choices
from memtrain.estimate.arguments import COMPILE_NOTE
from memtrain.estimate.fake import meta_model
from memtrain.offload import PREFETCH_DEFAULT
from memtrain.report import MemoryReport, format_bytes

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def block_weight_bytes(model: Any, weights_dtype: str | None = None) -> list[int]:
    """Each block's weight bytes on the device (``weights_dtype`` for floating parameters, else their own)."""
    meta = meta_model(model)
    modules = dict(meta.named_modules())
    target = _DTYPES.get(weights_dtype or "")

    def nbytes(p: torch.Tensor) -> int:
        dtype = target if target is not None and p.is_floating_point() else p.dtype
        return p.numel() * dtype.itemsize

    return [sum(nbytes(p) for p in modules[name].parameters()) for name in find_blocks(meta)]


def with_streamed_weights(report: MemoryReport, model: Any, weights_dtype: str | None = None,
                          prefetch: int = PREFETCH_DEFAULT) -> MemoryReport:
    """``report`` (a step with every weight on the device and the offloaded optimizer) with the blocks' weights
    streamed: parameter, peak and phase bytes less every block's weights but ``1 + prefetch`` of the largest; host bytes
    plus a gradient stage of their own beside a 16-bit cast (``CPUOffloadOptimizer.stream_weights``)."""
    blocks = block_weight_bytes(model, weights_dtype)
    in_flight = min(1 + prefetch, len(blocks)) * max(blocks)
    shift = in_flight - sum(blocks)
    stage = sum(blocks) if weights_dtype in ("bf16", "fp16") else 0
    note = (f"parameter offload: the {len(blocks)} blocks' weights ({format_bytes(sum(blocks))}) in host RAM, "
            f"{min(1 + prefetch, len(blocks))} on the device at a time ({format_bytes(in_flight)})")
    return dataclasses.replace(
        report, parameter_bytes=report.parameter_bytes + shift,
        peak_bytes=None if report.peak_bytes is None else report.peak_bytes + shift,
        phase_bytes=tuple((phase, nbytes + shift) for phase, nbytes in report.phase_bytes),
        host_bytes=report.host_bytes + stage, assumptions=(*report.assumptions, note))


def with_setup_notes(report: MemoryReport, setup: Choices | None, model: Any, weights_dtype: str | None) -> MemoryReport:
    """``estimate``'s report with what its set-up changes after the trace: a compiled step's note, streamed
    weights."""
    if setup is not None and setup.compile:
        report = dataclasses.replace(report, assumptions=(*report.assumptions, COMPILE_NOTE))
    if setup is not None and setup.offload_weights:
        report = with_streamed_weights(report, model, weights_dtype)
    return report
