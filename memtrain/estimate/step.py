"""The step, traced: ``trace`` runs a steady-state training step on tensors without data (set-up, forward,
backward, optimizer step) and returns what it showed (``Trace``); ``estimate`` returns its report.

The set-up lives in ``prepare``; forward, backward and the optimizer step are the functions below, in the order the
step runs them. The order of what they record (allocations, frees, runs) is what the estimate is calibrated on, so
it is kept exactly.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from memtrain.checkpointing import find_blocks
from memtrain.choices import Choices
from memtrain.device import active_simulation
from memtrain.errors import ConfigError, MemtrainError, describe_exception
from memtrain.estimate.arguments import (
    AUTOCAST_DTYPES,
    OptimizerKind,
    Precision,
    batch_values,
    check_arguments,
    kept_labels,
    problems_before_tracing,
    setup_options,
)
from memtrain.estimate.attribution import attribute_release
from memtrain.estimate.cuda import CUDA_BLOCK
from memtrain.estimate.explain import assumptions_of, explain_peak, forward_failure
from memtrain.estimate.fake import call_convention, hf_sees_real_tensors
from memtrain.estimate.optimizer_state import OptimizerFigures, optimizer_figures
from memtrain.estimate.prepare import NullContext, Watch, fake_inputs, prepare_model, watch_step
from memtrain.estimate.streamed_weights import with_setup_notes
from memtrain.estimate.tracker import LiveTracker, Run
from memtrain.measure import as_loss
from memtrain.offload import MIN_BYTES_DEFAULT
from memtrain.report import MemoryReport
from memtrain.tiled_mlp import tiled_mlp_tokens


@dataclass(frozen=True)
class Trace:
    """What one traced step showed: the report, and the runs (per block, per phase) the planner composes."""

    report: MemoryReport
    runs: tuple[Run, ...]  # forward, then backward, in order
    blocks: tuple[str, ...]  # the model's repeated blocks, in order (wrapped or not)
    block_parameter_bytes: tuple[int, ...]  # bytes of the trainable parameters of each block
    trainable_bytes: int  # bytes of every trainable parameter (their gradients' bytes, in the same dtypes)
    state_bytes: int  # optimizer state on the device
    step_temp_bytes: int  # the optimizer step's temporaries on the device
    fixed_bytes: int  # allocated before forward: parameters, buffers, inputs, optimizer state, workspaces
    host_bytes: int  # optimizer state and offloaded activations in host memory
    offloaded_bytes: int  # of host_bytes, the activations (they cross the host link twice a step)
    forward_end_bytes: int  # bytes alive when forward ended, before autocast's cast cache was let go
    no_gradient: tuple[str, ...] = ()  # trainable parameters the step gives no gradient (so no optimizer state)


def estimate(
    model: Any,
    batch: Any = None,
    *,
    device: str = "cuda",
    precision: Precision = "fp32",
    checkpointing: Any = "none",
    optimizer: OptimizerKind = "adamw",
    setup: Choices | None = None,
    micro_batch_size: int | None = None,
    seq_len: int | None = None,
    accumulation: int = 1,
    weights_dtype: str | None = None,
    keep_output: bool = False,
    replay: bool = True,
) -> MemoryReport:
    """Predicts a training step's peak memory by running it on fake tensors: seconds of CPU, no device memory.

    The step is the steady state a training loop reaches from its second step on: forward with labels (the loss on
    fp32 logits for causal LMs), backward, optimizer step, ``zero_grad(set_to_none=True)``, with the optimizer state
    already allocated and only the loss kept from the forward's output. The first step's peak is lower (no optimizer
    state yet). With ``accumulation > 1`` it is the window's later micro-batches, which run with every gradient of
    the earlier ones alive (unless they stream to the host).

    Args:
        model: an ``nn.Module`` (any device, meta included; not modified, no data copied) or a Hugging Face
            ``PretrainedConfig`` (``AutoModelForCausalLM.from_config`` on the meta device). Where its output has no
            ``.loss`` (a base model such as ``BertModel``, a tensor, a tuple), the sum of its first tensor stands
            for the loss: the same saved tensors as a loss on it (``memtrain.measure.as_loss``, as ``measure``).
        batch: a token tensor (any device), a shape such as ``(4, 2048)``, a dict of model inputs (tensors or
            shapes: packed rows' ``position_ids`` and a padded ``attention_mask`` included, see ``batch_values``;
            ``labels`` with values: with the chunked loss, only the positions they count reach the head, as in
            memtrain's loop, see ``kept_labels``),
            or ``None``: ``(micro_batch_size, seq_len)``.
        device: ``"cuda"`` (CUDA autocast lists and attention kernels, 512-byte allocator blocks, cuBLAS
            workspaces) or ``"cpu"`` (the CPU's own kernels, as ``measure`` sees them).
        precision: ``"fp32"``, ``"bf16-mixed"`` or ``"fp16-mixed"`` (autocast; parameters keep their dtype).
        checkpointing: ``"none"``, ``"all"``, ``"every:K"`` / ``K``, any ``Checkpointing`` spelling, or a dict of
            ``apply_checkpointing`` arguments (per-block ``policies`` included); applied to a copy of the model.
            ``setup.checkpointing`` says the same (with this left at "none", or naming the same policy).
        optimizer: ``"adamw"`` (fused), ``"sgd"``, ``"sgd-momentum"``, ``"adafactor"`` or ``"adamw-offload"``
            (``CPUOffloadOptimizer``: state on the host, gradients streamed there as they are produced);
            ``setup.optimizer.placement="offload"`` makes ``"adamw"`` ``"adamw-offload"``.
        setup: the one set-up the step runs with (``memtrain.choices.Choices``; a None in it means off, fp32
            moments, no offload: there is no planner here). Its ``offload_activations``, ``chunked_loss``,
            ``pure_bf16``, ``tiled_mlp`` and ``optimizer``'s ``state_precision``, ``offload_fraction`` and ``step_in_backward`` are
            ``trace``'s keywords of those names (what each does to the step is said there); ``compile``: the
            prediction is still the eager step's, and the report's assumptions say so; ``offload_weights``: the
            blocks' weights streamed from host RAM (implies the offloaded optimizer).
        micro_batch_size, seq_len: override the batch's first and second dimensions.
        accumulation: micro-batches per optimizer step.
        weights_dtype: ``"bf16"`` / ``"fp16"`` / ``"fp32"``: the parameters' dtype on the device (e.g. bf16 weights
            whose fp32 master lives with ``"adamw-offload"``); None keeps the model's.
        keep_output: the loop holds the forward's output (its logits) until the step ends, as ``out = model(...);
            out.loss.backward()`` does; False (the default, memtrain's own loop) keeps only the loss.
        replay: on meta tensors (``device="cuda"``), reuse the output shapes of identical earlier op calls instead of
            running torch's meta functions again (same result, several times faster on deep models).

    Returns:
        A ``MemoryReport`` with ``source="estimated"``: parameter, gradient, optimizer-state and saved-activation
        bytes (activations exactly as ``measure`` counts them), ``peak_bytes`` (the predicted device peak),
        ``peak_phase`` (where, and the largest tensors alive there), ``phase_bytes`` (bytes alive after
        forward, backward and step), ``host_bytes`` and ``assumptions`` (including the breakdown at the peak).

    Raises:
        ConfigError: an unknown device, precision, optimizer or checkpointing policy; a ``setup`` that is not a
            ``Choices`` or contradicts ``checkpointing=`` / ``optimizer=`` / ``precision=`` (pure bf16 needs
            "bf16-mixed", as a run does); a batch that is missing, does not fit the model, or is too large to trace
            in bounded time. Every problem at once.
        MemtrainError: the model's forward cannot run on fake tensors (the message names the module).

    Example:
        >>> from memtrain.choices import Choices, OptimizerChoice
        >>> from memtrain.models import GPT, GPT_PRESETS
        >>> with torch.device("meta"):
        ...     model = GPT(GPT_PRESETS["gpt-tiny"])
        >>> report = estimate(model, (8, 64), device="cpu")
        >>> report.source, report.peak_bytes > report.parameter_bytes
        ('estimated', True)
        >>> lean = estimate(model, (8, 64), device="cpu", setup=Choices(
        ...     checkpointing="all", chunked_loss=True, optimizer=OptimizerChoice(state_precision="bf16")))
        >>> lean.peak_bytes < report.peak_bytes
        True
    """
    arguments = dict(device=device, precision=precision, micro_batch_size=micro_batch_size, seq_len=seq_len,
                     accumulation=accumulation, weights_dtype=weights_dtype)
    options = _setup_keywords(setup, model, batch, arguments, checkpointing=checkpointing, optimizer=optimizer)
    report = trace(model, batch, **arguments, **options, keep_output=keep_output, replay=replay).report
    return with_setup_notes(report, setup, model, weights_dtype)


def _setup_keywords(setup: Choices | None, model: Any, batch: Any, arguments: dict[str, Any], *,
                    checkpointing: Any, optimizer: OptimizerKind) -> dict[str, Any]:
    """``trace``'s set-up keywords from ``setup`` (beside ``checkpointing=`` and ``optimizer=``); a ConfigError
    naming ``setup``'s problems with the other arguments' and the batch's against the model (every problem known
    before tracing, at once)."""
    options, problems = setup_options(setup, checkpointing=checkpointing, optimizer=optimizer,
                                      precision=arguments["precision"])
    dtype = options.pop("weights_dtype", None)  # the set-up's device weights (an offloaded master's bf16 casts)
    if dtype is not None and arguments["weights_dtype"] not in (None, dtype):
        # Python's argument only (the command line has no such flag): not kept as an argument
        problems.append(f"weights_dtype={arguments['weights_dtype']!r} with setup.optimizer.placement="
                        f"'offload-bf16-weights': its device weights are {dtype}. To resolve this error, drop "
                        f"weights_dtype or pass weights_dtype={dtype!r}.")
    elif dtype is not None:
        arguments["weights_dtype"] = dtype
    ConfigError.raise_if(problems_before_tracing(model, batch, problems, **arguments, **options))
    return options


def trace(
    model: Any,
    batch: Any = None,
    *,
    device: str = "cuda",
    precision: Precision = "fp32",
    checkpointing: Any = "none",
    offload_activations: bool = False,
    optimizer: OptimizerKind = "adamw",
    state_precision: str = "fp32",
    offload_fraction: float = 0.0,
    step_in_backward: bool = False,
    chunked_loss: bool = False,
    micro_batch_size: int | None = None,
    seq_len: int | None = None,
    accumulation: int = 1,
    weights_dtype: str | None = None,
    keep_output: bool = False,
    replay: bool = True,
    runs: bool = False,
    offload_min_bytes: int = MIN_BYTES_DEFAULT,
    no_gradient: frozenset[str] = frozenset(), pure_bf16: bool = False,  # pure: bf16 weights, no master
    tiled_mlp: bool = False,
) -> Trace:
    """``estimate``'s step, with what the planner composes plans from: the bytes and work of every block's
    forward and backward.

    Args:
        model, batch, device, precision, checkpointing, optimizer, micro_batch_size, seq_len, accumulation,
            weights_dtype, keep_output, replay: as ``estimate`` takes them.
        offload_activations: activations in pinned host memory, as ``memtrain train --offload-activations`` does:
            with checkpointing, the recomputed blocks' saved inputs; without, every saved tensor of
            ``offload_min_bytes`` (1 MiB) or more outside the head. Blocks with an ``"offload"`` policy (or a
            "+offload" policy) offload whatever they save either way. Simulated exactly (what leaves the device,
            what comes back and when, two records prefetched ahead).
        state_precision, offload_fraction, step_in_backward: AdamW as ``memtrain.optim.build_optimizer`` builds
            it: moments in ``state_precision`` "fp32", "bf16" or "int8"; ``offload_fraction`` of the parameters'
            state in host RAM (their gradients streamed there); ``step_in_backward``: each parameter stepping in
            backward, its gradient freed at once.
        chunked_loss: the loss computed with ``memtrain.loss.apply_chunked_loss`` (the model's own chunk size when
            its loss is chunked already, else 1024 tokens of logits at a time) instead of on the whole batch's fp32
            logits; applied to a copy of the model.
        pure_bf16: bf16 weights with no fp32 master anywhere (pure bf16 AdamW).
        tiled_mlp: each block's MLP over tiles of tokens (``memtrain.tiled_mlp.apply_tiled_mlp``: the model's own
            tile size where it has one, else the hidden size), applied to the copy of the model; False: whole, as
            ``apply_plan`` leaves a model whose plan says so.
        runs: record the runs (``Trace.runs``; empty otherwise).
        offload_min_bytes: the smallest storage the simulated offloader moves (the real one's by default).
        no_gradient: trainable parameters given no gradient, so no optimizer state: those the loss does not reach
            (a first trace finds them, then traces the step again so).

    These keywords are the fields of ``estimate``'s ``setup`` (a None there is False / "fp32" / 0.0 here).
    """
    arguments = dict(locals())  # this call's arguments, for the trace again once such parameters are found
    device_type, lean, ckpt, spec = check_arguments(
        model, batch, device=device, precision=precision, checkpointing=checkpointing,
        offload_activations=offload_activations, optimizer=optimizer, state_precision=state_precision,
        offload_fraction=offload_fraction, step_in_backward=step_in_backward, chunked_loss=chunked_loss,
        micro_batch_size=micro_batch_size, seq_len=seq_len, accumulation=accumulation, weights_dtype=weights_dtype,
        tiled_mlp=tiled_mlp)
    step = _set_up(model, spec, ckpt, isinstance(batch, Mapping), device_type=device_type, precision=precision,
                   lean=lean, optimizer=optimizer, state_precision=state_precision, offload_fraction=offload_fraction,
                   step_in_backward=step_in_backward, chunked_loss=chunked_loss, accumulation=accumulation,
                   weights_dtype=weights_dtype, offload_activations=offload_activations, replay=replay, runs=runs,
                   offload_min_bytes=offload_min_bytes, no_gradient=no_gradient, pure_bf16=pure_bf16,
                   tiled_mlp=tiled_mlp, kept=kept_labels(batch))
    ran = _run_step(step, batch, keep_output, no_gradient)
    if ran.unreached:  # as the optimizers do, no state for them: the step again (outside this one's modes) without it
        return trace(**{**arguments, "no_gradient": no_gradient | ran.unreached})
    report = _report_of(step, ran, device_type=device_type, keep_output=keep_output, accumulation=accumulation,
                        weights_dtype=weights_dtype, chunked_loss=chunked_loss, no_gradient=no_gradient)
    return _trace_of(report, step, ran, no_gradient)


# -- set-up -------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class _Step:
    """A step set up to be traced: the model's meta copy, its fake inputs, the optimizer's figures and what watches
    the step (``prepare.watch_step``)."""

    meta: nn.Module
    checkpointing: Any  # the checkpointing applied to ``meta`` (``prepare_model``'s), for the assumptions
    chunk_tokens: int | None  # the chunked loss's tokens of logits at a time
    fake_mode: Any
    inputs: dict[str, torch.Tensor]
    run: Callable[[dict[str, torch.Tensor]], Any]  # the model called on the inputs as the batch says
    params: list[nn.Parameter]
    trainable: list[nn.Parameter]  # with a gradient and optimizer state
    optim: OptimizerFigures
    watch: Watch
    on_cuda: bool  # CUDA's kernels and cuBLAS workspaces (not a simulated device, which runs the CPU's)

    @property
    def offloaded_bytes(self) -> int:
        """The activations the simulated offloader holds in host memory (they cross the host link twice a step)."""
        return self.watch.offload.host_bytes if self.watch.offload is not None else 0


def _set_up(model: Any, spec: Any, ckpt: Any, named_inputs: bool, *, device_type: str, precision: Precision,
            lean: bool, optimizer: OptimizerKind, state_precision: str, offload_fraction: float,
            step_in_backward: bool, chunked_loss: bool, accumulation: int, weights_dtype: str | None,
            offload_activations: bool, replay: bool, runs: bool, offload_min_bytes: int,
            no_gradient: frozenset[str], pure_bf16: bool, tiled_mlp: bool, kept: int | None) -> _Step:
    """The model's meta copy with the set-up applied (``prepare_model``), its fake inputs, the optimizer's state
    figures and the watchers of the step (allocations, runs, the simulated offloader)."""
    on_cuda = device_type == "cuda" and active_simulation() is None  # simulated: the CPU's kernels, no cuBLAS
    round_to = CUDA_BLOCK if device_type == "cuda" else 1  # a simulated device's allocator is CUDA's
    meta, kwargs, offloads, chunk_tokens = prepare_model(model, spec, ckpt, chunked_loss=chunked_loss,
                                                         weights_dtype="bf16" if pure_bf16 else weights_dtype,
                                                         offload_activations=offload_activations,
                                                         tiled_mlp=tiled_mlp)
    fake_mode, inputs = fake_inputs(meta, spec, on_cuda)
    run = call_convention(meta, spec, named_inputs, kept)

    params = list(dict.fromkeys(p for p in meta.parameters()))
    # Not frozen (forward saves for them as in the real step), but without gradient or optimizer state.
    trainable = [p for name, p in meta.named_parameters() if p.requires_grad and name not in no_gradient]
    optim = optimizer_figures(trainable, optimizer, lean=lean or pure_bf16, state_precision=state_precision,
                              offload_fraction=offload_fraction, step_in_backward=step_in_backward, pure_bf16=pure_bf16,
                              accumulation=accumulation, device_type=device_type, round_to=round_to,
                              idle=[p for name, p in meta.named_parameters() if name in no_gradient])
    watch = watch_step(meta, inputs, params, trainable, optim, fake_mode, round_to=round_to, record=runs,
                       replay=on_cuda and replay, on_cuda=on_cuda, autocast_dtype=AUTOCAST_DTYPES[precision],
                       accumulation=accumulation, chunked_loss=chunked_loss, offloads=offloads,
                       offload_activations=offload_activations, offload_min_bytes=offload_min_bytes)
    return _Step(meta, kwargs, chunk_tokens, fake_mode, inputs, run, params, trainable, optim, watch, on_cuda)


# -- the step ---------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class _Ran:
    """What running the step showed beyond its watchers' records."""

    unreached: frozenset[str]  # trainable parameters the loss does not reach (the step stopped after forward)
    forward_end_bytes: int = 0
    grad_names: dict[int, str] = field(default_factory=dict)  # the gradients alive in the step, by allocation serial
    peak_live: Any = None  # the tracker's peak: what was alive, in which phase, where
    peak_phase: str = ""
    peak_where: Any = None


def _run_step(step: _Step, batch: Any, keep_output: bool, no_gradient: frozenset[str]) -> _Ran:
    """Forward, backward and the optimizer step, in the fake mode and under the watchers; backward and the step
    only when the loss reaches every trainable parameter (else the step is traced again without them)."""
    watch, meta, tracker = step.watch, step.meta, step.watch.tracker
    with (hf_sees_real_tensors(*batch_values(batch)), step.fake_mode, tracker, watch.where, watch.meter,
          (watch.rules or NullContext())):
        out, loss, forward_end_bytes = _forward(watch, meta, step.run, step.inputs, keep_output)
        unreached = _unreached(meta, loss) - no_gradient
        if not unreached:
            _backward(watch, meta, loss)
            grad_names = _optimizer_step(watch, meta, step.optim.step_temp_bytes)
            peak_live, (peak_phase, peak_where) = tracker.peak_live, tracker.peak_at
        del out, loss
    for handle in watch.hooks:
        handle.remove()
    if unreached:
        return _Ran(unreached)
    return _Ran(unreached, forward_end_bytes, grad_names, peak_live, peak_phase, peak_where)


def _forward(watch: Watch, meta: nn.Module, run: Callable[[dict[str, torch.Tensor]], Any],
             inputs: dict[str, torch.Tensor], keep_output: bool) -> tuple[Any, torch.Tensor, int]:
    """Forward (inside autocast: CUDA's emulated, or the CPU's own). Returns (the output if kept, else None; the
    loss; the bytes alive when forward ended, before autocast's cast cache was let go)."""
    where, tracker, meter, rules = watch.where, watch.tracker, watch.meter, watch.rules
    if rules is not None:
        rules.autocast, rules.cache = True, None  # MixedPrecision.autocast() keeps no weight-cast cache
    try:
        with watch.cpu_autocast, watch.whole_forward:
            out = run(inputs)
            loss = as_loss(out, f"estimate: the forward of {type(meta).__name__}")
            if not keep_output:
                out = None  # as memtrain's loop does: only the loss outlives forward (and the logits die)
            before_release = dict(tracker.live)  # autocast's cast cache dies with its region
    except MemtrainError:
        raise
    except Exception as e:  # noqa: BLE001 - re-raised with the module and the fix
        module = where.stack[-1] if where.stack else type(meta).__name__
        raise MemtrainError(forward_failure(module, e)) from None
    if rules is not None:
        rules.cache = None  # autocast's cast cache dies when the autocast region ends
    tracker.snapshot()
    forward_end_bytes = tracker.current + sum(v[0] for k, v in before_release.items() if k not in tracker.live)
    attribute_release(tracker, before_release)
    tracker.end_runs()
    watch.phase_bytes.append(("forward", tracker.current))
    meter.mark("forward")
    return out, loss, forward_end_bytes


def _unreached(meta: nn.Module, loss: torch.Tensor) -> frozenset[str]:
    """The trainable parameters of ``meta`` that ``loss`` does not reach: they get no gradient."""
    reached = parameters_reached(loss)
    return frozenset(name for name, p in meta.named_parameters() if p.requires_grad and id(p) not in reached)


def parameters_reached(loss: torch.Tensor) -> set[int]:
    """The ids of the leaf tensors (parameters) ``loss``'s autograd graph accumulates a gradient into."""
    reached: set[int] = set()
    seen: set[Any] = set()
    stack = [loss.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        variable = getattr(node, "variable", None)  # an AccumulateGrad node's leaf
        if isinstance(variable, torch.Tensor):
            reached.add(id(variable))
        stack.extend(child for child, _ in node.next_functions)
    return reached


def _backward(watch: Watch, meta: nn.Module, loss: torch.Tensor) -> None:
    """Backward (autograd turns grad mode off; only checkpoint recomputes run with it, under autocast)."""
    where, tracker, meter, rules, offload = watch.where, watch.tracker, watch.meter, watch.rules, watch.offload
    tracker.phase, where.in_backward = "backward", True
    where.stack.clear()
    try:
        loss.backward()
    except Exception as e:  # noqa: BLE001 - re-raised with the place and the fix
        raise MemtrainError(
            f"estimate: the backward failed on fake tensors near {where.backward_label or type(meta).__name__!r}: "
            f"{describe_exception(e)}. To resolve this error, estimate "
            "without checkpointing to see whether the recompute is the cause, or use memtrain.measure on a "
            "device with memory."
        ) from None
    if offload is not None:
        offload.end_of_backward()
    where.in_backward = False
    tracker.end_runs()
    meter.mark("backward")
    tracker.snapshot()
    watch.phase_bytes.append(("backward", tracker.current))
    if rules is not None:
        rules.autocast = False


def _optimizer_step(watch: Watch, meta: nn.Module, step_temp_bytes: int) -> dict[int, str]:
    """Optimizer step: parameters, gradients and state at once, plus the step's temporaries. Returns the names of
    the gradients alive, by allocation serial."""
    tracker = watch.tracker
    tracker.phase = "optimizer step"
    grad_names = {tracker.live[k][2]: name for name, k in (
        (name, p.grad.untyped_storage()._cdata) for name, p in meta.named_parameters() if p.grad is not None
    ) if k in tracker.live}
    tracker.add_block(step_temp_bytes)
    tracker.snapshot()
    watch.phase_bytes.append(("step", tracker.current))
    return grad_names


# -- what the step showed ---------------------------------------------------------------------------------------
def _book_gradients(tracker: LiveTracker, landed: dict[int, tuple[int, int, int]]) -> None:
    """Books each gradient to the run it came into being in (and to its peak when alive there)."""
    for allocated, (nbytes, index, serial) in landed.items():
        run = tracker.runs[index]
        run.gradient_bytes += nbytes
        run.gradients.append((serial, nbytes))
        if allocated <= run.peak_serial:
            run.gradient_bytes_at_peak += nbytes


def _report_of(step: _Step, ran: _Ran, *, device_type: str, keep_output: bool, accumulation: int,
               weights_dtype: str | None, chunked_loss: bool, no_gradient: frozenset[str]) -> MemoryReport:
    """The step's ``MemoryReport``: the bytes by category, the peak explained, and the assumptions."""
    watch, tracker, optim, offload = step.watch, step.watch.tracker, step.optim, step.watch.offload
    if watch.landed is not None:
        _book_gradients(tracker, watch.landed)
    measured = watch.meter.report()
    peak_phase, by_category = explain_peak(tracker, ran.peak_live, ran.peak_phase, ran.peak_where, ran.grad_names,
                                           state_bytes=optim.state_bytes, step_temp_bytes=optim.step_temp_bytes,
                                           workspace=watch.workspace)
    offloaded_bytes = step.offloaded_bytes
    assumptions = assumptions_of(keep_output=keep_output, optimizer_note=optim.note, by_category=by_category,
                                 accumulation=accumulation, streamed=bool(optim.leaving), weights_dtype=weights_dtype,
                                 on_cuda=step.on_cuda, checkpointing=step.checkpointing, chunked_loss=chunked_loss,
                                 chunk_tokens=step.chunk_tokens, offload=offload, offloaded_bytes=offloaded_bytes,
                                 tile_tokens=tiled_mlp_tokens(step.meta))
    assumptions += _no_gradient_note(no_gradient)
    return MemoryReport(
        parameter_bytes=sum(p.numel() * p.element_size() for p in step.params),
        gradient_bytes=measured.gradient_bytes,
        optimizer_state_bytes=optim.all_state_bytes,
        activation_bytes=measured.activation_bytes,
        activation_tensors=measured.activation_tensors,
        device=device_type,
        source="estimated",
        peak_bytes=tracker.peak,
        peak_phase=peak_phase,
        phase_bytes=tuple(watch.phase_bytes),
        host_bytes=optim.host_bytes + offloaded_bytes,
        assumptions=tuple(assumptions),
        reserved_bytes=tracker.segments.peak_reserved if tracker.segments is not None else None,
        needed_bytes=tracker.segments.least_capacity() if tracker.segments is not None else None,
    )


def _no_gradient_note(no_gradient: frozenset[str]) -> list[str]:
    if not no_gradient:
        return []
    names = sorted(no_gradient)
    return [f"{len(names)} trainable parameter(s) the loss does not reach, so no gradient nor optimizer state "
            f"(optimizers create it lazily): {', '.join(names[:4])}"
            + (f" and {len(names) - 4} more (Trace.no_gradient)" if len(names) > 4 else "")]


def _trace_of(report: MemoryReport, step: _Step, ran: _Ran, no_gradient: frozenset[str]) -> Trace:
    """The ``Trace`` of a step: its report, its runs (the phase-boundary markers left out) and its blocks."""
    modules = dict(step.meta.named_modules())
    block_names = tuple(find_blocks(step.meta))
    return Trace(
        report=report,
        runs=tuple(r for r in step.watch.tracker.runs if r.phase != "-"),
        blocks=block_names,
        block_parameter_bytes=tuple(sum(p.numel() * p.element_size() for n, p in modules[name].named_parameters(
            prefix=name) if p.requires_grad and n not in no_gradient) for name in block_names),
        trainable_bytes=sum(p.numel() * p.element_size() for p in step.trainable),
        state_bytes=step.optim.state_bytes,
        step_temp_bytes=step.optim.step_temp_bytes,
        fixed_bytes=step.watch.fixed_bytes,
        host_bytes=report.host_bytes,
        offloaded_bytes=step.offloaded_bytes,
        forward_end_bytes=ran.forward_end_bytes,
        no_gradient=tuple(sorted(no_gradient)),
    )
