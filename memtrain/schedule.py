"""The learning-rate schedule of a run: its peak (chosen for pre-training or fine-tuning), its warm-up, its shape
(cosine, linear or constant after the warm-up) and its length (``max_steps``, or ``epochs`` of the data).

Each automatic choice comes with its reason, which ``train()`` logs at the start of the run.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

import torch
from torch import nn

from memtrain.config import TrainConfig
from memtrain.errors import ConfigError
from memtrain.hf import is_hf_model, is_lora
from memtrain.message import arg
from memtrain.unwrap import unwrap_model

# The peak learning rates train() picks when TrainConfig.lr is None (memtrain train without --lr).
PRETRAINING_LR = 3e-3  # a small model trained from random weights (memtrain's GPT presets, --hf-config)
# Full fine-tuning of a pretrained model: the Stanford Alpaca recipe (learning_rate 2e-5, warmup_ratio 0.03, cosine)
# and torchtune's full fine-tuning configs (e.g. recipes/configs/llama3_2/1B_full.yaml: lr 2e-5).
FULL_FINETUNING_LR = 2e-5
# LoRA adapters on a pretrained model: the QLoRA paper's setting for 7B-13B models (Dettmers et al. 2023,
# appendix: lr 2e-4, warmup ratio 0.03), the value PEFT's and TRL's examples use; adapters start at zero and
# move the weights by alpha / r times their product, so they need a 10x larger rate than the weights themselves.
LORA_LR = 2e-4
FINETUNING_WARMUP_RATIO = 0.03  # of max_steps, as HF Trainer's warmup_ratio in the recipes above


def pretrained_source(model: nn.Module) -> str | None:
    """Where a Hugging Face model's pretrained weights came from (``from_pretrained`` records the folder or hub id
    as ``name_or_path``), or None for a model built from its config (random weights) or not from Hugging Face."""
    inner = unwrap_model(model)
    if is_lora(inner):
        inner = inner.get_base_model()
    if not is_hf_model(inner):
        return None
    return getattr(inner, "name_or_path", "") or None


def default_lr(model: nn.Module) -> tuple[float, str]:
    """(the peak learning rate for ``model``, why): ``LORA_LR`` for LoRA adapters on pretrained weights,
    ``FULL_FINETUNING_LR`` for pretrained weights, ``PRETRAINING_LR`` otherwise."""
    source = pretrained_source(model)
    if source is not None and is_lora(unwrap_model(model)):
        return LORA_LR, (f"LoRA adapters on a pretrained model ({source!r}, --hf-model --lora): the rate of the "
                         "QLoRA recipe, 10x full fine-tuning's, as adapters start at zero")
    if source is not None:
        return FULL_FINETUNING_LR, (f"fine-tuning a pretrained model ({source!r}, --hf-model): the rate of the "
                                    "Alpaca and torchtune full fine-tuning recipes, 100x below pre-training's, so "
                                    "the weights keep what they learnt")
    return PRETRAINING_LR, "training from random weights (pre-training a small model)"


def default_warmup(config: TrainConfig, finetuning: bool) -> tuple[int, str]:
    """(warm-up steps, why) for ``warmup_steps=None``: 3% of ``max_steps`` (at least 1) when fine-tuning, else
    ``min(50, max_steps // 10)``: a 10-step run warms up in 1 step and reaches ``lr``, a 500-step run in 50."""
    if finetuning:
        return max(1, math.ceil(FINETUNING_WARMUP_RATIO * config.max_steps)), "3% of max_steps, as fine-tuning recipes"
    return min(50, config.max_steps // 10), "min(50, max_steps // 10)"


def steps_for_epochs(epochs: int, examples: int, global_batch: int) -> int:
    """Optimizer steps that pass over ``examples`` ``epochs`` times, ``global_batch`` examples per step (the last
    step of the run completes its batch from the next pass's order)."""
    return math.ceil(epochs * examples / global_batch)


def resolve_schedule(config: TrainConfig, model: nn.Module, examples: int, global_batch: int
                     ) -> tuple[TrainConfig, list[str], dict[str, bool]]:
    """The config with ``max_steps``, ``lr`` and ``warmup_steps`` fixed (from ``epochs`` and the defaults), the
    reason lines, and which of ``lr`` / ``warmup_steps`` were automatic (a resume takes the run's own then).

    Raises:
        ConfigError: a warm-up longer than the run ``epochs`` makes.
    """
    reasons = []
    if config.epochs is not None:
        steps = steps_for_epochs(config.epochs, examples, global_batch)
        config = replace(config, max_steps=steps)
        reasons.append(f"max_steps {steps}, because: {config.epochs} epoch(s) of {examples} examples at a global "
                       f"batch of {global_batch} = ceil({config.epochs} x {examples} / {global_batch}) (--epochs)")
    elif config.max_steps is None:
        config = replace(config, max_steps=500)
    auto = {"lr": config.lr is None, "warmup_steps": config.warmup_steps is None}
    lr_why = "given (--lr)"
    if config.lr is None:
        lr, lr_why = default_lr(model)
        config = replace(config, lr=lr)
    warmup_why = "given (--warmup-steps)"
    if config.warmup_steps is None:
        warmup, warmup_why = default_warmup(config, pretrained_source(model) is not None)
        config = replace(config, warmup_steps=warmup)
    if config.warmup_steps > config.max_steps:
        raise ConfigError(f"{arg('warmup_steps', config.warmup_steps)} is more than the {config.max_steps} steps of "
                          f"{arg('epochs', config.epochs)}: the learning rate would never reach lr. To resolve this "
                          f"error, pass {arg('warmup_steps', config.max_steps // 10)} or fewer, or more epochs.")
    reasons.append(f"lr {config.lr:g}, because: {lr_why}")
    reasons.append(schedule_text(config) + f" (warm-up: {warmup_why})")
    return config, reasons, auto


def schedule_text(config: TrainConfig, *, resumed_at: int | None = None) -> str:
    """The schedule in words, e.g. ``learning rate 0.003 after 50 warm-up steps, cosine to 0.0003 at step 500``;
    ``resumed_at``: from the step a resume continues at, with the rate it continues with there."""
    start = f"learning rate {config.lr:g} after {config.warmup_steps} warm-up steps"
    if resumed_at is not None:
        done = resumed_at >= (config.warmup_steps or 0)
        start = (f"learning rate {lr_at(resumed_at, config):.3g} at step {resumed_at}, where the run resumes (peak "
                 f"{config.lr:g}; its {config.warmup_steps} warm-up steps {'done' if done else 'continue'})")
    if config.lr_schedule == "constant":
        return f"{start}, then constant to step {config.max_steps} (--lr-schedule constant)"
    return (f"{start}, {config.lr_schedule} to {config.lr * config.min_lr_ratio:g} at step {config.max_steps} "
            f"(--lr-schedule {config.lr_schedule})")


def resumed_reasons(reasons: list[str], config: TrainConfig, step: int) -> list[str]:
    """A resumed run's start-up lines with the schedule's as the run continues: the run's own warm-up and rate
    (not the ones its new length would pick), from ``step``, at the rate the schedule gives there."""
    return [schedule_text(config, resumed_at=step) + " (the run's own warm-up and peak)"
            if line.startswith("learning rate ") else line for line in reasons]


def lr_at(step: int, config: TrainConfig) -> float:
    """The learning rate of optimizer step ``step`` (from 0): a linear warm-up over ``warmup_steps`` steps, then
    ``lr_schedule``: cosine or linear decay to ``lr * min_lr_ratio`` at ``max_steps``, or constant at ``lr``.

    The same rates as torch's schedulers chained at the end of the warm-up (``SequentialLR`` of
    ``LinearLR(start_factor=1 / warmup, total_iters=warmup - 1)`` and ``CosineAnnealingLR(T_max=max_steps -
    warmup, eta_min=lr * min_lr_ratio)``, ``LinearLR(end_factor=min_lr_ratio, total_iters=max_steps - warmup)``
    or ``ConstantLR(factor=1)``): tests/test_schedule.py checks each.
    """
    warmup = config.warmup_steps if config.warmup_steps is not None else default_warmup(config, False)[0]
    if step < warmup:
        return config.lr * (step + 1) / warmup
    if config.lr_schedule == "constant":
        return config.lr
    progress = min(1.0, (step - warmup) / max(1, config.max_steps - warmup))
    shape = 0.5 * (1 + math.cos(math.pi * progress)) if config.lr_schedule == "cosine" else 1 - progress
    return config.lr * (config.min_lr_ratio + (1 - config.min_lr_ratio) * shape)


def lr_scheduler(config_of: Any) -> Any:
    """Builds the ``LambdaLR`` that follows ``lr_at`` for ``apply_plan``'s ``scheduler=``. ``config_of()`` returns
    the run's config at each step (a resume replaces it with the run's own warm-up and rate)."""

    def build(optimizer: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LambdaLR:
        return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_at(step, config_of()) / config_of().lr)

    return build
