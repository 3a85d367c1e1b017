"""A setting's field declares its flag once (memtrain.setting, issue 30): the fields of Choices and OptimizerChoice
are the command line's technique flags, their parsing back into the choices, and the flag names in messages
(--checkpointing and --compile, whose parser, default and meaning are each command's, are declared by the commands)."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from memtrain.choices import Choices, OptimizerChoice
from memtrain.cli import build_parser, in_flag_terms
from memtrain.cli.flags import subparser
from memtrain.cli.techniques import choices_from_flags
from memtrain.setting import flags_of

CLI = Path(__file__).resolve().parent.parent / "memtrain" / "cli"
DECLARED = [*flags_of(Choices), *flags_of(OptimizerChoice)]


def test_every_field_of_the_optimizer_choice_declares_its_flag():
    declared = dict(flags_of(OptimizerChoice))
    assert list(declared) == [f.name for f in dataclasses.fields(OptimizerChoice)]
    assert len({f.name for f in declared.values()}) == len(declared)


@pytest.mark.parametrize("command", ["train", "plan", "estimate"])
def test_each_command_takes_the_declared_flags_with_their_help(command):
    actions = {a.option_strings[0]: a for a in subparser(build_parser(), command)._actions if a.option_strings}
    for _, f in DECLARED:
        assert f.name in actions, (command, f.name)
        assert actions[f.name].help == f.help_text(planned=command != "estimate")


def test_the_flags_parse_back_into_the_choice():
    args = build_parser().parse_args(["estimate", "--no-offload-optimizer", "--step-in-backward", "--optimizer",
                                      "adafactor", "--optimizer-arg", "beta2_decay=-0.5", "--optimizer-arg", "d=2.0"])
    choice = choices_from_flags(args).optimizer
    assert choice.placement == "device" and choice.step_in_backward is True and choice.state_precision is None
    assert choice.named.path == "torch.optim.Adafactor" and dict(choice.kwargs) == {"beta2_decay": -0.5, "d": 2.0}
    plain = choices_from_flags(build_parser().parse_args(["estimate"]))
    assert dataclasses.replace(plain, checkpointing=None) == Choices()  # estimate's --checkpointing is its own
    choices = choices_from_flags(build_parser().parse_args(["plan", "--no-offload-activations", "--pure-bf16",
                                                            "--chunked-loss", "--no-offload-weights"]))
    assert (choices.offload_activations, choices.pure_bf16, choices.chunked_loss, choices.offload_weights) == \
        (False, True, True, False)


def test_messages_name_the_declared_flags():
    from memtrain.message import arg

    assert in_flag_terms(f"{arg('optimizer.state_precision', 'int8')} with {arg('optimizer.placement', 'offload')}") \
        == "--optimizer-state 'int8' with --offload-optimizer"
    assert in_flag_terms(f"{arg('optimizer.step_in_backward', True)} and {arg('offload_fraction', 0.5)}") == \
        "--step-in-backward and --offload-optimizer-fraction 0.5"
    assert in_flag_terms(f"{arg('offload_weights', True)} with {arg('pure_bf16', True)} and "
                         f"{arg('chunked_loss', False)}") == "--offload-weights with --pure-bf16 and --no-chunked-loss"


def test_no_table_or_parser_call_in_the_cli_spells_a_declared_flag_again():
    source = "\n".join(p.read_text() for p in CLI.glob("*.py"))
    for field, f in DECLARED:
        assert not re.search(rf"add_argument\(\s*\"{re.escape(f.name)}\"", source), f.name
        assert not re.search(rf"\"(optimizer\.)?{field}\":", source), field
