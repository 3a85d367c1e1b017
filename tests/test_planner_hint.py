"""The plan's Hint: lines for sizes that work but are rarely meant: the built-in GPT's position table grown past the
rest of the model by --seq-len, and a step predicted to take many minutes. (A Hugging Face model refuses a --seq-len
past its max_position_embeddings: tests/test_cli.py.)"""

from __future__ import annotations

from types import SimpleNamespace

import torch

from memtrain import plan
from memtrain.models import GPT
from memtrain.planner.hint import SLOW_STEP_HINT_S, size_hints


def _gpt_tiny(seq_len: int) -> GPT:
    with torch.device("meta"):
        return GPT.from_preset("gpt-tiny", seq_len=seq_len)


def _hints(reasons) -> list[str]:
    return [r for r in reasons if r.startswith("Hint:")]


def test_a_sequence_far_past_the_built_in_gpts_positions_gets_a_hint_saying_what_grows():
    long = plan(_gpt_tiny(4096), budget=None, seq_len=4096, global_batch_size=1, device="cpu", precision="fp32")
    hints = [h for h in _hints(long.reasons) if "position table" in h]
    assert len(hints) == 1, long.reasons
    table, total = 4096 * 32, sum(p.numel() for p in _gpt_tiny(4096).parameters())
    assert (f"Hint: --seq-len 4096 (seq_len) gives the built-in GPT a learned position table of 4,096 x 32 = "
            f"{table / 1e6:.2f}M parameters, {table / total:.0%} of its {total / 1e6:.2f}M") in hints[0], hints[0]
    assert f"a --seq-len of {(total - table) // 32:,} or less" in hints[0], hints[0]
    usual = plan(_gpt_tiny(256), budget=None, seq_len=256, global_batch_size=1, device="cpu", precision="fp32")
    assert not [h for h in _hints(usual.reasons) if "position table" in h], usual.reasons


def test_a_step_predicted_to_take_many_minutes_gets_a_hint_with_the_time_and_what_to_change():
    ctx = SimpleNamespace(model=_gpt_tiny(64), seq_len=100_000, global_batch=16, device="cpu")
    (hint,) = size_hints(ctx, 1320.0)
    assert hint.startswith("Hint: the plan predicts 22.0 minutes a step on the CPU (1,600,000 tokens a step at 1,212 "
                           "tokens/s)"), hint
    assert "a shorter --seq-len" in hint and "or train on a GPU" in hint, hint
    assert size_hints(ctx, SLOW_STEP_HINT_S / 2) == ()  # a step of a few minutes is not worth a line
    on_gpu = size_hints(SimpleNamespace(model=_gpt_tiny(64), seq_len=4096, global_batch=8, device="cuda"), 600.0)
    assert len(on_gpu) == 1 and "on the cuda device" in on_gpu[0] and "GPU" not in on_gpu[0], on_gpu
