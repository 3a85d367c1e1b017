"""--optimizer end to end (issue 30): memtrain train, plan and estimate with a named class; the run keeps it on
resume and refuses another; a config file names it as the flags do."""

from __future__ import annotations

import json

import pytest

from memtrain.cli import main

TINY = ["--model", "gpt-tiny", "--max-steps", "3", "--micro-batch-size", "4", "--no-progress", "--seq-len", "32"]


@pytest.fixture
def text_file(tmp_path):
    path = tmp_path / "text.txt"
    path.write_bytes(b"def f(x):\n    return x + 1\n\n" * 400)
    return path


@pytest.mark.parametrize("extra", [[], ["--offload-optimizer"], ["--step-in-backward"]],
                         ids=["device", "offloaded", "in-backward"])
def test_train_takes_a_named_optimizer(extra, tmp_path, text_file, capsys):
    out = tmp_path / "run"
    argv = ["train", *TINY, "--data", str(text_file), "--optimizer", "adafactor", "--optimizer-arg",
            "beta2_decay=-0.5", *extra, "--out", str(out), "--json"]
    assert main(argv) == 0, capsys.readouterr().err
    result = json.loads(capsys.readouterr().out)
    chosen = result["plan"]["settings"]["choices"]["optimizer"]
    assert (chosen["name"], chosen["kwargs"]) == ("torch.optim.Adafactor", {"beta2_decay": -0.5}), chosen
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in lines] == [1, 2, 3]
    # Adafactor's factored state: far below AdamW's 8 bytes a parameter (what the run measured).
    assert 0 < lines[-1]["optimizer_state_bytes"] < lines[-1]["parameter_bytes"] / 4  # under 1 byte a parameter
    saved = json.loads((out / "config.json").read_text())
    assert saved["train"]["choices"]["optimizer"]["name"] == "torch.optim.Adafactor"


def test_a_resume_keeps_the_runs_optimizer_and_refuses_another(tmp_path, text_file, capsys):
    out = tmp_path / "run"
    assert main(["train", *TINY, "--data", str(text_file), "--optimizer", "lion", "--out", str(out)]) == 0
    capsys.readouterr()
    assert main(["train", "--out", str(out), "--resume", "--max-steps", "4", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["resumed_from"] == 3 and result["plan"]["settings"]["choices"]["optimizer"]["name"] == "pytorch_optimizer.Lion"
    assert main(["train", "--out", str(out), "--resume", "--max-steps", "5", "--optimizer", "adafactor"]) == 2
    err = capsys.readouterr().err
    assert "--optimizer 'adafactor': the run's optimizer is Lion" in err and "To resolve this error" in err, err


def test_plan_and_estimate_count_a_named_optimizers_own_state(capsys):
    base = ["--model", "gpt-small", "--seq-len", "256", "--micro-batch-size", "4", "--json"]
    assert main(["estimate", *base]) == 0
    adamw = json.loads(capsys.readouterr().out)
    assert main(["estimate", *base, "--optimizer", "adafactor"]) == 0
    adafactor = json.loads(capsys.readouterr().out)
    assert main(["estimate", *base, "--optimizer", "lion"]) == 0
    lion = json.loads(capsys.readouterr().out)
    assert adafactor["optimizer_state_bytes"] < lion["optimizer_state_bytes"] < adamw["optimizer_state_bytes"]
    assert main(["plan", "--model", "gpt-small", "--seq-len", "256", "--global-batch-size", "8", "--budget", "2GiB",
                 "--optimizer", "lion", "--json"]) == 0
    planned = json.loads(capsys.readouterr().out)
    assert planned["plan"]["choices"]["optimizer"]["name"] == "pytorch_optimizer.Lion"


def test_bad_optimizer_flags_exit_2_naming_the_fix(capsys):
    assert main(["estimate", "--model", "gpt-tiny", "--micro-batch-size", "2", "--optimizer", "no.such.Opt"]) == 2
    assert "--optimizer" in capsys.readouterr().err
    assert main(["estimate", "--model", "gpt-tiny", "--micro-batch-size", "2", "--optimizer", "lion",
                 "--optimizer-state", "int8"]) == 2
    err = capsys.readouterr().err
    assert "--optimizer-state 'int8'" in err and "To resolve this error" in err, err
    with pytest.raises(SystemExit):
        main(["estimate", "--model", "gpt-tiny", "--optimizer-arg", "no-equals-sign"])
