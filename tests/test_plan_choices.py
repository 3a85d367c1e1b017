"""A plan's one set-up is the user's own setting type: ``PlanSettings.choices`` is the ``Choices`` that fix every
technique as the plan has it, and ``PlanSettings.of_choices`` (through ``Fixed.of_choices``, the one translation of
a run's choices) gives the same set-up back. So ``plan(choices=p.settings.choices)`` and
``TrainConfig(choices=p.settings.choices)`` reproduce a plan, and a checkpointing layout, a recompute flavor and an
optimizer placement the plan can choose are each one a user can write."""

from __future__ import annotations

import dataclasses
import itertools
import json
import random
import shlex
from pathlib import Path

import pytest
import torch
from helpers import code_windows, fields_form, h100, planner_llama, quick_run_config, tiny_gpt

from memtrain import estimate, techniques, train
from memtrain.checkpointing import Checkpointing, SelectivePolicy
from memtrain.choices import Choices, OptimizerChoice
from memtrain.cli.flags import build_parser
from memtrain.cli.techniques import choices_from_flags, flags_for
from memtrain.device import simulate
from memtrain.errors import ConfigError
from memtrain.models import GPT, GPTConfig
from memtrain.planner import plan
from memtrain.planner.settings import PlanSettings
from memtrain.techniques.optimizer import NamedOptimizer

SAVED = Path(__file__).resolve().parent / "data" / "plan_identity.json"


def _round_trip(settings: PlanSettings) -> PlanSettings:
    return PlanSettings.of_choices(settings.choices, micro_batch_size=settings.micro_batch_size,
                                   accumulation=settings.accumulation, distribution=settings.distribution,
                                   precision=settings.precision, n_blocks=len(settings.blocks))


def test_every_saved_plan_and_runner_up_is_its_own_choices():
    """The README's and the design's plans (tests/test_plan_identity.py's), their runners-up too: 81 set-ups."""
    saved = json.loads(SAVED.read_text())
    settings = [PlanSettings.from_dict(s) for entry in saved.values()
                for s in (entry["plan"]["plan"], *(c["settings"] for c in entry["plan"]["candidates"]))]
    assert len(settings) > 50
    for s in settings:
        assert _round_trip(s) == s, (s, s.choices)


def _layouts(n: int) -> list[tuple[str, ...]]:
    return [tuple(kinds) for kinds in itertools.product(("keep", "recompute", "offload"), repeat=n)]


def _allowed(s: PlanSettings) -> bool:
    """Whether a hand-made set-up is one a run can take (no rule refuses it, each value has its meaning)."""
    run = dict(precision=s.precision, processes=1 if s.distribution == "none" else 2, fsdp=s.distribution == "fsdp2")
    problems = [p for t in techniques.REGISTRY for p in t.settings_problems(s)]
    return not problems and not techniques.refuses(techniques.planned_setup(s, **run))


def test_every_set_up_no_rule_refuses_is_its_own_choices():
    """Every layout of three blocks in every flavor, and a seeded sample of the other techniques' values (placements
    with bf16 device weights, moments, the step in backward, a share offloaded, a named class, pure bf16, parameter
    offload, compile, the loss, DDP and FSDP2, the precisions): each one a rule allows comes back as itself."""
    base = dict(micro_batch_size=2, accumulation=3, distribution="none", precision="bf16-mixed")
    for blocks, flavor in itertools.product(_layouts(3), ("full", "selective", "offload-inputs")):
        s = PlanSettings(blocks=blocks, flavor=flavor, **base)
        assert _round_trip(s) == s, (s, s.choices)
    values = dict(optimizer=("device", "offload", "offload-bf16-weights"), state_precision=("fp32", "bf16", "int8"),
                  step_in_backward=(False, True), offload_fraction=(0.0, 0.5), chunked_loss=(False, True),
                  compile=(False, True), pure_bf16=(False, True), offload_weights=(False, True),
                  optimizer_class=(NamedOptimizer(), NamedOptimizer.of("torch.optim.Adafactor")),
                  distribution=("none", "ddp", "fsdp2"), precision=("bf16-mixed", "fp32", "fp16-mixed"),
                  flavor=("full", "selective", "offload-inputs"))
    rng, layouts = random.Random(30), _layouts(4)
    sampled = 0
    for _ in range(10_000):
        fields = {name: rng.choice(options) for name, options in values.items()}
        s = PlanSettings(**{**base, **fields, "blocks": rng.choice(layouts)})
        if _allowed(s):
            assert _round_trip(s) == s, (s, s.choices)
            sampled += 1
    assert sampled > 300, sampled  # most combinations are refused by a rule: enough are not


def test_the_choices_read_as_a_user_writes_them():
    s = PlanSettings(micro_batch_size=1, accumulation=1, distribution="none", precision="bf16-mixed",
                     blocks=("recompute", "recompute", "keep", "offload"), flavor="selective",
                     optimizer="offload-bf16-weights", chunked_loss=True)
    choices = s.choices
    assert str(choices.checkpointing) == "blocks(RRKO)+selective(matmul,attention)"
    assert choices.optimizer == OptimizerChoice(placement="offload-bf16-weights", state_precision="fp32",
                                                step_in_backward=False)
    assert choices.chunked_loss and choices.offload_activations is None  # the layout's "O" block says it
    # Its JSON is a config's: read back, the same choices.
    assert Choices.from_dict(json.loads(json.dumps(choices.to_dict()))) == choices
    plain = dataclasses.replace(s, blocks=("keep",) * 4, flavor="full", optimizer="device", offload_fraction=0.25)
    assert str(plain.choices.checkpointing) == "none" and plain.choices.offload_activations is False
    assert plain.choices.optimizer.offload_fraction == 0.25 and plain.choices.optimizer.placement is None  # implied
    assert str(dataclasses.replace(plain, blocks=("recompute",) * 4).choices.checkpointing) == "all"
    assert str(dataclasses.replace(plain, blocks=("recompute",) * 4, flavor="offload-inputs").choices.checkpointing) \
        == "all+offload"


def test_a_flavor_without_a_recomputed_block_is_one_set_up():
    """Where no block recomputes, "selective" and "offload-inputs" recompute nothing: the record says "full"."""
    s = PlanSettings(micro_batch_size=1, accumulation=1, distribution="none", precision="bf16-mixed",
                     blocks=("keep", "offload"), flavor="offload-inputs")
    assert s.flavor == "full" and s == dataclasses.replace(s, flavor="selective")
    with pytest.raises(ConfigError, match="flavor='bogus'"):  # not a flavor: still named, not rewritten
        PlanSettings.from_dict({**fields_form(s), "flavor": "bogus"})  # the form of each field (earlier runs')


# 116 MiB, not 110: torch 2.11's traces of this step need 114 MiB in the allocator's pages (2.13's fit 110).
@pytest.mark.parametrize("budget", ["400MiB", "150MiB", "116MiB"])
def test_a_plan_given_its_own_choices_plans_the_same_set_up(budget):
    """Roomy, tight and tighter (recomputed and offloaded blocks, the optimizer on the host, streamed weights): the
    plan of a run that fixes every technique as the first plan chose is the first plan's set-up, predicted alike."""
    model = planner_llama(layers=6, hidden=512)
    common = dict(seq_len=256, global_batch_size=4, device="cuda", device_profile=h100(), host_budget="8GiB",
                  budget=budget)
    first = plan(model, **common)
    again = plan(model, **common, choices=first.settings.choices, micro_batch_size=first.settings.micro_batch_size)
    assert again.settings == first.settings, (first.summary(), again.summary())
    assert (again.peak_bytes, again.host_bytes, again.step_seconds) == (
        first.peak_bytes, first.host_bytes, first.step_seconds)


def test_a_selective_layout_and_bf16_device_weights_are_choices_a_plan_keeps():
    model = planner_llama(layers=4, hidden=256)
    common = dict(seq_len=128, global_batch_size=2, device="cuda", device_profile=h100(), host_budget="8GiB",
                  budget=None)
    choices = Choices(checkpointing="blocks(RRKK)+selective",
                      optimizer=OptimizerChoice(placement="offload-bf16-weights"))
    s = plan(model, **common, choices=choices).settings
    assert (s.blocks, s.flavor, s.optimizer) == (("recompute",) * 2 + ("keep",) * 2, "selective",
                                                 "offload-bf16-weights")
    with pytest.raises(ConfigError, match="offload-bf16-weights' with precision='fp32'"):
        plan(model, **common, precision="fp32", choices=choices)
    gpt = GPT(GPTConfig(n_layer=4, n_embd=32, n_head=2, seq_len=16))
    arguments = Checkpointing.parse("blocks(RRKK)+selective").arguments(gpt)
    assert arguments["selective"] == SelectivePolicy() and list(arguments["policies"].values())[:3] == [
        "recompute", "recompute", "keep"]


def test_a_run_given_a_plans_choices_trains_that_set_up_on_the_simulated_device(tmp_path):
    """The choices a plan can return that no flag had before (a mixed layout recomputed selectively, bf16 device
    weights from the host master) are a run's ``Choices``: the simulated device trains them, the plan in force is
    theirs, and its own ``choices`` are the ones given."""
    given = Choices(checkpointing="blocks(RRKK)+selective", optimizer=OptimizerChoice(
        placement="offload-bf16-weights", state_precision="bf16", step_in_backward=False), chunked_loss=False,
                    offload_activations=False, offload_weights=False, tiled_mlp=False)
    # precision "auto" (TrainConfig's default): the bf16 device weights compute in bf16-mixed
    config = quick_run_config(tmp_path, max_steps=2, global_batch_size=4, budget="8MiB", choices=given)
    with simulate("8MiB"):
        result = train(tiny_gpt(4, seq_len=32, seed=0), code_windows(32), config)
    settings = PlanSettings.from_dict(result.plan["settings"])
    assert (settings.blocks, settings.flavor, settings.optimizer, settings.state_precision) == (
        ("recompute",) * 2 + ("keep",) * 2, "selective", "offload-bf16-weights", "bf16"), settings
    assert settings.choices == given == Choices.from_dict(result.plan["settings"]["choices"])  # the report's form
    assert result.steps == 2 and result.peak_bytes is not None and result.peak_bytes <= 8 * 2**20
    assert result.precision == "bf16-mixed" and any("bf16 device weights compute in bf16" in r for r in result.reasons)


def test_bf16_device_weights_are_estimated_and_refused_where_they_cannot_run():
    """``estimate`` traces the set-up's bf16 device weights (the plan's figure for them), a ``weights_dtype=`` that
    contradicts them is named, and the Trainer helper, which trains the model's own weights, refuses them."""
    model = GPT(GPTConfig(n_layer=2, n_embd=64, n_head=2, seq_len=32))
    common = dict(device="cuda", precision="bf16-mixed", micro_batch_size=2, seq_len=32)

    def peak(placement, name=None, **extra):
        return estimate(model, **common, **extra, setup=Choices(optimizer=OptimizerChoice(placement=placement,
                                                                                          name=name))).peak_bytes

    for name in (None, "torch.optim.Adafactor"):  # memtrain's AdamW and a named class alike
        assert peak("offload-bf16-weights", name) == peak("offload", name, weights_dtype="bf16") < peak(
            "offload", name), name
    assert peak("offload-bf16-weights", optimizer="adamw-offload") == peak("offload-bf16-weights")
    with pytest.raises(ConfigError, match="weights_dtype='fp32' with setup.optimizer.placement='offload-bf16-weights'"):
        peak("offload-bf16-weights", weights_dtype="fp32")
    problems = techniques.optimizer.TECHNIQUE.trainer_problems(
        Choices(optimizer=OptimizerChoice(placement="offload-bf16-weights")))
    assert len(problems) == 1 and "MemtrainTrainer trains the model's own weights" in problems[0], problems
    assert techniques.optimizer.TECHNIQUE.setup_text(Choices(optimizer=OptimizerChoice(
        placement="offload-bf16-weights"))) == "AdamW offloaded, bf16 device weights, fp32 moments"  # estimate's header


def test_a_plans_choices_are_the_flags_that_fix_it():
    """Each saved plan's and runner-up's choices, written as the command's flags (from the fields' flag
    declarations) and read back by the command's parser, are the same choices: a plan is a command line."""
    saved = json.loads(SAVED.read_text())
    parser = build_parser()
    seen = set()
    for entry in saved.values():
        for s in (entry["plan"]["plan"], *(c["settings"] for c in entry["plan"]["candidates"])):
            choices = PlanSettings.from_dict(s).choices
            words = flags_for(choices)
            args = parser.parse_args(["train", *words])
            assert choices_from_flags(args) == choices, (words, choices)
            seen.update(w for w in words if w.startswith("--"))
    assert {"--checkpointing", "--offload-optimizer", "--optimizer-state", "--no-chunked-loss",
            "--offload-weights"} <= seen, seen
    named = Choices(optimizer=OptimizerChoice(name="torch.optim.Adafactor", kwargs={"beta2_decay": -0.8}),
                    pure_bf16=False, compile=True, checkpointing="blocks(RRK)+selective")
    assert choices_from_flags(parser.parse_args(["train", *flags_for(named)])) == named, flags_for(named)


def test_a_runs_auto_precision_is_the_one_its_techniques_compute_in():
    bf16_weights = Choices(optimizer=OptimizerChoice(placement="offload-bf16-weights"))
    assert techniques.asked_precision(bf16_weights, "auto") == (
        "bf16-mixed", "the offloaded optimizer's bf16 device weights compute in bf16")
    assert techniques.asked_precision(Choices(pure_bf16=True), "auto")[0] == "bf16-mixed"
    assert techniques.asked_precision(Choices(), "auto") == ("auto", "requested")
    assert techniques.asked_precision(bf16_weights, "fp32") == ("fp32", "requested")  # refused by its rule, named
    assert bf16_weights.precision_problems("auto") == [] and bf16_weights.precision_problems("fp32")


def test_the_plans_flags_keep_its_global_batch(capsys):
    """memtrain plan's "as flags:" line, given to memtrain plan again, plans the same set-up: where the plan
    accumulates, --micro-batch-size alone would shrink the default global batch to one micro-batch per rank, so the
    line names --global-batch-size too."""
    from helpers import run_cli

    first = ["plan", "--model", "gpt-tiny", "--gpu", "H100", "--budget", "82MiB", "--no-progress"]

    def lines(argv):
        code, errors, text = run_cli(argv, capsys)
        assert code == 0, errors
        return {k: line.split(k, 1)[1].strip() for line in text.splitlines() for k in ("choice:", "predicted:",
                                                                                       "as flags:") if k in line}

    one = lines(first)
    assert "accumulation" in one["choice:"] and not one["choice:"].startswith("micro-batch 16 x 1"), one
    flags = shlex.split(one["as flags:"])
    assert "--global-batch-size" in flags, flags
    two = lines([*first, *flags])
    assert (two["choice:"], two["predicted:"]) == (one["choice:"], one["predicted:"]), (one, two)


@pytest.mark.parametrize(("argv", "precision"), [(["--device", "cpu"], "bf16-mixed"),
                                                 (["--gpu", "H100", "--precision", "fp32"], "fp32"),
                                                 (["--gpu", "H100"], "auto")])
def test_the_plans_flags_keep_its_precision(capsys, argv, precision):
    """memtrain plan plans bf16-mixed by default, memtrain train's "auto" is fp32 on a CPU: a plan whose precision
    is not the one memtrain train would pick there names --precision in its "as flags:" line (a CPU plan at 800 KiB
    given to memtrain train without it was refused: fp32's peak does not fit)."""
    from helpers import run_cli

    code, errors, text = run_cli(["plan", "--model", "gpt-tiny", "--no-progress", *argv], capsys)
    assert code == 0, errors
    flags = shlex.split(next(line for line in text.splitlines() if "as flags:" in line).split("as flags:", 1)[1])
    assert build_parser().parse_args(["train", *flags]).precision == precision, flags


def test_a_reason_compares_a_layout_without_recompute_with_its_own_flavors_rows(capsys):
    """A plan with no recomputed block writes its flavor "full" while its table's rows keep the search's (fixed to
    offloaded inputs by --offload-activations): the checkpointing reason still names the fewer-blocks alternative."""
    from helpers import run_cli

    code, errors, text = run_cli(["plan", "--budget", "100MiB", "--offload-activations", "--no-progress"], capsys)
    assert code == 0, errors
    reason = next(line for line in text.splitlines() if "- checkpointing:" in line)
    assert "with every activation in pinned host memory" in reason and "fewer blocks would" in reason, reason


def test_the_plans_flags_name_fsdp_where_it_shards(capsys):
    from helpers import run_cli

    code, errors, text = run_cli(["plan", "--budget", "100MiB", "--nproc", "2", "--fsdp", "--no-progress"], capsys)
    assert code == 0 and "fsdp2" in text, errors
    flags = shlex.split(next(line for line in text.splitlines() if "as flags:" in line).split("as flags:", 1)[1])
    assert build_parser().parse_args(["train", *flags]).fsdp, flags


def test_configure_model_applies_a_hand_made_layout_whatever_its_other_fields():
    """The model's stage applies the layout alone: the rules between the other techniques are apply_plan's to
    check (a re-plan's configure_model never refused a set-up for them)."""
    from memtrain.planner import configure_model

    model = GPT(GPTConfig(n_layer=2, n_embd=32, n_head=2, seq_len=16))
    s = PlanSettings(micro_batch_size=1, accumulation=1, distribution="none", precision="bf16-mixed",
                     blocks=("recompute", "keep"), flavor="selective", offload_weights=True, optimizer="device")
    assert configure_model(model, s) == ["blocks.0"]


def test_a_run_whose_optimizer_class_has_no_import_path_trains_and_stores_its_plan(tmp_path):
    """A class made inside a function (the design's "in Python, the class itself") has no path to import it by:
    storing the plan checks its choices as objects, never by importing the class back (the first form of the
    stored choices refused such a run at its start, or after its last step without a folder)."""

    def local_class():
        class LocalSGD(torch.optim.SGD):
            pass
        return LocalSGD

    choices = Choices(optimizer=OptimizerChoice(name=local_class(), kwargs={"momentum": 0.9}), checkpointing="none")
    for out in (tmp_path / "run", None):
        config = quick_run_config(tmp_path, max_steps=2, global_batch_size=4, choices=choices, out_dir=out and str(out))
        result = train(tiny_gpt(2, seq_len=32, seed=0), code_windows(32), config)
        assert result.steps == 2 and result.plan["settings"]["choices"]["optimizer"]["name"].endswith("LocalSGD")
    saved = json.loads((tmp_path / "run" / "config.json").read_text())["plan"]
    assert saved["choices"]["optimizer"]["kwargs"] == {"momentum": 0.9}, saved


def test_a_runner_up_said_to_fit_fits_with_what_the_allocators_segments_need():
    """At a budget where CUDA's 20 MiB pages decide (gpt-tiny's 64 MiB of cuBLAS workspaces: its plan needs 82 MiB),
    a composed runner-up is judged as the search judges it: its peak, with the most the segments needed beyond a
    full estimate's, within the whole budget. Before, rows whose peak alone fitted the usable bytes were listed as
    slower set-ups that fit (1.4% slower, needing 86.2 MiB of the 82)."""
    from memtrain.models import GPT_PRESETS

    p = plan(GPT(GPT_PRESETS["gpt-tiny"]), budget="82MiB", seq_len=64, global_batch_size=8, device="cuda",
             device_profile=h100(), host_budget="8GiB")
    beyond = p.report.needed_bytes - p.report.peak_bytes
    assert beyond > 16 * 2**20  # the pages' rounding decides here
    fitting = [c for c in p.candidates if "slower" in c.lost_because or "as fast" in c.lost_because]
    assert fitting, p.summary()
    for c in fitting:
        assert c.peak_bytes + beyond <= p.budget_bytes, (c.peak_bytes, beyond, c.lost_because)


def test_a_runner_up_said_to_fit_carries_what_composition_missed_for_its_shape(monkeypatch):
    """A full estimate above its composed peak says what composition missed for that shape of candidate (its
    configuration, with or without offloaded blocks); the search carries it to later rows of that shape, and so do
    the runners-up. Here gpt-tiny's fastest row's full estimate is made to come out 1 MiB over the usable bytes, with
    only the blocks' checkpointing left to the plan: its slower rows of that shape (a block recomputed), composed a
    little under that peak, are over by the same token. Before, one was listed as a slower set-up that fits."""
    import memtrain.planner.search as search
    from memtrain.models import GPT_PRESETS

    def planned(**fixed):
        return plan(GPT(GPT_PRESETS["gpt-tiny"]), budget="100MiB", seq_len=64, global_batch_size=8, device="cuda",
                    device_profile=h100(), host_budget="8GiB", **fixed)

    def shape(s):  # the search's: the configuration (the recompute flavor too), and whether a block offloads
        return s.flavor, dataclasses.replace(s, blocks=()), "offload" in s.blocks

    def fitting(p):
        return [c for c in p.candidates if "slower" in c.lost_because or "as fast" in c.lost_because]

    first = planned()
    fixed = {"micro_batch_size": first.settings.micro_batch_size, "choices": dataclasses.replace(
        first.settings.choices, checkpointing=None, offload_activations=None)}
    plain = planned(**fixed)
    assert plain.settings == first.settings
    assert [c for c in fitting(plain) if shape(c.settings) == shape(first.settings)], plain.summary()

    missed = first.usable_bytes - first.peak_bytes + 2**20
    real = search.estimate_of

    def missing(ctx, prof, s):
        peak, t = real(ctx, prof, s)
        return peak + (missed if shape(s) == shape(first.settings) else 0), t

    monkeypatch.setattr(search, "estimate_of", missing)
    p = planned(**fixed)
    assert shape(p.settings) != shape(first.settings)
    assert not [c for c in fitting(p) if shape(c.settings) == shape(first.settings)], p.summary()


def test_a_faster_runner_up_the_full_estimates_never_reached_says_it_is_not_confirmed(monkeypatch):
    """Where the search's tries run out (here 1, and every set-up of more than one example a micro-batch fully
    estimated 100x its peak), it chooses the least set-up: a faster one whose composed peak fits, never estimated
    in full, is a runner-up that says the full estimates ran out before it, not that it is slower or over."""
    import functools

    import memtrain.planner.search as search
    from memtrain.models import GPT_PRESETS

    estimate_of = search.estimate_of

    def inflated(ctx, prof, s):
        peak, t = estimate_of(ctx, prof, s)
        return (100 * peak if s.micro_batch_size > 1 else peak), t

    monkeypatch.setattr(search, "estimate_of", inflated)
    monkeypatch.setattr(search, "_judged", functools.partial(search._judged, tries=1))
    p = plan(GPT(GPT_PRESETS["gpt-tiny"]), budget="100MiB", seq_len=64, global_batch_size=8, device="cuda",
             device_profile=h100(), host_budget="8GiB")
    assert p.settings.micro_batch_size == 1, p.summary()
    unconfirmed = [c for c in p.candidates if "as composed, but not confirmed" in c.lost_because]
    assert unconfirmed, p.summary()
    for c in unconfirmed:
        assert c.lost_because.endswith("% faster as composed, but not confirmed: the plan's full estimates ran out "
                                       "before it"), c.lost_because
        assert not c.verified and c.peak_bytes <= p.usable_bytes and c.step_seconds < p.step_seconds, c
        assert not c.settings.offload_weights, c  # a streamed one says so instead


def test_a_faster_runner_up_that_streams_the_weights_says_why_it_lost(monkeypatch):
    """Parameter offload is for weights that do not fit the device: the search confirms a streamed set-up only
    after every other. Where one is faster (here gpt-tiny's streamed rows are made twice as fast), the runners-up say
    so and why it lost. Before, "as fast (within 0.1%)"."""
    from memtrain.models import GPT_PRESETS
    from memtrain.planner.cost import Composer

    composed = Composer._seconds

    def streamed_faster(self, cfg, *rest):
        return composed(self, cfg, *rest) / (2 if cfg.offload_weights else 1)

    monkeypatch.setattr(Composer, "_seconds", streamed_faster)
    p = plan(GPT(GPT_PRESETS["gpt-tiny"]), budget="100MiB", seq_len=64, global_batch_size=8, device="cuda",
             device_profile=h100(), host_budget="8GiB")
    assert not p.settings.offload_weights
    faster = [c for c in p.candidates if c.settings.offload_weights and c.step_seconds < p.step_seconds]
    assert faster, p.summary()
    for c in faster:
        assert "% faster, but it streams the weights from host RAM" in c.lost_because, c.lost_because
