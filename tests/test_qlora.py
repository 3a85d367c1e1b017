"""QLoRA (--quantize-base nf4 with --lora): a 4-bit NF4 base through bitsandbytes under LoRA adapters. It trains a
local Llama folder on the CPU and writes adapters that load onto the unquantised base; estimate counts what measure
finds (the 4-bit weights with their scales, the adapters, their gradients and optimizer state, saved activations);
the issue's 8B fits a 12 GiB 4090 plan; bad combinations are one error each; a resume rebuilds the 4-bit base."""

from __future__ import annotations

import contextlib
import json

import pytest
from helpers import tiny_llama_config

from memtrain.cli import main
from memtrain.quantize import fsdp_shards_4bit

pytest.importorskip("bitsandbytes")
pytest.importorskip("peft")
torch = pytest.importorskip("torch")

LLAMA3_8B = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096,
             "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
             "num_key_value_heads": 8, "vocab_size": 128256, "max_position_embeddings": 8192, "rope_theta": 500000.0,
             "rms_norm_eps": 1e-5, "tie_word_embeddings": False}


@pytest.fixture(scope="module")
def text_file(tmp_path_factory):
    from memtrain.data import stdlib_corpus

    path = tmp_path_factory.mktemp("qlora-data") / "stdlib.txt"
    path.write_bytes(stdlib_corpus(2**15).tobytes())
    return path


def _train(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(["train", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def _fails(capsys, command: str, *argv: str) -> str:
    """The one error line of a refused command (exit 2, no traceback)."""
    code = main([command, *argv])
    err = capsys.readouterr().err
    assert code == 2, err
    assert "Traceback" not in err, err
    lines = [line for line in err.splitlines() if line.startswith("memtrain")]
    assert len(lines) == 1, err
    return lines[0]


def _steps(run) -> list[float]:
    return [json.loads(line)["loss"] for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_qlora_trains_a_local_llama_and_its_adapters_load_onto_the_unquantised_base(hf_model_dir, text_file,
                                                                                     tmp_path, capsys):
    """The issue's CPU target: 5 steps on a 4-bit base with a falling loss, hf/ holding the adapters (not the 4-bit
    base), which PeftModel loads onto the fp32 base it came from: its logits equal the trained model's up to NF4's
    rounding of the base, and differ from the base's alone (the adapters learned something)."""
    import peft
    import transformers

    run = tmp_path / "run"
    code, out, err = _train(capsys, "--hf-model", str(hf_model_dir), "--data", str(text_file), "--lora", "8",
                            "--quantize-base", "nf4", "--max-steps", "5", "--seq-len", "64", "--global-batch-size",
                            "4", "--lr", "2e-2", "--out", str(run), "--no-progress", "--json")
    assert code == 0, err
    assert "LoRA rank 8" in err and "in 4-bit NF4 (--quantize-base" in err, err  # said, not silent
    losses = _steps(run)
    assert len(losses) == 5 and losses[-1] < losses[0], losses
    files = sorted(p.name for p in (run / "hf").iterdir())
    assert "adapter_model.safetensors" in files and "model.safetensors" not in files, files
    base = transformers.AutoModelForCausalLM.from_pretrained(hf_model_dir)
    x = torch.randint(0, 100, (1, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        plain = base(input_ids=x).logits
        tuned = peft.PeftModel.from_pretrained(base, run / "hf")(input_ids=x).logits
    assert torch.isfinite(tuned).all()
    assert (tuned - plain).abs().max() > 1e-4, "the adapters changed nothing"


@pytest.mark.slow
def test_a_qlora_run_resumes_with_its_4bit_base(hf_model_dir, text_file, tmp_path, capsys):
    """--resume needs no other flag: config.json records --quantize-base, so the run rebuilds the 4-bit base and its
    checkpoint (the packed weights and their scales beside the adapters) loads into it; the resumed steps equal an
    uninterrupted run's; --quantize-base on the resume of a run without it is refused."""
    common = ["--hf-model", str(hf_model_dir), "--data", str(text_file), "--lora", "4", "--quantize-base", "nf4",
              "--seq-len", "32", "--global-batch-size", "2", "--lr", "1e-2", "--lr-schedule", "constant",
              "--warmup-steps", "0", "--no-progress", "--checkpointing", "none", "--micro-batch-size", "2",
              "--no-offload-optimizer", "--optimizer-state", "fp32", "--no-step-in-backward", "--no-chunked-loss",
              "--no-offload-activations"]
    whole, part = tmp_path / "whole", tmp_path / "part"
    assert _train(capsys, *common, "--max-steps", "4", "--out", str(whole))[0] == 0
    assert _train(capsys, *common, "--max-steps", "2", "--save-every", "1", "--out", str(part))[0] == 0
    record = json.loads((part / "config.json").read_text())
    assert record["command"]["quantize_base"] == "nf4", record["command"]
    code, _, err = _train(capsys, "--out", str(part), "--resume", "--max-steps", "4", "--no-progress")
    assert code == 0, err
    assert "resumed from step 2" in err, err
    assert _steps(part) == pytest.approx(_steps(whole), abs=1e-6), (_steps(part), _steps(whole))
    plain = tmp_path / "plain"  # a LoRA run on the unquantised base: --quantize-base on its resume is another model
    unquantised = [a for a in common if a not in ("--quantize-base", "nf4")]
    assert _train(capsys, *unquantised, "--max-steps", "1", "--out", str(plain))[0] == 0
    line = _fails(capsys, "train", "--out", str(plain), "--resume", "--quantize-base", "nf4", "--no-progress")
    assert "--quantize-base 'nf4' now but not given in the run being resumed" in line, line


@pytest.mark.parametrize("precision", ["fp32", "bf16-mixed"])
def test_qlora_estimate_equals_measure_on_the_cpu(tmp_path, capsys, precision):
    """estimate's meta stand-ins of the 4-bit layers count what the real bitsandbytes model holds and saves in one
    step: parameters (packed uint8 weights, fp32 absmax per 64 weights and the code book: measure counts the
    quantisation state beside the parameters), the adapters' gradients and AdamW state, saved activations."""
    import transformers

    from memtrain import measure
    from memtrain.cli.workloads import frozen_linear_weights_to
    from memtrain.hf import apply_lora
    from memtrain.quantize import quant_state_tensors, quantize_base, quantized_bytes

    tiny_llama_config(vocab_size=512).save_pretrained(tmp_path / "cfg")
    argv = ["estimate", "--hf-config", str(tmp_path / "cfg" / "config.json"), "--seq-len", "32",
            "--micro-batch-size", "2", "--device", "cpu", "--precision", precision, "--checkpointing", "none",
            "--no-chunked-loss", "--json", "--lora", "4"]
    assert main([*argv, "--quantize-base", "nf4"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert main(argv) == 0
    lora = json.loads(capsys.readouterr().out)
    mixed = precision == "bf16-mixed"
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(tiny_llama_config(vocab_size=512))
    quantize_base(model, "nf4", compute_dtype=torch.bfloat16 if mixed else torch.float32)
    model = apply_lora(model, 4)
    if mixed:
        frozen_linear_weights_to(model, torch.bfloat16)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad])
    x = torch.randint(0, 512, (2, 32), generator=torch.Generator().manual_seed(1))

    def step():
        with torch.autocast("cpu", dtype=torch.bfloat16) if mixed else contextlib.nullcontext():
            return model(input_ids=x, labels=x.clone())

    measured = measure(step, model=model, optimizer=optimizer)
    for field in ("activation_bytes", "gradient_bytes", "optimizer_state_bytes", "parameter_bytes"):
        assert report[field] == getattr(measured, field), (field, report[field], getattr(measured, field))
    # The 4-bit layers' bytes, independently: 14 layers (7 a block), 0.5 byte a weight + 4 bytes per 64 + 64 bytes.
    import bitsandbytes

    layers = [m for m in model.modules() if isinstance(m, bitsandbytes.nn.Linear4bit)]
    expected = sum(quantized_bytes(m.in_features * m.out_features) for m in layers)
    held = sum(m.weight.numel() for m in layers) + sum(t.numel() * 4 for t in quant_state_tensors(model))
    assert len(layers) == 14 and held == expected, (len(layers), held, expected)
    unquantised = sum(m.in_features * m.out_features for m in layers) * (2 if mixed else 4)  # LoRA's frozen dtype
    assert lora["parameter_bytes"] - report["parameter_bytes"] == unquantised - expected, (lora, report)
    assert report["gradient_bytes"] == lora["gradient_bytes"], (report, lora)


def test_qlora_stand_in_dequantises_in_forward_and_backward():
    """The meta stand-in allocates bitsandbytes' transient: the weight dequantised to the compute dtype, once in
    forward and once in backward, freed after each matmul; it saves nothing for backward."""
    from memtrain.quantize import Linear4bitStandIn

    layer = Linear4bitStandIn(256, 512, None, torch.bfloat16)
    sizes = []

    class Allocations(torch.utils._python_dispatch.TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func is torch.ops.aten._to_copy.default and args[0].dtype == torch.uint8:  # the packed codes
                sizes.append((tuple(out.shape), out.dtype))
            return out

    saved = []
    x = torch.empty(2, 8, 256, device="meta", requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t), Allocations():
        out = layer(x)
        out.sum().backward()
    assert sizes == [((512, 128, 2), torch.bfloat16)] * 2, sizes
    assert out.dtype == torch.float32 and x.grad.shape == x.shape
    assert not saved, [tuple(t.shape) for t in saved]


@pytest.mark.slow
def test_qlora_plan_of_train_equals_memtrain_plan(hf_model_dir, text_file, tmp_path, capsys):
    """memtrain train plans the real 4-bit model (meta_model turns its bitsandbytes layers into stand-ins); memtrain
    plan builds the stand-ins from the config: the same settings and the same predicted peak."""
    common = ["--seq-len", "32", "--precision", "bf16-mixed", "--checkpointing", "all", "--micro-batch-size", "2",
              "--global-batch-size", "4", "--no-offload-optimizer", "--no-offload-activations", "--optimizer-state",
              "fp32", "--no-step-in-backward", "--no-chunked-loss", "--budget", "1GiB", "--lora", "4",
              "--quantize-base", "nf4", "--hf-model", str(hf_model_dir)]
    assert main(["plan", *common, "--device", "cpu", "--json"]) == 0
    planned = json.loads(capsys.readouterr().out)
    assert main(["train", *common, "--data", str(text_file), "--max-steps", "1", "--out", str(tmp_path / "run"),
                 "--json", "--no-progress"]) == 0
    out, err = capsys.readouterr()
    trained = json.loads(out.splitlines()[-1])["plan"]
    assert trained["settings"] == planned["plan"], (trained["settings"], planned["plan"])
    assert trained["peak_bytes"] == planned["peak_bytes"], (trained["peak_bytes"], planned["peak_bytes"])


def test_qlora_16_fits_llama3_8b_on_a_12_gib_4090(tmp_path, capsys):
    """Issue 20's QLoRA target: the 8B's 6.98B linear weights (all but the head) in NF4 take 3.66 GiB with their
    scales instead of 13 GiB in bf16, so seq 2048 x 16 fits a 12 GiB budget on a 4090."""
    path = tmp_path / "llama3-8b.json"
    path.write_text(json.dumps(LLAMA3_8B))
    code = main(["plan", "--hf-config", str(path), "--seq-len", "2048", "--global-batch-size", "16", "--lora", "16",
                 "--quantize-base", "nf4", "--budget", "12GiB", "--gpu", "4090", "--json"])
    out, err = capsys.readouterr()
    assert code == 0, err
    p = json.loads(out)
    assert p["peak_bytes"] <= p["usable_bytes"] < 12 * 2**30, (p["peak_bytes"], p["usable_bytes"])
    assert p["plan"]["micro_batch_size"] * p["plan"]["accumulation"] == 16, p["plan"]
    reason = p["reasons"][0]
    assert reason.startswith("LoRA rank 16: 41.94M trainable parameters (0.52%) beside 8.03B frozen"), reason
    assert "6.98B of them in 4-bit NF4" in reason and "3.66 GiB" in reason, reason


def _several_ranks(tmp_path) -> list[str]:
    tiny_llama_config(vocab_size=512).save_pretrained(tmp_path / "cfg")
    return ["plan", "--hf-config", str(tmp_path / "cfg" / "config.json"), "--lora", "4", "--quantize-base", "nf4",
            "--seq-len", "32", "--nproc", "2", "--budget", "1GiB", "--gpu", "4090", "--checkpointing", "all", "--json"]


@pytest.mark.skipif(not fsdp_shards_4bit(), reason=f"torch {torch.__version__}'s FSDP2 cannot shard uint8 weights")
def test_a_qlora_plan_over_several_ranks_compares_ddp_and_fsdp2(tmp_path, capsys):
    """The 4-bit base shards like any weight (FSDP-QLoRA): memtrain plan --nproc 2 weighs FSDP2 beside DDP for QLoRA,
    and --fsdp plans it (both were DDP only, or refused)."""
    common = _several_ranks(tmp_path)
    assert main(common) == 0
    p = json.loads(capsys.readouterr().out)
    compared = [r for r in p["reasons"] if r.startswith(("DDP over 2 ranks", "FSDP2 over 2 ranks"))]
    assert len(compared) == 1 and ", because: " in compared[0], p["reasons"]  # the other one named: searched too
    assert main([*common, "--fsdp"]) == 0
    assert json.loads(capsys.readouterr().out)["plan"]["distribution"] == "fsdp2"


def test_fsdp_qlora_is_refused_naming_torch_2_12_where_fsdp2_cannot_shard_uint8_weights(tmp_path, capsys,
                                                                                       monkeypatch):
    """torch 2.11's FSDP2 makes every sharded parameter require grad (a uint8 one cannot) and would cast it to the
    gathered dtype (pytorch#177844): --fsdp with --quantize-base is one error naming the fix, and a plan over several
    ranks compares nothing but DDP."""
    from memtrain.cli import plan as plan_command
    from memtrain.cli import workloads

    for module in (workloads, plan_command):
        monkeypatch.setattr(module, "fsdp_shards_4bit", lambda: False)
    common = _several_ranks(tmp_path)
    assert main(common) == 0
    reasons = json.loads(capsys.readouterr().out)["reasons"]
    assert "DDP over 2 ranks (as asked)" in reasons, reasons
    line = _fails(capsys, *common[:-1], "--fsdp")
    assert "--fsdp with --quantize-base nf4 on torch" in line and "torch 2.12 or newer" in line, line


def test_quantize_base_bad_input_is_one_error_each(hf_model_dir, tmp_path, capsys, monkeypatch):
    """--quantize-base without --lora, with the built-in GPT and with --merge-lora: one error each
    naming the fix; bitsandbytes missing: the extra that installs it."""
    tiny_llama_config(vocab_size=512).save_pretrained(tmp_path / "cfg")
    cfg = ["--hf-config", str(tmp_path / "cfg" / "config.json")]
    for command in ("estimate", "plan"):
        line = _fails(capsys, command, *cfg, "--quantize-base", "nf4", "--checkpointing", "all")
        assert "--quantize-base nf4 without --lora" in line and "--lora R" in line, line
        line = _fails(capsys, command, "--model", "gpt-tiny", "--lora", "4", "--quantize-base", "nf4",
                      "--checkpointing", "all")
        assert "with the built-in GPT" in line and "--hf-model DIR" in line, line
    out = str(tmp_path / "run")
    line = _fails(capsys, "train", *cfg, "--lora", "4", "--quantize-base", "nf4", "--merge-lora", "--out", out)
    assert "--merge-lora with --quantize-base nf4" in line and "PeftModel.from_pretrained" in line, line
    import builtins

    real_import = builtins.__import__

    def no_bitsandbytes(name, *args, **kwargs):
        if name == "bitsandbytes" or name.startswith("bitsandbytes."):
            raise ImportError(f"No module named {name!r}")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_bitsandbytes)
    line = _fails(capsys, "train", *cfg, "--lora", "4", "--quantize-base", "nf4", "--max-steps", "1", "--out", out,
                  "--no-progress")
    assert "needs the bitsandbytes package" in line and "pip install 'memtrain[qlora]'" in line, line


def test_qlora_under_bf16_mixed_with_an_offloaded_optimizer_finishes_its_run(hf_model_dir, text_file, tmp_path,
                                                                                 capsys):
    """bf16-mixed (QLoRA's usual compute dtype) with checkpointing and the optimizer on the CPU: the run ends with its
    sample and hf/ (the sample ran outside autocast before, where the output head's bf16 weight met fp32
    activations: an internal error after the last step)."""
    run = tmp_path / "run"
    code, _, err = _train(capsys, "--hf-model", str(hf_model_dir), "--data", str(text_file), "--lora", "4",
                          "--quantize-base", "nf4", "--max-steps", "2", "--seq-len", "32", "--global-batch-size", "2",
                          "--precision", "bf16-mixed", "--checkpointing", "all", "--offload-optimizer",
                          "--out", str(run), "--no-progress")
    assert code == 0, err
    assert (run / "sample.txt").is_file() and (run / "hf" / "adapter_model.safetensors").is_file()


def test_quantize_base_stores_what_transformers_4bit_loader_stores(hf_model_dir):
    """quantize_base on the loaded fp32 model gives the bytes transformers' own loader gives with
    BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4") (no double quantisation, blocks of 64): the
    same packed weights, scales and layers (all linear layers but lm_head)."""
    import bitsandbytes
    import transformers

    from memtrain.hf import load_pretrained
    from memtrain.quantize import quantize_base

    config = transformers.BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                             bnb_4bit_compute_dtype=torch.bfloat16)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(hf_model_dir, quantization_config=config,
                                                               device_map="cpu")
    ours = quantize_base(load_pretrained(hf_model_dir), "nf4", compute_dtype=torch.bfloat16)
    layers = {n: m for n, m in theirs.named_modules() if isinstance(m, bitsandbytes.nn.Linear4bit)}
    mine = {n: m for n, m in ours.named_modules() if isinstance(m, bitsandbytes.nn.Linear4bit)}
    assert sorted(layers) == sorted(mine) and "lm_head" not in mine and len(mine) == 14, (sorted(layers), sorted(mine))
    for name, layer in layers.items():
        a, b = layer.weight, mine[name].weight
        assert torch.equal(a, b) and torch.equal(a.quant_state.absmax, b.quant_state.absmax), name
        assert a.quant_state.nested is b.quant_state.nested is False, name
        assert mine[name].compute_dtype == layer.compute_dtype == torch.bfloat16, name


def test_bf16_device_weights_leave_the_4bit_scales_in_fp32():
    """offload-bf16-weights casts the device's floating-point parameters to bf16 (planner/apply, and the estimate's
    convert_weights); a real 4-bit layer's absmax is no parameter and stays fp32, so the stand-in's stays fp32 too."""
    from memtrain.estimate.fake import convert_weights
    from memtrain.quantize import Linear4bitStandIn

    model = torch.nn.Sequential(Linear4bitStandIn(128, 64, None, torch.bfloat16), torch.nn.Linear(64, 8,
                                                                                                   device="meta"))
    convert_weights(model, torch.bfloat16)
    assert model[0].absmax.dtype == model[0].code.dtype == torch.float32
    assert model[0].weight.dtype == torch.uint8 and model[1].weight.dtype == torch.bfloat16


@pytest.mark.parametrize("precision", ["fp32", "bf16-mixed"])
def test_estimate_of_the_real_4bit_model_with_checkpointing_equals_measure(hf_model_dir, precision):
    """estimate(model) of the real bitsandbytes model (meta_model turns its 4-bit layers into stand-ins) with every
    block checkpointed and a chunked loss: the saved activations and parameter bytes measure finds."""
    from memtrain import MemoryMeter, estimate
    from memtrain.checkpointing import apply_checkpointing
    from memtrain.choices import Choices
    from memtrain.hf import apply_lora, load_pretrained
    from memtrain.loss import apply_chunked_loss
    from memtrain.quantize import quantize_base

    mixed = precision == "bf16-mixed"
    base = quantize_base(load_pretrained(hf_model_dir), "nf4", compute_dtype=torch.bfloat16 if mixed else torch.float32)
    lora = apply_lora(base, 4)
    apply_checkpointing(lora)
    apply_chunked_loss(lora)
    x = torch.randint(0, 100, (2, 32), generator=torch.Generator().manual_seed(0))
    with MemoryMeter(lora) as meter:
        with torch.autocast("cpu", dtype=torch.bfloat16) if mixed else contextlib.nullcontext():
            loss = lora(input_ids=x, labels=x).loss
    loss.backward()
    measured = meter.report()
    predicted = estimate(lora, x, device="cpu", precision=precision, checkpointing="all",
                         setup=Choices(chunked_loss=True))
    assert predicted.activation_bytes == measured.activation_bytes, (predicted.activation_bytes,
                                                                     measured.activation_bytes)
    assert predicted.parameter_bytes == measured.parameter_bytes, (predicted.parameter_bytes, measured.parameter_bytes)


def test_quantize_base_with_offload_weights_is_refused_by_plan_and_estimate_as_train_would(tmp_path, capsys):
    """Parameter offload streams the weights the optimizer trains; the 4-bit base is frozen and its packed weights
    cannot be streamed: plan and estimate accepted the pair that train then refused with WeightStreamer's class
    names, after loading the model."""
    tiny_llama_config(vocab_size=512).save_pretrained(tmp_path / "cfg")
    cfg = ["--hf-config", str(tmp_path / "cfg" / "config.json"), "--lora", "8", "--quantize-base", "nf4"]
    for command in ("estimate", "plan"):
        line = _fails(capsys, command, *cfg, "--offload-weights")
        assert "--offload-weights with --quantize-base nf4" in line and "drop --offload-weights" in line, line
