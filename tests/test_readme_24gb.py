"""The README's "Fit an 8B on a 24 GB GPU" section: each `memtrain plan` command it shows, run as written, prints the
figures of its row in the section's tables (predicted peak, host RAM, tokens/s), and the set-up the row names."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from helpers import FIGURES_TORCH, THIS_TORCH, saved_settings

from memtrain.cli import main

ROOT = Path(__file__).resolve().parent.parent
SECTION = re.search(r"\n## Fit an 8B on a 24 GB GPU\n(.*?)(?=\n## )", (ROOT / "README.md").read_text(), re.S).group(1)
COMMANDS = [line for block in re.findall(r"```sh\n(.*?)```", SECTION, re.S) for line in block.splitlines()
            if line.startswith("memtrain plan ")]
ROWS = [[cell.strip() for cell in line.strip("|").split("|")] for line in SECTION.splitlines()
        if line.startswith("| ") and not line.startswith("| set-up")]


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB"


def test_the_section_has_one_row_per_command():
    assert len(COMMANDS) == len(ROWS) == 8, (COMMANDS, ROWS)


@pytest.mark.slow
@pytest.mark.skipif(not hasattr(F, "linear_cross_entropy"), reason=(
    f"the section's figures are planned on torch >= 2.13, and torch {torch.__version__} has no F.linear_cross_entropy: "
    "its chunked loss is memtrain's kernel, which keeps other bytes (the README says so)"))
@pytest.mark.parametrize("index", range(len(COMMANDS)))
def test_each_plan_of_the_section_prints_its_rows_figures(index, capsys, monkeypatch):
    """About 15-30 s a plan on two cores (the 70B: a minute or two): every block traced at 2048 or 4096 tokens. The
    figures are torch 2.13's, as the plan identity's are."""
    monkeypatch.chdir(ROOT)  # the commands name examples/*.json
    argv = shlex.split(COMMANDS[index])[1:]
    code = main([*argv, "--json"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    p = json.loads(captured.out)
    _, budget, peak, host, tokens, chose = ROWS[index]
    assert f"--budget {budget.replace(' ', '')}" in COMMANDS[index], (budget, COMMANDS[index])
    if THIS_TORCH == FIGURES_TORCH:
        assert (peak, host, tokens) == (_gib(p["peak_bytes"]), _gib(p["host_bytes"]), f"{p['tokens_per_s']:,.0f}"), p
    else:  # another torch traces other aten ops: other figures (tests/test_plan_identity.py), within the budget
        assert p["peak_bytes"] <= p["usable_bytes"], p
    s = saved_settings(p["plan"])
    assert s.pure_bf16 == ("pure bf16" in chose) and s.offload_weights == ("weights streamed" in chose), s
    assert f"{s.micro_batch_size} x {s.accumulation}" in chose and f"{s.state_precision} moments" in chose, s
    if s.offload_weights:  # the 13B and the 70B: their weights alone do not fit the device
        assert any("because: the weights on the device would peak at" in r for r in p["reasons"]), p["reasons"]
