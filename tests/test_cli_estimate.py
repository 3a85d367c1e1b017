"""memtrain estimate: the peak of one given set-up as JSON and as a table, Hugging Face configs, the lean optimizer
flags and every checkpointing spelling."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import tiny_llama_config

from memtrain.cli import main


def test_estimate_json_and_table(tmp_path, capsys):
    assert main(["estimate", "--model", "gpt-tiny", "--micro-batch-size", "4", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["source"] == "estimated" and report["peak_bytes"] > report["parameter_bytes"] > 0
    assert main(["estimate", "--model", "gpt-tiny", "--checkpointing", "none", "--device", "cpu"]) == 0
    table = capsys.readouterr().out
    assert "memory report (estimated, cpu)" in table and "peak at:" in table


def test_estimate_hf_config_and_bad_input(tmp_path, capsys):
    tiny_llama_config(vocab_size=512, max_position_embeddings=2048).save_pretrained(tmp_path / "cfg")
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


def test_estimate_takes_the_lean_optimizer_flags_and_every_checkpointing_spelling(capsys):
    def estimate(*flags: str) -> dict:
        assert main(["estimate", "--model", "gpt-tiny", "--micro-batch-size", "4", "--json", *flags]) == 0
        return json.loads(capsys.readouterr().out)

    base = estimate()  # checkpointing all, AdamW with fp32 moments on the device
    bf16 = estimate("--optimizer-state", "bf16")
    assert bf16["optimizer_state_bytes"] < 0.6 * base["optimizer_state_bytes"], (bf16, base)
    in_backward = estimate("--step-in-backward")
    assert in_backward["gradient_bytes"] < base["gradient_bytes"], (in_backward, base)
    half = estimate("--offload-optimizer-fraction", "0.5")
    assert 0 < half["host_bytes"] and half["optimizer_state_bytes"] < base["optimizer_state_bytes"], half
    saved = {policy: estimate("--checkpointing", policy)["activation_bytes"]
             for policy in ("none", "blocks(RK)", "selective", "all")}
    assert saved["all"] < saved["blocks(RK)"] < saved["none"] and saved["selective"] < saved["none"], saved
    assert main(["estimate", "--model", "gpt-tiny", "--checkpointing", "auto"]) == 2
    assert "memtrain plan --budget SIZE" in capsys.readouterr().err



def test_estimate_and_plan_of_a_hf_model_folder_trace_the_packed_rows_train_feeds(hf_model_dir, capsys):
    """memtrain train --hf-model packs the tokenised documents, so estimate and plan trace packed rows (labels and
    restarting position_ids: the block-diagonal mask Hugging Face builds for them), as train's own plan does."""
    from memtrain.estimate import estimate, hf_config_from_file

    argv = ["--hf-model", str(hf_model_dir), "--seq-len", "64", "--device", "cpu", "--precision", "fp32",
            "--checkpointing", "none", "--no-chunked-loss"]
    assert main(["estimate", *argv, "--micro-batch-size", "4", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    config = hf_config_from_file(hf_model_dir / "config.json")
    packed = estimate(config, dict.fromkeys(("input_ids", "labels", "position_ids"), (4, 64)), device="cpu")
    tokens_only = estimate(config, (4, 64), device="cpu")
    assert report["activation_bytes"] == packed.activation_bytes > tokens_only.activation_bytes, (
        report["activation_bytes"], packed.activation_bytes, tokens_only.activation_bytes)
    assert main(["plan", *argv, "--micro-batch-size", "4", "--global-batch-size", "4", "--budget", "1GiB",
                 "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["estimate"]["activation_bytes"] == packed.activation_bytes


@pytest.mark.parametrize("precision", ["fp32", "bf16-mixed"])
def test_estimate_with_lora_equals_measure_of_the_adapted_model_on_cpu(tmp_path, capsys, precision):
    """--lora R: the meta model gets PEFT's adapters on its frozen base, so estimate counts the base's weights
    without gradients or optimizer state (its linear weights in bf16 under bf16-mixed, as train stores them), the
    adapters with theirs, and what LoRA saves for backward: the bytes measure finds in one real step of the same
    adapted model."""
    import contextlib

    import torch
    import transformers

    from memtrain import measure
    from memtrain.cli.workloads import frozen_linear_weights_to
    from memtrain.hf import apply_lora

    tiny_llama_config(vocab_size=512).save_pretrained(tmp_path / "cfg")
    argv = ["estimate", "--hf-config", str(tmp_path / "cfg" / "config.json"), "--seq-len", "32",
            "--micro-batch-size", "2", "--device", "cpu", "--precision", precision, "--checkpointing", "none",
            "--no-chunked-loss", "--json"]
    assert main([*argv, "--lora", "4"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert main(argv) == 0
    full = json.loads(capsys.readouterr().out)
    torch.manual_seed(0)
    model = apply_lora(transformers.LlamaForCausalLM(tiny_llama_config(vocab_size=512)), 4)
    mixed = precision == "bf16-mixed"
    if mixed:
        frozen_linear_weights_to(model, torch.bfloat16)
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable)
    x = torch.randint(0, 512, (2, 32), generator=torch.Generator().manual_seed(1))

    def step():
        with torch.autocast("cpu", dtype=torch.bfloat16) if mixed else contextlib.nullcontext():
            return model(input_ids=x, labels=x.clone())

    measured = measure(step, model=model, optimizer=optimizer)
    adapters = 4 * sum(p.numel() for p in trainable)
    for field in ("activation_bytes", "gradient_bytes", "optimizer_state_bytes", "parameter_bytes"):
        assert report[field] == getattr(measured, field), (field, report[field], getattr(measured, field))
    assert report["gradient_bytes"] == adapters, (report["gradient_bytes"], adapters)  # the adapters' only
    assert report["optimizer_state_bytes"] < 0.1 * full["optimizer_state_bytes"], (report, full)
    assert (report["parameter_bytes"] < 0.8 * full["parameter_bytes"]) == mixed, (report, full)
    assert any("LoRA rank 4" in a and "trainable parameters" in a for a in report["assumptions"]), report


def test_lora_in_estimate_is_checked_as_in_train(tmp_path, capsys):
    tiny_llama_config(vocab_size=512).save_pretrained(tmp_path / "cfg")
    path = str(tmp_path / "cfg" / "config.json")
    assert main(["estimate", "--hf-config", path, "--lora", "100"]) == 2
    err = capsys.readouterr().err
    assert "--lora 100 is above the rank of the layers it adapts" in err and "--lora 32 or less" in err, err
    assert main(["estimate", "--hf-config", path, "--lora-alpha", "16"]) == 2
    assert "--lora-alpha without --lora" in capsys.readouterr().err
    assert main(["estimate", "--hf-config", path, "--lora", "4", "--lora-targets", "nope"]) == 2
    assert "--lora-targets" in capsys.readouterr().err


def test_a_config_naming_bf16_weights_is_estimated_with_the_fp32_weights_the_run_trains(tmp_path, capsys):
    """A hub config.json often says torch_dtype bfloat16: the model was built from it with bf16 weights, so the
    estimate counted no fp32 master (half the weights' and the moments' bytes) and train trained bf16 weights with
    plain AdamW, silently. Pure bf16 is --pure-bf16's, an explicit choice."""
    from memtrain.cli.workloads import _build_hf_model

    config = tiny_llama_config(vocab_size=512)
    config.save_pretrained(tmp_path / "fp32")
    config.torch_dtype = torch.bfloat16
    config.save_pretrained(tmp_path / "bf16")
    assert "bfloat16" in (tmp_path / "bf16" / "config.json").read_text()
    reports = []
    for name in ("fp32", "bf16"):
        assert main(["estimate", "--hf-config", str(tmp_path / name / "config.json"), "--seq-len", "32",
                     "--micro-batch-size", "2", "--json"]) == 0
        reports.append(json.loads(capsys.readouterr().out))
    assert [r["parameter_bytes"] for r in reports] == [4 * sum(p.numel() for p in _build_hf_model(
        str(tmp_path / "fp32" / "config.json"), 32)[0].parameters())] * 2, reports
    assert reports[0]["peak_bytes"] == reports[1]["peak_bytes"]
    model, _ = _build_hf_model(str(tmp_path / "bf16" / "config.json"), 32)
    assert {p.dtype for p in model.parameters()} == {torch.float32}


def test_the_estimate_header_names_streamed_weights_and_their_offloaded_optimizer(capsys):
    assert main(["estimate", "--model", "gpt-tiny", "--micro-batch-size", "2", "--offload-weights"]) == 0
    header = capsys.readouterr().out.splitlines()[0]
    assert "AdamW offloaded" in header and "the blocks' weights streamed from host RAM" in header, header


def test_estimate_names_every_problem_of_its_flags_at_once(tmp_path, capsys):
    """A sequence the model cannot take with a contradiction between the technique flags, or with one between them
    and the precision: one error naming both (each used to stop the command alone)."""
    tiny_llama_config(vocab_size=512, max_position_embeddings=128).save_pretrained(tmp_path / "cfg")
    path = str(tmp_path / "cfg" / "config.json")
    long = ["estimate", "--hf-config", path, "--seq-len", "1000"]
    assert main([*long, "--pure-bf16", "--precision", "fp32"]) == 2
    err = capsys.readouterr().err
    assert "2 problems" in err and "--precision 'bf16-mixed'" in err and "--seq-len 128 or less" in err, err
    assert main([*long, "--no-offload-optimizer", "--offload-optimizer-fraction", "0.5"]) == 2
    err = capsys.readouterr().err
    assert "2 problems" in err and "0.5 contradict" in err and "--seq-len 128 or less" in err, err
