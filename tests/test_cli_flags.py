"""The command line's flags: a --config TOML file sets them (switches by either spelling), its bad keys and values
refused at once."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from memtrain.cli.flags import apply_config_file, build_parser
from memtrain.errors import ConfigError


def test_a_config_file_sets_the_new_flags_switches_by_either_spelling(tmp_path):
    (tmp_path / "run.toml").write_text('budget = "8MiB"\nno-chunked-loss = true\noffload-optimizer = false\n'
                                       'offload-optimizer-fraction = 0.25\nlora = 4\ncheckpointing = "Every:2"\n'
                                       'optimizer-state = "bf16"\nstep-in-backward = true\n')
    parser = build_parser()
    argv = ["train", "--config", str(tmp_path / "run.toml"), "--offload-optimizer-fraction", "0.5"]
    assert apply_config_file(parser, argv) >= {"budget", "chunked_loss", "offload_optimizer", "lora"}
    args = parser.parse_args(argv)
    assert (args.budget, args.chunked_loss, args.offload_optimizer, args.offload_optimizer_fraction, args.lora,
            args.checkpointing, args.optimizer_state, args.step_in_backward) == (
        8 * 2**20, False, False, 0.5, 4, "every:2", "bf16", True)
    (tmp_path / "bad.toml").write_text('budget = "lots"\nchunked-loss = "yes"\n')
    with pytest.raises(ConfigError) as info:
        apply_config_file(build_parser(), ["train", "--config", str(tmp_path / "bad.toml")])
    assert "'lots' is not a size" in str(info.value) and "chunked-loss = 'yes' must be true or false" in str(info.value)



# -- fine-tuning flags (issue 22) ------------------------------------------------------------------------------
def test_a_config_file_sets_the_fine_tuning_flags(tmp_path):
    (tmp_path / "run.toml").write_text('lr-schedule = "linear"\nepochs = 2\nadam-betas = "0.8,0.99"\n'
                                       'adam-eps = 1e-6\nlora = 4\nlora-alpha = 16\nlora-dropout = 0.1\n'
                                       'lora-targets = "q_proj, v_proj"\neval-data = "held.txt"\n')
    parser = build_parser()
    argv = ["train", "--config", str(tmp_path / "run.toml")]
    assert apply_config_file(parser, argv) >= {"lr_schedule", "epochs", "adam_betas", "lora_targets", "eval_data"}
    args = parser.parse_args(argv)
    assert (args.lr_schedule, args.epochs, args.adam_betas, args.adam_eps, args.lora_alpha, args.lora_dropout,
            args.lora_targets, args.eval_data, args.lr) == (
        "linear", 2, (0.8, 0.99), 1e-6, 16.0, 0.1, ("q_proj", "v_proj"), "held.txt", None)
    (tmp_path / "bad.toml").write_text('adam-betas = "0.9"\nlora-dropout = 1.0\nlr-schedule = "step"\n')
    with pytest.raises(ConfigError) as info:
        apply_config_file(build_parser(), ["train", "--config", str(tmp_path / "bad.toml")])
    text = str(info.value)
    assert "'0.9' is not two numbers in [0, 1)" in text and "1.0 must be < 1" in text and "'step' is not one of" in text


def test_epochs_and_max_steps_together_are_refused(tmp_path, capsys):
    from memtrain.cli import main

    with pytest.raises(SystemExit) as exit_info:  # on one command line: argparse's mutually exclusive group
        main(["train", "--model", "gpt-tiny", "--epochs", "1", "--max-steps", "3"])
    assert exit_info.value.code == 2 and "not allowed with argument" in capsys.readouterr().err
    (tmp_path / "run.toml").write_text("epochs = 1\n")
    assert main(["train", "--model", "gpt-tiny", "--config", str(tmp_path / "run.toml"), "--max-steps", "3",
                 "--out", str(tmp_path / "r")]) == 2
    assert "--epochs 1 and --max-steps 3 both set the run's length" in capsys.readouterr().err


@pytest.mark.parametrize("flag", [["--lora-alpha", "16"], ["--lora-dropout", "0.1"], ["--lora-targets", "c_attn"]])
def test_lora_options_without_lora_are_refused(tmp_path, capsys, flag):
    from memtrain.cli import main

    assert main(["train", "--model", "gpt-tiny", *flag, "--out", str(tmp_path / "r")]) == 2
    assert f"{flag[0]} without --lora" in capsys.readouterr().err


def _docs(path, n: int, word: str) -> str:
    path.write_text("".join(f'{{"text": "def {word}{i}(x):\\n    return x + {i}"}}\n' for i in range(n)))
    return str(path)


def test_lora_targets_are_checked_against_the_model_listing_its_names(tmp_path, hf_model_dir, capsys):
    pytest.importorskip("peft")
    from memtrain.cli import main

    data = _docs(tmp_path / "docs.jsonl", 80, "f")
    assert main(["train", "--hf-model", str(hf_model_dir), "--data", data, "--lora", "4", "--lora-targets",
                 "q_proj,attn_out", "--max-steps", "1", "--out", str(tmp_path / "r"), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "--lora-targets ['q_proj', 'attn_out']: LlamaForCausalLM has no module named 'attn_out'" in err, err
    assert "its linear layers are named down_proj, gate_proj, k_proj, o_proj, q_proj, up_proj, v_proj" in err, err
    assert "Traceback" not in err


def test_a_lora_fine_tune_states_its_defaults_and_a_resume_keeps_its_flags(tmp_path, hf_model_dir, capsys):
    pytest.importorskip("peft")
    from memtrain.cli import main

    data, held = _docs(tmp_path / "docs.jsonl", 80, "f"), _docs(tmp_path / "held.jsonl", 20, "g")
    out = tmp_path / "run"
    argv = ["train", "--hf-model", str(hf_model_dir), "--data", data, "--eval-data", held, "--lora", "4",
            "--lora-alpha", "16", "--lora-dropout", "0.1", "--lora-targets", "q_proj,v_proj", "--lr-schedule",
            "constant", "--adam-betas", "0.8,0.99", "--adam-eps", "1e-6", "--global-batch-size", "4",
            "--eval-every", "1", "--save-every", "1", "--no-progress", "--seq-len", "32"]
    assert main([*argv, "--max-steps", "2", "--out", str(out)]) == 0
    err = "".join(capsys.readouterr())
    assert "lr 0.0002, because: LoRA adapters on a pretrained model" in err, err
    assert "learning rate 0.0002 after 1 warm-up steps, then constant to step 2 (--lr-schedule constant)" in err
    assert f"evaluated on {held}" in err and "spread evenly over all" in err
    adapter = json.loads((out / "hf" / "adapter_config.json").read_text())
    assert (adapter["r"], adapter["lora_alpha"], adapter["lora_dropout"], set(adapter["target_modules"])) == (
        4, 16, 0.1, {"q_proj", "v_proj"})
    command = json.loads((out / "config.json").read_text())["command"]
    assert command["eval_data"] == str(Path(held).absolute()) and command["adam_betas"] == [0.8, 0.99]
    # The resume takes every flag back from config.json: the same schedule, betas and held-out file.
    assert main(["train", "--out", str(out), "--resume", "--max-steps", "4", "--no-progress"]) == 0
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["lr"] for r in rows] == pytest.approx([2e-4] * 4) and all("eval_loss" in r for r in rows)
    capsys.readouterr()
    # What defines the run cannot change on resume: other betas are refused, naming them.
    assert main(["train", "--out", str(out), "--resume", "--max-steps", "6", "--adam-betas", "0.9,0.95"]) == 2
    assert "adam_betas" in capsys.readouterr().err.replace("--adam-betas", "adam_betas")


def test_full_fine_tuning_for_epochs_states_the_rate_and_the_steps(tmp_path, hf_model_dir, capsys):
    from memtrain.cli import main

    data = _docs(tmp_path / "docs.jsonl", 80, "f")
    assert main(["train", "--hf-model", str(hf_model_dir), "--data", data, "--epochs", "1", "--global-batch-size",
                 "8", "--seq-len", "64", "--no-progress", "--lr-schedule", "linear", "--out",
                 str(tmp_path / "r")]) == 0
    err = capsys.readouterr().err
    assert "lr 2e-05, because: fine-tuning a pretrained model" in err, err
    steps = re.search(r"max_steps (\d+), because: 1 epoch\(s\) of (\d+) examples at a global batch of 8", err)
    assert steps is not None, err
    assert int(steps.group(1)) == -(-int(steps.group(2)) // 8)
    rows = (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()
    assert len(rows) == int(steps.group(1))


def test_a_resumed_epochs_run_takes_a_new_max_steps(tmp_path, capsys):
    """--max-steps given to a --resume of an --epochs run is the run's new length (as on any resume), not a
    conflict with the --epochs the run recorded."""
    from memtrain.cli import main

    text = tmp_path / "text.txt"
    text.write_bytes(b"def f(x):\n    return x + 1\n\n" * 120)  # 3360 bytes: the first 95% make 49 windows of 64
    out = tmp_path / "r"
    assert main(["train", "--model", "gpt-tiny", "--data", str(text), "--epochs", "1", "--global-batch-size", "16",
                 "--no-progress", "--out", str(out)]) == 0
    assert "max_steps 4, because: 1 epoch(s) of 49 examples at a global batch of 16" in capsys.readouterr().err
    assert main(["train", "--out", str(out), "--resume", "--max-steps", "6", "--no-progress"]) == 0
    assert len((out / "metrics.jsonl").read_text().splitlines()) == 6


def test_a_hf_config_that_names_its_hub_model_still_trains_at_pre_trainings_rate(tmp_path, capsys):
    """A transformers 4 config.json keeps "_name_or_path": the model built from it has random weights all the same."""
    pytest.importorskip("transformers")
    from memtrain.cli import main

    (tmp_path / "config.json").write_text(json.dumps({
        "model_type": "gpt2", "vocab_size": 256, "n_embd": 16, "n_layer": 1, "n_head": 2, "n_positions": 64,
        "bos_token_id": 0, "eos_token_id": 0, "_name_or_path": "openai-community/gpt2"}))
    assert main(["train", "--hf-config", str(tmp_path / "config.json"), "--seq-len", "32", "--max-steps", "1",
                 "--global-batch-size", "2", "--no-progress", "--out", str(tmp_path / "r")]) == 0
    assert "lr 0.003, because: training from random weights" in capsys.readouterr().err


def test_train_help_groups_its_flags_by_purpose():
    from memtrain.cli.flags import TRAIN_GROUPS, subparser

    train = subparser(build_parser(), "train")
    groups = {g.title: [a.option_strings[0] for a in g._group_actions] for g in train._action_groups}  # noqa: SLF001
    assert set(TRAIN_GROUPS.values()) <= set(groups), sorted(groups)
    assert sorted(groups["options"]) == ["--config", "-h"], groups["options"]  # nothing left ungrouped
    assert all(groups[title] for title in TRAIN_GROUPS.values()), groups  # no empty section
    assert "--lr" in groups["optimizer and learning-rate schedule"] and "--resume" in groups[
        "run length, run folder and resume"], groups
    text = train.format_help()
    assert all(f"\n{title}:\n" in text for title in TRAIN_GROUPS.values()), text


def test_seq_len_has_one_default_in_train_plan_and_estimate(tmp_path, capsys):
    from helpers import planner_llama

    from memtrain.cli import main
    from memtrain.cli.workloads import hf_seq_len

    config = planner_llama()  # 2048 positions: neither default is capped
    config.save_pretrained(tmp_path / "llama")
    train_default = hf_seq_len(config, None, "--hf-config")  # what memtrain train trains on
    flags = ["--hf-config", str(tmp_path / "llama" / "config.json"), "--device", "cpu", "--json"]
    assert main(["plan", *flags]) == 0
    planned = json.loads(capsys.readouterr().out)["seq_len"]
    assert main(["estimate", *flags]) == 0
    estimated = capsys.readouterr().out
    assert planned == train_default, (planned, train_default)
    assert main(["estimate", *flags, "--seq-len", str(train_default)]) == 0
    assert capsys.readouterr().out == estimated  # the default is that length
    helps = {c: subparser_help(c) for c in ("train", "plan", "estimate")}
    assert all(f"{train_default} for Hugging Face models" in h for h in helps.values()), helps


def subparser_help(command: str) -> str:
    from memtrain.cli.flags import subparser

    return " ".join(subparser(build_parser(), command).format_help().split())
