"""Resume after kill -9 is bit-identical with dropout on, for every source of dropout: the built-in GPT's, LoRA's
on a Hugging Face folder, and a Hugging Face config's attention and hidden dropout.

Each test trains a straight run, then the same run killed with SIGKILL right after a checkpoint (a subprocess that
kills itself the moment the checkpoint is written: the kill lands at the same place every time, no polling) and
resumed; the final weights must be equal (``torch.equal``). Dropout masks come from the global generators, so
anything that draws from them between the checkpoint and the next step in one run only (a new data loader's
iterator, on resume) shifts every mask after it.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import CODE_TEXT, code_windows, quick_run_config, tiny_gpt, write_docs_jsonl
from safetensors.torch import load_file

from memtrain import train
from memtrain.cli import main
from memtrain.run import RunCheckpoints

ROOT = Path(__file__).resolve().parent.parent
STEPS = 3
KILL_AT = 1  # the step whose checkpoint is the last thing the killed run does

# Runs memtrain in this process, then SIGKILLs it right after the checkpoint of step KILL_AT is written.
DRIVER = """
import importlib, os, signal, sys
sys.path.insert(0, {tests!r})
loop = importlib.import_module("memtrain.train")
save = loop.save_run_state


def save_then_die(checkpoints, step, *args, **kwargs):
    save(checkpoints, step, *args, **kwargs)
    if step == {kill_at}:
        os.kill(os.getpid(), signal.SIGKILL)


loop.save_run_state = save_then_die
{run}
"""


def run_killed(out: Path, run: str) -> None:
    """Runs ``run`` (Python source) in a subprocess that dies by SIGKILL after the checkpoint of step KILL_AT."""
    source = DRIVER.format(tests=str(ROOT / "tests"), kill_at=KILL_AT, run=run)
    proc = subprocess.run([sys.executable, "-c", source], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-3000:]
    assert [p.name for p in RunCheckpoints(out).paths()][:1] == [f"step-{KILL_AT:07d}"], proc.stderr[-3000:]
    assert not (out / "model.safetensors").exists(), "the run was meant to die before its end"


def assert_bit_identical(a: Path, b: Path) -> None:
    wa, wb = load_file(a / "model.safetensors"), load_file(b / "model.safetensors")
    assert wa.keys() == wb.keys()
    different = {k: (wa[k] - wb[k]).abs().max().item() for k in wa if not torch.equal(wa[k], wb[k])}
    assert not different, f"max |dw| per weight after kill -9 + resume: {different}"


# -- the built-in GPT with dropout (no CLI flag sets it: the Python API) ----------------------------------------
def gpt_run(out: str, *, resume: bool = False) -> None:
    """The built-in GPT with dropout 0.1 on the code windows, checkpointed every step."""
    model = tiny_gpt(seq_len=32, dropout=0.1, seed=0)
    train(model, code_windows(32), quick_run_config(Path(out), max_steps=STEPS, global_batch_size=4,
                                                    save_every=1, resume=resume))


def test_builtin_gpt_dropout_resumes_bit_for_bit(tmp_path):
    gpt_run(str(tmp_path / "straight"))
    killed = tmp_path / "killed"
    run_killed(killed, f"from test_run_resume_dropout import gpt_run\ngpt_run({str(killed)!r})")
    gpt_run(str(killed), resume=True)
    assert_bit_identical(killed, tmp_path / "straight")


# -- the CLI: LoRA dropout, a Hugging Face config's dropout ---------------------------------------------------
def cli_resumes_bit_for_bit(tmp_path: Path, *args: str) -> None:
    """``memtrain train *args`` straight, and killed after a checkpoint then ``--resume``d: the same weights."""
    common = [*args, "--seq-len", "32", "--micro-batch-size", "2", "--global-batch-size", "4", "--max-steps",
              str(STEPS), "--save-every", "1", "--no-progress", "--quiet"]
    straight, killed = tmp_path / "straight", tmp_path / "killed"
    assert main(["train", *common, "--out", str(straight)]) == 0
    run_killed(killed, f"from memtrain.cli import main\nsys.exit(main({['train', *common, '--out', str(killed)]!r}))")
    assert main(["train", *common, "--out", str(killed), "--resume"]) == 0
    assert_bit_identical(killed, straight)


def test_lora_dropout_resumes_bit_for_bit(tmp_path, hf_model_dir):
    data = write_docs_jsonl(tmp_path / "docs.jsonl", paragraphs=60)
    cli_resumes_bit_for_bit(tmp_path, "--hf-model", str(hf_model_dir), "--data", str(data), "--lora", "4",
                            "--lora-dropout", "0.1")


HF_DROPOUT_CONFIGS = {
    # Llama's only dropout: on the attention probabilities (SDPA's dropout_p).
    "llama-attention": {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                        "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 256,
                        "max_position_embeddings": 64, "attention_dropout": 0.1},
    # GPT-2's: on the embeddings, the residual branches and the attention probabilities.
    "gpt2-hidden": {"model_type": "gpt2", "n_embd": 64, "n_layer": 2, "n_head": 4, "vocab_size": 256,
                    "n_positions": 64, "embd_pdrop": 0.1, "resid_pdrop": 0.1, "attn_pdrop": 0.1},
}


@pytest.mark.parametrize("name", list(HF_DROPOUT_CONFIGS))
def test_hf_config_dropout_resumes_bit_for_bit(tmp_path, name):
    config = tmp_path / "config.json"
    config.write_text(json.dumps(HF_DROPOUT_CONFIGS[name]))
    data = tmp_path / "code.txt"
    data.write_bytes(CODE_TEXT)
    cli_resumes_bit_for_bit(tmp_path, "--hf-config", str(config), "--data", str(data))
