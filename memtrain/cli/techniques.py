"""The technique flags (--checkpointing, --offload-activations, --offload-optimizer[-fraction], --optimizer-state,
--step-in-backward, --chunked-loss, --compile) as the one ``Choices`` that train, plan and estimate take. The rules
between them are ``Choices``'s own; its errors reach the user in flag terms (``cli.terms``)."""

from __future__ import annotations

import argparse

from memtrain.choices import Choices, OptimizerChoice
from memtrain.errors import ConfigError
from memtrain.setting import flags_of


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
        optimizer = OptimizerChoice(**{name: f.value_of(getattr(args, f.dest, None))
                                       for name, f in flags_of(OptimizerChoice)})
    except ConfigError as e:  # the other fields are still checked: every problem at once
        problems += e.problems
    try:
        choices = Choices(checkpointing=args.checkpointing, optimizer=optimizer,
                          compile=bool(getattr(args, "compile", False)),
                          **{name: f.value_of(getattr(args, f.dest, None)) for name, f in flags_of(Choices)})
    except ConfigError as e:
        problems += e.problems
    ConfigError.raise_if(problems)
    return choices

