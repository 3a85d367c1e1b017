"""TensorBoard logging (``log=("tensorboard",)``, ``--log tensorboard``): event files that TensorBoard's own reader
loads with the figures of metrics.jsonl; a resume appends; a missing package fails at start-up naming the extra."""

from __future__ import annotations

import importlib.util
import json
import shutil

import pytest
from helpers import code_windows, quick_run_config, tiny_gpt

from memtrain import train
from memtrain.cli import main
from memtrain.config import TrainConfig
from memtrain.errors import ConfigError

pytest.importorskip("tensorboard")
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator  # noqa: E402


def _read_events(folder):
    events = EventAccumulator(str(folder))
    events.Reload()
    return events


def _metrics(out):
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def _scalars(events, tag):
    return [(e.step, e.value) for e in events.Scalars(tag)]


def test_event_files_hold_the_metrics_lines_and_the_plan(tmp_path):
    out = tmp_path / "run"
    train(tiny_gpt(seq_len=32, seed=0), code_windows(),
          quick_run_config(out, max_steps=4, eval_every=2, log=("tensorboard",)))
    events = _read_events(out / "tensorboard")
    lines = _metrics(out)
    tags = set(events.Tags()["scalars"])
    expected = {"train/loss", "eval/loss", "train/lr", "train/tokens_per_s", "train/grad_norm",
                "memory/saved_activations_MiB", "memory/model_state_MiB", "memory/host_resident_MiB"}
    assert expected <= tags, sorted(tags)
    # a CPU run has no allocator peak, allocated or reserved (None in metrics.jsonl)
    assert not tags & {"memory/peak_MiB", "memory/peak_reserved_MiB"}
    for key, tag in (("loss", "train/loss"), ("lr", "train/lr"), ("tokens_per_s", "train/tokens_per_s")):
        logged = _scalars(events, tag)
        assert [s for s, _ in logged] == [1, 2, 3, 4], (tag, logged)
        for (_, value), line in zip(logged, lines, strict=True):
            assert value == pytest.approx(line[key], rel=1e-6), (tag, value, line[key])
    assert _scalars(events, "eval/loss") == [(m["step"], pytest.approx(m["eval_loss"], rel=1e-6))
                                             for m in lines if "eval_loss" in m]
    assert [s for s, _ in _scalars(events, "eval/loss")] == [2, 4]
    saved = _scalars(events, "memory/saved_activations_MiB")
    assert saved[-1][1] == pytest.approx(lines[-1]["activation_bytes"] / 2**20, rel=1e-6)
    assert all(value > 1 for _, value in _scalars(events, "memory/host_resident_MiB"))  # a Python process: > 1 MiB
    plan = events.Tensors("plan/text_summary")
    text = plan[0].tensor_proto.string_val[0].decode()
    assert plan[0].step == 0 and "checkpointing" in text and "learning rate" in text, text


def test_a_resume_appends_and_each_step_shows_once(tmp_path):
    out = tmp_path / "run"
    train(tiny_gpt(seq_len=32, seed=0), code_windows(),
          quick_run_config(out, max_steps=4, save_every=2, log=("tensorboard",)))
    # The run died after logging steps 3 and 4 but before their checkpoint: the resume runs them again.
    shutil.rmtree(out / "checkpoints" / "step-0000004")
    train(tiny_gpt(seq_len=32, seed=0), code_windows(),
          quick_run_config(out, max_steps=6, save_every=2, resume=True, log=("tensorboard",)))
    assert len(list((out / "tensorboard").iterdir())) == 2  # one event file per session, the first kept
    events = _read_events(out / "tensorboard")
    logged = _scalars(events, "train/loss")
    assert [s for s, _ in logged] == [1, 2, 3, 4, 5, 6], logged
    assert [v for _, v in logged] == pytest.approx([m["loss"] for m in _metrics(out)], rel=1e-6)
    assert sorted(e.step for e in events.Tensors("plan/text_summary")) == [0, 2]  # each session's plan


def test_overwrite_replaces_the_previous_runs_event_files(tmp_path):
    out = tmp_path / "run"
    for overwrite in (False, True):
        train(tiny_gpt(seq_len=32, seed=0), code_windows(),
              quick_run_config(out, max_steps=1, overwrite=overwrite, log=("tensorboard",)))
    assert len(list((out / "tensorboard").iterdir())) == 1  # tensorboard/ is memtrain's: overwrite replaces it


def test_no_tensorboard_files_without_the_option(tmp_path):
    out = tmp_path / "run"
    train(tiny_gpt(seq_len=32, seed=0), code_windows(), quick_run_config(out, max_steps=1))
    assert not (out / "tensorboard").exists()


@pytest.fixture
def no_tensorboard(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a, **k: None if name == "tensorboard" else real(name, *a, **k))


def test_a_missing_package_fails_at_start_up_naming_the_extra(tmp_path, no_tensorboard, capsys):
    with pytest.raises(ConfigError, match=r"pip install 'memtrain\[tensorboard\]'"):
        TrainConfig(log=("tensorboard",)).validate()
    out = tmp_path / "run"
    argv = ["train", "--model", "gpt-tiny", "--max-steps", "2", "--micro-batch-size", "4", "--no-progress",
            "--log", "tensorboard", "--out", str(out)]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "pip install 'memtrain[tensorboard]'" in err and "--log" in err, err
    assert not out.exists()  # refused before the model, the data or the run folder


@pytest.mark.parametrize("log,fragment", [
    ("tensorboard", "must be a tuple"),
    (("wandb",), "'wandb' is not a logger"),
])
def test_bad_log_values_name_the_loggers(log, fragment):
    with pytest.raises(ConfigError, match=fragment):
        TrainConfig(log=log).validate()


def test_the_log_flag_reads_a_list_or_none(tmp_path, capsys):
    from memtrain.cli.flags import build_parser

    parser = build_parser()
    assert parser.parse_args(["train", "--log", "tensorboard"]).log == ("tensorboard",)
    assert parser.parse_args(["train", "--log", "none"]).log == ()
    assert parser.parse_args(["train"]).log == ()
    with pytest.raises(SystemExit) as stop:
        parser.parse_args(["train", "--log", "tensorboard,wandb"])
    assert stop.value.code == 2
    assert "'wandb' is not a logger memtrain has; the loggers are tensorboard (or none)" in capsys.readouterr().err
