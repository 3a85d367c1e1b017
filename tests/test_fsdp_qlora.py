"""FSDP-QLoRA (issue 31, item 2): ``--fsdp --quantize-base nf4 --lora R`` under torchrun. The packed 4-bit base is
sharded like any parameter (each rank stores half of every layer's codes), each layer's quantisation state stays
whole on every rank, the adapters train as one process trains them, and the end of the run writes them from the
gathered state: the base is never rebuilt unquantised. A sharded checkpoint resumes on the same ranks bit for bit
and on one process. Under FSDP2's host offload (``--offload-optimizer``) the adapters train alike."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

pytest.importorskip("bitsandbytes")
pytest.importorskip("peft")
from memtrain.quantize import fsdp_shards_4bit  # noqa: E402

pytestmark = pytest.mark.skipif(not fsdp_shards_4bit(), reason=(
    f"torch {torch.__version__}'s FSDP2 cannot shard uint8 weights (pytorch#177844; --fsdp is refused with "
    "--quantize-base there: tests/test_qlora.py)"))

ROOT = Path(__file__).resolve().parents[1]
# One thread a process: another thread count sums the matmuls in another order.
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
       "OMP_NUM_THREADS": "1"}
# 2 ranks against one process on the same examples: the gradients are summed in another order (fp32 rounding);
# measured 2.2e-8 on the tiny Llama's adapters after 4 steps.
ADAPTER_TOL = 1e-6


@pytest.fixture(scope="module")
def docs(tmp_path_factory) -> Path:
    from helpers import write_docs_jsonl

    return write_docs_jsonl(tmp_path_factory.mktemp("data") / "docs.jsonl")


def _flags(model: Path, data: Path, out: Path, steps: int = 4) -> list[str]:
    return ["train", "--hf-model", str(model), "--data", str(data), "--seq-len", "64", "--max-steps", str(steps),
            "--global-batch-size", "4", "--save-every", "2", "--lora", "8", "--quantize-base", "nf4",
            "--no-progress", "--out", str(out)]


def _run(flags: list[str], nproc: int) -> str:
    launcher = ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"] if nproc == 2 else []
    done = subprocess.run([sys.executable, *launcher, "-m", "memtrain", *flags], env=ENV, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout + done.stderr


def _worst(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> float:
    assert sorted(got) == sorted(want), sorted(set(got) ^ set(want))[:5]
    return max((got[k].float() - want[k].float()).abs().max().item() for k in want)


@pytest.mark.slow
def test_fsdp_qlora_shards_the_4_bit_base_trains_as_one_process_and_resumes(hf_model_dir, docs, tmp_path):
    fsdp, one = tmp_path / "fsdp", tmp_path / "one"
    _run([*_flags(hf_model_dir, docs, fsdp), "--fsdp"], nproc=2)
    _run(_flags(hf_model_dir, docs, one), nproc=1)

    # The adapters hf/ holds, as PeftModel.from_pretrained loads them: one process's within fp32 rounding.
    got, want = (load_file(f / "hf" / "adapter_model.safetensors") for f in (fsdp, one))
    assert (worst := _worst(got, want)) <= ADAPTER_TOL, worst
    assert max(v.abs().max().item() for k, v in want.items() if "lora_B" in k) > 100 * ADAPTER_TOL  # they trained
    assert json.loads((fsdp / "hf" / "adapter_config.json").read_text())["r"] == 8

    # model.safetensors: what one process writes, key for key, the base as its packed codes and their scales
    # (bitsandbytes' absmax and code book, gathered from no shard: every rank keeps them whole) bit for bit.
    got, want = (load_file(f / "model.safetensors") for f in (fsdp, one))
    base = [k for k in want if k.endswith("base_layer.weight")]
    assert base and all(got[k].dtype == torch.uint8 for k in base)
    frozen = [k for k in want if "lora_" not in k]
    assert all(torch.equal(got[k], want[k]) for k in frozen), [k for k in frozen if not torch.equal(got[k], want[k])]
    assert (worst := _worst(got, want)) <= ADAPTER_TOL, worst

    # Rank 0's measured peak against the plan's per-rank prediction (FSDP2's shift by formula on a one-process
    # trace): measured 1.77 MiB against 1.89 MiB predicted, the prediction 6.9% above the measurement (128 KiB of it
    # one process at the same micro-batch over-predicts too).
    report = json.loads((fsdp / "report.json").read_text())
    predicted, measured = report["prediction"]["peak_bytes"], report["measurement"]["peak_bytes"]
    assert 0.9 * predicted <= measured <= predicted, (measured, predicted)

    # Each rank's shard file holds half of every layer's packed codes: the base is sharded, not replicated.
    import torch.distributed.checkpoint as dcp

    checkpoint = fsdp / "checkpoints" / "step-0000004" / "shards"
    metadata = dcp.FileSystemReader(str(checkpoint)).read_metadata().state_dict_metadata
    codes = {k: v for k, v in metadata.items() if k.startswith("model.") and k.endswith("base_layer.weight")}
    assert len(codes) == len(base), (len(codes), len(base))
    # Their scales, which no shard carries, once: a resume reads them with the codes they scale.
    scales = [k for k in metadata if k.endswith("base_layer.weight.absmax")]
    assert len(scales) == len(base) and all(len(metadata[k].chunks) == 1 for k in scales), scales[:3]
    for key, meta in codes.items():
        assert meta.properties.dtype == torch.uint8, (key, meta.properties.dtype)
        rows = sorted(chunk.sizes[0] for chunk in meta.chunks)
        assert len(rows) == 2 and rows[1] - rows[0] <= 1 and sum(rows) == meta.size[0], (key, rows, meta.size)

    # Its checkpoint of step 2 resumed on the same 2 ranks: the uninterrupted run, bit for bit.
    resumed = tmp_path / "resumed"
    shutil.copytree(fsdp, resumed)
    shutil.rmtree(resumed / "checkpoints" / "step-0000004")
    log = _run([*_flags(hf_model_dir, docs, resumed), "--fsdp", "--resume"], nproc=2)
    assert "resumed from step 2" in log, log[-2000:]
    want = load_file(fsdp / "model.safetensors")
    got = load_file(resumed / "model.safetensors")
    assert all(torch.equal(got[k], want[k]) for k in want), [k for k in want if not torch.equal(got[k], want[k])]

    # FSDP2's host offload over the same base: each rank's shards (the packed codes too) in host RAM, stepped there.
    offloaded = tmp_path / "offloaded"
    _run([*_flags(hf_model_dir, docs, offloaded), "--fsdp", "--offload-optimizer"], nproc=2)
    worst = _worst(*(load_file(f / "hf" / "adapter_model.safetensors") for f in (offloaded, one)))
    assert worst <= ADAPTER_TOL, worst

    # And on one process, its shards read resharded.
    single = tmp_path / "single"
    shutil.copytree(fsdp, single)
    shutil.rmtree(single / "checkpoints" / "step-0000004")
    log = _run([*_flags(hf_model_dir, docs, single), "--nproc", "1", "--no-fsdp", "--resume"], nproc=1)
    assert "resumed from step 2" in log and "1 rank(s) now, 2 in the run" in log, log[-2000:]
    assert (worst := _worst(load_file(single / "model.safetensors"), want)) <= ADAPTER_TOL, worst
