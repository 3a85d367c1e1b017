"""The technique flags (--checkpointing, --offload-activations, --offload-optimizer[-fraction], --optimizer-state,
--step-in-backward, --chunked-loss, --compile) as the one ``Choices`` that train, plan and estimate take. The rules
between them are ``Choices``'s own; its errors reach the user in flag terms (``cli.terms``)."""

from __future__ import annotations

import argparse

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
        kwargs = dict(getattr(args, "optimizer_arg", None) or ()) or None
        optimizer = OptimizerChoice(placement=_PLACEMENT[args.offload_optimizer], state_precision=args.optimizer_state,
                                    step_in_backward=args.step_in_backward, offload_fraction=fraction,
                                    name=getattr(args, "optimizer", None), kwargs=kwargs)
    except ConfigError as e:  # the other fields are still checked: every problem at once
        problems += e.problems
    try:
        choices = Choices(checkpointing=args.checkpointing, offload_activations=args.offload_activations,
                          optimizer=optimizer, chunked_loss=args.chunked_loss,
                          compile=bool(getattr(args, "compile", False)),
                          pure_bf16=bool(getattr(args, "pure_bf16", False)), offload_weights=args.offload_weights)
    except ConfigError as e:
        problems += e.problems
    ConfigError.raise_if(problems)
    return choices

