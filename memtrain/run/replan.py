"""A training run's plan: ``TrainConfig``'s choices as the planner's constraints, the check of the plan against
the device at step 2, and the re-plan when the device disagrees.

``train()`` calls these in order; the decisions themselves are ``memtrain.planner``'s. When the device
disagrees (the measured peak passes the budget, or a step runs out of memory) the shortfall is folded into every
predicted peak (``plan(correction_bytes=)``) and the plan is made again, keeping the optimizer (its state is
already built) and the global batch: the next plan is the fastest that fits with the estimate corrected, not
merely half the micro-batch.
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from memtrain import techniques
from memtrain.checkpointing import find_blocks
from memtrain.choices import Choices
from memtrain.config import TrainConfig
from memtrain.device import accelerator
from memtrain.errors import ConfigError, MemtrainError
from memtrain.loss import supports_chunked_loss
from memtrain.measure import available_host_bytes
from memtrain.message import WHATEVER, arg, marked
from memtrain.planner import Plan, PlanSettings, budget_bytes, plan, planning_device
from memtrain.planner.settings import Fixed
from memtrain.report import format_bytes, parse_bytes
from memtrain.run.state import PlanCheck

OOM_MIN_OVERSHOOT = 0.02  # of the predicted peak: the least a step that ran out of memory is taken to have missed
# The TrainConfig fields that shape the plan: a resume that changes none of them continues on the plan the run
# had (re-planned ones included); one that changes any plans again.
PLAN_FIELDS = ("budget", "host_budget", "safety_margin", "micro_batch_size", "choices")


@dataclass(frozen=True)
class PlanInForce:
    """The plan a run follows now: the planner's ``Plan`` (None for a model without repeated blocks: nothing is
    planned per block), its settings, the budget in effect and the correction folded into it so far."""

    settings: PlanSettings
    plan: Plan | None
    budget_bytes: int | None
    reasons: tuple[str, ...]
    correction_bytes: int = 0
    unchecked: str = ""  # why a plan of a model with blocks is None: the estimate could not run (the plan check is off)

    def to_dict(self) -> dict[str, Any]:
        """The settings (the run's shape and the ``Choices`` that fix them: ``PlanSettings.to_dict``) and the
        predictions (the compact form of ``TrainResult.plan``)."""
        p = self.plan
        return {"settings": self.settings.to_dict(), "budget_bytes": self.budget_bytes,
                "usable_bytes": p.usable_bytes if p else None, "correction_bytes": self.correction_bytes,
                "peak_bytes": p.peak_bytes if p else None, "activation_bytes": p.activation_bytes if p else None,
                "host_bytes": p.host_bytes if p else None, "step_seconds": p.step_seconds if p else None,
                "tokens_per_s": p.tokens_per_s if p else None}


@dataclass(frozen=True)
class RunContext:
    """What the run is, as every plan of it sees it: fixed at the start (``train`` builds it once) and passed to
    ``plan_for_run`` and ``replan`` alike."""

    seq_len: int  # tokens per example
    global_batch: int  # examples per optimizer step, all ranks
    device: torch.device  # the training device
    world: int  # ranks (1 without torchrun)
    precision: str  # resolved: "fp32", "bf16-mixed" or "fp16-mixed"
    packed: bool = False  # packed rows (position_ids restart at each document): the plan traces such batches
    precision_reason: str | None = None  # resolve_precision's ("fp32, because: ..."), for the plan's reasons
    kept_share: float = 1.0  # the share of label positions the loss counts (memtrain.run.step.kept_share)


def plan_request(config: TrainConfig) -> dict[str, Any]:
    """The plan-shaping fields of ``config`` as JSON values (kept in checkpoints; see ``PLAN_FIELDS``)."""
    out = {name: getattr(config, name) for name in PLAN_FIELDS}
    out["choices"] = config.choices.to_dict()
    return out


def read_plan_request(saved: Any) -> dict[str, Any] | None:
    """A checkpoint's plan request (``plan_request``'s form); None where it is missing or not a mapping."""
    return dict(saved) if isinstance(saved, Mapping) else None


def flat_settings(values: Mapping[str, Any]) -> dict[str, Any]:
    """A saved config (``TrainConfig.to_dict``) with its choices' run-level fields at the top (checkpointing,
    offload_activations, chunked_loss, tiled_mlp, compile), as a resume's log compares them."""
    out = {k: v for k, v in values.items() if k != "choices"}
    saved = values.get("choices")
    try:
        choices = Choices.from_dict(saved if isinstance(saved, Mapping) else {})
    except ConfigError:
        return out
    top = {**choices.to_dict(), "checkpointing": str(choices.checkpointing or "auto")}  # None: the plan's, "auto"
    return {**out, **{name: top[name] for name in ("checkpointing", "offload_activations", "chunked_loss", "tiled_mlp",
                                                   "compile")}}


def run_budget(config: TrainConfig, model: nn.Module, device: torch.device) -> tuple[int, str]:
    """The device bytes per rank the plan must fit, and where the figure comes from.

    Unset, it is what the device can give this run: on an accelerator (a simulated one too) its free memory at
    the start plus what this process already holds there; on the CPU the RAM available plus the model's own bytes.
    """
    given = budget_bytes(config.budget)
    if given is not None:
        return given, f"budget {format_bytes(given)} per rank (budget=)" + budget_beyond_device(given, device)
    acc = accelerator(device)
    if acc.has_streams:
        free, _ = acc.mem_get_info()
        have = free + acc.memory_allocated()
        return have, (f"budget {format_bytes(have)}: the device's free memory at the start with what this process "
                      "holds there (budget= sets one)")
    ram = available_host_bytes()
    if ram is None:
        raise ConfigError("the machine does not say how much RAM is free, so no budget can be inferred. To resolve "
                          f"this error, pass {arg('budget', WHATEVER)} (e.g. '8GiB').")
    own = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])
    return ram + own, (f"budget {format_bytes(ram + own)}: the RAM available at the start with the model already in "
                       "it (budget= sets one)")


def budget_beyond_device(budget: int, device: torch.device) -> str:
    """A Hint when a given budget is more than the device (the machine's RAM on the CPU) holds: the plan then
    fits the number, not the machine, and the run may run out of memory."""
    acc = accelerator(device)
    if acc.has_streams:
        total, what = acc.total_memory, f"{device} has" if acc.kind != "simulated" else "the simulated device has"
    else:
        try:
            total, what = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"), "this machine has in RAM"
        except (ValueError, OSError, AttributeError):
            return ""
    if budget <= total:
        return ""
    return (f"; Hint: that is more than the {format_bytes(total)} {what}, so the plan may not fit here: set the "
            f"budget to {format_bytes(total).replace(' ', '')} or less, or leave it out (the memory free at the start)")


def plan_for_run(model: nn.Module, config: TrainConfig, context: RunContext, *, correction_bytes: int = 0,
             keep_optimizer: PlanSettings | None = None, micro_batch_size: int | None = None, free_micro: bool = False,
             settings: PlanSettings | None = None, budget: int | None = None) -> PlanInForce:
    """The plan for ``model`` under ``config``: its fixed choices kept, the rest chosen to fit the budget.

    Args:
        context: what the run is (sequence length, global batch, device, ranks, precision).
        keep_optimizer: a plan whose optimizer (placement, moments, in-backward step, offloaded share) must stay
            (a resume, a re-plan: the optimizer and its state exist already).
        micro_batch_size: overrides ``config.micro_batch_size`` (a resume of a re-planned run).
        free_micro: the plan chooses the micro-batch even where ``config`` fixes it (a re-plan after the fixed one
            ran out of memory).
        settings: no search: predict exactly these (a resume continues on the plan it left off with).
        budget: the budget in bytes as resolved at the run's start (a re-plan keeps it: the free memory moves);
            None resolves it now (``run_budget``).

    Raises:
        ConfigError: a bad choice, or nothing fits (the planner's message: the smallest peak and what would fit).
    """
    micro = None if free_micro else (micro_batch_size or config.micro_batch_size)
    device, world = context.device, context.world
    choices = config.choices
    choices.check_run(world_size=world, fsdp=config.fsdp)
    blocks = find_blocks(model)
    if not blocks and choices.checkpointing is None:
        if settings is not None:  # a resume continues on the settings it left off with (a halved micro-batch)
            return PlanInForce(settings, None, None, ("no plan (the model has no repeated blocks): the run's settings "
                                                  "as saved",), correction_bytes)
        return _unplanned(model, config, context.global_batch, world, context.precision, micro)
    if budget is None:
        budget, budget_reason = run_budget(config, model, device)
    else:
        budget_reason = f"budget {format_bytes(budget)} per rank (as at the run's start)"
    if keep_optimizer is not None:
        check_kept_optimizer(choices, keep_optimizer)
    # The plan translates the choices (Fixed.of_choices); its reasons open with the notes on choices it dropped.
    try:
        chosen = plan(model, budget=budget, seq_len=context.seq_len, global_batch_size=context.global_batch,
                      device=planning_device(device), precision=context.precision,
                      precision_reason=context.precision_reason,
                      world_size=world,
                      fsdp=config.fsdp if world > 1 else False, host_budget=config.host_budget,
                      micro_batch_size=micro, safety_margin=config.safety_margin,
                      grad_clip=config.grad_clip is not None, choices=choices, keep_optimizer=keep_optimizer,
                      settings=settings, correction_bytes=correction_bytes, packed=context.packed,
                      kept_share=context.kept_share)
    except ConfigError:
        raise
    except MemtrainError as e:  # the estimate cannot trace this model: the run goes on as fixed, or says what to fix
        return without_estimate(model, config, context, micro, len(blocks), str(e), settings=settings)
    # The precision's reason is train's own line (it resolved "auto").
    reasons = (budget_reason, *(r for r in chosen.reasons if not r.startswith("precision ")))
    return PlanInForce(chosen.settings, chosen, budget, reasons, correction_bytes)


def without_estimate(model: nn.Module, config: TrainConfig, context: RunContext, micro: int | None, n_blocks: int,
                     cause: str, *, settings: PlanSettings | None = None) -> PlanInForce:
    """The run's settings as the config fixes them, with no plan (nothing predicted, the plan check off), for a
    model the estimate cannot trace; ``settings``, where given, are the run's own (a resume).

    Raises:
        MemtrainError: a technique is left to the planner, which needs the estimate: one line naming the cause
            and the arguments that would fix every technique.
    """
    cause = cause.split(". To resolve this error")[0].removeprefix("estimate: ").rstrip(".")
    unchecked = f"plan check off: the estimate cannot trace {type(model).__name__} (see the start of the run)"
    why = f"plan check off, because: the estimate cannot trace {type(model).__name__}: {cause}"
    if settings is not None:
        return PlanInForce(settings, None, None, (f"{why}; the run's settings as saved",), unchecked=unchecked)
    fixed, _, notes = Fixed.of_choices(config.choices, n_blocks=n_blocks, device=planning_device(context.device))
    per_rank = context.global_batch // context.world
    missing = fixed.left_open() + ([f"{arg('micro_batch_size', per_rank)} (or a divisor of it)"] if micro is None
                                   else [])
    if missing:
        raise MemtrainError(f"the planner cannot estimate {type(model).__name__}: {cause}; it needs that estimate "
                            "to choose the techniques left open. To resolve this error, fix every technique: pass "
                            f"{', '.join(map(marked, missing))}; training then runs as given, without the plan check.")
    assert micro is not None
    chosen = fixed.settings(micro_batch_size=micro, accumulation=per_rank // micro, precision=context.precision,
                            distribution="none" if context.world == 1 else "fsdp2" if config.fsdp else "ddp")
    return PlanInForce(chosen, None, None, (*notes, f"{why}; every technique is fixed, so the run goes on as given"),
                   unchecked=unchecked)


def check_kept_optimizer(choices: Choices, kept: PlanSettings) -> None:
    """ConfigError where ``choices`` fix another optimizer than the one a run keeps (a resume, a re-plan: its state
    exists already), or another weight layout (pure bf16 weights have no master; streamed weights are the
    optimizer's), naming each field that differs."""
    differ = [d for technique in techniques.REGISTRY for d in technique.kept_differences(choices, kept)]
    if differ:
        raise ConfigError(f"{', '.join(marked(given) for given, _ in differ)}: the run's optimizer is {kept.optimizer_text}, "
                          "and its state exists already (a resume or a re-plan keeps it). To resolve this error, drop "
                          f"{' and '.join(marked(drop) for _, drop in differ)} or start a new run ({arg('overwrite', True)}).")


def _unplanned(model: nn.Module, config: TrainConfig, global_batch: int, world: int, precision: str,
               micro: int | None) -> PlanInForce:
    """A model without repeated blocks: nothing to checkpoint or offload per block, so no plan; the loss and the
    optimizer as given (plain where unset), the whole per-rank batch in one micro-batch unless fixed."""
    per_rank = global_batch // world
    micro = micro or per_rank
    choices = config.choices
    # The rules with what this model lacks: no blocks (parameter offload streams them), a loss that cannot chunk.
    ConfigError.raise_if(techniques.problems(choices.setup(has_blocks=False, chunkable=supports_chunked_loss(model))))
    # Nothing per block to plan: the policy is moot (whatever it says, no block to apply it to).
    fixed, _, _ = Fixed.of_choices(dataclasses.replace(choices, checkpointing=None), n_blocks=0, device="cuda")
    settings = fixed.settings(micro_batch_size=micro, accumulation=per_rank // micro, blocks=(), flavor="full",
                              precision=precision, distribution="none" if world == 1 else "fsdp2" if config.fsdp
                              else "ddp")
    reason = (f"checkpointing off, because: auto found no repeated blocks in {type(model).__name__} (no "
              "nn.ModuleList/nn.Sequential of one module type, no Hugging Face _no_split_modules), so nothing is "
              "planned per block; to checkpoint it, call apply_checkpointing(model, blocks=...) before train()")
    return PlanInForce(settings, None, None, (reason, f"optimizer {settings.optimizer_text} (as given)"))


# -- the check at step 2 and the re-plans -------------------------------------------------------------------
def check_plan(in_force: PlanInForce, step: int, peak_bytes: int | None, activation_bytes: int | None,
               device: torch.device) -> PlanCheck:
    """What the plan predicted beside what step ``step`` (counted from 1) measured: on an accelerator (a simulated
    one too) the allocator's peak (over the budget: a re-plan), on the CPU the bytes saved for backward (exactly
    what ``measure`` counts)."""
    p = in_force.plan
    if p is None:
        return PlanCheck(log=in_force.unchecked or "plan check: no plan to check (the model has no repeated blocks)")
    cuda = accelerator(device).has_streams
    what, predicted, measured = (("peak", p.peak_bytes, peak_bytes) if cuda else
                                 ("saved activations", p.activation_bytes, activation_bytes))
    error = predicted / measured - 1 if measured else None
    over = bool(cuda and measured is not None and in_force.budget_bytes is not None
                and measured > in_force.budget_bytes)
    text = f"{error:+.1%}" if error is not None else "not measured"
    return PlanCheck(
        log=f"plan check at step {step}: predicted {what} {format_bytes(predicted)}, measured "
            f"{format_bytes(measured)} ({text})" + (f": over the budget {format_bytes(in_force.budget_bytes)}, "
                                                    "re-planning" if over else ""),
        what=what, predicted_bytes=predicted, measured_bytes=measured, relative_error=error, over_budget=over,
        step=step)


def failed_allocation_bytes(message: str) -> int:
    """The allocation an out-of-memory error names ("Tried to allocate 2.00 GiB"), or 0."""
    match = re.search(r"Tried to allocate ([0-9.]+) ?([KMGT]i?B)", message)
    return parse_bytes(match[1] + match[2]) if match else 0


def replan(in_force: PlanInForce, model: nn.Module, config: TrainConfig, context: RunContext, *, shortfall_bytes: int,
           why: str) -> PlanInForce:
    """The next plan with ``shortfall_bytes`` more folded into every predicted peak, the optimizer kept.

    Where the config fixes the micro-batch and nothing fits with it, the plan chooses the micro-batch too (the
    reasons say so).

    Raises:
        MemtrainError: nothing fits even so (the message carries the planner's: the smallest peak, what fits).
    """
    correction = in_force.correction_bytes + max(1, int(shortfall_bytes))
    notes = [f"re-planned after {why}: {format_bytes(correction)} the estimate missed, folded into every predicted "
             "peak"]
    try:
        try:
            new = plan_for_run(model, config, context, correction_bytes=correction, keep_optimizer=in_force.settings,
                           micro_batch_size=in_force.settings.micro_batch_size if config.micro_batch_size else None,
                           budget=in_force.budget_bytes)
        except ConfigError:
            if config.micro_batch_size is None:
                raise
            new = plan_for_run(model, config, context, correction_bytes=correction, keep_optimizer=in_force.settings,
                           free_micro=True, budget=in_force.budget_bytes)
            notes.append(f"micro_batch_size={config.micro_batch_size} does not fit with the correction: the plan "
                         f"chose {new.settings.micro_batch_size}")
    except ConfigError as e:
        raise MemtrainError(f"{why}, and no plan fits with the {format_bytes(correction)} the estimate missed "
                            f"folded in: {marked(e)}") from None
    return dataclasses.replace(new, reasons=(*notes, *new.reasons))


def shortfall_after_oom(in_force: PlanInForce, error: str, measured_peak: int | None = None) -> int:
    """What the estimate missed at least, after a step ran out of memory: the allocator's peak in the failed
    step plus the allocation that failed, over the predicted peak (``measured_peak``, CUDA); where it is not known,
    the real peak passed the usable budget (the device gave out) by that allocation. Where the error does not say
    how much it asked for, ``OOM_MIN_OVERSHOOT`` of the predicted peak."""
    p = in_force.plan
    assert p is not None and p.usable_bytes is not None
    failed = failed_allocation_bytes(error) or int(OOM_MIN_OVERSHOOT * p.peak_bytes)
    if measured_peak is not None:
        return max(measured_peak + failed - p.peak_bytes, failed)
    return p.usable_bytes - p.peak_bytes + failed


def plan_after_out_of_memory(in_force: PlanInForce, error: str, model: nn.Module, config: TrainConfig,
                             context: RunContext, step: int, measured_peak: int | None) -> PlanInForce:
    """The plan after step ``step`` (counted from 0) ran out of memory: with the shortfall folded in, or (a model
    without blocks, so no plan) half the micro-batch."""
    micro = in_force.settings.micro_batch_size
    if context.world > 1:
        raise MemtrainError(f"out of memory at step {step + 1} with a micro-batch of {micro} on one of several "
                            "ranks (the others cannot re-plan in step). To resolve this error, pass a smaller budget "
                            f"({arg('budget', WHATEVER)}) so that the plan leaves more room, or a smaller "
                            f"{arg('micro_batch_size')}.")
    if in_force.plan is None:
        per_rank = context.global_batch  # one rank
        if micro == 1:
            raise MemtrainError(f"out of memory at step {step + 1} with a micro-batch of 1. To resolve this error, "
                                f"pass {arg('optimizer.placement', 'offload')}, a shorter {arg('seq_len')}, or a "
                                "smaller model.")
        smaller = next(m for m in range(micro // 2, 0, -1) if per_rank % m == 0)
        s = dataclasses.replace(in_force.settings, micro_batch_size=smaller, accumulation=per_rank // smaller)
        return dataclasses.replace(in_force, settings=s, reasons=(
            "no plan to correct (the model has no repeated blocks)", f"micro-batch halved to {smaller}"))
    return replan(in_force, model, config, context, why=f"out of memory at step {step + 1}",
                  shortfall_bytes=shortfall_after_oom(in_force, error, measured_peak))


def replan_record(step: int, why: str, old: PlanInForce, new: PlanInForce) -> dict[str, Any]:
    """One entry of report.json's "replans": the step, why, the new settings, the correction, and both plans'
    peaks as the estimate alone predicts them (the correction left out)."""
    def raw(r: PlanInForce) -> int | None:
        return r.plan.peak_bytes - r.correction_bytes if r.plan is not None else None

    return {"step": step + 1, "why": why, "settings": new.settings.to_dict(), "correction_bytes": new.correction_bytes,
            "estimated_peak_before": raw(old), "estimated_peak_after": raw(new)}
