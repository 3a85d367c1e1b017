"""The faults a new user hit around Hugging Face models (issue 33): a config.json with sizes left to transformers'
defaults or values that cannot make a model, a config.json that does not match its weights, MemtrainTrainer given
what it cannot train, a tokenizer with no token between documents, LoRA on random weights. Each is one line naming
the fix (exit 2 at the CLI), a note, or the right behaviour; none is a traceback.
"""

from __future__ import annotations

import json
import shutil

import pytest
from helpers import run_cli

from memtrain.errors import ConfigError

transformers = pytest.importorskip("transformers")

# A Mixtral of test size: every key its size depends on written.
TINY_MIXTRAL = {"model_type": "mixtral", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 256, "max_position_embeddings": 256,
                "num_local_experts": 2, "num_experts_per_tok": 1}
TINY_LLAMA = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 256, "max_position_embeddings": 256}


run = run_cli


def refused(argv, capsys) -> str:
    """The whole error of a command that must exit 2 with one error and no traceback."""
    code, lines, text = run(argv, capsys)
    assert code == 2 and len(lines) == 1, text
    assert "Traceback" not in text and "internal error" not in text and "To resolve this error" in text, text
    return text


@pytest.fixture
def no_model_built(monkeypatch):
    """Fails the test if a model is built from a config (the checks must come first)."""
    def build(*args, **kwargs):
        raise AssertionError("a model was built from a config that the checks should have refused")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_config", build)


def write_config(tmp_path, fields, name="config.json"):
    path = tmp_path / name
    path.write_text(json.dumps(fields))
    return str(path)


# -- 1. config validation before any model is built -----------------------------------------------------------
@pytest.mark.parametrize("command", ["train", "estimate", "plan"])
def test_an_moe_config_routing_to_more_experts_than_it_has_is_one_line(command, tmp_path, capsys, no_model_built):
    path = write_config(tmp_path, {**TINY_MIXTRAL, "num_experts_per_tok": 4})
    extra = {"train": ["--max-steps", "1", "--no-progress", "--out", str(tmp_path / "run")],
             "estimate": [], "plan": ["--budget", "1GiB"]}[command]
    text = refused([command, "--hf-config", path, "--seq-len", "32", *extra], capsys)
    assert f"--hf-config {path!r} sets num_experts_per_tok=4, more than its num_local_experts=2" in text, text
    assert "set num_experts_per_tok to at most 2" in text
    assert "fake tensors" not in text and "fix every technique" not in text, text
    assert not (tmp_path / "run").exists()


def test_an_moe_config_without_its_sizes_names_each_key_it_leaves_to_a_default(tmp_path, capsys, no_model_built):
    fields = {k: v for k, v in TINY_MIXTRAL.items() if k not in ("hidden_size", "num_local_experts")}
    path = write_config(tmp_path, fields)
    text = refused(["estimate", "--hf-config", path, "--seq-len", "32"], capsys)
    assert f"--hf-config {path!r} does not set hidden_size, num_local_experts" in text, text
    assert "MixtralConfig's defaults (hidden_size 4096, num_local_experts 8)" in text, text


def test_every_problem_of_a_config_is_listed_in_one_error(tmp_path, no_model_built):
    from memtrain.cli.workloads import hf_config_file

    fields = {**TINY_MIXTRAL, "num_key_value_heads": 3, "num_experts_per_tok": 3, "intermediate_size": 0}
    del fields["vocab_size"]
    with pytest.raises(ConfigError) as e:
        hf_config_file(write_config(tmp_path, fields))
    problems = e.value.problems
    assert len(problems) == 4, problems
    assert "does not set vocab_size" in problems[0]
    assert "sets intermediate_size=0: a size must be at least 1" in problems[1]
    assert "sets num_key_value_heads=3, which does not divide num_attention_heads=4" in problems[2]
    assert "sets num_experts_per_tok=3, more than its num_local_experts=2" in problems[3]
    assert all(str(tmp_path / "config.json") in p for p in problems)


@pytest.mark.parametrize("fields, fragment", [
    ({**TINY_LLAMA, "num_key_value_heads": 3}, "sets num_key_value_heads=3, which does not divide "
                                               "num_attention_heads=4"),
    ({"model_type": "gpt2", "vocab_size": 256, "n_embd": 64, "n_layer": 1, "n_head": 3, "n_positions": 64},
     "sets n_embd=64 and n_head=3: the heads do not divide the hidden size"),
    ({k: v for k, v in TINY_MIXTRAL.items() if k != "num_key_value_heads"},
     "leaves num_key_value_heads at MixtralConfig's default, 8, which does not divide num_attention_heads=4"),
    ({k: v for k, v in TINY_LLAMA.items() if k != "num_hidden_layers"}, "does not set num_hidden_layers"),
    ({**TINY_LLAMA, "num_hidden_layers": -1}, "sets num_hidden_layers=-1: a size must be at least 1"),
])
def test_a_dense_config_that_cannot_make_its_model_is_one_line(fields, fragment, tmp_path, capsys, no_model_built):
    path = write_config(tmp_path, fields)
    text = refused(["train", "--hf-config", path, "--seq-len", "32", "--max-steps", "1", "--no-progress",
                    "--out", str(tmp_path / "run")], capsys)
    assert fragment in text, text


def test_a_config_saved_by_transformers_passes_the_checks(tmp_path):
    from memtrain.cli.workloads import hf_config_file

    for config in (transformers.MixtralConfig(**TINY_MIXTRAL), transformers.GPT2Config(n_embd=64, n_head=4),
                   transformers.Qwen2MoeConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2)):
        config.save_pretrained(tmp_path / config.model_type)
        assert hf_config_file(tmp_path / config.model_type / "config.json").model_type == config.model_type
    # An old spelling transformers still reads (Falcon's n_embed) sets the size: nothing is left to a default.
    old_falcon = {"model_type": "falcon", "n_embed": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
                  "vocab_size": 256}
    assert hf_config_file(write_config(tmp_path, old_falcon, "falcon.json")).hidden_size == 64


def test_a_pretrained_folder_with_a_bad_config_is_refused_before_loading(hf_model_dir, tmp_path, capsys):
    folder = tmp_path / "model"
    shutil.copytree(hf_model_dir, folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "num_key_value_heads": 3}))
    text = refused(["estimate", "--hf-model", str(folder), "--seq-len", "32"], capsys)
    assert f"--hf-model {str(folder)!r}: config.json sets num_key_value_heads=3" in text, text
    from memtrain.hf import load_pretrained

    with pytest.raises(ConfigError, match="config.json sets num_key_value_heads=3, which does not divide"):
        load_pretrained(folder)


# -- 2. a config.json that does not match the weights ---------------------------------------------------------
@pytest.fixture
def narrowed_folder(hf_model_dir, tmp_path):
    """The tiny Llama's folder with hidden_size 32 in config.json; its weights are 64 wide."""
    folder = tmp_path / "model"
    shutil.copytree(hf_model_dir, folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "hidden_size": 32}))
    return folder


def test_a_config_whose_hidden_size_does_not_match_the_weights_is_one_line(narrowed_folder, tmp_path, capsys):
    data = tmp_path / "docs.txt"
    data.write_text("".join(f"def g{i}(y):\n    return y + {i}\n\n" for i in range(300)))
    text = refused(["train", "--hf-model", str(narrowed_folder), "--data", str(data), "--seq-len", "32",
                    "--max-steps", "1", "--no-progress", "--out", str(tmp_path / "run")], capsys)
    config = narrowed_folder / "config.json"
    assert f"{config} does not match the weights: lm_head.weight is [512, 64] in model.safetensors but [512, 32]" \
        in text, text
    assert f"hidden_size is 32 in config.json where the weights have 64. To resolve this error, set hidden_size " \
           f"to 64 in {config}" in text, text
    assert "LOAD REPORT" not in text  # transformers' table: the line above says it


def test_load_pretrained_names_the_mismatched_tensor(narrowed_folder):
    from memtrain.hf import load_pretrained

    with pytest.raises(ConfigError, match=r"model.embed_tokens.weight is \[512, 64\]|lm_head.weight is \[512, 64\]"):
        load_pretrained(narrowed_folder)


# -- 3. MemtrainTrainer ---------------------------------------------------------------------------------------
def test_the_trainer_refuses_a_meta_device_model_in_one_error(tmp_path):
    from helpers import tiny_llama_config

    from memtrain.hf import MemtrainTrainer

    torch = pytest.importorskip("torch")
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(tiny_llama_config())
    args = transformers.TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to="none")
    with pytest.raises(ConfigError, match=r"MemtrainTrainer: \d+ of the model's weights are on the meta device "
                                          r"\(e.g. model.embed_tokens.weight\).*load_pretrained\(DIR\)") as e:
        MemtrainTrainer(model, args)
    assert len(e.value.problems) == 1


def test_every_choices_field_is_honoured_or_refused_by_the_trainer():
    """A field of Choices that the Trainer helper neither applies nor refuses would be ignored in silence."""
    import dataclasses

    from memtrain.choices import Choices, OptimizerChoice
    from memtrain.hf import trainer_problems

    # What MemtrainTrainer applies (prepare_model, create_optimizer, training_step), as tests/test_hf.py checks.
    # A named optimizer class (and its kwargs) is honoured offloaded (CPUOffloadOptimizer steps it on the host) and
    # refused on the device, where the Trainer builds its own optimizer.
    honoured = {"checkpointing", "offload_activations", "chunked_loss", "tiled_mlp", "optimizer.placement",
                "optimizer.state_precision", "optimizer.kwargs"}
    on = {"compile": True, "pure_bf16": True, "offload_weights": True, "optimizer.step_in_backward": True,
          "optimizer.offload_fraction": 0.5, "optimizer.name": "adafactor"}
    fields = {f.name for f in dataclasses.fields(Choices) if f.name != "optimizer"}
    fields |= {f"optimizer.{f.name}" for f in dataclasses.fields(OptimizerChoice)}
    assert fields == honoured | set(on), f"a new field needs a decision here: {sorted(fields - honoured - set(on))}"
    for name, value in on.items():
        if name.startswith("optimizer."):
            choices = Choices(optimizer=OptimizerChoice(**{name.split(".")[1]: value}))
        else:
            choices = Choices(**{name: value})
        problems = trainer_problems(choices)
        assert len(problems) == 1 and name.split(".")[-1] in problems[0], (name, problems)


# -- 4. notes: a tokenizer with no separator, LoRA on random weights --------------------------------------------
def tokenizer_without_special_tokens(folder):
    """A fast byte-level BPE with no eos, bos or pad token, saved into ``folder`` over the one there."""
    tokenizers = pytest.importorskip("tokenizers")
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        (folder / name).unlink(missing_ok=True)
    bpe = tokenizers.Tokenizer(tokenizers.models.BPE())
    bpe.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(vocab_size=300, show_progress=False,
                                             initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet())
    bpe.train_from_iterator(["def f(x): return x + 1"] * 50, trainer=trainer)
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=bpe)
    tokenizer.save_pretrained(folder)
    return tokenizer


def test_a_tokenizer_without_eos_or_bos_gets_a_note_at_start_up(hf_model_dir, tmp_path, capsys):
    from memtrain.data.documents import separator_note
    from memtrain.hf import load_tokenizer

    assert separator_note(load_tokenizer(hf_model_dir)) is None  # its eos ends every document
    folder = tmp_path / "model"
    shutil.copytree(hf_model_dir, folder)
    tokenizer = tokenizer_without_special_tokens(folder)
    assert tokenizer.eos_token_id is None and tokenizer.bos_token_id is None and tokenizer.pad_token_id is None
    data = tmp_path / "docs.txt"
    data.write_text("".join(f"def g{i}(y):\n    return y + {i}\n\n" for i in range(300)))
    code, _, text = run(["train", "--hf-model", str(folder), "--data", str(data), "--seq-len", "32", "--max-steps",
                         "1", "--micro-batch-size", "4", "--no-progress", "--out", str(tmp_path / "run")], capsys)
    assert code == 0, text
    notes = [line for line in text.splitlines() if "note: the tokenizer in" in line]
    assert len(notes) == 1 and f"{folder} has no end-of-text token (eos_token) and adds no bos_token" in notes[0], text
    assert "tokenizer.eos_token = " in notes[0]


@pytest.mark.parametrize("base", ["hf-config", "model"])
def test_lora_on_random_weights_gets_a_hint(base, tmp_path, capsys):
    pytest.importorskip("peft")
    model = ["--hf-config", write_config(tmp_path, TINY_LLAMA)] if base == "hf-config" else ["--model", "gpt-tiny"]
    code, _, text = run(["train", *model, "--lora", "4", "--seq-len", "32", "--max-steps", "1", "--micro-batch-size",
                         "4", "--no-progress", "--out", str(tmp_path / "run")], capsys)
    assert code == 0, text
    hints = [line.strip() for line in text.splitlines() if "Hint: --lora 4 on" in line]
    assert len(hints) == 1, text
    assert "whose weights are random" in hints[0] and "pass --hf-model DIR" in hints[0], hints


def test_lora_on_pretrained_weights_gets_no_hint(hf_model_dir):
    import argparse

    from memtrain.cli.workloads import start_up_notes
    from memtrain.hf import load_tokenizer

    args = argparse.Namespace(hf_model=str(hf_model_dir), hf_config=None, model="gpt-tiny", lora=4)
    assert start_up_notes(args, load_tokenizer(hf_model_dir)) == []
