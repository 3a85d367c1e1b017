"""The technique flags (--checkpointing, --offload-activations, --offload-optimizer[-fraction], --optimizer-state,
--step-in-backward, --chunked-loss, --compile) as the one ``Choices`` that train, plan and estimate take. The rules
between them are ``Choices``'s own; its errors reach the user in flag terms (``cli.terms``)."""

from __future__ import annotations

import argparse
from typing import Any

from memtrain.checkpointing import Checkpointing
from memtrain.choices import Choices, OptimizerChoice
from memtrain.errors import ConfigError

# --offload-optimizer / --no-offload-optimizer / neither: where AdamW's state lives (neither: the plan decides).
_PLACEMENT = {True: "offload", False: "device", None: None}


def choices_from_flags(args: argparse.Namespace) -> Choices:
    """The technique flags as ``Choices`` (a flag not given: the plan's, or off for memtrain estimate).

    --checkpointing auto is None (the plan's layout); --no-offload-optimizer keeps the whole optimizer on the
    device, so it contradicts a non-zero --offload-optimizer-fraction (one flag sets what the other forbids).

    Raises:
        ConfigError: every contradiction at once, in the library's terms (``in_flag_terms`` names the flags).
    """
    problems = []
    fraction = args.offload_optimizer_fraction
    if args.offload_optimizer is False and fraction:
        problems.append(f"--no-offload-optimizer and --offload-optimizer-fraction {fraction} contradict each other. "
                        "To resolve this error, drop one of them.")
    optimizer = OptimizerChoice()
    try:
        optimizer = OptimizerChoice(placement=_PLACEMENT[args.offload_optimizer], state_precision=args.optimizer_state,
                                    step_in_backward=args.step_in_backward, offload_fraction=fraction)
    except ConfigError as e:  # the other fields are still checked: every problem at once
        problems += e.problems
    try:
        choices = Choices(checkpointing=args.checkpointing, offload_activations=args.offload_activations,
                          optimizer=optimizer, chunked_loss=args.chunked_loss,
                          compile=bool(getattr(args, "compile", False)))
    except ConfigError as e:
        problems += e.problems
    ConfigError.raise_if(problems)
    return choices


# Replaced by choices_from_flags once train, plan and estimate take Choices.
def technique_problems(args: argparse.Namespace) -> list[str]:
    """Flags that contradict each other, named as flags (train and plan)."""
    problems = []
    if args.offload_optimizer and args.offload_optimizer_fraction is not None:
        problems.append(f"--offload-optimizer and --offload-optimizer-fraction {args.offload_optimizer_fraction} "
                        "together: the first puts all of the optimizer state in host RAM, the second a share of it. "
                        "To resolve this error, pass one of them.")
    if args.offload_optimizer is False and args.offload_optimizer_fraction:
        problems.append(f"--no-offload-optimizer and --offload-optimizer-fraction {args.offload_optimizer_fraction} "
                        "contradict each other. To resolve this error, drop one of them.")
    if args.offload_optimizer and args.optimizer_state not in (None, "fp32"):
        problems.append(f"--offload-optimizer with --optimizer-state {args.optimizer_state}: CPUOffloadOptimizer "
                        "keeps fp32 state in host RAM (the device holds none). To resolve this error, drop "
                        "--optimizer-state, or use it with the optimizer on the device (--no-offload-optimizer).")
    if args.offload_optimizer and args.step_in_backward:
        problems.append("--offload-optimizer with --step-in-backward: the offloaded optimizer already takes each "
                        "gradient off the device as it is produced and steps on the host; --step-in-backward is for "
                        "the device optimizer. To resolve this error, pass one of them.")
    if args.step_in_backward and args.offload_optimizer_fraction:
        problems.append("--step-in-backward with --offload-optimizer-fraction: a partial offload steps after "
                        "backward. To resolve this error, pass one of them.")
    if args.checkpointing != "auto" and args.offload_activations is False and \
            Checkpointing.parse(args.checkpointing).offload_inputs:
        problems.append(f"--checkpointing {args.checkpointing} offloads the recomputed blocks' inputs, but "
                        "--no-offload-activations says not to. To resolve this error, drop +offload or "
                        "--no-offload-activations.")
    return problems


def train_techniques(args: argparse.Namespace) -> dict[str, Any]:
    """TrainConfig's technique fields from the flags (unset: the plan decides)."""
    return dict(checkpointing=args.checkpointing, offload_optimizer=args.offload_optimizer,
                offload_activations=args.offload_activations, chunked_loss=args.chunked_loss,
                state_precision=args.optimizer_state, step_in_backward=args.step_in_backward,
                offload_fraction=args.offload_optimizer_fraction, compile=args.compile)
