"""The README's 24 GB story at 1/100 scale, on the simulated device: ``memtrain train`` of a Llama whose fp32 weights
are larger than the device trains inside the budget, and the measured (simulated) peak is the plan's prediction.

The story: a Llama-3-8B's fp32 weights (32 GB) on a 24 GB card; the plan keeps bf16 weights on the device and the
fp32 master with AdamW in host RAM. Here: a 5.0M-parameter Llama (19.1 MiB of fp32 weights) on a simulated device of
16 MiB (``MEMTRAIN_SIMULATED_DEVICE=16MiB``, which the ledger of ``memtrain.device`` enforces: placing more raises
``torch.OutOfMemoryError``). The run must never hold more on the device than its plan does: a model moved to the
device before the plan dies there (``test_the_whole_model_placed_before_the_plan_fails_the_check``).
"""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import code_windows, quick_run_config, run_cli, tiny_gpt
from safetensors.torch import load_file

import memtrain.cli.train as cli_train
from memtrain.choices import Choices, OptimizerChoice
from memtrain.device import accelerator, simulate
from memtrain.report import parse_bytes

pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parent.parent
CAPACITY = "16MiB"  # the simulated device, and the run's budget
LLAMA = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 256, "intermediate_size": 688,
         "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 4096,
         "max_position_embeddings": 256, "tie_word_embeddings": False, "use_cache": False, "rms_norm_eps": 1e-5}
FP32_WEIGHT_BYTES = 4 * 4_999_424  # LLAMA's parameters in fp32: 19.07 MiB, over the device's 16 MiB
STEPS = 3
TOLERANCE = 0.02  # measured peak against the plan's prediction


def _argv(config: Path, out: Path) -> list[str]:
    # --no-offload-weights: the story's row (bf16 weights on the device, fp32 master in host RAM); the plan chooses
    # the rest (optimizer placement, checkpointing, loss, micro-batch).
    return ["train", "--hf-config", str(config), "--seq-len", "64", "--global-batch-size", "4", "--budget", CAPACITY,
            "--precision", "bf16-mixed", "--no-offload-weights", "--max-steps", str(STEPS), "--out", str(out),
            "--no-progress", "--quiet"]


@pytest.fixture
def llama_config(tmp_path: Path) -> Path:
    path = tmp_path / "llama.json"
    path.write_text(json.dumps(LLAMA))
    return path


def check_fits_as_planned(code: int, out: Path, log: str) -> dict[str, int]:
    """The story's check: exit 0; every step's simulated peak (metrics.jsonl) within the budget and within
    ``TOLERANCE`` of the plan's predicted peak, as is report.json's measurement; the device held bf16 weights, not
    the fp32 ones. Returns the figures."""
    assert code == 0, log[-3000:]
    budget = parse_bytes(CAPACITY)
    report = json.loads((out / "report.json").read_text())
    predicted = report["prediction"]["peak_bytes"]
    peaks = [json.loads(line)["peak_bytes"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(peaks) == STEPS and None not in peaks, f"no simulated peak reported per step: {peaks}"
    measured = report["measurement"]["measured_bytes"]
    figures = {"budget": budget, "predicted": predicted, "measured": measured, "highest": max(peaks)}
    assert max(peaks) <= budget, f"a step's peak is over the budget: {figures}, peaks {peaks}"
    for peak in [measured, *peaks]:
        assert abs(peak / predicted - 1) <= TOLERANCE, f"measured {peak} vs predicted {predicted}: {figures}"
    settings = report["plan"]["plan"]["choices"]
    assert settings["optimizer"]["placement"] == "offload-bf16-weights", settings  # the fp32 weights cannot be on the device
    return figures


def test_a_llama_whose_fp32_weights_exceed_the_device_trains_within_the_budget(llama_config, tmp_path):
    """The whole command under ``MEMTRAIN_SIMULATED_DEVICE`` (read at the first use of the seam: a process of its
    own, since the simulation then lasts to the process's end)."""
    assert FP32_WEIGHT_BYTES > parse_bytes(CAPACITY)
    out = tmp_path / "run"
    env = {**os.environ, "MEMTRAIN_SIMULATED_DEVICE": CAPACITY, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-m", "memtrain", *_argv(llama_config, out)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    figures = check_fits_as_planned(proc.returncode, out, proc.stdout + proc.stderr)
    print(f"simulated {CAPACITY}: {figures}")


def test_the_whole_model_placed_before_the_plan_fails_the_check(llama_config, tmp_path, capsys, monkeypatch):
    """Fault injection: the fix patched away (the built model placed whole on the device before any plan, as
    ``model.to(device)`` did) runs out of the simulated device's memory at that placement, and the check fails."""
    build = cli_train.build_language_model

    def build_then_place(args, device):
        model, seq_len = build(args, device)
        return accelerator(device).place(model), seq_len

    monkeypatch.setattr(cli_train, "build_language_model", build_then_place)
    out = tmp_path / "run"
    with simulate(CAPACITY):
        code, _, log = run_cli(_argv(llama_config, out), capsys)
    assert "simulated device out of memory" in log, log[-2000:]
    with pytest.raises(AssertionError):
        check_fits_as_planned(code, out, log)


# -- apply_plan's placement, part by part ------------------------------------------------------------------------
@pytest.mark.parametrize("optimizer, streamed, pure", [
    ("offload-bf16-weights", False, False),  # bf16 weights on the device, the fp32 master from the host weights
    ("offload", True, False),  # the blocks' weights streamed: never on the device at rest
    ("offload", False, True),  # pure bf16: cast on the host, placed once
    ("device", False, False),  # fp32 weights and AdamW on the device: placed once
])
def test_apply_plan_places_no_more_than_the_plan_holds(optimizer, streamed, pure):
    """A model built on the host, applied on the simulated device: the device's peak during apply_plan is what
    stays there (no transient fp32 copy of weights the plan keeps in bf16, no streamed block), and the offloaded
    optimizer's fp32 masters hold the host weights' full digits."""
    from memtrain.planner import PlanSettings, apply_plan
    from memtrain.planner.apply import streamed_params

    model = tiny_gpt(4, seed=0)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    settings = PlanSettings(micro_batch_size=2, accumulation=1, blocks=("recompute",) * 4, flavor="full",
                            chunked_loss=False, optimizer=optimizer, distribution="none", compile=False,
                            precision="bf16-mixed", pure_bf16=pure, offload_weights=streamed)
    with simulate("8MiB") as acc:
        run = apply_plan(model, settings, lr=1e-3)
        left = {id(p) for p in streamed_params(model, list(run.blocks))} if streamed else set()
        state = [p for p in model.parameters() if id(p) not in left] + list(model.buffers())
        held = sum(-(-t.untyped_storage().nbytes() // 512) * 512 for t in {t.untyped_storage()._cdata: t
                                                                            for t in state}.values())
        # The streamer may make each block weight's device tensor before emptying it: one weight at a time, at most.
        largest = max((p.numel() * p.element_size() for p in model.parameters() if id(p) in left), default=0)
        assert acc.memory_allocated() == held and held <= acc.max_memory_allocated() <= held + largest, (
            acc.memory_allocated(), acc.max_memory_allocated(), held, largest)
        dtypes = {p.dtype for p in state if isinstance(p, torch.nn.Parameter)}
        assert dtypes == ({torch.bfloat16} if optimizer == "offload-bf16-weights" or pure else {torch.float32})
        if optimizer != "device" and not pure:
            masters = {s.key: s.master for s in run.optimizer.slots}
            assert all(torch.equal(masters[n], before[n]) for n in masters), "a master lost the host weights' digits"
        if hasattr(run.optimizer, "close"):
            run.optimizer.close()


def test_a_model_placed_whole_before_apply_plan_peaks_over_what_the_plan_holds():
    """Fault injection for the check above: the fp32 model placed whole first (what ``model.to(device)`` did)
    holds its fp32 weights on the device until the offloaded optimizer casts them: the peak is over the plan's."""
    from memtrain.planner import PlanSettings, apply_plan

    model = tiny_gpt(4, seed=0)
    settings = PlanSettings(micro_batch_size=2, accumulation=1, blocks=("recompute",) * 4, flavor="full",
                            chunked_loss=False, optimizer="offload-bf16-weights", distribution="none",
                            compile=False, precision="bf16-mixed")
    with simulate("8MiB") as acc:
        acc.place(model)
        run = apply_plan(model, settings, lr=1e-3)
        fp32 = sum(p.numel() * 4 for p in model.parameters())
        assert acc.max_memory_allocated() >= fp32 > acc.memory_allocated(), (acc.max_memory_allocated(), fp32)
        run.optimizer.close()


# -- resume on the simulated device ------------------------------------------------------------------------------
def _gpt_run(out: Path, *, max_steps: int, resume: bool = False, stop_after: int | None = None) -> None:
    """The built-in GPT with dropout on the simulated device, its optimizer offloaded (masters and state in host
    RAM), checkpointed every step; ``stop_after``: the process dies right after that step's checkpoint."""
    model = tiny_gpt(seq_len=32, dropout=0.1, seed=0)
    config = quick_run_config(out, max_steps=max_steps, global_batch_size=4, save_every=1, resume=resume,
                              precision="bf16-mixed", budget="8MiB",
                              choices=Choices(optimizer=OptimizerChoice(placement="offload")))
    loop = importlib.import_module("memtrain.train")  # the module: memtrain.train is the function
    save = loop.save_run_state

    def save_then_die(checkpoints, step, *args, **kwargs):
        save(checkpoints, step, *args, **kwargs)
        if step == stop_after:
            raise KeyboardInterrupt("killed")  # no _finish: no model.safetensors, as after kill -9

    with simulate("8MiB"), pytest.MonkeyPatch.context() as patch:
        patch.setattr(loop, "save_run_state", save_then_die)
        loop.train(model, code_windows(32), config)


def test_a_resumed_run_on_the_simulated_device_continues_as_the_unbroken_one(tmp_path):
    """Save and restore through the seam (the generators, the offloaded optimizer's host state, the plan placed
    again): a run stopped after step 1 and resumed ends with the unbroken run's weights, dropout masks included."""
    straight, broken = tmp_path / "straight", tmp_path / "broken"
    _gpt_run(straight, max_steps=3)
    with pytest.raises(KeyboardInterrupt):
        _gpt_run(broken, max_steps=3, stop_after=1)
    assert not (broken / "model.safetensors").exists()
    _gpt_run(broken, max_steps=3, resume=True)
    a, b = load_file(straight / "model.safetensors"), load_file(broken / "model.safetensors")
    different = {k: (a[k] - b[k]).abs().max().item() for k in a if not torch.equal(a[k], b[k])}
    assert not different, f"max |dw| per weight after a resume on the simulated device: {different}"
    peaks = [json.loads(line)["peak_bytes"] for line in (broken / "metrics.jsonl").read_text().splitlines()]
    assert len(peaks) == 3 and None not in peaks and max(peaks) <= parse_bytes("8MiB"), peaks
