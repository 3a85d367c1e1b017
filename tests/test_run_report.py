"""The run's report: memory.png's figure (the budget, the predicted and the measured peak, memory per step), read
from the matplotlib objects it is drawn with; the one plan line of a quiet run."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
from helpers import code_windows, quick_run_config, tiny_gpt

from memtrain import train
from memtrain.planner import PlanSettings
from memtrain.run.replan import PlanInForce
from memtrain.run.report import memory_figure, plan_summary

MIB = 2**20
BARS = {"with memtrain (measured)": {"parameter_bytes": 25 * MIB, "gradient_bytes": 25 * MIB,
                                     "optimizer_state_bytes": 50 * MIB, "activation_bytes": 33 * MIB}}


def _run_plan(*, budget: int | None = 1024 * MIB, peak: int = 300 * MIB, saved: int = 40 * MIB) -> PlanInForce:
    settings = PlanSettings(micro_batch_size=4, accumulation=2, blocks=("recompute", "keep"), flavor="full",
                            chunked_loss=True, optimizer="device", distribution="none", compile=False)
    return PlanInForce(settings=settings, plan=SimpleNamespace(peak_bytes=peak, activation_bytes=saved),
                   budget_bytes=budget, reasons=())


def _lines(fig):
    steps_ax = fig.axes[1]
    return steps_ax, {line.get_label(): line for line in steps_ax.get_lines()}


def _metrics(peaks):
    return [{"step": i + 1, "peak_bytes": peak, "peak_reserved_bytes": peak and peak + 64 * MIB,
             "activation_bytes": (30 + i) * MIB, "model_state_bytes": 100 * MIB,
             "parameter_bytes": 25 * MIB, "gradient_bytes": 25 * MIB, "optimizer_state_bytes": 50 * MIB}
            for i, peak in enumerate(peaks)]


def test_memory_figure_draws_the_budget_the_predicted_and_measured_peak_and_each_step():
    metrics = _metrics([280 * MIB, 310 * MIB, 290 * MIB, 295 * MIB])
    fig = memory_figure(BARS, metrics, _run_plan(), [{"step": 3}])
    steps_ax, lines = _lines(fig)
    assert set(lines) == {"allocator peak reserved", "allocator peak", "saved activations", "model state",
                          "budget 1.00 GiB",
                          "predicted peak 300.00 MiB", "measured peak 310.00 MiB",
                          "predicted saved activations 40.00 MiB", "re-plan at step 3"}, sorted(lines)
    assert list(lines["allocator peak"].get_xdata()) == [1, 2, 3, 4]
    assert list(lines["allocator peak"].get_ydata()) == [280, 310, 290, 295]  # MiB, per step
    assert list(lines["allocator peak reserved"].get_ydata()) == [344, 374, 354, 359]  # held from the driver
    assert list(lines["saved activations"].get_ydata()) == [30, 31, 32, 33]
    assert list(lines["budget 1.00 GiB"].get_ydata()) == [1024, 1024]  # a horizontal line at the budget
    assert list(lines["predicted peak 300.00 MiB"].get_ydata()) == [300, 300]
    assert list(lines["measured peak 310.00 MiB"].get_ydata()) == [310, 310]  # the highest step's
    assert list(lines["re-plan at step 3"].get_xdata()) == [3, 3]
    assert steps_ax.get_yscale() == "log" and steps_ax.get_xlabel() == "optimizer step"
    bars_ax = fig.axes[0]
    assert [t.get_text().replace("\n", " ") for t in bars_ax.get_xticklabels()] == [
        "parameters", "gradients", "optimizer state", "activations"]
    assert [p.get_height() for p in bars_ax.patches] == [25, 25, 50, 33]


def test_memory_png_labels_do_not_overlap():
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    # Two breakdowns of nearly equal bytes, as a CPU run's are: their labels side by side.
    same = {key: value + MIB // 5 for key, value in BARS["with memtrain (measured)"].items()}
    fig = memory_figure({"without memtrain (estimated)": same, **BARS}, _metrics([280 * MIB, 310 * MIB]),
                        _run_plan(), [{"step": 2}])
    canvas = FigureCanvasAgg(fig)
    canvas.draw()
    renderer = canvas.get_renderer()
    bars_ax, steps_ax = fig.axes
    texts = [t for t in [*bars_ax.texts, *bars_ax.get_xticklabels()] if t.get_text()]
    boxes = [(t.get_text(), t.get_window_extent(renderer)) for t in texts]
    overlapping = [(a, b) for i, (a, box) in enumerate(boxes) for b, other in boxes[i + 1:] if box.overlaps(other)]
    assert len(texts) == 12 and not overlapping, overlapping  # 8 bar labels, 4 categories
    legend = steps_ax.get_legend().get_window_extent(renderer)
    assert not legend.overlaps(steps_ax.get_window_extent(renderer)), "the legend covers the lines"
    assert not legend.overlaps(bars_ax.get_window_extent(renderer))


def test_memory_figure_without_an_allocator_peak_or_a_budget_says_so():
    fig = memory_figure(BARS, _metrics([None, None]), _run_plan(budget=None), [])
    steps_ax, lines = _lines(fig)
    assert set(lines) == {"saved activations", "model state", "predicted peak 300.00 MiB",
                          "predicted saved activations 40.00 MiB"}, sorted(lines)
    assert "no allocator peak" in steps_ax.get_title()


def test_a_run_writes_the_new_memory_png_and_the_plan_says_why_its_precision(tmp_path):
    out = tmp_path / "run"
    train(tiny_gpt(seq_len=32, seed=0), code_windows(), quick_run_config(out, max_steps=2))
    assert (out / "memory.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # precision "auto": the plan's reason is the automatic choice's, not "(requested)".
    reasons = json.loads((out / "report.json").read_text())["plan"]["reasons"]
    precision = [r for r in reasons if r.startswith("precision ")]
    assert precision and precision[0].startswith("precision fp32, because: CPU"), reasons
    assert not any("requested" in r for r in reasons), reasons


def test_plan_summary_is_one_line_with_the_choices():
    line = plan_summary(_run_plan(), "bf16-mixed")
    assert line == ("plan: bf16-mixed; checkpointing 1 recompute, 1 keep of 2; loss chunked; optimizer device; "
                    "micro-batch 4 x 2 accumulation; predicted peak 300.00 MiB per rank of the budget 1.00 GiB"), line


@pytest.mark.parametrize("quiet", [False, True])
def test_quiet_prints_one_plan_line_instead_of_the_reasons(tmp_path, capsys, quiet):
    result = train(tiny_gpt(seq_len=32, seed=0), code_windows(),
                   quick_run_config(tmp_path / "run", max_steps=2, quiet=quiet))
    err = capsys.readouterr().err.splitlines()
    start = [line for line in err if not line.startswith("  plan check")]  # the step-2 check is a measurement
    if quiet:
        assert len(start) == 1 and start[0].startswith("  plan: "), err
    else:
        assert len(start) >= 10 and sum("because" in line for line in start) >= 3, err
    assert len(result.reasons) >= 10  # the result keeps every reason either way
