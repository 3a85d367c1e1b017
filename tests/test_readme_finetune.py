"""The README's "Fine-tune a Hugging Face model" section runs: each command of its shell block and its Trainer
snippet, on a tiny local Llama folder, with the names of its folder and files and its step counts made small."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import write_docs_jsonl

ROOT = Path(__file__).resolve().parent.parent
SECTION = re.search(r"## Fine-tune a Hugging Face model\n(.*?)\n## ", (ROOT / "README.md").read_text(), re.S).group(1)
COMMANDS = re.search(r"```sh\n(.*?)```", SECTION, re.S).group(1).strip().splitlines()
SNIPPET = re.search(r"```py\n(.*?)```", SECTION, re.S).group(1)


@pytest.fixture(scope="module")
def files(tmp_path_factory, hf_model_dir) -> dict[str, Path]:
    """The section's names, made real: the model folder and its three data files."""
    pytest.importorskip("peft")
    folder = tmp_path_factory.mktemp("finetune")
    pairs = folder / "pairs.jsonl"
    pairs.write_text("".join(json.dumps({"prompt": f"Question {i}: what is {i} + {i}? ", "completion": f"{2 * i}."})
                             + "\n" for i in range(200)))
    return {"my-llama": hf_model_dir, "docs.jsonl": write_docs_jsonl(folder / "docs.jsonl"), "pairs.jsonl": pairs,
            "eval.jsonl": write_docs_jsonl(folder / "eval.jsonl", paragraphs=30)}


def _runnable(command: str, files: dict[str, Path], runs: Path) -> list[str]:
    """The README's command as this machine runs it: its names mapped to the tiny files, 2 steps, short rows."""
    argv = shlex.split(command)
    argv = [str(files.get(a, a)) for a in argv]
    argv = [str(runs / a.removeprefix("runs/")) if a.startswith("runs/") else a for a in argv]
    if "--max-steps" in argv:
        argv[argv.index("--max-steps") + 1] = "2"
    if argv[0] == "torchrun":  # --standalone: a free port, so parallel test runs do not meet on one
        argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", *argv[1:]]
    elif argv[0] == "memtrain":
        argv = [sys.executable, "-m", "memtrain", *argv[1:]]
    if "train" in argv:
        argv += ["--seq-len", "64", "--global-batch-size", "4", "--no-progress"]
    return argv


@pytest.mark.slow
def test_the_readme_finetuning_commands_run_on_a_tiny_local_folder(files, tmp_path):
    pytest.importorskip("tensorboard")
    assert len(COMMANDS) == 5, COMMANDS
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    for command in COMMANDS:
        done = subprocess.run(_runnable(command, files, tmp_path), env=env, capture_output=True, text=True,
                              timeout=600)
        assert done.returncode == 0, f"{command}\n{done.stderr[-3000:]}"
    for run in ("full", "lora", "tb", "fsdp"):
        assert (tmp_path / run / "hf").is_dir() and (tmp_path / run / "sample.txt").read_text(), run
    assert (tmp_path / "lora" / "hf" / "adapter_config.json").is_file()
    assert json.loads((tmp_path / "lora" / "hf" / "adapter_config.json").read_text())["lora_alpha"] == 32
    assert any((tmp_path / "tb" / "tensorboard").iterdir())
    config = json.loads((tmp_path / "full" / "hf" / "config.json").read_text())
    assert config.get("dtype", config.get("torch_dtype")) == "bfloat16"  # the export command's --export-dtype bf16


@pytest.mark.slow
def test_the_readme_trainer_snippet_runs_on_a_tiny_local_folder(files, tmp_path, monkeypatch):
    code = SNIPPET.replace('"my-llama"', repr(str(files["my-llama"]))).replace(
        '"docs.jsonl"', repr(str(files["docs.jsonl"]))).replace("seq_len=2048", "seq_len=64").replace(
        "max_steps=1000", "max_steps=2")
    if not __import__("torch").cuda.is_available():
        code = code.replace("bf16=True", "bf16=False")
    assert code.count(str(files["my-llama"])) == 3 and "max_steps=2" in code
    monkeypatch.chdir(tmp_path)
    exec(compile(code, "README.md fine-tuning snippet", "exec"), {"__name__": "__readme__"})
    assert (tmp_path / "out" / "hf" / "adapter_config.json").is_file()


def test_the_readme_makes_a_tiny_model_folder_offline_with_one_command(tmp_path):
    """The command the README gives for a model folder runs offline, and memtrain loads what it writes."""
    pytest.importorskip("tokenizers")
    command = re.search(r"`(python examples/make_tiny_llama\.py [\w-]+)`", SECTION)
    assert command, "the README shows no command that makes a model folder"
    argv = shlex.split(command.group(1))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
           "HF_HUB_OFFLINE": "1"}
    done = subprocess.run([sys.executable, str(ROOT / argv[1]), *argv[2:]], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    from memtrain.hf import load_pretrained, load_tokenizer

    folder = tmp_path / argv[2]
    model, tokenizer = load_pretrained(str(folder)), load_tokenizer(str(folder))
    assert model.config.num_hidden_layers == 2 and tokenizer.eos_token is not None
    assert model.config.vocab_size == len(tokenizer)
