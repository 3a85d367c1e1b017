"""The planner's answers do not move when its code is made faster: each plan below, run as ``memtrain plan ...
--json``, equals the figures saved in ``tests/data/plan_identity.json`` exactly (the chosen settings, its predicted
peak, host RAM, step time and tokens/s, the bytes over the host link, the reasons, and every runner-up's settings and
figures), and every candidate it composed (millions for the 70B) has the same predictions bit for bit (a digest of
each table of candidates).

The plans are pure functions of the model's config and the GPU table (``--gpu``: no probe of this machine) and of
the installed torch's minor version, so the floats are compared exactly on the torch they were saved with (JSON
writes a float as its shortest round-tripping repr). Another torch traces other aten ops, which the cost model counts:
torch 2.11 has no F.linear_cross_entropy (a chunked loss takes memtrain's kernel) and its checkpoint dispatches more
ops in the recompute; torch 2.14's F.linear_cross_entropy traces to other bytes than 2.13's.

Regenerate the saved figures (only for a change that is meant to move a plan, saying so in its commit; on the torch
of ``FIGURES_TORCH``, or change it with all of them regenerated):
``PYTHONPATH=. python tests/test_plan_identity.py --write [NAME ...]``.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import shlex
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from helpers import FIGURES_TORCH, THIS_TORCH

ROOT = Path(__file__).resolve().parent.parent
SAVED = ROOT / "tests" / "data" / "plan_identity.json"
OTHER_TORCH = pytest.mark.skipif(THIS_TORCH != FIGURES_TORCH, reason=(
    f"the saved figures are torch {FIGURES_TORCH}'s and this is torch {torch.__version__}, which traces other aten ops "
    "(the cost model counts them): its plans are other bit-exact figures"))
_8B = "--hf-config examples/llama3-8b.json --seq-len 2048 --global-batch-size 16 --gpu 4090"
# name -> the command (the README's "Fit an 8B on a 24 GB GPU" rows and the 1.1B Llama of docs/design.md's targets)
PLANS = {
    "1.1b-h200-24gib": "--hf-config examples/tinyllama-1.1b.json --seq-len 2048 --global-batch-size 16 "
                       "--budget 24GiB --gpu H200",
    "1.1b-h200-8gib": "--hf-config examples/tinyllama-1.1b.json --seq-len 2048 --global-batch-size 16 "
                      "--budget 8GiB --gpu H200 --host-budget 64GiB",
    "1.1b-h200-2-ranks": "--hf-config examples/tinyllama-1.1b.json --seq-len 2048 --global-batch-size 16 "
                         "--budget 12GiB --gpu H200 --host-budget 128GiB --nproc 2",  # DDP and FSDP2
    "8b-full": f"{_8B} --budget 24GiB --host-budget 96GiB",
    "8b-pure-bf16": f"{_8B} --budget 24GiB --host-budget 64GiB --pure-bf16 --compile",
    "8b-lora": f"{_8B} --budget 24GiB --host-budget 64GiB --lora 16",
    "8b-qlora": f"{_8B} --budget 12GiB --host-budget 64GiB --lora 16 --quantize-base nf4",
    "13b": "--hf-config examples/llama2-13b.json --seq-len 2048 --global-batch-size 16 --gpu 4090 --budget 24GiB "
           "--host-budget 256GiB",
    "70b": "--hf-config examples/llama3-70b.json --seq-len 4096 --global-batch-size 16 --gpu h100 --budget 80GiB "
           "--host-budget 1TiB",
}
# The plans the CI suite runs, a few seconds each: between them every part of the cost model (offloaded blocks and
# their stall, the optimizer on the host, DDP and FSDP2, parameter offload: the 70B streams its weights) and the
# largest table (the 70B's 1.8 million candidates). The rest (LoRA's, QLoRA's, pure bf16's, the 13B's:
# tests/test_readme_24gb.py runs them too, to the README's rounding) run with MEMTRAIN_PLAN_IDENTITY_ALL=1.
FAST = ("1.1b-h200-24gib", "1.1b-h200-8gib", "1.1b-h200-2-ranks", "8b-full", "70b")
ALL = bool(os.environ.get("MEMTRAIN_PLAN_IDENTITY_ALL"))


def _trimmed_candidate(c: dict[str, Any]) -> dict[str, Any]:
    return {k: c[k] for k in ("settings", "peak_bytes", "host_bytes", "step_seconds", "tokens_per_s", "verified",
                              "lost_because", "host_link")}


def trimmed(p: dict[str, Any]) -> dict[str, Any]:
    """The figures a plan is judged by: no timing of the planner itself, no device profile or full report."""
    out = {k: p[k] for k in ("plan", "peak_bytes", "host_bytes", "activation_bytes", "step_seconds", "tokens_per_s",
                             "host_link", "reasons", "assumptions", "tables")}
    out["candidates"] = [_trimmed_candidate(c) for c in p["candidates"]]
    return out


def table_digest(table: Any) -> str:
    """A digest of every composed candidate of a ``CandidateTable``, in its order: each row's set-up, offloaded
    and recomputed blocks, and predicted peak, host bytes and seconds, bit for bit."""
    digest = hashlib.sha256(repr(table.configs).encode())
    for column in (table.config, table.offload, table.recompute, table.peak, table.host, table.seconds):
        digest.update(str(column.dtype).encode() + np.ascontiguousarray(column).tobytes())
    return digest.hexdigest()


def in_force(command: str) -> dict[str, Any]:
    """``memtrain plan COMMAND --json`` in this process (from the checkout: the commands name examples/), with
    ``tables``: the digest of each table of candidates the plan composed (the search's, the pure bf16 hint's)."""
    from memtrain.cli import main
    from memtrain.planner.cost import CandidateTable

    out, cwd, tables = io.StringIO(), os.getcwd(), []
    finish = CandidateTable.finish

    def recorded(table: Any) -> None:
        finish(table)
        tables.append(table_digest(table))

    os.chdir(ROOT)
    CandidateTable.finish = recorded
    try:
        with contextlib.redirect_stdout(out):
            code = main(["plan", *shlex.split(command), "--json"])
    finally:
        CandidateTable.finish = finish
        os.chdir(cwd)
    assert code == 0, out.getvalue()
    return {**json.loads(out.getvalue()), "tables": tables}


def _saved() -> dict[str, Any]:
    return json.loads(SAVED.read_text())


def _check(name: str) -> None:
    expected = _saved()[name]
    assert expected["command"] == PLANS[name], (expected["command"], PLANS[name])
    got = trimmed(in_force(PLANS[name]))
    for key in expected["plan"]:
        assert got[key] == expected["plan"][key], f"{name}: {key}: expected {expected['plan'][key]!r}, got {got[key]!r}"
    assert got == expected["plan"]


@OTHER_TORCH
@pytest.mark.parametrize("name", FAST)
def test_plan_is_unchanged(name):
    _check(name)


@pytest.mark.slow
@OTHER_TORCH
@pytest.mark.skipif(not ALL, reason="set MEMTRAIN_PLAN_IDENTITY_ALL=1 to compare every saved plan")
@pytest.mark.parametrize("name", [n for n in PLANS if n not in FAST])
def test_large_plan_is_unchanged(name):
    _check(name)


def test_every_plan_has_saved_figures():
    assert sorted(_saved()) == sorted(PLANS)


if __name__ == "__main__":  # PYTHONPATH=. python tests/test_plan_identity.py --write [NAME ...]
    if sys.argv[1:2] != ["--write"]:
        sys.exit(__doc__)
    if THIS_TORCH != FIGURES_TORCH:
        sys.exit(f"The saved figures are torch {FIGURES_TORCH}'s and this is torch {torch.__version__}. To resolve this "
                 f"error, regenerate them on torch {FIGURES_TORCH}, or set FIGURES_TORCH and regenerate all of them.")
    names = sys.argv[2:] or list(PLANS)
    saved = _saved() if SAVED.exists() else {}
    for name in names:
        print(f"planning {name}: memtrain plan {PLANS[name]}", file=sys.stderr)
        saved[name] = {"command": PLANS[name], "plan": trimmed(in_force(PLANS[name]))}
        SAVED.parent.mkdir(exist_ok=True)
        SAVED.write_text(json.dumps(saved, indent=1, sort_keys=True) + "\n")
