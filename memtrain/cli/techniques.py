"""The technique flags (--checkpointing, --offload-activations, --offload-optimizer[-fraction], --optimizer-state,
--step-in-backward, --chunked-loss, --compile) as the one ``Choices`` that train, plan and estimate take. The rules
between them are ``Choices``'s own; its errors reach the user in flag terms (``cli.terms``)."""

from __future__ import annotations

import argparse

from memtrain.choices import Choices, OptimizerChoice
from memtrain.errors import ConfigError
from memtrain.setting import flags_of


def flags_for(choices: Choices) -> list[str]:
    """The technique flags that give ``choices`` back (each field's words from its flag's declaration,
    ``Flag.words_for``; a None field: no flag, the plan's): ``choices_from_flags``' inverse for a plan's set-up
    (``PlanSettings.choices``: a share of the state on the host leaves the device placement implied, which the
    command line's --no-offload-optimizer would contradict), as the flags that fix it: ``["--checkpointing", "blocks(RRKK)+selective(...)",
    "--offload-optimizer", "bf16-weights", ...]``."""
    words = [] if choices.checkpointing is None else ["--checkpointing", str(choices.checkpointing)]
    words += ["--compile"] if choices.compile else []
    for setting, owner in ((Choices, choices), (OptimizerChoice, choices.optimizer)):
        for name, f in flags_of(setting):
            value = getattr(owner, name)
            if name == "name" and value is not None:  # the class by its dotted path (a class object's too)
                value = None if owner.named.is_adamw else owner.named.path
            words += f.words_for(value)
    return words


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

