"""The faults a new user hit (issue 21): each one is a single line naming the fix (exit 2 for bad input, 1 for
the machine refusing a write), or the right behaviour, and nothing the user had is lost.

Writes that fail are real where the machine allows it: a file-size limit (``RLIMIT_FSIZE``; Python ignores
SIGXFSZ, so the write fails with EFBIG) set around the real writer, which then raises safetensors' own
``SafetensorError`` as a full disk does; elsewhere the writer is patched to raise that real exception type.
"""

from __future__ import annotations

import contextlib
import json
import math
import re
import resource
import shutil
import warnings

import numpy as np
import pytest
import safetensors.torch
from helpers import build_llama, build_tokenizer, run_cli
from safetensors import SafetensorError

from memtrain.cli import main
from memtrain.errors import ConfigError

TINY = ["--model", "gpt-tiny", "--max-steps", "4", "--micro-batch-size", "4", "--no-progress"]
NO_SPACE = "Error while serializing: I/O error: No space left on device (os error 28)"  # safetensors' own words


@pytest.fixture
def text_file(tmp_path):
    path = tmp_path / "text.txt"
    path.write_bytes(b"def f(x):\n    return x + 1\n\n" * 400)
    return path


@pytest.fixture
def model_dir(tmp_path):
    """A tiny pretrained folder (a Llama and its fast tokenizer) and a .jsonl file of 400 short texts."""
    folder = tmp_path / "model"
    tokenizer = build_tokenizer(folder, corpus_bytes=2**14)
    build_llama(folder, vocab_size=len(tokenizer), eos_token_id=tokenizer.eos_token_id,
                pad_token_id=tokenizer.pad_token_id)
    (tmp_path / "docs.jsonl").write_text("".join(json.dumps({"text": f"def f{i}(x): return x + {i}"}) + "\n"
                                                 for i in range(400)))
    return folder


HF_RUN = ["--max-steps", "1", "--seq-len", "32", "--micro-batch-size", "4", "--no-progress"]


run = run_cli


def one_line(code: int, lines: list[str], err: str, expected_code: int = 2) -> str:
    assert code == expected_code and len(lines) == 1, err
    assert "Traceback" not in err and "To resolve this error" in lines[0], err
    return lines[0]


@contextlib.contextmanager
def file_size_limit(limit_bytes: int):
    """A real file-size limit for this process (restored after): writes past it fail with EFBIG."""
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit_bytes, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))


# -- disk full and file-size limits ---------------------------------------------------------------------------
def test_file_size_limit_during_a_checkpoint_names_the_bytes_and_the_last_good_checkpoint_resumes_bit_for_bit(
        tmp_path, text_file, monkeypatch, capsys):
    real_save = safetensors.torch.save_file

    def limited(tensors, filename, *args, **kwargs):
        if "step-0000004" in str(filename):  # the second checkpoint meets the machine's limit, for real
            with file_size_limit(4096):
                return real_save(tensors, filename, *args, **kwargs)
        return real_save(tensors, filename, *args, **kwargs)

    monkeypatch.setattr(safetensors.torch, "save_file", limited)
    out = tmp_path / "run"
    argv = ["train", *TINY, "--data", str(text_file), "--save-every", "2", "--out"]
    line = one_line(*run([*argv, str(out)], capsys), expected_code=1)
    assert "step-0000004" in line and "(File too large)" in line and "it needs about" in line, line
    assert " free in " in line and "ulimit -f" in line and "continue the run with --resume" in line, line
    assert f"the last good checkpoint, {out / 'checkpoints' / 'step-0000002'}, is intact" in line, line
    assert [p.name for p in (out / "checkpoints").iterdir()] == ["step-0000002"]

    monkeypatch.setattr(safetensors.torch, "save_file", real_save)
    assert main(["train", "--out", str(out), "--resume", "--no-progress"]) == 0
    assert main([*argv, str(tmp_path / "whole")]) == 0
    resumed = safetensors.torch.load_file(str(out / "model.safetensors"))
    whole = safetensors.torch.load_file(str(tmp_path / "whole" / "model.safetensors"))
    assert resumed.keys() == whole.keys()
    assert all(resumed[k].equal(whole[k]) for k in whole), "the resumed run must equal the uninterrupted one"


def test_disk_full_writing_the_hf_folder_is_one_line_and_the_checkpoint_stays(tmp_path, model_dir, monkeypatch,
                                                                               capsys):
    real_save = safetensors.torch.save_file

    def full(tensors, filename, *args, **kwargs):
        if "checkpoints" not in str(filename):
            raise SafetensorError(NO_SPACE)
        return real_save(tensors, filename, *args, **kwargs)

    monkeypatch.setattr(safetensors.torch, "save_file", full)
    out = tmp_path / "run"
    line = one_line(*run(["train", "--hf-model", str(model_dir), "--data", str(tmp_path / "docs.jsonl"), *HF_RUN,
                          "--out", str(out)], capsys), expected_code=1)
    assert "could not write" in line and "(No space left on device)" in line and "free space" in line, line
    assert f"the last good checkpoint, {out / 'checkpoints' / 'step-0000001'}, is intact" in line, line


def test_disk_full_appending_metrics_is_one_line(tmp_path, text_file, monkeypatch, capsys):
    import errno

    from memtrain.run.metrics import MetricsLog

    def full(self, line):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(MetricsLog, "append", full)
    out = tmp_path / "run"
    line = one_line(*run(["train", *TINY, "--data", str(text_file), "--out", str(out)], capsys), expected_code=1)
    assert f"could not write {out / 'metrics.jsonl'} (No space left on device)" in line, line
    assert "no checkpoint was written before it" in line, line


def test_file_size_limit_writing_the_token_cache_warns_and_the_run_goes_on(tmp_path, model_dir, capsys):
    from memtrain.data import tokenize_file
    from memtrain.hf import load_tokenizer

    tokenizer = load_tokenizer(model_dir)
    with file_size_limit(1024), pytest.warns(UserWarning, match=r"could not cache .*File too large.*it needs about"):
        docs = tokenize_file(tmp_path / "docs.jsonl", tokenizer)
    assert len(docs) == 400 and not list(tmp_path.glob(".docs.jsonl.*"))  # no half-written cache left behind
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert tokenize_file(tmp_path / "docs.jsonl", tokenizer).tokens.tolist() == docs.tokens.tolist()


# -- data files -----------------------------------------------------------------------------------------------
def test_a_lone_surrogate_in_a_jsonl_text_is_named_with_its_line(tmp_path, model_dir, capsys):
    data = tmp_path / "docs.jsonl"
    data.write_text('{"text": "fine"}\n' * 3 + '{"text": "half a pair: \\ud800 here"}\n' + '{"text": "fine"}\n' * 3)
    line = one_line(*run(["train", "--hf-model", str(model_dir), "--data", str(data), *HF_RUN,
                          "--out", str(tmp_path / "r")], capsys))
    assert 'line 4: "text" holds a lone surrogate \\ud800 at character 14' in line, line
    assert not (tmp_path / "r").exists()


@pytest.mark.parametrize("name", ["DOCS.JSONL", ".JSONL", ".jsonl"])
def test_a_jsonl_extension_is_matched_in_any_case(name, tmp_path, model_dir, text_file, capsys):
    data = tmp_path / name
    data.write_text((tmp_path / "docs.jsonl").read_text())
    line = one_line(*run(["train", *TINY, "--data", str(data), "--out", str(tmp_path / "r")], capsys))
    assert "is a .jsonl file, which only a model with a tokenizer reads" in line, line  # not trained on raw JSON
    code, lines, err = run(["train", "--hf-model", str(model_dir), "--data", str(data), *HF_RUN, "--json",
                            "--out", str(tmp_path / "hf")], capsys)
    assert code == 0 and not lines, err  # 400 records, not one text document


def test_a_corrupted_token_cache_is_rebuilt_with_a_note(tmp_path, model_dir, capsys):
    argv = ["train", "--hf-model", str(model_dir), "--data", str(tmp_path / "docs.jsonl"), *HF_RUN]
    assert main([*argv, "--out", str(tmp_path / "a")]) == 0
    (cache,) = tmp_path.glob(".docs.jsonl.*.tokens.npz")
    good = cache.read_bytes()
    cache.write_bytes(good[: len(good) // 2])  # cut short
    code, lines, err = run([*argv, "--out", str(tmp_path / "b")], capsys)
    assert code == 0 and not lines and "Traceback" not in err, err
    assert f"note: the token cache {cache} is damaged" in err and "tokenising docs.jsonl again" in err, err
    assert cache.read_bytes() == good, "the cache is rewritten whole"
    a, b = ((tmp_path / r / "metrics.jsonl").read_text() for r in "ab")
    assert json.loads(a)["loss"] == json.loads(b)["loss"]  # the same tokens


def test_prompts_longer_than_seq_len_are_skipped_at_start_up_with_a_count(tmp_path, model_dir, capsys):
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": "long prompt words " * 30, "completion": f"yes {i}"}) + "\n"
                            for i in range(100)))
    code, lines, err = run(["train", "--hf-model", str(model_dir), "--data", str(data), "--seq-len", "32",
                            "--micro-batch-size", "1", "--global-batch-size", "1", "--max-steps", "12",
                            "--no-progress", "--out", str(tmp_path / "r")], capsys)
    assert code == 0 and not lines, err  # before: "the window holds 0 items over 1 rank(s)" mid-run
    assert "pieces of prompts longer than --seq-len 32 skipped: no completion token in them" in err, err

    from memtrain.data import PackedRows, TokenDocuments

    with pytest.raises(ConfigError, match=r"every one of the 4 pieces .* holds only prompt tokens"):
        PackedRows(TokenDocuments(np.arange(40), [0], [40], np.zeros(40, bool)), seq_len=12)


def test_a_one_line_text_file_is_refused_before_it_is_tokenised_and_names_eval_data(tmp_path, model_dir, capsys):
    """Issue 33: a 50 MB one-line .txt tokenised for 124 s and left a 122 MB cache, then "use more documents"."""
    folder = tmp_path / "data"
    folder.mkdir()
    data = folder / "one_line.txt"
    data.write_text("def f(x): return x + 1; " * 2000 + "\n")
    line = one_line(*run(["train", "--hf-model", str(model_dir), "--data", str(data), *HF_RUN,
                          "--out", str(tmp_path / "r")], capsys))
    assert "1 documents make 0 training and 1 validation documents" in line and "--eval-data FILE" in line, line
    assert sorted(p.name for p in folder.iterdir()) == ["one_line.txt"]  # not tokenised: no token cache beside it
    assert not (tmp_path / "r").exists()
    # With a held-out file of its own, the one long document trains.
    code, lines, err = run(["train", "--hf-model", str(model_dir), "--data", str(data), "--eval-data", str(data),
                            *HF_RUN, "--out", str(tmp_path / "r")], capsys)
    assert code == 0 and not lines, err


# -- pretrained folders and LoRA ------------------------------------------------------------------------------
def test_a_tokenizer_larger_than_the_embedding_is_refused_at_start_up_with_the_sizes(tmp_path, capsys):
    folder = tmp_path / "model"
    tokenizer = build_tokenizer(folder, corpus_bytes=2**14)
    build_llama(folder, vocab_size=len(tokenizer) - 100, eos_token_id=tokenizer.eos_token_id,
                pad_token_id=tokenizer.pad_token_id)
    (tmp_path / "docs.jsonl").write_text('{"text": "def f(): pass"}\n' * 400)
    line = one_line(*run(["train", "--hf-model", str(folder), "--data", str(tmp_path / "docs.jsonl"), *HF_RUN,
                          "--out", str(tmp_path / "r")], capsys))
    assert f"the tokenizer has {len(tokenizer)} tokens but the model's embedding holds {len(tokenizer) - 100}" \
        in line and "resize_token_embeddings" in line, line  # before: IndexError mid-step
    assert not (tmp_path / "r").exists()


def test_a_truncated_model_safetensors_is_named(tmp_path, model_dir, capsys):
    weights = model_dir / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    line = one_line(*run(["train", "--hf-model", str(model_dir), "--data", str(tmp_path / "docs.jsonl"), *HF_RUN,
                          "--out", str(tmp_path / "r")], capsys))
    assert f"{weights} is not a whole safetensors file (" in line and "download or copy it again" in line, line
    assert not (tmp_path / "r").exists()


def test_a_lora_rank_above_the_layers_sizes_is_refused(tmp_path, model_dir, capsys):
    line = one_line(*run(["train", "--hf-model", str(model_dir), "--data", str(tmp_path / "docs.jsonl"), *HF_RUN,
                          "--lora", "100000", "--out", str(tmp_path / "r")], capsys))
    assert "--lora 100000 is above the rank of the layers it adapts: the smallest, " \
           "model.layers.0.self_attn.k_proj, is 64 x 32, of rank at most 32" in line and "--lora 32 or less" in line
    assert not (tmp_path / "r").exists()


# -- launching ------------------------------------------------------------------------------------------------
def test_a_rendezvous_without_its_peer_times_out_in_seconds_with_one_line(tmp_path, text_file, monkeypatch, capsys):
    import socket
    import time

    with socket.socket() as s:  # a free port: nobody else answers there
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    for name, value in {"WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                        "MASTER_PORT": str(port), "MEMTRAIN_RENDEZVOUS_TIMEOUT": "2"}.items():
        monkeypatch.setenv(name, value)
    start = time.monotonic()
    line = one_line(*run(["train", *TINY, "--data", str(text_file), "--out", str(tmp_path / "r")], capsys))
    assert time.monotonic() - start < 30  # before: silent until killed
    assert f"RANK=0 of WORLD_SIZE=2 could not meet its peers at 127.0.0.1:{port} within 2 s" in line, line
    assert "MEMTRAIN_RENDEZVOUS_TIMEOUT=SECONDS" in line, line


def test_a_rank_outside_a_world_of_one_is_refused(tmp_path, text_file, monkeypatch, capsys):
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("RANK", "3")
    line = one_line(*run(["train", *TINY, "--data", str(text_file), "--out", str(tmp_path / "r")], capsys))
    assert "RANK=3 is not in [0, WORLD_SIZE=1)" in line, line
    assert not (tmp_path / "r").exists()


# -- messages that mislead ------------------------------------------------------------------------------------
def test_resume_with_the_seq_len_the_run_used_by_default_continues_and_another_names_the_used_one(
        tmp_path, text_file, capsys):
    out = str(tmp_path / "run")
    assert main(["train", *TINY, "--max-steps", "2", "--data", str(text_file), "--out", out]) == 0
    line = one_line(*run(["train", "--out", out, "--resume", "--seq-len", "32", "--max-steps", "3"], capsys))
    assert "--seq-len 32 now but 64 in the run being resumed (the model's default, no --seq-len given)" in line, line
    code, lines, err = run(["train", "--out", out, "--resume", "--seq-len", "64", "--max-steps", "3"], capsys)
    assert code == 0 and not lines, err  # before: "--seq-len 64 now but None in the run being resumed"


def test_a_budget_without_a_unit_is_refused_with_the_units_to_add(tmp_path, capsys):
    code, lines, err = run(["train", *TINY, "--budget", "24", "--out", str(tmp_path / "r")], capsys)
    line = one_line(code, lines, err)
    assert "'24' has no unit, so it would be 24 bytes. To resolve this error, pass 24GiB" in line, line
    (tmp_path / "c.toml").write_text("budget = 24\n")  # a TOML number is no different
    line = one_line(*run(["train", "--config", str(tmp_path / "c.toml"), "--out", str(tmp_path / "r")], capsys))
    assert "'24' has no unit" in line, line
    assert not (tmp_path / "r").exists()


# -- silent or wrong advice -----------------------------------------------------------------------------------
def test_a_budget_beyond_the_machine_gets_a_hint(tmp_path, capsys):
    code, lines, err = run(["train", *TINY, "--max-steps", "1", "--budget", "100000000TiB",
                            "--out", str(tmp_path / "r")], capsys)
    assert code == 0 and not lines, err
    assert "Hint: that is more than the" in err and "this machine has in RAM, so the plan may not fit here: set " \
           "the budget to " in err, err


def test_a_toml_key_with_underscores_is_the_flag_with_dashes(tmp_path, capsys):
    (tmp_path / "c.toml").write_text("max_steps = 1\nmicro_batch_size = 4\nno_progress = true\n")
    code, lines, err = run(["train", "--config", str(tmp_path / "c.toml"), "--out", str(tmp_path / "r")], capsys)
    assert code == 0 and not lines, err  # before: "unknown key '--max-steps'"
    assert len((tmp_path / "r" / "metrics.jsonl").read_text().splitlines()) == 1  # max_steps = 1 applied
    (tmp_path / "c.toml").write_text('out_dir = "x"\n')  # a library argument, not a flag: named as written
    line = one_line(*run(["train", "--config", str(tmp_path / "c.toml")], capsys))
    assert "unknown key 'out_dir'. Did you mean 'out'?" in line, line


def test_plan_below_the_cublas_workspace_names_that_floor_not_a_shorter_sequence(model_dir, capsys):
    line = one_line(*run(["plan", "--hf-model", str(model_dir), "--seq-len", "8", "--budget", "64MiB"], capsys))
    assert "shorter sequence" not in line, line
    assert "cuBLAS's fixed workspaces alone take 64.00 MiB" in line and "try a budget of at least" in line, line
    floor = re.search(r"a budget of at least ([0-9.]+) MiB", line).group(1)
    code, lines, err = run(["plan", "--hf-model", str(model_dir), "--seq-len", "8", "--budget",
                            f"{math.ceil(float(floor))}MiB"], capsys)
    assert code == 0 and not lines, err  # the budget it names fits


def test_library_errors_reach_the_command_in_flag_terms_not_as_cache_dir_val_fraction_or_max_grad_norm(
        tmp_path, model_dir, monkeypatch, capsys):
    import errno

    from memtrain.cli import in_flag_terms

    one = tmp_path / "one.jsonl"
    one.write_text('{"text": "def f(): pass"}\n')
    line = one_line(*run(["train", "--hf-model", str(model_dir), "--data", str(one), *HF_RUN,
                          "--out", str(tmp_path / "r")], capsys))
    assert "val_fraction" not in line and "holds out the last 5% of them for validation" in line, line

    def full(path, write):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr("memtrain.data.token_cache.atomic_write", full)
    code, lines, err = run(["train", "--hf-model", str(model_dir), "--data", str(tmp_path / "docs.jsonl"), *HF_RUN,
                            "--out", str(tmp_path / "s")], capsys)
    assert code == 0 and not lines, err
    assert "note: could not cache the tokenised data" in err and "cache_dir" not in err, err
    assert "or copy the data to a writable folder" in err, err

    from types import SimpleNamespace

    from memtrain.accumulation import GradientAccumulator
    from memtrain.errors import MemtrainError

    window = SimpleNamespace(skipped_steps=0, optimizer_steps=2, discard_window=lambda: None)
    with pytest.raises(MemtrainError) as info:  # the accumulator's own message for a nan gradient norm
        GradientAccumulator._refuse_non_finite(window, float("nan"))
    assert "max_grad_norm" in str(info.value)
    assert "set --grad-clip, or check" in in_flag_terms(info.value.message, "train")


# -- issue 33: runs, the run folder, export and the Python API ------------------------------------------------
def test_lora_on_the_output_head_only_plans_and_trains_the_head_adapter(tmp_path, text_file, model_dir, capsys):
    """No block gets a gradient (every block frozen below the only adapter): the planner's traces have no block
    backward, which was a StopIteration in planner/profiles.py; the head's adapter now trains, planned or fixed."""
    out = tmp_path / "gpt"
    code, _, err = run(["train", *TINY, "--data", str(text_file), "--lora", "4", "--lora-targets", "head",
                        "--out", str(out)], capsys)
    assert code == 0 and "Traceback" not in err, err
    code, _, err = run(["train", "--hf-model", str(model_dir), "--data", str(tmp_path / "docs.jsonl"), *HF_RUN,
                        "--lora", "4", "--lora-targets", "lm_head", "--checkpointing", "none", "--no-chunked-loss",
                        "--out", str(tmp_path / "hf")], capsys)
    assert code == 0 and "Traceback" not in err, err
    adapters = safetensors.torch.load_file(str(tmp_path / "hf" / "hf" / "adapter_model.safetensors"))
    assert adapters and all("lm_head" in k for k in adapters), sorted(adapters)


@pytest.mark.parametrize("command", ["new run", "resume", "export"])
@pytest.mark.parametrize("fault", ["ENOSPC", "short write", "ulimit -f 0"])
def test_a_disk_full_when_the_run_folder_is_taken_is_exit_1_naming_the_lock_file_and_the_bytes(
        command, fault, tmp_path, text_file, monkeypatch, capsys):
    """The lock is the first thing a run, a resume or an export writes: a disk with no room for its record was
    an OSError traceback from os.pwrite (or, where the disk took part of it, a lock naming no holder)."""
    import errno
    import os

    out = tmp_path / "run"
    if command != "new run":
        assert main(["train", *TINY, "--data", str(text_file), "--save-every", "2", "--out", str(out)]) == 0
    real_pwrite = os.pwrite

    def full(fd, data, offset):  # the disk fills up as the lock records its holder
        if os.readlink(f"/proc/self/fd/{fd}").endswith(".memtrain-lock"):
            if fault == "ENOSPC":
                raise OSError(errno.ENOSPC, "No space left on device")
            return real_pwrite(fd, data[:5], offset)  # a full disk takes what fits and says how much
        return real_pwrite(fd, data, offset)

    if fault != "ulimit -f 0":
        monkeypatch.setattr(os, "pwrite", full)
    argv = {"new run": ["train", *TINY, "--data", str(text_file), "--out", str(out)],
            "resume": ["train", "--out", str(out), "--resume", "--max-steps", "6", "--no-progress"],
            "export": ["export", str(out)]}[command]
    before = sorted(p.name for p in out.iterdir()) if out.exists() else None
    with file_size_limit(0) if fault == "ulimit -f 0" else contextlib.nullcontext():  # the machine's own limit
        code, lines, err = run(argv, capsys)
    assert code == 1 and len(lines) == 1 and "Traceback" not in err, err
    line = lines[0]
    why = "File too large" if fault == "ulimit -f 0" else "No space left on device"
    assert f"could not write {out / '.memtrain-lock'} ({why})" in line, line
    assert re.search(r"it needs \d+ B, [\d.]+ [KMG]?i?B free on its disk", line), line
    assert ("ulimit -f unlimited" if fault == "ulimit -f 0" else "free space on that disk") in line, line
    assert (sorted(p.name for p in out.iterdir()) if out.exists() else None) == before  # nothing left behind
    if command != "new run":
        assert (out / ".memtrain-lock").read_bytes() == b""  # no part of a record


def _cut_in_half(path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def test_a_truncated_model_safetensors_beside_a_good_checkpoint_exports_from_the_checkpoint_saying_so(
        tmp_path, text_file, capsys):
    out = tmp_path / "run"
    assert main(["train", *TINY, "--data", str(text_file), "--save-every", "2", "--out", str(out)]) == 0
    sample = (out / "sample.txt").read_text()
    _cut_in_half(out / "model.safetensors")  # before: SafetensorError from export and from --resume
    for argv in (["export", str(out)], ["train", "--out", str(out), "--resume", "--no-progress"]):
        (out / "sample.txt").unlink()
        code, lines, err = run(argv, capsys)
        assert code == 0 and not lines and "Traceback" not in err, err
        said = [line for line in err.splitlines() + [""] if "not a whole safetensors file" in line]
        assert len(said) == 1 and f"{out / 'model.safetensors'} is not a whole safetensors file (" in said[0], err
        assert "the checkpoint of step 4 instead" in said[0] and "left as it is" in said[0], said
        assert (out / "sample.txt").read_text() == sample  # the checkpoint holds the same weights
    # More steps resume from the checkpoint, never from model.safetensors, and write it whole again.
    assert main(["train", "--out", str(out), "--resume", "--max-steps", "6", "--no-progress"]) == 0
    assert len(safetensors.torch.load_file(str(out / "model.safetensors"))) > 0
    _cut_in_half(out / "model.safetensors")
    for step in (out / "checkpoints").iterdir():
        _cut_in_half(step / "tensors.safetensors")
    line = one_line(*run(["export", str(out)], capsys))
    assert f"{out / 'model.safetensors'} is not a whole safetensors file (" in line, line


def test_export_dtype_for_the_built_in_gpt_is_refused_with_the_reason(tmp_path, text_file, capsys):
    out = tmp_path / "run"
    assert main(["train", *TINY, "--data", str(text_file), "--out", str(out)]) == 0
    line = one_line(*run(["export", str(out), "--export-dtype", "bf16"], capsys))  # before: exit 0, ignored
    assert "--export-dtype bf16" in line and "no hf/" in line and "drop --export-dtype" in line, line
    assert main(["export", str(out), "--export-dtype", "auto"]) == 0


def test_no_progress_holds_for_the_export_of_a_finished_run_after_resume(tmp_path, model_dir, capsys):
    out = tmp_path / "run"
    argv = ["train", "--hf-model", str(model_dir), "--data", str(tmp_path / "docs.jsonl"), *HF_RUN, "--out", str(out)]
    assert main(argv) == 0
    shutil.rmtree(out / "hf")
    capsys.readouterr()
    assert main(["train", "--out", str(out), "--resume", "--no-progress"]) == 0
    stdout, err = capsys.readouterr()
    assert "hf/ from model.safetensors" in stdout and (out / "hf" / "config.json").is_file(), stdout + err
    assert "it/s]" not in err and "%|" not in err, err  # before: transformers' "Loading weights" bar


# -- the Python API's boundary --------------------------------------------------------------------------------
def test_train_given_a_model_name_or_a_dict_config_names_the_fix(tmp_path):
    """Before: AttributeError ('str' object has no attribute 'parameters', 'dict' object has no attribute
    'validate'). A dict is refused, not converted: TrainConfig is the one spelling of the settings, and building it
    checks the dict's keys, which train() should not guess at."""
    from helpers import tiny_gpt

    from memtrain import TrainConfig, train
    from memtrain.data import ByteWindows

    data = ByteWindows(np.frombuffer(b"def f(x):\n    return x\n" * 50, dtype=np.uint8), 16)
    with pytest.raises(ConfigError, match=r"model='gpt-tiny' is a str, not a torch nn\.Module.*To resolve this "
                                          r"error, build the model first.*memtrain\.hf\.load_pretrained"):
        train("gpt-tiny", data, TrainConfig(max_steps=1))
    with pytest.raises(ConfigError, match=r"config is a dict, not a TrainConfig.*To resolve this error, pass "
                                          r"TrainConfig\(\*\*that_dict\)"):
        train(tiny_gpt(seed=0), data, {"max_steps": 1, "lr": 1e-3})
    with pytest.raises(ConfigError, match=r"config is a NoneType, not a TrainConfig"):
        train(tiny_gpt(seed=0), data, None)
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("precision", ["fp32", "fp16-mixed"])
def test_estimate_refuses_pure_bf16_at_a_precision_the_cli_refuses(precision, capsys):
    """Before: bf16 figures for a set-up that memtrain estimate, train and plan refuse. The same rule
    (Choices.precision_problems) answers both, and it offers no precision='auto', which estimate has not."""
    import torch

    from memtrain import estimate
    from memtrain.choices import Choices
    from memtrain.models import GPT, GPT_PRESETS

    with torch.device("meta"):
        model = GPT(GPT_PRESETS["gpt-tiny"])
    with pytest.raises(ConfigError) as caught:
        estimate(model, (4, 64), device="cpu", precision=precision, setup=Choices(pure_bf16=True))
    assert list(caught.value.problems) == [p.replace(" (or 'auto')", "") for p in
                                     Choices(pure_bf16=True).precision_problems(precision)], caught.value.problems
    assert "auto" not in str(caught.value)
    line = one_line(*run(["estimate", "--model", "gpt-tiny", "--device", "cpu", "--precision", precision,
                          "--pure-bf16"], capsys))
    assert f"--pure-bf16 with --precision '{precision}'" in line and "auto" not in line, line
    assert estimate(model, (4, 64), device="cpu", precision="bf16-mixed", setup=Choices(pure_bf16=True)).peak_bytes
