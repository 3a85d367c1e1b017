"""memtrain estimate: the peak of one given set-up as JSON and as a table, Hugging Face configs, the lean optimizer
flags and every checkpointing spelling."""

from __future__ import annotations

import json

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
