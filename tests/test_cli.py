"""The memtrain command: a tiny end-to-end run, the run folder, exit codes and bad input."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest
from helpers import build_llama, build_tokenizer

from memtrain.cli import main

TINY = ["--model", "gpt-tiny", "--max-steps", "4", "--micro-batch-size", "4", "--no-progress"]


@pytest.fixture
def text_file(tmp_path):
    path = tmp_path / "text.txt"
    path.write_bytes(b"def f(x):\n    return x + 1\n\n" * 400)
    return path


def test_train_end_to_end_on_the_builtin_corpus(tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["train", *TINY, "--checkpointing", "all", "--out", str(out), "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["steps"] == 4 and result["checkpointed_blocks"] == ["blocks.0", "blocks.1"]
    assert result["plan"]["settings"]["micro_batch_size"] == 4 and result["plan"]["peak_bytes"] > 0
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
    assert report["measurement"]["relative_error"] is not None
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
    (["--hf-model", "/nonexistent/model", "--data", "TEXT"], "--hf-model '/nonexistent/model': no such folder"),
    (["--seq-len", "100000", "--data", "TEXT"], "validation windows"),
    (["--bogus"], "unrecognized arguments"),
    (["--micro-batch-size", "3", "--global-batch-size", "8"], "not divisible"),
    (["--precision", "fp8"], "invalid choice"),
    (["--resume", "--overwrite"], "contradict"),
    (["--fsdp"], "torchrun"),
    (["--seed", "-1"], "must be >= 0"),
    (["--save-every", "0"], "must be >= 1"),
    (["--offload-optimizer", "bf16-weights", "--fsdp"], "drop --fsdp (DDP)"),
    (["--offload-optimizer", "--fsdp", "--optimizer-state", "bf16"], "drop one of --offload-optimizer and --fsdp"),
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
        (tmp_path / "enc.json").write_text('{"model_type": "bert", "vocab_size": 512, "hidden_size": 32, '
                                           '"num_hidden_layers": 1, "num_attention_heads": 2, "intermediate_size": 64}')
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
                 "--seq-len", "32", "--max-steps", "2", "--micro-batch-size", "2", "--checkpointing", "all",
                 "--no-progress", "--out", str(tmp_path / "run"), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["checkpointed_blocks"] == ["model.layers.0", "model.layers.1"]


def test_python_dash_m_and_help():
    done = subprocess.run([sys.executable, "-m", "memtrain", "--help"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and "train" in done.stdout
    done = subprocess.run([sys.executable, "-m", "memtrain", "bench", "nope"], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 2 and "no benchmark named 'nope'" in done.stderr


# -- faults get one line, not a traceback, and write nothing (issue 13, item 22) -----------------------------
def _fault_case(case: str, tmp_path, text_file, monkeypatch) -> list[str]:
    """The argv of one bad input (set up in tmp_path); the run folder is tmp_path / "r" unless the case is --out."""
    run = ["--out", str(tmp_path / "r")]
    if case == "seed beyond 64 bits":
        return ["train", "--seed", str(2**64), *run]
    if case in ("out a dangling symlink", "out a symlink loop"):
        link = tmp_path / "link"
        link.symlink_to(tmp_path / "nowhere" if case == "out a dangling symlink" else link)
        return ["train", "--data", str(text_file), "--out", str(link)]
    if case.startswith("hf-config"):
        pytest.importorskip("transformers")
        fields = {"hf-config t5": {"model_type": "t5", "vocab_size": 512, "d_model": 32, "num_layers": 1,
                                   "num_heads": 2, "d_kv": 8, "d_ff": 64},
                  "hf-config negative hidden size": {"model_type": "llama", "vocab_size": 512, "hidden_size": -4,
                                                     "num_hidden_layers": 1, "num_attention_heads": 2,
                                                     "intermediate_size": 8},
                  "hf-config bad field keeps its cause": {"model_type": "llama", "vocab_size": "abc", "hidden_size": 8,
                                                          "num_hidden_layers": 1, "num_attention_heads": 2,
                                                          "intermediate_size": 8}}[case]
        (tmp_path / "config.json").write_text(json.dumps(fields))
        return ["train", "--hf-config", str(tmp_path / "config.json"), "--data", str(text_file), *run]
    if case == "WORLD_SIZE without RANK":
        monkeypatch.setenv("WORLD_SIZE", "2")
        monkeypatch.delenv("RANK", raising=False)
        return ["train", "--data", str(text_file), *run]
    if case == "data a directory":
        return ["train", "--data", str(tmp_path), *run]
    if case == "data a FIFO":
        os.mkfifo(tmp_path / "fifo")
        return ["train", "--data", str(tmp_path / "fifo"), *run]
    if case == "data a .jsonl file":
        (tmp_path / "x.jsonl").write_text('{"text": "def f(): pass"}\n' * 200)
        return ["train", "--data", str(tmp_path / "x.jsonl"), *run]
    if case.startswith("budget") or case == "nproc without torchrun" or case == "merge-lora without lora":
        flags = {"budget negative": ["--budget", "-1GiB"], "budget zero": ["--budget", "0"],
                 "budget unparsable": ["--budget", "lots"], "budget below one block": ["--budget", "4KiB"],
                 "budget with a micro-batch that cannot fit": ["--budget", "1MiB", "--micro-batch-size", "16",
                                                               "--global-batch-size", "16"],
                 "nproc without torchrun": ["--nproc", "2"],
                 "merge-lora without lora": ["--merge-lora"]}[case]
        monkeypatch.delenv("WORLD_SIZE", raising=False)
        return ["train", "--model", "gpt-tiny", "--data", str(text_file), *flags, *run]
    if case.startswith("hf-model") or case.startswith("jsonl"):
        return _hf_fault_case(case, tmp_path, run)
    if case == "lora without linear layers":
        pytest.importorskip("peft")
        (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "vocab_size": 256, "n_embd": 16,
                                                          "n_layer": 1, "n_head": 2, "n_positions": 64,
                                                          "bos_token_id": 0, "eos_token_id": 0}))
        return ["train", "--hf-config", str(tmp_path / "config.json"), "--data", str(text_file), "--lora", "4", *run]
    if case == "bench out unwritable":
        (tmp_path / "ro").mkdir(mode=0o500)
        return ["bench", "checkpointing", "--out", str(tmp_path / "ro" / "results.json")]
    raise AssertionError(case)


def _hf_fault_case(case: str, tmp_path, run: list[str]) -> list[str]:
    """A pretrained folder or tokenised data that cannot be used (built from conftest's tiny Llama)."""
    folder = tmp_path / "model"
    tokenizer = build_tokenizer(folder, corpus_bytes=2**14)
    build_llama(folder, vocab_size=len(tokenizer), eos_token_id=tokenizer.eos_token_id,
                pad_token_id=tokenizer.pad_token_id)
    data = tmp_path / "docs.jsonl"
    data.write_text('{"text": "def f(): pass"}\n' * 50)
    if case == "hf-model without weights":
        (folder / "model.safetensors").unlink()
    elif case == "hf-model with pickled weights only":
        (folder / "model.safetensors").rename(folder / "pytorch_model.bin")
    elif case == "hf-model without a tokenizer":
        for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
            (folder / name).unlink(missing_ok=True)
    elif case == "hf-model without config.json":
        (folder / "config.json").unlink()
    elif case == "hf-model without data":
        return ["train", "--hf-model", str(folder), *run]
    elif case == "jsonl with malformed lines":
        data.write_text('{"text": "a fine line"}\n{"text": "unterminated\n{"text": "fine"}\n[1, 2]\n')
    elif case == "jsonl without the text field":
        data.write_text('{"text": "fine"}\n{"body": "no text here"}\n')
    else:
        raise AssertionError(case)
    return ["train", "--hf-model", str(folder), "--data", str(data), *run]


FAULTS = {  # case: the words of the one line that names the fix
    "seed beyond 64 bits": "--seed 18446744073709551616 must be an integer in [0, 2**63)",
    "out a dangling symlink": "is a symbolic link to",
    "out a symlink loop": "is a symbolic link to",
    "hf-config t5": "cannot build a causal language model from this t5 config",
    "hf-config negative hidden size": "sets hidden_size=-4: a size must be at least 1",
    "hf-config bad field keeps its cause": "expected int, got str",
    "WORLD_SIZE without RANK": "WORLD_SIZE=2 is set but RANK",
    "data a directory": "is a directory",
    "data a FIFO": "is not a regular file",
    "data a .jsonl file": "is a .jsonl file, which only a model with a tokenizer reads",
    "bench out unwritable": "cannot be written",
    "budget negative": "--budget: '-1GiB' is negative",
    "budget zero": "--budget: '0' is zero",
    "budget unparsable": "--budget: 'lots' is not a size",
    "budget below one block": "is smaller than one block's parameters",
    "budget with a micro-batch that cannot fit": "micro-batch 16",
    "nproc without torchrun": "--nproc 2: this is one process, not started by torchrun",
    "merge-lora without lora": "--merge-lora without --lora",
    "lora without linear layers": "has no linear layer to adapt",
    "hf-model without weights": "holds no weights (*.safetensors)",
    "hf-model with pickled weights only": "holds only pickled weights (pytorch_model.bin)",
    "hf-model without a tokenizer": "holds no tokenizer",
    "hf-model without config.json": "holds no config.json",
    "hf-model without data": "without --data: the built-in corpus is read as bytes",
    "jsonl with malformed lines": "2 bad line(s): line 2: not valid JSON",
    "jsonl without the text field": 'line 2: "text" is missing',
}


@pytest.mark.parametrize("case", list(FAULTS))
def test_each_fault_gets_one_line_naming_the_fix_and_writes_nothing(case, tmp_path, text_file, monkeypatch, capsys):
    if case == "bench out unwritable" and os.geteuid() == 0:
        monkeypatch.setattr(os, "access", lambda path, mode, **kw: not str(path).endswith("ro"))
    argv = _fault_case(case, tmp_path, text_file, monkeypatch)
    before = sorted(p.name for p in tmp_path.iterdir())
    capsys.readouterr()  # what building the case printed (save_pretrained's progress bar)
    try:
        code = main(argv)
    except SystemExit as e:  # argparse's refusals: the usage, then one line
        code = e.code
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip() and not line.startswith(("usage:", " "))]
    assert code == 2 and len(lines) == 1, err
    assert FAULTS[case] in lines[0] and "To resolve this error" in lines[0], lines[0]
    assert "Traceback" not in err
    assert sorted(p.name for p in tmp_path.iterdir()) == before, "a refused command must write nothing"


def test_a_full_disk_during_a_checkpoint_is_one_line_naming_the_file_and_the_intact_checkpoint(
        tmp_path, text_file, monkeypatch, capsys):
    import errno

    import safetensors.torch

    real_save = safetensors.torch.save_file
    saved = []

    def fills_up(tensors, filename, *args, **kwargs):
        if "checkpoints" in str(filename) and saved:
            raise OSError(errno.ENOSPC, "No space left on device", filename)
        saved.append(filename)
        return real_save(tensors, filename, *args, **kwargs)

    monkeypatch.setattr(safetensors.torch, "save_file", fills_up)
    out = tmp_path / "run"
    code = main(["train", *TINY, "--data", str(text_file), "--save-every", "2", "--out", str(out)])
    lines = [line for line in capsys.readouterr().err.splitlines() if "error" in line]
    assert code == 1 and len(lines) == 1, lines
    assert "could not write" in lines[0] and "step-0000004" in lines[0] and "(No space left on device)" in lines[0]
    assert f"the last good checkpoint, {out / 'checkpoints' / 'step-0000002'}, is intact" in lines[0]
    assert "then continue the run with --resume" in lines[0]
    assert [p.name for p in (out / "checkpoints").iterdir()] == ["step-0000002"]


def test_stdout_closed_early_is_one_line_not_a_traceback(tmp_path, monkeypatch, capsys):
    class ClosedPipe:
        def write(self, text):
            raise BrokenPipeError(32, "Broken pipe")

        def flush(self):
            raise BrokenPipeError(32, "Broken pipe")

    monkeypatch.setattr(sys, "stdout", ClosedPipe())
    assert main(["estimate", "--model", "gpt-tiny", "--micro-batch-size", "2"]) == 1
    err = capsys.readouterr().err
    assert "stdout was closed before all the output was written" in err and "Traceback" not in err
    # The real thing: a reader that closes the pipe before memtrain writes (as `| head -0` would).
    proc = subprocess.Popen([sys.executable, "-m", "memtrain", "estimate", "--model", "gpt-tiny"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    proc.stdout.close()
    err = proc.stderr.read()
    assert proc.wait(timeout=120) == 1 and "Traceback" not in err and "Exception ignored" not in err, err


# -- resume from the folder alone (item 18) ----------------------------------------------------------------
def test_resume_needs_only_the_folder_and_checks_the_flags_given_with_it(tmp_path, text_file, capsys):
    out = tmp_path / "run"
    first = ["train", "--model", "gpt-tiny", "--seq-len", "32", "--data", str(text_file), "--max-steps", "2",
             "--micro-batch-size", "2", "--lr", "0.01", "--no-progress", "--out", str(out)]
    assert main(first) == 0
    capsys.readouterr()
    assert main(["train", "--out", str(out), "--resume", "--max-steps", "3", "--json"]) == 0
    captured = capsys.readouterr()
    result = json.loads(captured.out)
    assert result["resumed_from"] == 2 and result["steps"] == 3, result
    assert "max_steps=3 applied (the run had max_steps=2)" in captured.err
    config = json.loads((out / "config.json").read_text())
    assert config["command"]["model"] == "gpt-tiny" and config["train"]["max_steps"] == 3
    # A changed run-defining flag is refused by its flag; so is another model or other data.
    assert main(["train", "--out", str(out), "--resume", "--max-steps", "4", "--lr", "0.5", "--seed", "7"]) == 2
    err = capsys.readouterr().err
    assert "--lr 0.5 now but --lr 0.01 in the run being resumed" in err, err
    assert "--seed 7 now but --seed 0" in err and "lr=" not in err
    assert main(["train", "--out", str(out), "--resume", "--max-steps", "4", "--model", "gpt-mini"]) == 2
    assert "--model 'gpt-mini' now but 'gpt-tiny' in the run being resumed" in capsys.readouterr().err
    # A new --data path is let through (a moved file still resumes); its contents are what is compared.
    other = tmp_path / "other.txt"
    other.write_bytes(text_file.read_bytes().replace(b"return", b"yield "))
    assert main(["train", "--out", str(out), "--resume", "--max-steps", "4", "--data", str(other)]) == 2
    err = capsys.readouterr().err
    assert "the training data differ from the run being resumed: the same" in err and "other contents" in err, err
    assert json.loads((out / "config.json").read_text())["train"]["max_steps"] == 3, "refused: nothing written"


# -- flags users expect (item 23) and library names turned into flags (item 12) ----------------------------
def test_version(capsys):
    from memtrain import __version__

    with pytest.raises(SystemExit) as info:
        main(["--version"])
    assert info.value.code == 0 and capsys.readouterr().out.strip() == f"memtrain {__version__}"


def test_schedule_and_evaluation_flags_reach_the_run(tmp_path, text_file, capsys):
    out = tmp_path / "run"
    assert main(["train", *TINY, "--data", str(text_file), "--warmup-steps", "2", "--weight-decay", "0",
                 "--grad-clip", "none", "--eval-every", "2", "--out", str(out)]) == 0
    settings = json.loads((out / "config.json").read_text())["train"]
    assert (settings["warmup_steps"], settings["weight_decay"], settings["grad_clip"], settings["eval_every"]) == (
        2, 0.0, None, 2)
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [("eval_loss" in m) for m in lines] == [False, True, False, True]
    # Each line's lr is the one its step used: 2 warm-up steps to --lr, then the cosine decay.
    assert [m["lr"] for m in lines[:2]] == pytest.approx([0.003 / 2, 0.003]) and lines[3]["lr"] < 0.003
    with pytest.raises(SystemExit) as info:
        main(["train", *TINY, "--grad-clip", "-1", "--out", str(tmp_path / "x")])
    assert info.value.code == 2 and "must be > 0 (or 0 / none: no clipping)" in capsys.readouterr().err


def test_progress_in_a_log_is_lines_not_carriage_returns_and_agrees_with_the_summary(tmp_path, text_file, capsys):
    argv = ["train", "--model", "gpt-tiny", "--max-steps", "4", "--micro-batch-size", "4", "--data", str(text_file),
            "--out", str(tmp_path / "run")]
    assert main(argv) == 0  # capsys's stderr is not a terminal, as a log file or a pipe is not
    captured = capsys.readouterr()
    assert "\r" not in captured.err, "tqdm redraws in a log file"
    progress = re.findall(r"step (\d+)/4: loss [\d.]+ \| (\d+) tok/s", captured.err)
    assert [int(step) for step, _ in progress] == [1, 2, 3, 4], captured.err
    summary = re.search(r"(\d+) tokens/s in training steps", captured.out)
    assert summary and summary.group(1) == progress[-1][1], (summary, progress)


@pytest.mark.parametrize(("stop", "code"), [("SIGINT", 130), ("SIGTERM", 143)])
def test_a_run_stopped_by_a_signal_exits_with_the_signals_code(stop, code, text_file, tmp_path, monkeypatch, capsys):
    """A stopped run is not a success (`memtrain train ... && upload` must not go on): the shell's code for the
    signal (128 + its number), after the checkpoint, with the line that says how to continue."""
    import signal

    from memtrain.run import MetricsLog

    real = MetricsLog.append

    def append(self, line):
        real(self, line)
        if line["step"] == 1:
            signal.raise_signal(getattr(signal, stop))

    monkeypatch.setattr(MetricsLog, "append", append)
    out = tmp_path / "run"
    assert main(["train", *TINY, "--data", str(text_file), "--seq-len", "32", "--out", str(out)]) == code
    said = capsys.readouterr()
    assert f"{stop} received: stopped after step 1 with a checkpoint" in said.err, said.err
    assert f"continue with: memtrain train --out {out} --resume" in said.out + said.err
    assert main(["train", "--out", str(out), "--resume", "--no-progress"]) == 0
