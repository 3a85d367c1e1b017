"""The technique flags as one ``Choices``: each flag fixes its field, a flag not given leaves it to the plan, a
--config file goes through the same flags, and contradictions are one error in flag terms."""

from __future__ import annotations

import pytest

from memtrain.checkpointing import Checkpointing
from memtrain.choices import Choices, OptimizerChoice
from memtrain.cli.flags import apply_config_file, build_parser
from memtrain.cli.techniques import choices_from_flags
from memtrain.cli.terms import in_flag_terms
from memtrain.errors import ConfigError


def _choices(*argv: str, command: str = "train") -> Choices:
    return choices_from_flags(build_parser().parse_args([command, *argv]))


def _refused(*argv: str, command: str = "train") -> str:
    with pytest.raises(ConfigError) as info:
        _choices(*argv, command=command)
    return in_flag_terms(info.value.message, command)


def test_flags_not_given_leave_every_choice_to_the_plan():
    assert _choices() == Choices() == _choices(command="plan")
    assert _choices("--checkpointing", "auto").checkpointing is None


def test_each_flag_fixes_its_choice():
    choices = _choices("--checkpointing", "every:2", "--offload-activations", "--no-chunked-loss", "--compile",
                       "--optimizer-state", "bf16", "--step-in-backward")
    assert choices == Choices(checkpointing=Checkpointing.parse("every:2"), offload_activations=True,
                              optimizer=OptimizerChoice(state_precision="bf16", step_in_backward=True),
                              chunked_loss=False, compile=True)
    assert _choices("--offload-optimizer").optimizer == OptimizerChoice(placement="offload")
    assert _choices("--no-offload-optimizer", "--no-offload-activations").optimizer.placement == "device"
    assert _choices("--offload-optimizer-fraction", "0.25").optimizer == OptimizerChoice(offload_fraction=0.25)
    assert _choices("--no-offload-optimizer", "--offload-optimizer-fraction", "0").optimizer == OptimizerChoice(
        placement="device", offload_fraction=0.0)
    # memtrain estimate predicts one set-up: its default policy is a policy, and it has no --compile.
    assert _choices("--checkpointing", "selective", command="estimate") == Choices(checkpointing="selective")


def test_a_config_file_goes_through_the_same_flags(tmp_path):
    (tmp_path / "run.toml").write_text('checkpointing = "every:2"\nno-chunked-loss = true\noffload-optimizer = false\n'
                                       'optimizer-state = "int8"\n')
    parser = build_parser()
    argv = ["train", "--config", str(tmp_path / "run.toml"), "--compile"]
    apply_config_file(parser, argv)
    assert choices_from_flags(parser.parse_args(argv)) == Choices(
        checkpointing="every:2", chunked_loss=False, compile=True,
        optimizer=OptimizerChoice(placement="device", state_precision="int8"))


@pytest.mark.parametrize("argv,message", [
    (["--offload-optimizer", "--offload-optimizer-fraction", "0.5"],
     "--offload-optimizer with --offload-optimizer-fraction 0.5: the first puts all of the optimizer state in host "
     "RAM"),
    (["--offload-optimizer", "--step-in-backward"], "--step-in-backward is for the device optimizer"),
    (["--step-in-backward", "--offload-optimizer-fraction", "0.5"],
     "--step-in-backward with --offload-optimizer-fraction 0.5: a partial offload steps after backward"),
    (["--no-offload-optimizer", "--offload-optimizer-fraction", "0.5"],
     "--no-offload-optimizer and --offload-optimizer-fraction 0.5 contradict each other"),
    (["--checkpointing", "all+offload", "--no-offload-activations"],
     "but --no-offload-activations says not to. To resolve this error, drop +offload or --no-offload-activations"),
])
def test_contradicting_flags_are_named_as_flags(argv, message):
    for command in ("train", "plan", "estimate"):
        line = _refused(*argv, command=command)
        assert message in line and "optimizer.p" not in line and "_" not in line and "To resolve this error" in line, line


def test_every_contradiction_is_named_at_once():
    line = _refused("--offload-optimizer", "--offload-optimizer-fraction", "0.5", "--step-in-backward",
                    "--checkpointing", "every:2+offload", "--no-offload-activations")
    assert "--offload-optimizer-fraction 0.5" in line and "--step-in-backward is for" in line and "says not to" in line, line


def test_bf16_device_weights_are_a_word_of_the_offload_flag(tmp_path, capsys):
    """--offload-optimizer takes an optional word for the plan's third placement (bf16 device weights cast from
    the host master); --no-offload-optimizer takes none; a config file writes the word as the key's value."""
    for words, placement in ((["--offload-optimizer", "bf16-weights"], "offload-bf16-weights"),
                             (["--offload-optimizer", "--budget", "1GiB"], "offload"),
                             (["--no-offload-optimizer"], "device"), ([], None)):
        assert _choices(*words).optimizer.placement == placement, words
    parser = build_parser()
    for words, error in ((["--offload-optimizer", "gpu"], "invalid choice: 'gpu'"),
                         (["--no-offload-optimizer", "bf16-weights"], "takes no value")):
        with pytest.raises(SystemExit):
            parser.parse_args(["train", *words])
        assert error in capsys.readouterr().err, words
    (tmp_path / "run.toml").write_text('offload-optimizer = "bf16-weights"\n')
    argv = ["train", "--config", str(tmp_path / "run.toml")]
    apply_config_file(parser, argv)
    assert choices_from_flags(parser.parse_args(argv)).optimizer.placement == "offload-bf16-weights"
    (tmp_path / "bad.toml").write_text('offload-optimizer = "gpu"\n')
    with pytest.raises(ConfigError, match="= 'gpu' must be true or false or 'bf16-weights'"):
        apply_config_file(build_parser(), ["train", "--config", str(tmp_path / "bad.toml")])


def test_a_config_files_negated_switch_does_not_offer_the_word_it_refuses(tmp_path):
    """no-offload-optimizer = "bf16-weights" was refused as "must be true or false or 'bf16-weights'": the word is
    offload-optimizer's, so the fix names that key."""
    (tmp_path / "run.toml").write_text('no-offload-optimizer = "bf16-weights"\n')
    with pytest.raises(ConfigError) as info:
        apply_config_file(build_parser(), ["train", "--config", str(tmp_path / "run.toml")])
    assert info.value.message == ("--config: no-offload-optimizer = 'bf16-weights' must be true or false. To resolve "
                                  "this error, write offload-optimizer = 'bf16-weights'."), info.value.message


@pytest.mark.parametrize("command", ["train", "plan", "estimate"])
def test_the_help_offers_the_word_to_the_offload_flag_only(command, capsys):
    """--help listed "--no-offload-optimizer [bf16-weights]", a value that flag refuses."""
    with pytest.raises(SystemExit):
        build_parser().parse_args([command, "--help"])
    text = capsys.readouterr().out
    assert "--offload-optimizer [bf16-weights], --no-offload-optimizer\n" in text, text
    assert "--no-offload-optimizer [" not in text


@pytest.mark.parametrize(("command", "layout", "expected"), [
    ("estimate", "blocks(RRR)+selective", "--checkpointing 'blocks(RRR)+selective(matmul,attention)' names 3 blocks, "
     "but GPT has 2 (blocks.0 ... blocks.1). To resolve this error, give one letter per block, 2 in all"),
    ("plan", "blocks(RRR)+selective", "--checkpointing's layout blocks(RRR) names 3 blocks, not 2: a layout has a "
     "letter per block of the model. To resolve this error, give 2 letters"),
    ("plan", "blocks(R)", "--checkpointing's layout blocks(R) names 1 block, not 2"),
])
def test_a_layouts_wrong_block_count_is_told_in_letters(command, layout, expected, capsys):
    """A layout with the wrong number of letters was told "names 1 blocks", "(['recompute'])", "in the order
    find_blocks(model) returns them": the command's words are its flag and its letters."""
    from helpers import run_cli

    code, errors, text = run_cli([command, "--model", "gpt-tiny", "--gpu" if command == "plan" else "--device",
                                  "H100" if command == "plan" else "cuda", "--checkpointing", layout], capsys)
    assert code == 2 and len(errors) == 1 and expected in errors[0], text
    assert "find_blocks" not in text and "['recompute']" not in text, text


def test_a_checkpointing_spelling_that_is_none_is_told_once(capsys):
    """'blocks(RK)+offload+selective' was "not a checkpointing policy (--checkpointing ... is not a checkpointing
    policy. To resolve this error, pass one of <the spellings>); the spellings are <the spellings>"."""
    from helpers import run_cli

    code, errors, _ = run_cli(["estimate", "--checkpointing", "blocks(RK)+offload+selective"], capsys)
    assert code == 2 and len(errors) == 1, errors
    assert errors[0].count("is not a checkpointing policy") == 1 and errors[0].count("recomputes the R blocks") == 1, (
        errors[0])
