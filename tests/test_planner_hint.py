"""The plan's Hint: lines for sizes that work but are rarely meant: the built-in GPT's position table grown past the
rest of the model by --seq-len, and a step predicted to take many minutes. (A Hugging Face model refuses a --seq-len
past its max_position_embeddings: tests/test_cli.py.) And the search of a refusal's FSDP2 fix for the fewest ranks
(its plans: tests/test_planner_reasons.py)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from memtrain import plan
from memtrain.models import GPT
from memtrain.planner import search
from memtrain.planner.hint import MOST_RANKS, SLOW_STEP_HINT_S, FSDP2Fit, fsdp2_fit, size_hints


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


def _judge(fewest: int, calls: list[int]):
    """A judgement of rank counts that passes from ``fewest`` on, recording each count asked."""

    def judge(ranks: int) -> FSDP2Fit | None:
        calls.append(ranks)
        return FSDP2Fit(ranks, None, 0.0, 0.0) if ranks >= fewest else None

    return judge


@pytest.mark.parametrize(("bound_from", "fits_from", "start", "fewest"),
                         [(39, 39, 2, 39), (48, 39, 2, 39), (12, 11, 2, 11), (5, 5, 3, 5), (7, 2, 4, 4)])
def test_the_fsdp2_fix_walks_down_from_the_cheap_bound_to_the_fewest_ranks_the_plan_fits(
        bound_from, fits_from, start, fewest):
    # The bound (counts where composition says nothing fits passed over untraced) passes from `bound_from`; the
    # plan's own judgement from `fits_from` (composition can err high): the count named is the plan's fewest,
    # judged on every count only down from the bound, and the set-up named is the one chosen there.
    bound_calls, fits_calls, chosen_calls = [], [], []
    found = fsdp2_fit(_judge(bound_from, bound_calls), _judge(fits_from, fits_calls),
                      _judge(fits_from, chosen_calls), start)
    assert found.ranks == fewest and chosen_calls == [fewest], (found, fits_calls)
    assert all(ranks < bound_from for ranks in fits_calls), fits_calls  # the plan's judgement only below the bound
    assert len(fits_calls) <= 2 + 2 * max(1, bound_from - fewest).bit_length(), fits_calls
    if bound_from > 9:  # above a node's ranks: one fewer, always asked
        assert bound_from - 1 in fits_calls, fits_calls
    else:  # within a node: each count below the bound's in turn, fewest first, up to the first that fits
        assert fits_calls == list(range(start, min(fewest + 1, bound_from))), fits_calls


def _judge_at(counts: set[int], calls: list[int]):
    """A judgement that passes at ``counts`` only, recording each count asked."""

    def judge(ranks: int) -> FSDP2Fit | None:
        calls.append(ranks)
        return FSDP2Fit(ranks, None, 0.0, 0.0) if ranks in counts else None

    return judge


def test_the_fsdp2_fix_judges_each_count_within_a_node_as_a_node_can_fit_fewer_ranks_than_more():
    # A node's host RAM grows with its ranks: a set-up with its optimizer on the host fits 3 ranks' devices and
    # their node's RAM, not 4's RAM; another fits from 5. Composition errs high for the first: the bound passes 3
    # over. The walk down judges 2, 3 (fewest first), not 4 then 3 and 2 by steps.
    fits = {3} | set(range(5, 1000))
    fits_calls = []
    found = fsdp2_fit(_judge_at(set(range(5, 1000)), []), _judge_at(fits, fits_calls), _judge_at(fits, []), 2)
    assert found.ranks == 3 and fits_calls == [2, 3], (found, fits_calls)
    # Above a node, both figures a rank needs shrink as the ranks grow: steps and bisection down to the node.
    fits_calls.clear()
    found = fsdp2_fit(_judge(40, []), _judge_at(fits, fits_calls), _judge_at(fits, []), 2)
    assert found.ranks == 3 and fits_calls[-2:] == [2, 3] and 4 not in fits_calls, (found, fits_calls)


def test_the_fsdp2_fix_does_not_judge_again_a_count_the_bound_refused_in_full():
    bound_calls, fits_calls, refused = [], [], set()

    def bound(ranks: int) -> FSDP2Fit | None:  # judged 2 and 3 in full (refused), passed the rest over
        bound_calls.append(ranks)
        if ranks in (2, 3):
            refused.add(ranks)
        return None

    looser_calls = []
    found = fsdp2_fit(bound, _judge(6, fits_calls), _judge(6, []), 2, refused, looser=_judge(6, looser_calls))
    assert found.ranks == 6 and looser_calls == [4, 5, 6] and fits_calls == [4, 5], (found, looser_calls, fits_calls)


def test_where_the_bound_passes_every_count_over_a_looser_band_looks_if_composition_was_seen_to_err_high():
    # Composition that errs high everywhere (memtrain's own chunked loss on torch 2.11) passes every count over: a
    # wider band (by what the plan's full estimates showed) looks again, a node one by one, then doubled.
    calls = []
    assert fsdp2_fit(_judge(MOST_RANKS + 1, []), _judge(2, []), _judge(2, []), 2,
                     looser=_judge(MOST_RANKS + 1, calls)) is None
    assert calls[:7] == [2, 3, 4, 5, 6, 7, 8] and calls[-1] == MOST_RANKS, calls
    found = fsdp2_fit(_judge(MOST_RANKS + 1, []), _judge(7, []), _judge(7, []), 2, looser=_judge(9, []))
    assert found.ranks == 7, found  # the walk down from the looser band's 9
    # Composition not seen to err high (no looser band): no count fits, and none is judged again in full (before,
    # a 70B's refusal at 4 GiB judged all 20 counts again: 38 of its 43 s).
    fits_calls = []
    assert fsdp2_fit(_judge(MOST_RANKS + 1, []), _judge(7, fits_calls), _judge(7, []), 2) is None
    assert fits_calls == [], fits_calls


def test_the_fsdp2_fix_names_no_count_whose_plan_finds_no_set_up():
    # The plan there, with more tries, can judge otherwise (another row's full estimate sets what composition
    # missed): where it finds none, the next counts (up to twice as many), and none named where none plans.
    calls = []
    found = fsdp2_fit(_judge(10, []), _judge(10, []), _judge(12, calls), 2)
    assert found.ranks == 12 and calls == [10, 11, 12], (found, calls)
    calls.clear()
    assert fsdp2_fit(_judge(10, []), _judge(10, []), _judge(MOST_RANKS + 1, calls), 2) is None
    assert calls == list(range(10, 21)), calls
    calls.clear()  # up to twice as many, and no more than the widest FSDP2 tried
    assert fsdp2_fit(_judge(MOST_RANKS, []), _judge(MOST_RANKS, []), _judge(MOST_RANKS + 1, calls), 2) is None
    assert calls == [MOST_RANKS], calls


@pytest.mark.parametrize(("confirmed_from", "rows", "named"), [(11, 6, None), (10, 16, None), (10, 6, 10)])
def test_where_the_estimates_run_out_the_fsdp2_fix_names_no_count_the_plan_did_not_choose_a_set_up_at(
        monkeypatch, confirmed_from, rows, named):
    # The cheap judgement (1 try) fits from 10 ranks; the plan's (16 tries) estimates `rows` other rows in full and
    # fits from `confirmed_from`. Where it refuses 10 and the estimates run out judging 11, or run out judging 10,
    # no count is named (before: 10, with the cheap judgement's set-up, a --nproc 10 the plan may refuse). Where the
    # plan confirms 10 within the estimates, 10 is named with the set-up it chooses there.
    monkeypatch.setattr(search, "estimate_of", lambda ctx, prof, s: (0.0, None))
    monkeypatch.setattr(search, "rank_peak", lambda ctx, prof, s, t: 1.0)
    monkeypatch.setattr(search, "_setup_line", str)

    def wider(ranks):
        table = SimpleNamespace(ranks=ranks, host=np.zeros(1), peak=np.array([50.0]), settings=lambda k: f"at {ranks}")
        return SimpleNamespace(ctx=None, profile_of=lambda s: None), table

    def judged(table, usable, host_limit, margin, estimate, tries):
        full = SimpleNamespace(peak=lambda k: 42.0)
        if tries == search._FSDP2_TRIES:
            estimate("the fastest row", "")
            return (0 if table.ranks >= 10 else None), full, None
        for row in range(rows):
            estimate(f"row {row} at {table.ranks}", "")
        return (0 if table.ranks >= confirmed_from else None), full, None

    monkeypatch.setattr(search, "_judged", judged)
    ctx, results = SimpleNamespace(world=1), SimpleNamespace(column=lambda name: np.array(["ddp"]))
    fit = search._fsdp2_hint(ctx, results, wider, 100, None, 0.05, 0)
    if named is None:
        assert fit is None, fit
    else:
        assert fit is not None and fit.ranks == named and fit.settings == f"at {named}", fit
