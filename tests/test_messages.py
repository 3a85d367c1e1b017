"""Messages a differential fuzz run found unclear (issue 30): each says what was given, in the terms of the caller
(the library's arguments, or the command's flags), and the fix that works there."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from memtrain.choices import Choices, OptimizerChoice
from memtrain.cli.terms import in_flag_terms
from memtrain.errors import ConfigError
from memtrain.models import GPT, GPT_PRESETS
from memtrain.techniques.optimizer import NamedOptimizer


def _refusal(call) -> str:
    with pytest.raises(ConfigError) as info:
        call()
    return info.value.message  # the library's wording, with the arguments it names kept for in_flag_terms


def _kept(**fields):
    from memtrain.planner.settings import PlanSettings

    return PlanSettings(micro_batch_size=1, accumulation=1, blocks=("keep",), flavor="full", chunked_loss=False,
                        optimizer="device", distribution="none", compile=False, **fields)


def test_a_resume_refusal_names_the_flag_to_drop_not_a_field_without_its_value():
    from memtrain.run.replan import check_kept_optimizer

    message = _refusal(lambda: check_kept_optimizer(
        Choices(optimizer=OptimizerChoice(state_precision="bf16")), _kept()))
    assert "drop optimizer.state_precision=" in message, message  # the library names the argument
    command = in_flag_terms(message, "train")
    assert "drop --optimizer-state or" in command and "state_precision" not in command, command
    # A switch or a placement reads as the flag that was given (its value says which of the two).
    message = _refusal(lambda: check_kept_optimizer(
        Choices(optimizer=OptimizerChoice(placement="offload", state_precision="fp32")), _kept()))
    assert "drop --offload-optimizer" in in_flag_terms(message, "train"), in_flag_terms(message, "train")
    message = _refusal(lambda: check_kept_optimizer(
        Choices(optimizer=OptimizerChoice(step_in_backward=False)), _kept(step_in_backward=True)))
    assert "drop --no-step-in-backward" in in_flag_terms(message, "train"), in_flag_terms(message, "train")


def test_optimizer_kwargs_with_adamw_name_the_settings_adamw_takes():
    message = _refusal(lambda: OptimizerChoice(kwargs={"foo": 1}))
    assert "optimizer.kwargs={'foo': 1}" in message and "adam_betas" in message, message
    command = in_flag_terms(message, "train")
    for flag in ("--optimizer-arg foo=1", "--adam-betas", "--adam-eps", "--optimizer-state", "drop --optimizer-arg",
                 "pass --optimizer"):
        assert flag in command, (flag, command)
    for word in ("kwargs", "betas and eps"):
        assert word not in command, (word, command)


def test_pure_bf16_with_a_named_optimizer_names_it_as_given_and_the_fix():
    message = _refusal(lambda: Choices(pure_bf16=True, optimizer=OptimizerChoice(name="lion")))
    assert "optimizer.name='lion'" in message and "pytorch_optimizer" not in message, message
    command = in_flag_terms(message, "train")
    assert "drop --optimizer 'lion' (" in command and "or drop --pure-bf16" in command, command
    assert "'adamw' optimizer" not in command, command


def test_checkpointing_every_zero_names_the_spelling_given():
    from memtrain.cli import build_parser

    message = _refusal(lambda: Choices(checkpointing="every:0"))
    assert "'every:2'" in message and "every=2" not in message, message
    with pytest.raises(SystemExit):
        build_parser().parse_args(["estimate", "--checkpointing", "every:0"])


def test_checkpointing_every_zero_in_the_command(capsys):
    from memtrain.cli import main

    with pytest.raises(SystemExit):
        main(["estimate", "--model", "gpt-tiny", "--checkpointing", "every:0"])
    err = capsys.readouterr().err
    assert "every:2" in err and "every=2" not in err, err


def test_parameter_offload_with_a_step_in_backward_says_why_without_a_device_optimizer():
    message = _refusal(lambda: Choices(offload_weights=True, optimizer=OptimizerChoice(step_in_backward=True)))
    assert "a device optimizer" not in message, message
    assert "needs the offloaded optimizer" in message and "never in backward" in message, message


def _meta_gpt() -> GPT:
    with torch.device("meta"):
        return GPT(GPT_PRESETS["gpt-tiny"])  # 64 positions


def test_estimate_names_every_problem_before_tracing_at_once():
    from memtrain import estimate

    message = _refusal(lambda: estimate(_meta_gpt(), (1, 1000), device="cpu", precision="fp32",
                                        setup=Choices(pure_bf16=True)))
    assert "pure_bf16=True with precision='fp32'" in message and "64 positions" in message, message
    message = _refusal(lambda: estimate(_meta_gpt(), (1, 1000), device="cpu", weights_dtype="fp8"))
    assert "weights_dtype='fp8'" in message and "64 positions" in message, message


def test_plan_names_every_problem_before_tracing_at_once():
    from memtrain.planner import plan

    message = _refusal(lambda: plan(_meta_gpt(), budget=None, seq_len=0, global_batch_size=4, world_size=2,
                                    device="cpu", choices=Choices(offload_weights=True)))
    assert "seq_len=0" in message and "offload_weights=True with world_size=2" in message, message
    message = _refusal(lambda: plan(_meta_gpt(), budget="1KiB", seq_len=1000, global_batch_size=4, device="cpu",
                                    precision="fp32", choices=Choices(pure_bf16=True)))
    for words in ("budget 1.00 KiB", "pure_bf16=True with precision='fp32'", "64 positions"):
        assert words in message, (words, message)
    settings = dataclasses.replace(plan(_meta_gpt(), budget=None, seq_len=32, global_batch_size=4,
                                        device="cpu").settings, blocks=("keep",))
    message = _refusal(lambda: plan(_meta_gpt(), budget=None, seq_len=1000, global_batch_size=4, device="cpu",
                                    settings=settings))
    assert "settings.blocks has 1 entries" in message and "64 positions" in message, message


def _tiny_mixtral():
    transformers = pytest.importorskip("transformers")
    config = transformers.MixtralConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, vocab_size=128,
                                        max_position_embeddings=256, head_dim=16, num_local_experts=2,
                                        num_experts_per_tok=1)
    return transformers.MixtralForCausalLM(config)  # a router loss beside the cross-entropy: memtrain.loss does not chunk it


def test_prepare_model_refuses_an_unchunkable_model_through_the_rule():
    from memtrain import techniques
    from memtrain.hf import prepare_model

    why = next(r for r in techniques.RULES if r.name == "chunked-loss-model").why
    model = _tiny_mixtral()
    message = _refusal(lambda: prepare_model(model))  # the default choices chunk the loss
    assert why in message and "Choices(chunked_loss=False)" in message, message
    assert prepare_model(model, Choices(chunked_loss=False)).chunk_tokens is None


def test_named_optimizer_takes_the_short_names_its_message_lists():
    assert NamedOptimizer("lion") == NamedOptimizer.of("lion")
    assert NamedOptimizer("lion").path == "pytorch_optimizer.Lion" and NamedOptimizer("lion").spelling == "lion"
    assert NamedOptimizer("SGD").resolve() is torch.optim.SGD
    assert NamedOptimizer("AdamW").is_adamw and NamedOptimizer("AdamW") == NamedOptimizer()
    assert NamedOptimizer("torch.optim.SGD").spelling == "torch.optim.SGD"


def test_a_plans_settings_keep_what_was_saved_and_say_what_is_wrong():
    """The second fuzz run's findings: a saved plan's dict missing a field is refused (a default would change it),
    a list is not one; a hand-made plan's placement that is none is named; its class prints."""
    from memtrain.planner import PlanSettings
    from memtrain.planner.checks import check_settings

    s = PlanSettings(micro_batch_size=2, accumulation=1, blocks=("keep", "keep"), flavor="full",
                     distribution="none", chunked_loss=True)
    saved = s.to_dict()
    assert PlanSettings.from_dict(saved) == s
    del saved["choices"]["chunked_loss"]  # None, the plan's: read as the plain loss, it would be another set-up
    with pytest.raises(ConfigError, match=r"whose choices leave chunked_loss to a plan \(None\)"):
        PlanSettings.from_dict(saved)
    del saved["n_blocks"]
    with pytest.raises(ConfigError, match=r"not a plan's settings \(missing n_blocks\)"):
        PlanSettings.from_dict(saved)
    with pytest.raises(ConfigError, match="not a mapping"):
        PlanSettings.from_dict([])
    with pytest.raises(ConfigError, match=r"optimizer='cpu' is not one of 'device', 'offload'"):
        check_settings(dataclasses.replace(s, optimizer="cpu"), 2, 2, True, 1, True, "bf16-mixed")
    assert "optimizer_class=" in repr(dataclasses.replace(s, optimizer_class=NamedOptimizer("torch.optim.SGD")))


def test_a_partial_offload_with_lean_moments_is_planned_where_both_are_asked_for():
    """estimate predicted it and build_optimizer builds it, but the plan refused it (its search's own partial offloads
    keep fp32 moments); under FSDP2 lean moments are refused with FSDP2's reason only."""
    from memtrain.planner import known_gpu, plan

    with torch.device("meta"):
        model = GPT(GPT_PRESETS["gpt-tiny"])
    common = dict(budget=None, seq_len=32, global_batch_size=4, device="cuda", device_profile=known_gpu("H100"))
    p = plan(model, **common, choices=Choices(optimizer=OptimizerChoice(offload_fraction=0.5, state_precision="bf16")))
    assert p.settings.optimizer_text == "50% offloaded, bf16 moments"
    with pytest.raises(ConfigError) as info:
        plan(model, **common, world_size=2, fsdp=True, choices=Choices(optimizer=OptimizerChoice(state_precision="bf16")))
    assert "FSDP2 shards fp32 moments only" in str(info.value) and "step in backward" not in str(info.value)


def test_the_third_fuzz_runs_messages_name_the_flags_and_fixes_the_command_takes(tmp_path, capsys):
    """The third fuzz run's findings (issue 30): --data's too-short text on the byte path named path=; the optimizer
    probe's "fix its kwargs" and the checkpointing spellings only Python takes (an integer K, True, a Checkpointing:
    refused by --checkpointing and a --config file) reached the command; a layout's 'O' blocks on a CPU were to be
    dropped with --offload-activations, which they do not come from; export's folder is RUN_DIR, not --out; a LoRA
    option without --lora read "no adapters to -lora"."""
    from memtrain.checkpointing.policy import Checkpointing
    from memtrain.cli import main
    from memtrain.optim import probe

    short = tmp_path / "short.txt"
    short.write_bytes(b"x")
    assert main(["train", "--model", "gpt-tiny", "--max-steps", "1", "--data", str(short),
                 "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert f"--data {str(short)!r} holds 1 bytes" in err and "path=" not in err, err

    message = _refusal(lambda: probe.state_sizes(torch.optim.SGD, (("nokey", 1),), (4,), torch.float32))
    assert message.endswith("or fix its kwargs."), message
    assert in_flag_terms(message, "train").endswith("or fix its --optimizer-arg values."), message

    message = _refusal(lambda: Checkpointing.parse("bogus"))
    assert "True (all)" in message and "or a Checkpointing" in message, message
    rendered = in_flag_terms(message, "train")
    assert "True (all)" not in rendered and "Checkpointing." not in rendered and "'+offload'" in rendered, rendered

    assert main(["plan", "--model", "gpt-tiny", "--device", "cpu", "--checkpointing", "blocks(OK)"]) == 2
    err = capsys.readouterr().err
    assert "the 'O' blocks of --checkpointing" in err and "(--offload-activations)" not in err, err

    assert main(["export", str(short)]) == 2
    err = capsys.readouterr().err
    assert f"RUN_DIR {str(short)!r} is a file" in err and "--out" not in err, err

    assert main(["train", "--model", "gpt-tiny", "--merge-lora", "--lora-targets", "q"]) == 2
    err = capsys.readouterr().err
    assert "no adapters to merge" in err and "no adapters to place" in err and "to -lora" not in err, err
