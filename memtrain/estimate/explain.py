"""What a traced step's report says in words: where the peak is and what makes it (by category, and its largest
tensors), and the assumptions the figures rest on.
"""

from __future__ import annotations

from typing import Any

from memtrain.errors import describe_exception
from memtrain.estimate.simulated_offload import SimulatedOffload
from memtrain.estimate.tracker import LiveTracker
from memtrain.report import format_bytes

_FRIENDLY = {
    "_log_softmax": "log-softmax of the logits",
    "_log_softmax_backward_data": "logits grad",
    "nll_loss_backward": "loss grad wrt log-probs",
}


def describe_tensor(nbytes: int, label: tuple[Any, ...], grad_of: str | None) -> str:
    """One tensor alive at the peak, in words: what it is, its bytes, shape and dtype."""
    phase, where, op, shape, dtype = label
    what = f"grad of {grad_of}" if grad_of else _FRIENDLY.get(op, f"{op} output")
    if op == "_to_copy" and not grad_of:
        what = f"cast to {str(dtype).replace('torch.', '')}"
    dims = "x".join(str(d) for d in shape)
    return f"{what} {format_bytes(nbytes)} ({dims} {str(dtype).replace('torch.', '')})"


def explain_peak(tracker: LiveTracker, peak_live: dict[int, tuple[int, tuple[Any, ...], int]], peak_phase_name: str,
                 peak_where: str, grad_names: dict[int, str], *, state_bytes: int, step_temp_bytes: int,
                 workspace: int) -> tuple[str, dict[str, int]]:
    """(where the peak is, with its largest tensors; bytes alive there by category) from the live set at the peak."""
    by_category = {"parameters": 0, "gradients": 0, "saved activations": 0, "other live tensors": 0}
    for nbytes, label, serial in peak_live.values():
        category = ("parameters" if label[2] in ("parameter", "buffer") else "gradients" if serial in grad_names
                    else "saved activations" if serial in tracker.saved_serials else "other live tensors")
        by_category[category] += nbytes
    by_category["optimizer state"] = state_bytes
    if peak_phase_name == "optimizer step":
        by_category["optimizer step temporaries"] = step_temp_bytes
    if workspace:
        by_category["cuBLAS workspaces"] = workspace
    largest = sorted((v for v in peak_live.values() if v[1][2] not in ("parameter", "buffer")), key=lambda v: -v[0])[:3]
    peak_phase = peak_phase_name if peak_phase_name == "optimizer step" else f"{peak_phase_name} of {peak_where}"
    if peak_phase_name == "optimizer step" and step_temp_bytes:
        peak_phase += f": optimizer step temporaries {format_bytes(step_temp_bytes)}"
    elif largest:
        peak_phase += ": " + ", ".join(describe_tensor(n, label, grad_names.get(serial)) for n, label, serial in largest)
    return peak_phase, by_category


def assumptions_of(*, keep_output: bool, optimizer_note: str, by_category: dict[str, int], accumulation: int,
                   streamed: bool, weights_dtype: str | None, on_cuda: bool, checkpointing: dict[str, Any] | None,
                   chunked_loss: bool, chunk_tokens: int, offload: SimulatedOffload | None,
                   offloaded_bytes: int, tile_tokens: int | None = None) -> list[str]:
    """The assumptions a traced step's figures rest on, one sentence each."""
    assumptions = [
        "steady-state step (optimizer state allocated); forward with labels, backward, optimizer step, "
        "zero_grad(set_to_none=True); "
        + ("the forward's output (logits) is kept until the step ends" if keep_output else
           "only the loss outlives forward (the output's logits die with it)"),
        optimizer_note,
        "at the peak: " + ", ".join(f"{k} {format_bytes(v)}" for k, v in by_category.items() if v),
    ]
    if accumulation > 1:
        assumptions.append(f"a later micro-batch of {accumulation} in the window: "
                           + ("gradients stream to the host, none accumulate on the device" if streamed else
                              "every gradient of the earlier ones is alive from its start"))
    if weights_dtype is not None:
        assumptions.append(f"device weights in {weights_dtype}")
    if on_cuda:
        assumptions.append(
            "CUDA rules: autocast op lists, the attention kernel CUDA picks on sm90 (flash for fp16/bf16 without a "
            "mask, memory-efficient for fp32 without grouped-query heads, else the math kernel), allocations "
            "rounded to 512-byte blocks (the peak is memory_allocated's; the peak reserved replays the same "
            "allocations through the caching allocator's segments, one stream)"
        )
    if checkpointing is not None:
        shown = {k: v for k, v in checkpointing.items() if k != "offloader"}
        assumptions.append(f"checkpointing: apply_checkpointing({', '.join(f'{k}={v!r}' for k, v in shown.items())})")
    if chunked_loss:
        assumptions.append(f"loss: apply_chunked_loss ({chunk_tokens} tokens of fp32 logits at a time, recomputed "
                           "in backward)")
    if tile_tokens is not None:
        assumptions.append(f"MLP: apply_tiled_mlp ({tile_tokens or 'the hidden size of'} tokens a tile, in forward and "
                           "again in backward, one tile at a time)")
    if offload is not None:
        assumptions.append(
            f"activation offload: {format_bytes(offloaded_bytes)} of saved activations ({len(offload.records)} "
            "storages of 1 MiB or more, not parameters or their casts) in pinned host memory, back on the device "
            "when backward needs them, two prefetched ahead; a copy's device memory is freed when it is issued (the "
            "copy's own latency is not modelled)"
        )
    return assumptions


def forward_failure(module: str, error: BaseException) -> str:
    """Why the forward of ``module`` failed on tensors without data, in one line, with the fix: a value it reads, an
    operator with no shape-only kernel, or (anything else) a batch that does not fit the model."""
    from torch._subclasses.fake_tensor import (
        DataDependentOutputException,
        DynamicOutputShapeException,
        UnsupportedOperatorException,
    )

    what = describe_exception(error)
    fix = ("use memtrain.measure on a device with memory; `memtrain train` runs without the estimate when every "
           "technique is fixed by flag")
    # A value read: fake tensors raise their own exceptions, meta tensors (a CUDA target) "no data!".
    reads = isinstance(error, (DataDependentOutputException, DynamicOutputShapeException)) or any(
        said in str(error) for said in ("Cannot copy out of meta tensor", "cannot be called on meta tensors"))
    if reads:
        return (f"estimate: {module!r} reads a tensor value computed from the batch or the weights (an .item(), "
                ".tolist() or value-dependent shape, e.g. a mixture-of-experts router's token counts: "
                f"{what}), which a trace without data does not have. To resolve this error, make that module's "
                f"shapes independent of values, or {fix}.")
    if isinstance(error, (UnsupportedOperatorException, NotImplementedError)):
        return (f"estimate: {module!r} calls an operator that cannot run without data ({what}). To resolve this "
                f"error, {fix}.")
    return (f"estimate: the forward of {module!r} failed on fake tensors (shapes only, no values): {what}. This "
            "happens when a module reads tensor values (.item(), .tolist(), data-dependent shapes, numpy) or when "
            "the batch does not fit the model. To resolve this error, check the batch's shape and dtype against the "
            "model, or make that module's forward shape-only (e.g. precompute the value it reads); or, on a device "
            "with memory, use memtrain.measure instead.")
