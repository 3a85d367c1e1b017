"""The memtrain command: a tiny end-to-end run, the run folder, exit codes and bad input."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from memtrain.cli import main

TINY = ["--model", "gpt-tiny", "--max-steps", "4", "--micro-batch-size", "4", "--no-progress"]


@pytest.fixture
def text_file(tmp_path):
    path = tmp_path / "text.txt"
    path.write_bytes(b"def f(x):\n    return x + 1\n\n" * 400)
    return path


def test_train_end_to_end_on_the_builtin_corpus(tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["train", *TINY, "--out", str(out), "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["steps"] == 4 and result["checkpointed_blocks"] == ["blocks.0", "blocks.1"]
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in lines] == [1, 2, 3, 4]
    assert all(m["activation_bytes"] > 0 and m["tokens_per_s"] > 0 for m in lines)
    assert "eval_loss" in lines[-1]
    from safetensors.torch import load_file

    weights = load_file(out / "model.safetensors")
    assert "blocks.0.attn.qkv.weight" in weights
    report = json.loads((out / "report.json").read_text())
    assert report["with_memtrain"]["activation_bytes"] == lines[-1]["activation_bytes"]
    assert report["without_memtrain"]["activation_bytes"] > report["with_memtrain"]["activation_bytes"]
    assert report["estimate_check"]["relative_error"] is not None
    for picture in ("loss.png", "memory.png"):
        assert (out / picture).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", picture
    assert len((out / "sample.txt").read_text()) > 0
    assert json.loads((out / "config.json").read_text())["train"]["max_steps"] == 4
    assert json.loads((out / ".memtrain-run").read_text())["format"] == 1
    assert [p.name for p in (out / "checkpoints").iterdir()] == ["step-0000004"]


def test_checkpointing_flag_changes_saved_bytes(tmp_path, text_file, capsys):
    saved = {}
    for mode in ("none", "all", "every:2"):
        out = tmp_path / mode.replace(":", "")
        assert main(["train", *TINY, "--model", "gpt-tiny", "--data", str(text_file), "--checkpointing", mode,
                     "--out", str(out), "--json"]) == 0
        saved[mode] = json.loads(capsys.readouterr().out)["activation_bytes"]
    assert saved["all"] < saved["every:2"] < saved["none"], saved


def test_refuses_a_folder_holding_another_run(tmp_path, text_file, capsys):
    out = tmp_path / "run"
    assert main(["train", *TINY, "--data", str(text_file), "--out", str(out)]) == 0
    before = (out / "model.safetensors").read_bytes()
    assert main(["train", *TINY, "--data", str(text_file), "--out", str(out), "--lr", "0.1"]) == 2
    assert "--overwrite" in capsys.readouterr().err
    assert (out / "model.safetensors").read_bytes() == before
    assert main(["train", *TINY, "--data", str(text_file), "--out", str(out), "--overwrite", "--lr", "0.1"]) == 0
    assert (out / "model.safetensors").read_bytes() != before


@pytest.mark.parametrize("argv,fragment", [
    (["--checkpointing", "some"], "every:K"),
    (["--checkpointing", "every:0"], "every:K"),
    (["--max-steps", "0"], "must be >= 1"),
    (["--micro-batch-size", "-2"], "must be >= 1"),
    (["--lr", "fast"], "not a number"),
    (["--model", "gpt-huge"], "--model 'gpt-huge'"),
    (["--data", "/nonexistent/file.txt"], "no such file"),
    (["--hf-config", "/nonexistent/config.json"], "could not read the Hugging Face config"),
    (["--seq-len", "100000", "--data", "TEXT"], "validation windows"),
    (["--bogus"], "unrecognized arguments"),
    (["--micro-batch-size", "3", "--global-batch-size", "8"], "not divisible"),
    (["--precision", "fp8"], "invalid choice"),
    (["--resume", "--overwrite"], "contradict"),
    (["--fsdp"], "torchrun"),
    (["--seed", "-1"], "must be >= 0"),
    (["--save-every", "0"], "must be >= 1"),
    (["--offload-optimizer", "--fsdp"], "drop one of"),
    (["--config", "/nonexistent/run.toml"], "no such file"),
    (["--hf-config", "SMALLVOCAB"], "vocab_size=64 must be an integer >= 256"),
    (["--hf-config", "SMALLVOCAB", "--seq-len", "4096"], "longer than the model's"),
    (["--hf-config", "BADFIELD"], "is invalid"),
    (["--hf-config", "ENCODER"], "is an encoder"),
    (["--config", "/"], "cannot be read as a TOML file"),
])
def test_bad_input_exits_2_with_one_message(argv, fragment, tmp_path, text_file, capsys):
    if "BADFIELD" in argv or "ENCODER" in argv:
        (tmp_path / "bad.json").write_text('{"model_type": "llama", "vocab_size": "abc"}')
        (tmp_path / "enc.json").write_text('{"model_type": "bert", "vocab_size": 512}')
        argv = [str(tmp_path / "bad.json") if a == "BADFIELD" else str(tmp_path / "enc.json") if a == "ENCODER"
                else a for a in argv]
    if "SMALLVOCAB" in argv:
        transformers = pytest.importorskip("transformers")
        transformers.LlamaConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                                 num_key_value_heads=1, vocab_size=64).save_pretrained(tmp_path / "cfg")
        argv = [str(tmp_path / "cfg" / "config.json") if a == "SMALLVOCAB" else a for a in argv]
    argv = [str(text_file) if a == "TEXT" else a for a in argv]
    try:
        code = main(["train", "--no-progress", "--max-steps", "1", "--out", str(tmp_path / "r"), *argv])
    except SystemExit as e:
        code = e.code
    err = capsys.readouterr().err
    assert code == 2 and fragment in err, err
    assert "Traceback" not in err
    assert not (tmp_path / "r" / "metrics.jsonl").exists()


def test_hf_config_trains(tmp_path, text_file, capsys):
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                                      num_key_value_heads=1, vocab_size=256, max_position_embeddings=64)
    config.save_pretrained(tmp_path / "cfg")
    assert main(["train", "--hf-config", str(tmp_path / "cfg" / "config.json"), "--data", str(text_file),
                 "--seq-len", "32", "--max-steps", "2", "--micro-batch-size", "2", "--no-progress",
                 "--out", str(tmp_path / "run"), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["checkpointed_blocks"] == ["model.layers.0", "model.layers.1"]


def test_python_dash_m_and_help():
    done = subprocess.run([sys.executable, "-m", "memtrain", "--help"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and "train" in done.stdout
    done = subprocess.run([sys.executable, "-m", "memtrain", "bench", "nope"], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 2 and "no benchmark named 'nope'" in done.stderr


def test_estimate_json_and_table(tmp_path, capsys):
    assert main(["estimate", "--model", "gpt-tiny", "--micro-batch-size", "4", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["source"] == "estimated" and report["peak_bytes"] > report["parameter_bytes"] > 0
    assert main(["estimate", "--model", "gpt-tiny", "--checkpointing", "none", "--device", "cpu"]) == 0
    table = capsys.readouterr().out
    assert "memory report (estimated, cpu)" in table and "peak at:" in table


def test_estimate_hf_config_and_bad_input(tmp_path, capsys):
    transformers = pytest.importorskip("transformers")
    transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                             num_key_value_heads=2, vocab_size=512).save_pretrained(tmp_path / "cfg")
    path = str(tmp_path / "cfg" / "config.json")
    assert main(["estimate", "--hf-config", path, "--seq-len", "64", "--micro-batch-size", "2", "--json"]) == 0
    with_all = json.loads(capsys.readouterr().out)
    assert main(["estimate", "--hf-config", path, "--seq-len", "64", "--micro-batch-size", "2", "--json",
                 "--checkpointing", "none"]) == 0
    without = json.loads(capsys.readouterr().out)
    assert with_all["activation_bytes"] < without["activation_bytes"]
    # By default the loss is chunked with checkpointing on, as memtrain train does; the flag keeps whole logits.
    assert any("apply_chunked_loss" in a for a in with_all["assumptions"])
    assert main(["estimate", "--hf-config", path, "--seq-len", "64", "--micro-batch-size", "2", "--json",
                 "--no-chunked-loss"]) == 0
    whole_logits = json.loads(capsys.readouterr().out)
    assert with_all["activation_bytes"] < whole_logits["activation_bytes"] < without["activation_bytes"]
    assert not any("apply_chunked_loss" in a for a in whole_logits["assumptions"])
    assert main(["estimate", "--hf-config", str(tmp_path / "missing.json")]) == 2
    assert "To resolve this error" in capsys.readouterr().err
