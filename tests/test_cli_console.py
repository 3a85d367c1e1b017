"""What the command prints: --no-progress silences the bars of transformers and huggingface_hub too ("Loading
weights", "Writing model shards"), and --quiet keeps one line of the plan."""

from __future__ import annotations

import pytest

from memtrain.cli import main
from memtrain.cli.console import third_party_progress

transformers_logging = pytest.importorskip("transformers.utils.logging")
hub_utils = pytest.importorskip("huggingface_hub.utils")


def test_third_party_bars_are_off_inside_and_as_they_were_after():
    assert transformers_logging.is_progress_bar_enabled() and not hub_utils.are_progress_bars_disabled()
    with third_party_progress(enabled=False):
        assert not transformers_logging.is_progress_bar_enabled()
        assert hub_utils.are_progress_bars_disabled()
    assert transformers_logging.is_progress_bar_enabled() and not hub_utils.are_progress_bars_disabled()
    with third_party_progress(enabled=True):
        assert transformers_logging.is_progress_bar_enabled() and not hub_utils.are_progress_bars_disabled()
    transformers_logging.disable_progress_bar()  # a setting of the caller's own stays as it was
    try:
        with third_party_progress(enabled=False):
            pass
        assert not transformers_logging.is_progress_bar_enabled()
    finally:
        transformers_logging.enable_progress_bar()


def test_no_progress_and_quiet_print_no_bar_and_one_plan_line(tmp_path, hf_model_dir, capfd, monkeypatch):
    from memtrain.data import token_cache

    monkeypatch.setattr(token_cache, "_PROGRESS_BYTES", 0)  # the tokenising bar of a large file, for a small one
    data = tmp_path / "docs.txt"
    data.write_text("\n\n".join(f"def f{i}(x):\n    return x + {i}" for i in range(300)))
    out = tmp_path / "run"
    assert main(["train", "--hf-model", str(hf_model_dir), "--data", str(data), "--max-steps", "2",
                 "--micro-batch-size", "2", "--global-batch-size", "2", "--seq-len", "64", "--no-progress",
                 "--quiet", "--out", str(out)]) == 0
    printed = capfd.readouterr()
    for bar in ("tokenising", "Loading weights", "Writing model shards", "it/s]"):  # memtrain's, transformers' bars
        assert bar not in printed.err and bar not in printed.out, (bar, printed.err, printed.out)
    lines = printed.err.splitlines()
    assert len(lines) == 2 and lines[0].startswith("  plan: ") and lines[1].startswith("  plan check"), lines
    assert (out / "hf" / "model.safetensors").is_file()  # the export that printed "Writing model shards" ran
    assert transformers_logging.is_progress_bar_enabled()  # the command gave the setting back
