"""Parameter offload in a run: Choices' rules, the CLI's --offload-weights, apply_plan and train on the CPU (the
built-in GPT and a Hugging Face Llama config, resume, the exported weights), and the planner's figures for it."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import tiny_gpt, tiny_llama_config

from memtrain.choices import Choices, OptimizerChoice
from memtrain.cli import main
from memtrain.errors import ConfigError
from memtrain.offload import WeightStreamer
from memtrain.planner import apply_plan, plan
from memtrain.techniques.weight_offload import WEIGHTS_IN_FLIGHT


@pytest.mark.parametrize("kwargs,fragment", [
    (dict(optimizer=OptimizerChoice(placement="device")), "drop optimizer.placement='device'"),
    (dict(optimizer=OptimizerChoice(step_in_backward=True)), "drop optimizer.step_in_backward=True"),
    (dict(compile=True), "drop compile=True or offload_weights=True"),
])
def test_choices_that_contradict_parameter_offload_name_the_fix(kwargs, fragment):
    with pytest.raises(ConfigError, match="offload_weights=True with") as e:
        Choices(offload_weights=True, **kwargs)
    assert fragment in str(e.value)


def test_a_run_that_replicates_is_refused_and_one_that_shards_streams_its_shards():
    with pytest.raises(ConfigError, match="run one process"):  # DDP
        Choices(offload_weights=True).check_run(world_size=2)
    Choices(offload_weights=False).check_run(world_size=2)
    Choices(offload_weights=True).check_run(world_size=2, fsdp=True)  # FSDP2's CPUOffloadPolicy


def test_choices_round_trip_through_a_dict():
    choices = Choices(offload_weights=True)
    assert Choices.from_dict(choices.to_dict()) == choices


@pytest.mark.parametrize("argv,fragment", [
    (["plan", "--nproc", "2", "--ddp"], "--offload-weights with --nproc 2"),
    (["train", "--no-offload-optimizer"], "drop --no-offload-optimizer"),
    (["plan", "--compile"], "drop --compile or --offload-weights"),
    (["estimate", "--step-in-backward"], "drop --step-in-backward"),
])
def test_the_cli_refuses_what_cannot_combine_with_exit_2(argv, fragment, capsys, tmp_path):
    command, *flags = argv
    extra = ["--out", str(tmp_path / "run"), "--max-steps", "1"] if command == "train" else []
    assert main([command, "--model", "gpt-tiny", "--offload-weights", *flags, *extra]) == 2
    err = capsys.readouterr().err
    assert fragment in err and "Traceback" not in err, err


def test_apply_plan_streams_the_blocks_from_the_optimizers_master():
    model = tiny_gpt(4, seed=0)
    p = plan(model, budget=None, seq_len=16, global_batch_size=2, device="cpu", choices=Choices(offload_weights=True))
    assert p.settings.offload_weights and p.settings.optimizer == "offload", p.settings
    assert "weights streamed" in p.summary() and any(r.startswith("parameter offload") for r in p.reasons)
    run = apply_plan(model, p, lr=1e-2)
    assert isinstance(run.weights, WeightStreamer)
    masters = {id(s.device): s.master for s in run.optimizer.slots}
    for block in model.blocks:
        for param in block.parameters():
            assert param.data_ptr() == masters[id(param)].data_ptr()  # at rest: the master itself
    x = torch.randint(0, 256, (2, 16))
    for _ in range(2):
        with run.accumulator.micro_batch(is_last=True):
            run.accumulator.backward(model(x, x), reduction="mean", items=1)
        run.accumulator.step()
    assert run.weights.stats.peak_resident_blocks == WEIGHTS_IN_FLIGHT
    assert run.weights.stats.link_bytes["host_to_device"] == 2 * 2 * sum(
        p.numel() * 4 for b in model.blocks for p in b.parameters())


def test_the_plan_predicts_the_device_bytes_the_streamer_holds():
    """Estimate == measure for the weights: the plan's peak falls by all but the blocks in flight, which is what the
    streamer held at most; its host link counts every block twice a micro-batch."""
    model = tiny_gpt(4, seed=0)
    common = dict(budget=None, seq_len=16, global_batch_size=2, device="cpu", micro_batch_size=2)
    base = plan(model, choices=Choices(offload_weights=False, optimizer=OptimizerChoice(placement="offload"),
                                       checkpointing="none", chunked_loss=False), **common)
    streamed = plan(model, choices=Choices(offload_weights=True, checkpointing="none", chunked_loss=False), **common)
    run = apply_plan(model, streamed)
    x = torch.randint(0, 256, (2, 16))
    with run.accumulator.micro_batch(is_last=True):
        run.accumulator.backward(model(x, x), reduction="mean", items=1)
    run.accumulator.step()
    blocks = sum(p.numel() * 4 for b in model.blocks for p in b.parameters())
    held = run.weights.stats.peak_resident_bytes
    assert base.peak_bytes - streamed.peak_bytes == blocks - held, (base.peak_bytes, streamed.peak_bytes, blocks, held)
    assert streamed.host_link.weights_to_device == run.weights.stats.link_bytes["host_to_device"]


def _train(tmp_path, name, *argv):
    out = tmp_path / name
    code = main(["train", "--offload-weights", "--out", str(out), "--json", "--no-progress", *argv])
    return code, out


def test_train_resumes_and_exports_from_the_host_weights(tmp_path, capsys):
    common = ["--model", "gpt-tiny", "--seq-len", "32", "--global-batch-size", "4", "--eval-every", "100",
              "--lr-schedule", "constant"]
    code, out = _train(tmp_path, "run", *common, "--max-steps", "2", "--save-every", "1")
    assert code == 0, capsys.readouterr().err
    config = json.loads((out / "config.json").read_text())
    assert config["plan"]["choices"]["offload_weights"] is True
    code, _ = _train(tmp_path, "run", "--resume", "--max-steps", "3")  # --resume needs no other flag
    assert code == 0, capsys.readouterr().err
    code, straight = _train(tmp_path, "straight", *common, "--max-steps", "3")
    assert code == 0, capsys.readouterr().err
    from safetensors.torch import load_file
    a, b = load_file(out / "model.safetensors"), load_file(straight / "model.safetensors")
    worst = max((a[k] - b[k]).abs().max().item() for k in a)
    assert worst <= 1e-6, f"resumed run's weights differ from a straight run's by {worst:.3g}"


def test_train_a_hugging_face_llama_and_export_hf(tmp_path, capsys):
    config = tiny_llama_config(vocab_size=256).to_dict()
    path = tmp_path / "llama.json"
    path.write_text(json.dumps({**config, "architectures": ["LlamaForCausalLM"]}))
    code, out = _train(tmp_path, "run", "--hf-config", str(path), "--seq-len", "32", "--global-batch-size", "4",
                       "--max-steps", "3")
    assert code == 0, capsys.readouterr().err
    transformers = pytest.importorskip("transformers")
    loaded = transformers.AutoModelForCausalLM.from_pretrained(out / "hf")
    from safetensors.torch import load_file
    final = load_file(out / "model.safetensors")
    exported = loaded.state_dict()
    # Every weight saved: the host masters are views of one flat buffer, several of the same shape.
    assert set(final) == set(exported), sorted(set(exported) ^ set(final))
    keys = [k for k in final if k.endswith("layers.0.mlp.down_proj.weight")]
    assert keys, sorted(final)[:5]
    suffix = keys[0].split("layers.0.")[0]
    twin = next(k for k in exported if k.endswith("layers.0.mlp.down_proj.weight"))
    assert suffix is not None and torch.equal(exported[twin], final[keys[0]])
    assert not torch.equal(exported[twin], torch.zeros_like(exported[twin]))


@pytest.mark.parametrize("checkpointing", ["none", "all"])
def test_estimate_equals_measure_on_the_cpu(checkpointing):
    """The estimate of a step with parameter offload: the saved activations ``measure`` counts (the weights' views
    autograd saves are weights, not activations, though their storage is the streamer's), and the parameters on the
    device: the other parameters and the blocks the streamer held at most."""
    from memtrain.checkpointing import apply_checkpointing, find_blocks
    from memtrain.estimate import estimate
    from memtrain.measure import measure
    from memtrain.optim import CPUOffloadOptimizer

    model = tiny_gpt(4, seed=0)
    x = torch.randint(0, 256, (2, 16))
    predicted = estimate(model, x, device="cpu", setup=Choices(offload_weights=True, checkpointing=checkpointing))
    if checkpointing == "all":
        apply_checkpointing(model)
    optimizer = CPUOffloadOptimizer(model.named_parameters(), lr=1e-3)
    blocks = [p for b in model.blocks for p in b.parameters()]
    streamer = WeightStreamer(model, blocks=find_blocks(model), host_weights=optimizer.stream_weights(blocks))
    measured = measure(lambda: model(x, x.clone()), model=model, optimizer=optimizer)
    optimizer.step()
    assert predicted.activation_bytes == measured.activation_bytes, (predicted.activation_bytes,
                                                                     measured.activation_bytes)
    outside = sum(p.numel() * 4 for n, p in model.named_parameters() if not n.startswith("blocks."))
    assert predicted.parameter_bytes == outside + streamer.stats.peak_resident_bytes, (
        predicted.parameter_bytes, outside, streamer.stats.peak_resident_bytes)
    assert any(a.startswith("parameter offload: the 4 blocks") for a in predicted.assumptions)


def test_the_gpu_script_runs_its_path_on_the_cpu(tmp_path):
    """benchmarks/gpu_offload_weights.py --small: plan with parameter offload, apply, train a tiny Llama, write the
    row (no peak is measurable on a CPU, and none is claimed)."""
    import importlib.util
    import sys
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / "benchmarks" / "gpu_offload_weights.py"
    spec = importlib.util.spec_from_file_location("gpu_offload_weights", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_offload_weights"] = module
    spec.loader.exec_module(module)
    out = tmp_path / "row.json"
    assert module.main(["--small", "--steps", "2", "--out", str(out)]) == 0
    row = json.loads(out.read_text())
    assert row["plan"]["choices"]["offload_weights"] is True and row["peak_allocated_bytes"] is None and not row["fits"]
    assert row["losses"][-1] < row["losses"][0], row["losses"]


def test_memtrain_estimate_offload_weights_lowers_the_peak_by_all_but_two_blocks(capsys):
    figures = {}
    for flags in ([], ["--offload-weights"]):
        assert main(["estimate", "--model", "gpt-mini", "--offload-optimizer", *flags, "--json"]) == 0
        figures[bool(flags)] = json.loads(capsys.readouterr().out)
    plain, streamed = figures[False], figures[True]
    dropped = plain["peak_bytes"] - streamed["peak_bytes"]
    assert dropped == plain["parameter_bytes"] - streamed["parameter_bytes"] > 0, (dropped, plain, streamed)
    assert any(a.startswith("parameter offload:") for a in streamed["assumptions"])


def test_offload_weights_with_pure_bf16_is_one_error_naming_both():
    with pytest.raises(ConfigError, match="offload_weights=True with pure_bf16=True.*drop one of them"):
        Choices(offload_weights=True, pure_bf16=True)


def test_offload_weights_on_a_model_without_blocks_is_refused_naming_the_flag():
    from torch import nn

    from memtrain.config import TrainConfig
    from memtrain.run.replan import _unplanned

    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    config = TrainConfig(choices=Choices(offload_weights=True))
    with pytest.raises(ConfigError, match="no repeated blocks.*drop offload_weights=True"):
        _unplanned(model, config, 4, 1, "fp32", None)


def test_the_plan_says_streamed_weights_are_why_the_optimizer_is_offloaded():
    """--offload-weights alone fixes the offloaded optimizer (the weights stream from its master): the reason said
    "on a CPU an offload only copies within RAM", as if the plan had chosen it."""
    p = plan(tiny_gpt(), budget=None, seq_len=16, global_batch_size=2, device="cpu",
             choices=Choices(offload_weights=True))
    why = next(r for r in p.reasons if r.startswith("optimizer "))
    assert why.endswith("because: parameter offload streams the blocks' weights from its master in host RAM"), why
