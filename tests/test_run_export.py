"""A run's exports written again from its folder: ``memtrain export RUN_DIR`` (from model.safetensors, else the
newest checkpoint), ``--resume`` of a run that finished training but not its exports, and the advice for a finished
run whose checkpoints/ is gone (which must never lead to deleting model.safetensors).

Each test works on a copy of one finished run of the tiny Llama of tests/conftest.py (``hf_model_dir``); the
exports written again are compared with the ones the run wrote itself, tensor for tensor.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from helpers import write_docs_jsonl

from memtrain.cli import main

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
safetensors_torch = pytest.importorskip("safetensors.torch")

STEPS = 3


@pytest.fixture(scope="module")
def docs(tmp_path_factory) -> Path:
    """docs.jsonl: 120 paragraphs of the standard library's source."""
    return write_docs_jsonl(tmp_path_factory.mktemp("data") / "docs.jsonl")


def _train(hf_model_dir: Path, docs: Path, out: Path, *extra: str) -> Path:
    argv = ["train", "--hf-model", str(hf_model_dir), "--data", str(docs), "--seq-len", "64", "--max-steps",
            str(STEPS), "--micro-batch-size", "2", "--global-batch-size", "2", "--no-progress", "--out", str(out),
            *extra]
    assert main(argv) == 0
    return out


@pytest.fixture(scope="module")
def finished(hf_model_dir, docs, tmp_path_factory) -> Path:
    return _train(hf_model_dir, docs, tmp_path_factory.mktemp("runs") / "full")


@pytest.fixture(scope="module")
def finished_lora(hf_model_dir, docs, tmp_path_factory) -> Path:
    return _train(hf_model_dir, docs, tmp_path_factory.mktemp("runs") / "lora", "--lora", "4")


def _copy(run: Path, tmp_path: Path, *remove: str) -> Path:
    copy = tmp_path / run.name
    shutil.copytree(run, copy)
    for name in remove:
        path = copy / name
        shutil.rmtree(path) if path.is_dir() else path.unlink()
    return copy


def _assert_same_exports(got: Path, want: Path) -> None:
    lora = (want / "hf" / "adapter_model.safetensors").exists()
    weights = "adapter_model.safetensors" if lora else "model.safetensors"
    a, b = safetensors_torch.load_file(got / "hf" / weights), safetensors_torch.load_file(want / "hf" / weights)
    assert a.keys() == b.keys()
    diffs = {k: (a[k].float() - b[k].float()).abs().max().item() for k in a}
    worst = max(diffs, key=diffs.get)
    assert all(a[k].dtype == b[k].dtype for k in a) and diffs[worst] == 0, (worst, diffs[worst])
    names = sorted(p.name for p in (want / "hf").iterdir())
    assert sorted(p.name for p in (got / "hf").iterdir()) == names
    for name in names:
        if name.endswith(".json"):
            assert (got / "hf" / name).read_text() == (want / "hf" / name).read_text(), name
    assert (got / "sample.txt").read_text() == (want / "sample.txt").read_text()


@pytest.mark.parametrize("weights", ["model.safetensors", "checkpoint"])
def test_memtrain_export_writes_the_runs_hf_and_sample_again(finished, tmp_path, capsys, weights):
    removed = ("hf", "sample.txt") + (("model.safetensors",) if weights == "checkpoint" else ())
    run = _copy(finished, tmp_path, *removed)
    assert main(["export", str(run)]) == 0
    source = "model.safetensors" if weights == "model.safetensors" else f"the checkpoint of step {STEPS}"
    assert f"wrote sample.txt, hf/ in {run} from {source}" in capsys.readouterr().out
    _assert_same_exports(run, finished)  # the checkpoint at the end holds the final weights too


def test_memtrain_export_of_a_lora_run_writes_its_adapter(finished_lora, tmp_path, hf_model_dir):
    run = _copy(finished_lora, tmp_path, "hf", "sample.txt")
    assert main(["export", str(run), "--json"]) == 0
    _assert_same_exports(run, finished_lora)
    adapter = json.loads((run / "hf" / "adapter_config.json").read_text())
    assert adapter["base_model_name_or_path"] == str(hf_model_dir.absolute())


@pytest.mark.parametrize("checkpoints", ["kept", "deleted"])
def test_resume_of_a_finished_run_writes_its_missing_exports_without_training(finished, tmp_path, capsys,
                                                                               checkpoints):
    # An export that failed or was interrupted at the end of the run (e.g. FSDP2 before this existed).
    run = _copy(finished, tmp_path, "hf", "sample.txt", *(["checkpoints"] if checkpoints == "deleted" else []))
    metrics = (run / "metrics.jsonl").read_bytes()
    assert main(["train", "--out", str(run), "--resume"]) == 0
    out = capsys.readouterr().out
    assert f"finished training at step {STEPS} without writing sample.txt and hf/" in out and "no step trained" in out
    assert (run / "metrics.jsonl").read_bytes() == metrics  # nothing trained
    _assert_same_exports(run, finished)
    # A larger --max-steps given now continues the run instead (from its checkpoint).
    if checkpoints == "kept":
        shutil.rmtree(run / "hf")
        assert main(["train", "--out", str(run), "--resume", "--max-steps", str(STEPS + 1)]) == 0
        assert len((run / "metrics.jsonl").read_text().splitlines()) == STEPS + 1


def test_a_finished_run_without_checkpoints_is_named_finished_and_not_sent_to_overwrite(finished, tmp_path, capsys):
    run = _copy(finished, tmp_path, "checkpoints")
    assert main(["train", "--out", str(run), "--resume"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert "finished" in err and f"memtrain export {run}" in err and "before its first checkpoint" not in err, err
    assert "--overwrite would delete its model.safetensors" in err, err
    assert (run / "model.safetensors").is_file()


def test_export_bad_input_is_one_line_each(tmp_path, capsys):
    from helpers import quick_run_config, tiny_gpt

    from memtrain import train
    from memtrain.data import builtin_corpus

    assert main(["export", str(tmp_path / "missing")]) == 2
    assert "does not exist" in capsys.readouterr().err
    (tmp_path / "plain").mkdir()
    assert main(["export", str(tmp_path / "plain")]) == 2
    assert "is not a memtrain run folder" in capsys.readouterr().err
    torch.manual_seed(0)
    train(tiny_gpt(), builtin_corpus(16), quick_run_config(tmp_path / "python", max_steps=1))
    capsys.readouterr()  # the run's own log
    assert main(["export", str(tmp_path / "python")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "started from Python" in err and "save_hf" in err, err


def test_hf_holds_the_fp32_masters_where_the_device_held_bf16_copies(tmp_path):
    """The offloaded optimizer with bf16 device weights (the plan's offload-bf16-weights, an 8B's full fine-tuning
    on a 24 GB card) keeps the fp32 masters on the host: hf/ holds them, as model.safetensors does, not their bf16
    roundings (which lose a fine-tuning's small updates); the model keeps its bf16 weights."""
    from helpers import tiny_llama_config

    from memtrain.run.export import export_results

    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(tiny_llama_config())
    masters = {id(p): p.detach().float() + 1e-4 for p in model.parameters()}  # finer than bf16's steps near 1e-2
    model.to(torch.bfloat16)
    export_results(tmp_path, model, None, None, seq_len=16, sample_bytes=0, seed=0, merge=False, writer=True,
                   dtype=torch.float32, masters=masters)
    saved = safetensors_torch.load_file(tmp_path / "hf" / "model.safetensors")
    names = {id(p): n for n, p in model.named_parameters()}
    assert {names[i] for i in masters} <= set(saved), sorted(saved)[:4]
    for pid, master in masters.items():
        assert torch.equal(saved[names[pid]], master), names[pid]
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())


def test_memtrain_export_of_a_built_in_gpt_run_writes_its_sample(tmp_path, capsys):
    """The byte-level sample was written only where the GPT's loss was chunked at that moment: never by `memtrain
    export` or a resume completing an interrupted export (the rebuilt model's loss is not chunked)."""
    run = tmp_path / "gpt"
    assert main(["train", "--model", "gpt-tiny", "--max-steps", "2", "--seq-len", "32", "--out", str(run),
                 "--no-progress", "--quiet"]) == 0
    written = (run / "sample.txt").read_text()
    (run / "sample.txt").unlink()
    capsys.readouterr()
    assert main(["export", str(run)]) == 0, capsys.readouterr().err
    assert (run / "sample.txt").read_text() == written  # the same seed draws the same text
