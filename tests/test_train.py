"""train(): resume after SIGKILL bit for bit, corrupt checkpoints, SIGTERM, out-of-memory retry and re-plans,
torchrun. TrainConfig's checks are tests/test_config.py's."""

from __future__ import annotations

import importlib
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from helpers import tiny_gpt
from safetensors.torch import load_file

from memtrain import ConfigError, TrainConfig, train
from memtrain.choices import Choices, OptimizerChoice
from memtrain.data import split_windows, text_file_tokens
from memtrain.models import GPT, GPTConfig
from memtrain.run import RunCheckpoints, RunWriteError

ROOT = Path(__file__).resolve().parent.parent
TEXT = (b"def add(a, b):\n    return a + b\n\nclass Point:\n    x: int = 0\n    y: int = 0\n\n" * 300)


@pytest.fixture(scope="module")
def text_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("data") / "text.txt"
    path.write_bytes(TEXT)
    return path


# The interrupted runs' length: long enough that a signal sent after a few steps lands with steps still to run (at
# 8 steps a tiny model could finish between two polls of the test).
RUN_STEPS = 40


def cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "memtrain", "train", "--model", "gpt-tiny", "--seq-len", "32", "--no-progress",
            "--lr", "1e-2", *args]


def weights(run: Path) -> dict[str, torch.Tensor]:
    return load_file(run / "model.safetensors")


def assert_same_weights(a: Path, b: Path, atol: float = 0.0) -> None:
    wa, wb = weights(a), weights(b)
    assert wa.keys() == wb.keys()
    for name in wa:
        diff = (wa[name] - wb[name]).abs().max().item()
        assert diff <= atol, f"{name}: max abs diff {diff:.3e} > {atol}"


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, text_file) -> Path:
    out = tmp_path_factory.mktemp("runs") / "full"
    subprocess.run(cli("--data", str(text_file), "--max-steps", str(RUN_STEPS), "--micro-batch-size", "2",
                       "--global-batch-size", "4", "--out", str(out)), check=True, timeout=300, cwd=ROOT)
    return out


def wait_for(predicate, timeout: float = 240.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out waiting for the run"
        time.sleep(0.05)


def test_sigkill_then_resume_is_bit_identical(tmp_path, text_file, uninterrupted):
    out = tmp_path / "killed"
    args = ("--data", str(text_file), "--max-steps", str(RUN_STEPS), "--micro-batch-size", "2",
            "--global-batch-size", "4", "--out", str(out))
    proc = subprocess.Popen(cli(*args, "--save-every", "1"), cwd=ROOT, stderr=subprocess.DEVNULL)
    try:
        wait_for(lambda: len(RunCheckpoints(out).paths()) >= 1 and RunCheckpoints(out).paths()[0].name >= "step-0000003")
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.wait(timeout=60)
    assert proc.returncode == -signal.SIGKILL
    assert not (out / "model.safetensors").exists(), "the run was meant to die before its end"
    done = subprocess.run(cli(*args, "--resume", "--save-every", "1"), cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    assert "resumed from step" in done.stderr
    assert_same_weights(out, uninterrupted)
    steps = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(1, RUN_STEPS + 1)), steps


def test_corrupt_latest_checkpoint_falls_back_to_the_previous_one(tmp_path, text_file, uninterrupted):
    out = tmp_path / "corrupt"
    args = ("--data", str(text_file), "--micro-batch-size", "2", "--global-batch-size", "4", "--out", str(out))
    # Stop after a few steps the honest way: the run interrupted by SIGTERM, with a checkpoint after every step.
    proc = subprocess.Popen(cli(*args, "--max-steps", str(RUN_STEPS), "--save-every", "1"), cwd=ROOT,
                            stderr=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    wait_for(lambda: (out / "metrics.jsonl").exists() and len((out / "metrics.jsonl").read_text().splitlines()) >= 4)
    proc.send_signal(signal.SIGTERM)
    said, err = proc.communicate(timeout=120)
    assert proc.returncode == 143, err  # stopped, not finished: `memtrain train ... && upload` must not go on
    assert "SIGTERM received" in err
    newest = RunCheckpoints(out).paths()[0]
    data = (newest / "tensors.safetensors").read_bytes()
    (newest / "tensors.safetensors").write_bytes(data[: len(data) // 2])  # truncated by a crash mid-copy
    # As the SIGTERM message says: the folder alone is enough, the run's flags come from its config.json.
    assert f"continue with: memtrain train --out {out} --resume" in said
    done = subprocess.run([sys.executable, "-m", "memtrain", "train", "--out", str(out), "--resume"], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "skipped a damaged checkpoint" in done.stderr and newest.name in done.stderr
    assert_same_weights(out, uninterrupted)


def test_a_good_checkpoint_is_never_replaced_by_a_failed_write(tmp_path, monkeypatch):
    checkpoints = RunCheckpoints(tmp_path, keep=2)
    checkpoints.save(1, {"w": torch.ones(3)})

    def broken(*args, **kwargs):
        raise OSError("disk full")

    import safetensors.torch

    monkeypatch.setattr(safetensors.torch, "save_file", broken)
    with pytest.raises(RunWriteError, match="disk full"):
        checkpoints.save(1, {"w": torch.zeros(3)})
    step, state, skipped = checkpoints.load_latest()
    assert step == 1 and state["w"].tolist() == [1.0, 1.0, 1.0] and skipped == []
    assert [p.name for p in (tmp_path / "checkpoints").iterdir()] == ["step-0000001"]


def _tiny_data(text_file: Path):
    return split_windows(text_file_tokens(text_file), 32)


def _tiny_model() -> GPT:
    return tiny_gpt(seq_len=32, seed=0)


def test_out_of_memory_re_plans_with_the_shortfall_and_keeps_the_data_order(tmp_path, text_file, monkeypatch,
                                                                             capsys):
    """An out-of-memory step is planned again with what the estimate missed folded in: each new plan predicts
    a smaller peak than the one that failed. With checkpointing and the loss fixed, only the micro-batch can
    shrink (8 -> 4 -> 2 here), and the run ends with the weights of a run at micro-batch 2 (bit for bit: the same
    examples per step, the same order)."""
    train_module = importlib.import_module("memtrain.run.step")  # where the step calls the loss

    real_loss = train_module.language_model_loss
    failures = []

    def loss_that_runs_out_of_memory(model, x, y, positions=None, **kwargs):
        if x.shape[0] > 2:  # pretend a micro-batch above 2 does not fit
            failures.append(x.shape[0])
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 100.00 KiB (injected)")
        return real_loss(model, x, y, positions, **kwargs)

    monkeypatch.setattr(train_module, "language_model_loss", loss_that_runs_out_of_memory)
    fixed = {"choices": Choices(checkpointing="none", chunked_loss=False,
                                optimizer=OptimizerChoice(state_precision="fp32")), "precision": "fp32"}
    config = TrainConfig(max_steps=4, micro_batch_size=8, global_batch_size=8, lr=1e-2, out_dir=str(tmp_path / "oom"),
                         progress=False, eval_every=100, **fixed)
    result = train(_tiny_model(), _tiny_data(text_file), config)
    assert failures == [8, 4], failures
    assert result.micro_batch_size == 2 and result.accumulation == 4 and result.replans == 2
    err = capsys.readouterr().err
    assert "out of memory at step 1 with micro-batch 8: re-planned after out of memory at step 1" in err, err
    replans = json.loads((tmp_path / "oom" / "report.json").read_text())["replans"]
    for r in replans:  # the allocation that failed (100 KiB) at least: the next plan's peak is that much lower
        assert r["estimated_peak_after"] <= r["estimated_peak_before"] - 100 * 2**10, r

    monkeypatch.setattr(train_module, "language_model_loss", real_loss)
    reference = TrainConfig(max_steps=4, micro_batch_size=2, global_batch_size=8, lr=1e-2,
                            out_dir=str(tmp_path / "small"), progress=False, eval_every=100, **fixed)
    train(_tiny_model(), _tiny_data(text_file), reference)
    assert_same_weights(tmp_path / "oom", tmp_path / "small")


def test_out_of_memory_re_plans_with_every_technique_open(tmp_path, text_file, monkeypatch):
    """With nothing fixed the re-plan may recompute blocks instead of shrinking the micro-batch; whatever it
    picks predicts a lower peak, and the run trains on."""
    train_module = importlib.import_module("memtrain.run.step")  # where the step calls the loss
    real_loss = train_module.language_model_loss
    calls = []

    def first_step_runs_out(model, x, y, positions=None, **kwargs):
        calls.append(x.shape[0])
        if len(calls) == 1:
            raise torch.OutOfMemoryError("CUDA out of memory (injected)")
        return real_loss(model, x, y, positions, **kwargs)

    monkeypatch.setattr(train_module, "language_model_loss", first_step_runs_out)
    result = train(_tiny_model(), _tiny_data(text_file), TrainConfig(max_steps=2, global_batch_size=8, progress=False,
                                                                     out_dir=str(tmp_path / "open"), sample_bytes=0))
    assert result.replans == 1 and result.steps == 2
    (r,) = json.loads((tmp_path / "open" / "report.json").read_text())["replans"]
    assert r["estimated_peak_after"] < r["estimated_peak_before"], r


def test_out_of_memory_with_nothing_left_to_shrink_is_a_clear_error(tmp_path, text_file, monkeypatch):
    train_module = importlib.import_module("memtrain.run.step")  # where the step calls the loss

    def always_oom(model, x, y, positions=None, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory (injected)")

    monkeypatch.setattr(train_module, "language_model_loss", always_oom)
    from memtrain import MemtrainError

    config = TrainConfig(max_steps=1, micro_batch_size=1, progress=False, out_dir=str(tmp_path / "x"),
                         choices=Choices(checkpointing="all", chunked_loss=True,
                                         optimizer=OptimizerChoice(state_precision="fp32")))
    with pytest.raises(MemtrainError, match="out of memory at step 1.*no plan fits"):
        train(_tiny_model(), _tiny_data(text_file), config)
    assert not (tmp_path / "x" / "model.safetensors").exists()


def test_out_of_memory_after_parameters_stepped_in_backward_is_not_retried(tmp_path, text_file, monkeypatch):
    """With step_in_backward the first parameters step during the last backward: an out-of-memory error after
    them cannot be retried (they would step twice, their AdamW counters one ahead), so it is one clear error."""
    from memtrain import MemtrainError

    train_module = importlib.import_module("memtrain.train")
    real_apply, fired = train_module.apply_plan, []

    def apply_then_fail_in_backward(*args, **kwargs):
        run = real_apply(*args, **kwargs)

        def hook(p):  # registered after the optimizer's: its parameter has stepped when this runs
            if not fired:
                fired.append(p.shape)
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.00 KiB (injected in backward)")
        for p in run.model.parameters():
            p.register_post_accumulate_grad_hook(hook)
        return run

    monkeypatch.setattr(train_module, "apply_plan", apply_then_fail_in_backward)
    config = TrainConfig(max_steps=3, global_batch_size=8, lr=1e-2, progress=False, precision="fp32",
                         grad_clip=None, sample_bytes=0, out_dir=str(tmp_path / "sib"),
                         choices=Choices(chunked_loss=False,
                                         optimizer=OptimizerChoice(step_in_backward=True, state_precision="fp32")))
    with pytest.raises(MemtrainError, match="after some parameters had already been updated"):
        train(_tiny_model(), _tiny_data(text_file), config)
    assert fired


def test_out_of_memory_before_the_optimizer_step_retries_with_an_fp16_scaler(tmp_path, text_file, monkeypatch):
    """The scaler has unscaled the window's gradients when the step fails: the retry's unscale_() must not find
    that record (torch raises 'unscale_() has already been called'), and the run trains on."""
    train_module = importlib.import_module("memtrain.train")
    real_apply = train_module.apply_plan

    def apply_then_fail_once_in_step(*args, **kwargs):
        run = real_apply(*args, **kwargs)
        real_step, fired = run.optimizer.step, []

        def step(*a, **k):
            if not fired:
                fired.append(1)
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.00 KiB (injected in step)")
            return real_step(*a, **k)
        run.optimizer.step = step
        return run

    monkeypatch.setattr(train_module, "apply_plan", apply_then_fail_once_in_step)
    config = TrainConfig(max_steps=2, global_batch_size=8, progress=False, precision="fp16-mixed", sample_bytes=0,
                         out_dir=str(tmp_path / "fp16"),
                         choices=Choices(optimizer=OptimizerChoice(placement="device", state_precision="fp32",
                                                                   step_in_backward=False)))
    result = train(_tiny_model(), _tiny_data(text_file), config)
    assert result.steps == 2 and result.replans == 1


def test_a_resume_refuses_another_optimizer(tmp_path, text_file):
    from memtrain import ConfigError

    base = dict(global_batch_size=8, progress=False, precision="fp32", sample_bytes=0, out_dir=str(tmp_path / "r"))
    on_device, offloaded = (Choices(optimizer=OptimizerChoice(placement=p)) for p in ("device", "offload"))
    train(_tiny_model(), _tiny_data(text_file), TrainConfig(max_steps=2, choices=on_device, **base))
    with pytest.raises(ConfigError, match="optimizer.placement='offload': the run's optimizer is device"):
        train(_tiny_model(), _tiny_data(text_file), TrainConfig(max_steps=3, resume=True, choices=offloaded,
                                                                  **base))


def test_accumulation_equals_the_large_batch(tmp_path, text_file):
    """fp32, no checkpointing: micro-batch 2 x 4 accumulation ends with the weights of micro-batch 8 (1e-5)."""
    runs = {}
    for micro in (2, 8):
        out = tmp_path / f"micro{micro}"
        config = TrainConfig(max_steps=4, micro_batch_size=micro, global_batch_size=8, lr=1e-2, precision="fp32",
                             choices=Choices(checkpointing="none"), out_dir=str(out), progress=False, sample_bytes=0)
        runs[micro] = train(_tiny_model(), _tiny_data(text_file), config)
    assert runs[2].accumulation == 4 and runs[8].accumulation == 1
    assert_same_weights(tmp_path / "micro2", tmp_path / "micro8", atol=1e-5)


def test_offloaded_optimizer_matches_device_adamw_with_accumulation_and_clipping(tmp_path, text_file):
    """Gradients streamed to the host, normalised over the window and clipped there: same weights (1e-6)."""
    runs = {}
    for offload in (False, True):
        out = tmp_path / f"offload{offload}"
        config = TrainConfig(max_steps=5, micro_batch_size=2, global_batch_size=6, lr=1e-2, grad_clip=0.05,
                             choices=Choices(optimizer=OptimizerChoice(placement="offload" if offload else "device")),
                             out_dir=str(out), progress=False, sample_bytes=0)
        runs[offload] = train(_tiny_model(), _tiny_data(text_file), config)
    norms = [json.loads(line)["grad_norm"] for line in (tmp_path / "offloadTrue" / "metrics.jsonl").read_text().splitlines()]
    assert min(norms) > 0.05, f"clipping must be active for this test to mean anything: norms {norms}"
    assert_same_weights(tmp_path / "offloadFalse", tmp_path / "offloadTrue", atol=1e-6)


def test_chunked_loss_keeps_fewer_bytes_for_the_same_weights(tmp_path, text_file):
    """With checkpointing on, train chunks the loss by default: the saved bytes fall, the weights stay within 1e-4
    after 3 AdamW steps at lr 1e-2 (torch's chunked linear cross-entropy sums in another order than the whole-logits
    loss, and Adam's normalisation amplifies such rounding where a gradient is near zero)."""
    runs = {}
    for chunked in (False, True):
        out = tmp_path / f"chunked{chunked}"
        config = TrainConfig(max_steps=3, micro_batch_size=8, lr=1e-2, precision="fp32",
                             choices=Choices(checkpointing="all", chunked_loss=chunked), out_dir=str(out),
                             progress=False, sample_bytes=0)
        model = _tiny_model()
        runs[chunked] = train(model, _tiny_data(text_file), config)
        assert (model.loss_chunk_tokens is not None) == chunked
    # gpt-tiny here: vocabulary 256 over width 32, so the fp32 log-softmax dwarfs the hidden states kept instead
    assert runs[True].activation_bytes < runs[False].activation_bytes / 2, (runs[True].activation_bytes,
                                                                            runs[False].activation_bytes)
    assert_same_weights(tmp_path / "chunkedFalse", tmp_path / "chunkedTrue", atol=1e-4)
    report = json.loads((tmp_path / "chunkedTrue" / "report.json").read_text())
    check = report["measurement"]  # the plan knows the loss is chunked: saved bytes on CPU within 5%
    assert abs(check["relative_error"]) < 0.05, check["log"]


def test_compiled_training_step_ends_where_eager_does(tmp_path, text_file):
    """--compile: checkpointing and the chunked loss inside one compiled graph (inductor on the CPU), the same
    weights as the eager run within 1e-4 after 3 AdamW steps (inductor fuses and reorders float arithmetic)."""
    import shutil

    from torch._dynamo.utils import counters

    if not any(shutil.which(cxx) for cxx in ("g++", "c++", "clang++")):
        pytest.skip("inductor needs a C++ compiler on the CPU (tests/test_compile.py covers compile without one)")
    torch._dynamo.reset()
    counters.clear()
    runs = {}
    for compiled in (False, True):
        out = tmp_path / f"compiled{compiled}"
        config = TrainConfig(max_steps=3, micro_batch_size=4, lr=1e-2, precision="fp32",
                             choices=Choices(checkpointing="all", compile=compiled), out_dir=str(out), progress=False,
                             sample_bytes=0)
        runs[compiled] = train(_tiny_model(), _tiny_data(text_file), config)
    assert counters["stats"]["unique_graphs"] >= 1 and not counters["graph_break"], (
        dict(counters["stats"]), dict(counters["graph_break"]))
    # The same blocks' inputs are kept; the compiled graph may keep a little less around them (fused ops).
    assert runs[True].activation_bytes <= runs[False].activation_bytes, (runs[True].activation_bytes,
                                                                         runs[False].activation_bytes)
    assert_same_weights(tmp_path / "compiledFalse", tmp_path / "compiledTrue", atol=1e-4)


@pytest.mark.slow
@pytest.mark.parametrize("fsdp", [False, True], ids=["ddp", "fsdp2"])
def test_torchrun_two_processes_match_one(tmp_path, text_file, fsdp):
    common = ["--data", str(text_file), "--max-steps", "3", "--micro-batch-size", "2", "--global-batch-size", "4",
              "--checkpointing", "all"]
    single = tmp_path / "single"
    subprocess.run(cli(*common, "--out", str(single)), check=True, timeout=300, cwd=ROOT)
    double = tmp_path / "double"
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    command = torchrun + cli(*common, "--out", str(double), *(["--fsdp"] if fsdp else []))[1:]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    assert ("FSDP2 over 2 ranks" if fsdp else "DDP over 2 ranks") in done.stderr
    assert_same_weights(single, double, atol=1e-5)


def test_config_file_and_validation_before_any_write(tmp_path, text_file):
    config = tmp_path / "run.toml"
    config.write_text(f'data = "{text_file}"\nmax-steps = 2\nmicro-batch-size = 2\nseq-len = 32\n'
                      'model = "gpt-tiny"\nno-progress = true\n')
    out = tmp_path / "from-toml"
    done = subprocess.run([sys.executable, "-m", "memtrain", "train", "--config", str(config), "--out", str(out),
                           "--json"], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["steps"] == 2
    before = {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()}
    bad = tmp_path / "bad.toml"
    bad.write_text('micro_batch_sise = 2\nmax-steps = "many"\nlr = -1\n')  # a typo: underscores are dashes
    done = subprocess.run([sys.executable, "-m", "memtrain", "train", "--config", str(bad), "--out", str(out)],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 2
    assert "3 problems" in done.stderr and "Did you mean 'micro-batch-size'" in done.stderr, done.stderr
    assert {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()} == before


def test_resume_without_checkpoint(tmp_path, text_file):
    with pytest.raises(ConfigError, match="does not exist, so there is no run to continue"):
        train(_tiny_model(), _tiny_data(text_file), TrainConfig(max_steps=1, resume=True, out_dir=str(tmp_path / "x"),
                                                                progress=False))
    assert not (tmp_path / "x").exists(), "a run that fails its checks must not create its folder"


def _snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture
def finished_run(tmp_path, text_file) -> Path:
    out = tmp_path / "done"
    train(_tiny_model(), _tiny_data(text_file), TrainConfig(max_steps=2, micro_batch_size=2, out_dir=str(out),
                                                            progress=False, sample_bytes=8))
    return out


def test_overwrite_that_fails_set_up_leaves_the_old_run_whole(finished_run, text_file):
    before = _snapshot(finished_run)
    config = TrainConfig(max_steps=1, micro_batch_size=2, out_dir=str(finished_run), overwrite=True, progress=False)
    with pytest.raises(ConfigError, match="fsdp=True needs several processes"):
        train(_tiny_model(), _tiny_data(text_file), replace(config, fsdp=True))
    assert _snapshot(finished_run) == before
    train(_tiny_model(), _tiny_data(text_file), config)  # a good --overwrite replaces every file of the old run
    assert [p.name for p in (finished_run / "checkpoints").iterdir()] == ["step-0000001"]
    assert json.loads((finished_run / "config.json").read_text())["train"]["max_steps"] == 1


def test_resume_refuses_another_run_and_a_finished_one(finished_run, text_file):
    before = _snapshot(finished_run)
    config = TrainConfig(max_steps=4, micro_batch_size=2, out_dir=str(finished_run), resume=True, progress=False)
    with pytest.raises(ConfigError) as info:
        train(_tiny_model(), _tiny_data(text_file), replace(config, seed=5, global_batch_size=4))
    assert len(info.value.problems) == 2 and "seed=0 in the run being resumed" in str(info.value), info.value
    with pytest.raises(ConfigError, match="already reached step 2"):
        train(_tiny_model(), _tiny_data(text_file), replace(config, max_steps=2))
    assert _snapshot(finished_run) == before
    result = train(_tiny_model(), _tiny_data(text_file), config)
    assert result.resumed_from == 2 and result.steps == 4
    assert json.loads((finished_run / "report.json").read_text())["measurement"]["relative_error"] is not None


# -- resume never silently changes the run (issue 13, items 17-19) ------------------------------------------
def test_resume_refuses_changed_run_defining_settings_naming_each(finished_run, text_file):
    """A changed lr used to be ignored (and written to config.json); now each such change is refused by name."""
    before = _snapshot(finished_run)
    config = TrainConfig(max_steps=4, micro_batch_size=2, out_dir=str(finished_run), resume=True, progress=False)
    with pytest.raises(ConfigError) as info:
        train(_tiny_model(), _tiny_data(text_file), replace(config, lr=0.5, weight_decay=0.0, grad_clip=None))
    problems = info.value.problems
    assert len(problems) == 3, problems
    assert any("lr=0.5 now but lr=0.003 in the run being resumed" in p for p in problems), problems
    assert any("weight_decay=0.0 now but weight_decay=0.1" in p for p in problems), problems
    assert any("grad_clip=None now but grad_clip=1.0" in p for p in problems), problems
    assert _snapshot(finished_run) == before


def test_resume_applies_safe_changes_with_a_logged_line(finished_run, text_file, capsys):
    config = TrainConfig(max_steps=4, micro_batch_size=1, global_batch_size=2, out_dir=str(finished_run),
                         resume=True, progress=False, eval_every=3, save_every=1, choices=Choices(checkpointing="none"))
    result = train(_tiny_model(), _tiny_data(text_file), config)
    err = capsys.readouterr().err
    for line in ("max_steps=4 applied (the run had max_steps=2)", "micro_batch_size=1 applied",
                 "eval_every=3 applied", "save_every=1 applied", "checkpointing='none' applied"):
        assert line in err, err
    assert result.steps == 4 and result.accumulation == 2
    saved = json.loads((finished_run / "config.json").read_text())["train"]
    assert saved["max_steps"] == 4 and saved["eval_every"] == 3, saved


def test_resume_refuses_other_data_of_the_same_size_and_another_model(finished_run, text_file, tmp_path):
    config = TrainConfig(max_steps=4, micro_batch_size=2, out_dir=str(finished_run), resume=True, progress=False)
    other = tmp_path / "other.txt"
    other.write_bytes(TEXT.replace(b"Point", b"Plane"))  # same length, other text
    with pytest.raises(ConfigError, match=r"the same \d+ examples, but other contents") as info:
        train(_tiny_model(), _tiny_data(other), config)
    assert "examples now" not in str(info.value)
    torch.manual_seed(0)
    wider = GPT(GPTConfig(seq_len=32, n_layer=3, n_head=2, n_embd=32))
    with pytest.raises(ConfigError, match="the model differs") as info:
        train(wider, _tiny_data(text_file), config)
    assert "parameter(s) only in this model (blocks.2." in str(info.value), info.value
    torch.manual_seed(0)
    with pytest.raises(ConfigError, match=r"28 of another shape \(wte.weight: \[256, 48\] now, \[256, 32\] then"):
        train(GPT(GPTConfig(seq_len=32, n_layer=2, n_head=2, n_embd=48)), _tiny_data(text_file), config)


def test_a_foreign_name_under_checkpoints_neither_crashes_a_run_nor_a_resume(finished_run, text_file):
    (finished_run / "checkpoints" / "step-abc").mkdir()
    (finished_run / "checkpoints" / "step-12x").write_text("not a checkpoint")
    config = TrainConfig(max_steps=4, micro_batch_size=2, out_dir=str(finished_run), resume=True, progress=False,
                         save_every=1)
    result = train(_tiny_model(), _tiny_data(text_file), config)
    assert result.steps == 4
    names = sorted(p.name for p in (finished_run / "checkpoints").iterdir())
    assert names == ["step-0000003", "step-0000004", "step-12x", "step-abc"], names


# -- one clear error, or a stated choice, instead of a traceback (item 22) ---------------------------------
def test_a_model_without_parameters_is_a_clear_error(tmp_path, text_file):
    with pytest.raises(ConfigError, match="has no parameters: there is nothing to train"):
        train(torch.nn.Identity(), _tiny_data(text_file), TrainConfig(max_steps=1, progress=False,
                                                                       out_dir=str(tmp_path / "x")))
    assert not (tmp_path / "x").exists()


class _FlatLM(torch.nn.Module):
    """A language model with no repeated blocks: nothing for auto-detection to checkpoint."""

    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(256, 16)
        self.head = torch.nn.Linear(16, 256)

    def forward(self, x):
        return self.head(self.emb(x))


def test_auto_trains_a_model_without_blocks_unchekpointed_and_says_why(tmp_path, text_file, capsys):
    result = train(_FlatLM(), _tiny_data(text_file), TrainConfig(max_steps=2, micro_batch_size=2, progress=False,
                                                                 sample_bytes=0, out_dir=str(tmp_path / "flat")))
    assert result.checkpointed_blocks == () and result.steps == 2
    assert "checkpointing off, because: auto found no repeated blocks in _FlatLM" in capsys.readouterr().err
    with pytest.raises(ConfigError, match="no repeated blocks found"):  # asked for explicitly: an error
        train(_FlatLM(), _tiny_data(text_file), TrainConfig(max_steps=1, choices=Choices(checkpointing="all"), progress=False))
    # parameter offload streams blocks, and this model has none: its rule says so
    with pytest.raises(ConfigError, match=r"^offload_weights=True: parameter offload streams the model's repeated "
                                          r"blocks one at a time, and auto found no repeated blocks .* drop offload_weights=True"):
        train(_FlatLM(), _tiny_data(text_file), TrainConfig(max_steps=1, choices=Choices(offload_weights=True),
                                                            progress=False))


# -- the schedule and the step's device waits (items 23, 7) ------------------------------------------------
def test_the_default_warm_up_lets_a_short_run_reach_its_learning_rate():
    from memtrain.schedule import default_warmup, lr_at

    for max_steps, warmup, finetuning in ((10, 1, False), (5, 0, False), (500, 50, False), (10_000, 50, False),
                                          (10, 1, True), (500, 15, True), (10_000, 300, True)):
        config = TrainConfig(max_steps=max_steps, lr=1e-3)
        assert default_warmup(config, finetuning)[0] == warmup
        config = TrainConfig(max_steps=max_steps, lr=1e-3, warmup_steps=warmup)
        assert max(lr_at(s, config) for s in range(max_steps)) == pytest.approx(1e-3), max_steps
    with pytest.raises(ConfigError, match="warmup_steps=20 is more than max_steps=10"):
        TrainConfig(max_steps=10, warmup_steps=20).validate()


def test_a_resume_keeps_the_runs_automatic_warm_up_when_max_steps_grows(tmp_path, text_file):
    out = tmp_path / "warm"
    train(_tiny_model(), _tiny_data(text_file), TrainConfig(max_steps=10, micro_batch_size=2, out_dir=str(out),
                                                            progress=False, sample_bytes=0, save_every=5))
    train(_tiny_model(), _tiny_data(text_file), TrainConfig(max_steps=20, micro_batch_size=2, out_dir=str(out),
                                                            progress=False, sample_bytes=0, resume=True))
    from memtrain.schedule import lr_at

    lrs = [json.loads(line)["lr"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    # Step 11 runs on the new schedule (it ends at step 20), with the run's warm-up of 1 step (from max_steps 10)
    # kept: not the old schedule's last rate, nor a new warm-up of min(50, 20 // 10) = 2 steps.
    expected = lr_at(10, TrainConfig(max_steps=20, warmup_steps=1, lr=3e-3))
    assert lrs[10] == pytest.approx(expected), lrs
    assert lrs[9] == pytest.approx(lr_at(9, TrainConfig(max_steps=10, warmup_steps=1, lr=3e-3))), lrs
    assert expected != pytest.approx(lr_at(10, TrainConfig(max_steps=20, lr=3e-3)))


def test_the_training_step_does_not_stall_the_device_queue_to_measure(tmp_path, text_file, monkeypatch):
    """The per-step meter used to synchronise twice per step; on an accelerator the step's only wait is its own, at
    its end. On the simulated device, every wait and peak reset is counted by who asks for it."""
    import sys

    from memtrain.device import SimulatedAccelerator, simulate

    calls = []

    def counted(name):
        def call(self, *args, **kwargs):
            calls.append((name, Path(sys._getframe(1).f_code.co_filename).name))
        return call

    monkeypatch.setattr(SimulatedAccelerator, "synchronize", counted("synchronize"))
    monkeypatch.setattr(SimulatedAccelerator, "reset_peak_memory_stats", counted("reset"))
    with simulate("64MiB"):
        train(_tiny_model(), _tiny_data(text_file), TrainConfig(max_steps=3, micro_batch_size=2, progress=False))
    # The step's own wait at its end and its peak reset (memtrain/run/step.py), the meter's reset (it reads the peak
    # without waiting).
    assert calls.count(("synchronize", "step.py")) == 3, calls
    assert not [c for c in calls if c[1] == "measure.py" and c[0] == "synchronize"], calls
    assert calls.count(("reset", "measure.py")) == 3 and calls.count(("reset", "step.py")) == 3, calls


def _rewrite_checkpoint(folder: Path, change) -> None:
    """Edits the newest checkpoint's meta.json with ``change(state)`` and writes its checksums again."""
    import hashlib

    newest = sorted((folder / "checkpoints").iterdir())[-1]
    meta = json.loads((newest / "meta.json").read_text())
    change(meta["state"])
    (newest / "meta.json").write_text(json.dumps(meta))
    (newest / "SHA256SUMS").write_text("".join(f"{hashlib.sha256((newest / n).read_bytes()).hexdigest()}  {n}\n"
                                               for n in ("meta.json", "tensors.safetensors")))


def test_a_resume_continues_on_the_plan_the_run_left_off_with(tmp_path, text_file, capsys):
    """The checkpoint's plan differs from a fresh one (as after a re-plan): with the same plan request the resume
    keeps it, and logs no setting as changed but the one it applies."""
    out = tmp_path / "left"
    choices = Choices(checkpointing="every:2", optimizer=OptimizerChoice(placement="device", state_precision="fp32"))
    base = dict(global_batch_size=4, out_dir=str(out), progress=False, sample_bytes=0, precision="fp32",
                choices=choices)
    train(_tiny_model(), _tiny_data(text_file), TrainConfig(max_steps=2, **base))

    def replanned(state):
        settings = state["extra"]["plan_settings"]
        assert settings["micro_batch_size"] != 1, settings
        state["extra"]["plan_settings"] = {**settings, "micro_batch_size": 1, "accumulation": 4}
    _rewrite_checkpoint(out, replanned)
    capsys.readouterr()
    result = train(_tiny_model(), _tiny_data(text_file), TrainConfig(max_steps=3, resume=True, **base))
    err = capsys.readouterr().err
    assert result.steps == 3 and result.micro_batch_size == 1 and result.accumulation == 4, result
    assert "memory settings changed" not in err, err
    assert [line for line in err.splitlines() if " applied (the run had" in line] == [
        "  resume: max_steps=3 applied (the run had max_steps=2) (the cosine schedule now ends there)"], err
    newest = sorted((out / "checkpoints").iterdir())[-1]
    saved = json.loads((newest / "meta.json").read_text())["state"]["extra"]["plan_request"]
    assert saved["choices"] == choices.to_dict(), saved


# -- fine-tuning defaults (issue 22) ---------------------------------------------------------------------------
def test_evaluation_spreads_its_examples_over_the_held_out_set(text_file):
    """The first held-out examples are one stretch of text (the built-in corpus's: the start of queue.py, whose
    loss stayed far below the training loss); the evaluated ones are spread evenly over the whole set."""
    from memtrain.precision import MixedPrecision
    from memtrain.train import evaluate

    class Recording(torch.utils.data.Dataset):
        def __init__(self, windows):
            self.windows, self.seen = windows, []

        def __len__(self):
            return len(self.windows)

        def __getitem__(self, i):
            self.seen.append(i)
            return self.windows[i]

    train_data, _ = _tiny_data(text_file)
    held = Recording(train_data)
    n = len(held)
    evaluate(_tiny_model(), held, TrainConfig(), torch.device("cpu"), MixedPrecision("fp32", "cpu"), 2, 4)
    assert sorted(held.seen) == [0, n // 4, n // 2, 3 * n // 4], (n, held.seen)


def test_a_resume_keeps_the_runs_automatic_lr_when_the_default_changes(tmp_path, text_file, monkeypatch, capsys):
    import memtrain.schedule

    out = tmp_path / "auto-lr"
    config = TrainConfig(max_steps=4, micro_batch_size=2, out_dir=str(out), progress=False, sample_bytes=0,
                         save_every=2, warmup_steps=1, lr_schedule="constant")
    train(_tiny_model(), _tiny_data(text_file), replace(config, max_steps=2))
    assert "lr 0.003, because: training from random weights" in capsys.readouterr().err
    monkeypatch.setattr(memtrain.schedule, "PRETRAINING_LR", 1e-3)  # a later version's default
    train(_tiny_model(), _tiny_data(text_file), replace(config, resume=True))
    lrs = [json.loads(line)["lr"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert lrs == pytest.approx([3e-3] * 4)
    with pytest.raises(ConfigError, match="lr=0.001 now but lr=0.003"):  # an explicit one is checked
        train(_tiny_model(), _tiny_data(text_file), replace(config, max_steps=6, resume=True, lr=1e-3))
