"""The metrics log: appended one line per step, never rewritten; cut back to the checkpoint on resume,
surviving a damaged line."""

from __future__ import annotations

import json
import os
from pathlib import Path

from helpers import code_windows, quick_run_config, tiny_gpt

from memtrain import train
from memtrain.models import GPT
from memtrain.run import MetricsLog


def _model() -> GPT:
    return tiny_gpt(seq_len=32, seed=0)



def test_metrics_are_appended_one_line_per_step_never_rewritten(tmp_path, monkeypatch):
    renamed = []
    real_replace = os.replace

    def spy(src, dst, *args, **kwargs):
        renamed.append(Path(dst).name)
        return real_replace(src, dst, *args, **kwargs)

    monkeypatch.setattr(os, "replace", spy)
    out = tmp_path / "appended"
    train(_model(), code_windows(), quick_run_config(out, max_steps=4, save_every=2))
    assert "metrics.jsonl" not in renamed, renamed  # rewritten whole, a 100k-step run would be quadratic
    steps = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 4]


def _log_with(path: Path, lines: list[bytes]) -> None:
    path.write_bytes(b"".join(lines))


def test_resume_cuts_the_log_to_the_checkpoint_and_survives_a_damaged_line(tmp_path):
    path = tmp_path / "metrics.jsonl"
    good = [json.dumps({"step": s, "loss": 1.0}).encode() + b"\n" for s in range(1, 6)]
    _log_with(path, [*good, b'{"step": 6, "lo'])  # killed mid-line
    kept, notes = MetricsLog(path).start(resume_step=3)
    assert [m["step"] for m in kept] == [1, 2, 3] and "dropped 3 line(s) after step 3" in notes[0]
    assert path.read_bytes() == b"".join(good[:3])
    _log_with(path, [*good[:4], b'{"step": 5, "lo'])
    kept, notes = MetricsLog(path).start(resume_step=5)
    assert [m["step"] for m in kept] == [1, 2, 3, 4]
    assert "line 5 is damaged" in notes[0] and "the metrics of steps 5-5 are lost" in notes[0], notes
    _log_with(path, [good[0], b"\x00\x00garbage\n", good[2]])
    kept, notes = MetricsLog(path).start(resume_step=3)
    assert [m["step"] for m in kept] == [1] and "steps 2-3 are lost" in notes[0]
    log = MetricsLog(path)
    log.start(resume_step=1)
    log.append({"step": 2})
    log.close()
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [1, 2]


def test_a_resumed_run_with_a_damaged_metrics_line_continues_from_its_checkpoint(tmp_path, capsys):
    out = tmp_path / "run"
    train(_model(), code_windows(), quick_run_config(out, max_steps=3, save_every=2))
    import shutil

    shutil.rmtree(out / "checkpoints" / "step-0000003")  # the run died after logging step 3, before its checkpoint
    with open(out / "metrics.jsonl", "ab") as f:
        f.write(b'{"step": 4, "loss"')
    result = train(_model(), code_windows(), quick_run_config(out, max_steps=4, resume=True))
    assert result.resumed_from == 2 and result.steps == 4
    assert "dropped 2 line(s) after step 2" in capsys.readouterr().err
    steps = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 4]
