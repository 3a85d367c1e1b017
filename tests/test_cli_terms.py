"""Library errors in the command's terms: each argument a message keeps (``memtrain.message.arg``) as its flag."""

from __future__ import annotations

from memtrain.cli.terms import in_flag_terms
from memtrain.message import WHATEVER, Message, arg, words


def test_library_errors_are_shown_in_flag_terms():
    assert in_flag_terms(f"{arg('out_dir', '/a/out_dir')} is a file") == "--out '/a/out_dir' is a file"
    assert in_flag_terms(f"pass {arg('resume', True)}, {arg('overwrite', True)} or {arg('chunked_loss', False)}") == (
        "pass --resume, --overwrite or --no-chunked-loss")
    assert in_flag_terms(f"{arg('micro_batch_size', 0)} must be >= 1; lower {arg('global_batch_size')}") == (
        "--micro-batch-size 0 must be >= 1; lower --global-batch-size")
    assert in_flag_terms(f"{arg('world_size', 2)} now") == "torchrun --nproc_per_node 2 now"
    assert in_flag_terms(f"the precision of the run ({arg('precision', 'fp32')})") == (
        "the precision of the run (--precision 'fp32')")
    assert in_flag_terms(f"pass {arg('offload_optimizer', False)}; {arg('state_precision', 'int8')}") == (
        "pass --no-offload-optimizer; --optimizer-state 'int8'")
    assert in_flag_terms(f"{arg('world_size', 2)} with {arg('fsdp', False)}", "plan") == "--nproc 2 with --ddp"
    assert in_flag_terms(f"pass e.g. {arg('lr', text='3e-3')}") == "pass e.g. --lr 3e-3"


def test_the_library_wording_is_the_arguments_as_written():
    message = Message(f"{arg('out_dir', '/a')} with {arg('lr', text='3e-3')}; drop "
                      f"{arg('optimizer.state_precision', WHATEVER)} and {arg('micro_batch_size')}")
    assert message == "out_dir='/a' with lr=3e-3; drop optimizer.state_precision= and micro_batch_size"
    assert "\ue000" not in message and Message(message) is message


def test_the_choices_fields_are_shown_as_their_flags():
    assert in_flag_terms(f"drop one of {arg('optimizer.placement', 'offload')} and {arg('fsdp', True)}") == (
        "drop one of --offload-optimizer and --fsdp")
    assert in_flag_terms(f"{arg('optimizer.placement', 'device')} with {arg('optimizer.state_precision', 'int8')}") == (
        "--no-offload-optimizer with --optimizer-state 'int8'")
    assert in_flag_terms(f"{arg('optimizer.step_in_backward', True)} with {arg('optimizer.offload_fraction', 0.5)}") == (
        "--step-in-backward with --offload-optimizer-fraction 0.5")
    assert in_flag_terms(f"{arg('optimizer.step_in_backward')} and {arg('offload_fraction')} act on gradients") == (
        "--step-in-backward and --offload-optimizer-fraction act on gradients")


def test_text_that_looks_like_an_argument_is_left_as_written():
    # No guessing: only what the message marks as an argument is rendered as a flag.
    assert in_flag_terms("out_dir='x' and optimizer.placement='offload'") == "out_dir='x' and optimizer.placement='offload'"
    assert in_flag_terms(f"or {words('another val_fraction', 'pass --eval-data FILE')}") == "or pass --eval-data FILE"
    assert str(Message(f"or {words('another val_fraction', 'pass --eval-data FILE')}")) == "or another val_fraction"


def test_an_argument_named_whatever_its_value_reads_as_the_flag_given():
    assert in_flag_terms(f"drop {arg('optimizer.state_precision', WHATEVER)} or start") == "drop --optimizer-state or start"
    assert in_flag_terms(f"{arg('optimizer.placement', 'device')}: drop {arg('optimizer.placement', WHATEVER)}.") == (
        "--no-offload-optimizer: drop --no-offload-optimizer.")
    assert in_flag_terms(f"drop {arg('optimizer.name', WHATEVER)} and {arg('optimizer.kwargs', WHATEVER)}") == (
        "drop --optimizer and --optimizer-arg")
    assert in_flag_terms(f"{arg('optimizer.kwargs', {'a': 1, 'b': 'x'})}") == "--optimizer-arg a=1 --optimizer-arg b='x'"
    assert in_flag_terms(f"{arg('optimizer.step_in_backward', False)}: drop {arg('optimizer.step_in_backward', WHATEVER)}") == (
        "--no-step-in-backward: drop --no-step-in-backward")


def test_every_argument_a_message_names_has_the_commands_words_for_it():
    """Each ``arg("NAME", ...)`` written in memtrain's messages names an argument the command renders: a declared
    flag, an argument's flag, or a call site's own (``path`` is --hf-model's folder, ``r`` --lora's rank)."""
    import pathlib
    import re

    from memtrain.cli import terms

    known = {*terms.ARGUMENT_FLAGS, *terms.ARGUMENT_SWITCHES, *terms.ARGUMENT_VALUES,
             *terms.HF_MODEL_PATH, *terms.LORA_FLAGS}
    source = pathlib.Path(terms.__file__).parents[1]
    named = {(path.relative_to(source.parent).as_posix(), name) for path in source.rglob("*.py")
             for name in re.findall(r"""\barg\(\s*['"]([\w.]+)['"]""", path.read_text())}
    assert named, "no message names an argument"
    assert not {(path, name) for path, name in named if name not in known}, sorted(named)


def test_a_value_the_command_has_no_flag_for_is_named_as_the_library_writes_it():
    assert in_flag_terms(f"{arg('chunked_loss', 1)} must be True or False") == "chunked_loss=1 must be True or False"
    assert in_flag_terms(f"{arg('optimizer.placement', 'host')} is not a placement") == (
        "optimizer.placement='host' is not a placement")
    assert in_flag_terms(f"drop {arg('optimizer.placement', WHATEVER)}") == (
        "drop --offload-optimizer or --no-offload-optimizer")
    assert in_flag_terms(f"{arg('optimizer.placement', 'offload-bf16-weights')} with {arg('precision', 'fp32')}") == (
        "--offload-optimizer bf16-weights with --precision 'fp32'")


def test_a_call_sites_arguments_are_its_flags_and_the_others_stay_for_the_command():
    import pytest

    from memtrain.cli.terms import HF_MODEL_PATH, call_site_flags
    from memtrain.errors import ConfigError

    with pytest.raises(ConfigError) as info, call_site_flags(HF_MODEL_PATH):
        raise ConfigError(f"{arg('path', '/m')} has no config.json; {arg('world_size', 2)} ranks")
    assert str(info.value) == "path='/m' has no config.json; world_size=2 ranks"  # the library's words kept
    assert in_flag_terms(info.value.message, "plan") == "--hf-model '/m' has no config.json; --nproc 2 ranks"
