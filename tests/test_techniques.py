"""The registry of techniques (``memtrain.techniques``): each setting field owned by one technique and declared
once, in its module; the rules' messages read in each site's terms; the rules of what the plan plans apart from
those of what the primitives build."""

from __future__ import annotations

import dataclasses
import sys
from types import SimpleNamespace

import pytest
import torch

from memtrain import techniques
from memtrain.choices import Choices, OptimizerChoice
from memtrain.errors import ConfigError
from memtrain.optim import build_optimizer
from memtrain.setting import flags_of
from memtrain.techniques import SetUp, Terms, problems
from memtrain.techniques.optimizer import OptimizerChoice as OwnedOptimizerChoice


def _module(technique: techniques.Technique):
    return sys.modules[type(technique).__module__]


def test_each_choices_field_is_owned_by_one_technique():
    owned = [f for t in techniques.REGISTRY for f in t.fields]
    assert sorted(owned) == sorted(f.name for f in dataclasses.fields(Choices)), owned
    assert len(owned) == len(set(owned))
    assert techniques.optimizer.SETTING_FIELDS == tuple(f.name for f in dataclasses.fields(OptimizerChoice))
    assert OptimizerChoice is OwnedOptimizerChoice  # the setting type lives in its technique's module


def test_a_fields_flag_is_declared_once_in_its_techniques_module():
    """Choices declares a technique's field with the very ``dataclasses.Field`` its module holds, so the flag and
    its help are written in one place."""
    by_name = {f.name: f for f in dataclasses.fields(Choices)}
    for technique in techniques.REGISTRY:
        if hasattr(_module(technique), "FIELD"):
            (name,) = technique.fields
            assert by_name[name].metadata is _module(technique).FIELD.metadata, name
    assert [name for name, _ in flags_of(Choices)] == ["offload_activations", "chunked_loss", "pure_bf16",
                                                       "offload_weights", "tiled_mlp"]


def test_a_message_names_only_what_was_given_and_the_fix_names_it_back():
    (message,) = problems(SetUp(offload_weights=True, step_in_backward=True, offload_fraction=None),
                          techniques.optimizer.CHOICE_TERMS)
    assert message.startswith("offload_weights=True with optimizer.step_in_backward=True: "), message
    assert message.endswith("To resolve this error, drop optimizer.step_in_backward=True, or drop "
                            "offload_weights=True."), message
    # A share of 0 given with the placement left open is still a device optimizer's, and the message says so.
    (message,) = problems(SetUp(offload_weights=True, offload_fraction=0.0), techniques.optimizer.CHOICE_TERMS)
    assert "with optimizer.offload_fraction=0.0:" in message, message
    assert problems(SetUp(offload_weights=True, placement="offload", offload_fraction=None)) == []


def test_a_sites_terms_label_its_fields_and_word_its_fixes():
    terms = Terms(labels={"processes": "nproc"}, fixes={"gradients-before-ddp": "run one process"})
    (message,) = problems(SetUp(step_in_backward=True, processes=4), terms)
    assert message.startswith("step_in_backward=True with nproc=4: DDP and FSDP2 reduce"), message
    assert message.endswith("To resolve this error, run one process."), message


def test_the_plans_rules_are_not_the_primitives():
    """A step in backward with a partial offload builds (the device part steps in backward, the host part after
    it) but is not planned: the choices refuse it, build_optimizer does not."""
    setup = SetUp(step_in_backward=True, offload_fraction=0.5)
    assert techniques.refuses(setup) and problems(setup, primitives=True) == []
    with pytest.raises(ConfigError, match="a partial offload steps after backward"):
        OptimizerChoice(step_in_backward=True, offload_fraction=0.5)
    build_optimizer(torch.nn.Linear(8, 4).named_parameters(), lr=1e-3, step_in_backward=True, offload_fraction=0.5)


def test_a_foreign_class_that_cannot_step_alone_is_refused_at_start_up():
    """LBFGS needs every gradient at once: refused where the choices are made, not when the optimizer is built."""
    with pytest.raises(ConfigError, match="cannot step alone as its gradient is final"):
        OptimizerChoice(name="torch.optim.LBFGS", step_in_backward=True)
    OptimizerChoice(name="torch.optim.LBFGS")


def test_each_technique_is_one_module_with_one_technique_object():
    modules = [_module(t) for t in techniques.REGISTRY]
    assert len(set(modules)) == len(modules) and all(m.TECHNIQUE is t for m, t in zip(modules, techniques.REGISTRY,
                                                                                           strict=True))
    assert all(isinstance(t, techniques.Technique) and t.name for t in techniques.REGISTRY)
    from memtrain.planner import TECHNIQUES

    assert TECHNIQUES == ("checkpointing", "selective", "offload-activations", "chunked-loss", "tiled-mlp",
                          "offload-optimizer", "bf16-weights", "optimizer-state", "step-in-backward", "offload-weights")


NOTHING_FIXED = {"blocks": None, "flavor": None, "chunked_loss": None, "optimizer": None, "state_precision": None,
                 "step_in_backward": None, "offload_fraction": None, "compile": None, "pure_bf16": None,
                 "offload_weights": None, "tiled_mlp": None}
CPU_NOTE = "activation offload has no effect on a CPU-only run (no device memory to save): off"


@pytest.mark.parametrize("choices,device,values,closed,notes", [
    (Choices(), "cuda", NOTHING_FIXED, set(), []),
    (Choices(checkpointing="every:2", offload_activations=True), "cuda",
     {"blocks": ("recompute", "offload", "recompute", "offload"), "flavor": "offload-inputs"}, set(), []),
    (Choices(checkpointing="every:2", offload_activations=True), "cpu",
     {"blocks": ("recompute", "keep", "recompute", "keep"), "flavor": "full"}, {"offload-activations"}, [CPU_NOTE]),
    (Choices(checkpointing="all+offload"), "cpu", {"blocks": ("recompute",) * 4, "flavor": "full"},
     {"offload-activations"}, [CPU_NOTE]),
    (Choices(offload_activations=True), "cuda", {"blocks": None, "flavor": "offload-inputs"}, set(), []),
    (Choices(offload_activations=True), "cpu", {"blocks": None, "flavor": None}, {"offload-activations"},
     [CPU_NOTE]),
    (Choices(offload_activations=False), "cuda", {"flavor": None}, {"offload-activations"}, []),
    (Choices(optimizer=OptimizerChoice(placement="device")), "cuda", {"optimizer": "device", "offload_fraction": 0.0},
     {"offload-optimizer", "bf16-weights"}, []),
    (Choices(optimizer=OptimizerChoice(step_in_backward=True)), "cuda",
     {"optimizer": "device", "step_in_backward": True, "offload_fraction": None}, set(), []),
    (Choices(optimizer=OptimizerChoice(name="adafactor")), "cuda", {"state_precision": "fp32"}, {"optimizer-state"},
     []),
    (Choices(pure_bf16=True, compile=True, chunked_loss=False), "cuda",
     {"pure_bf16": True, "compile": True, "chunked_loss": False}, set(), []),
])
def test_each_techniques_share_of_the_fixed_choices(choices, device, values, closed, notes):
    """``Fixed.of_choices`` is the techniques' shares merged: a policy fixes the layout (offload_activations=True
    offloads what it keeps, and alone fixes how recomputed blocks recompute), refusing activation offload closes its
    search, a device optimizer closes the offloaded ones, a step in backward implies the device, a foreign class
    keeps its own fp32 state; on a CPU activation offload is off, with a note."""
    from memtrain.planner import TECHNIQUES, Fixed

    fixed, allowed, found = Fixed.of_choices(choices, n_blocks=4, device=device)
    assert {k: getattr(fixed, k) for k in values} == values
    assert set(TECHNIQUES) - allowed == closed and found == notes, (allowed, found)


def test_a_selective_policy_the_planner_cannot_plan_is_refused_by_checkpointings_share():
    from memtrain.planner import Fixed

    with pytest.raises(ConfigError, match="the planner's selective recompute keeps the outputs of"):
        Fixed.of_choices(Choices(checkpointing="selective(matmul)"), n_blocks=2, device="cuda")
    with pytest.raises(ConfigError, match="does not combine a selective recompute with offloaded inputs"):
        Fixed.of_choices(Choices(checkpointing="selective+offload"), n_blocks=2, device="cuda")


def _space(problem: SimpleNamespace, fixed, order=None):
    space = SimpleNamespace(flavors=[], offload_blocks=False, placements=["device"], states=["fp32"],
                            distributions=["none"], losses=[False], weights=[False], tiled=[False], pure_bf16=False)
    registry = list(order or techniques.REGISTRY)
    for technique in registry:
        technique.candidates(space, problem, frozenset(techniques.SEARCH))
    for technique in registry:
        technique.narrow(space, fixed)
    return vars(space)


CUDA = SimpleNamespace(cuda=True, precision="bf16-mixed", world=2, fsdp=None, chunkable=True, blocks_all_train=True,
                       int8=True, compile=True, mlp_tiles=8)


def test_the_search_space_is_each_techniques_candidates_narrowed_by_its_fixed_choices():
    from memtrain.planner import Fixed

    whole = _space(CUDA, Fixed())
    assert whole == {"flavors": ["full", "selective", "offload-inputs"], "offload_blocks": True,
                     "placements": ["device", "offload", "offload-bf16-weights"], "states": ["fp32", "bf16", "int8"],
                     "distributions": ["ddp", "fsdp2"], "losses": [False, True], "weights": [False, True],
                     "in_backward": [False, True], "fractions": [0.0, 0.25, 0.5, 0.75], "compiled": [False, True],
                     "tiled": [False, True], "pure_bf16": False}
    pure = _space(CUDA, Fixed(pure_bf16=True))  # no master: no bf16 device weights, int8 moments, FSDP2 or streaming
    assert (pure["placements"], pure["states"], pure["distributions"], pure["weights"], pure["pure_bf16"]) == (
        ["device", "offload"], ["fp32", "bf16"], ["ddp"], [False], True)
    streamed = _space(CUDA, Fixed(offload_weights=True))  # streamed weights are the offloaded optimizer's master
    assert streamed["placements"] == ["offload", "offload-bf16-weights"] and streamed["weights"] == [True]
    cpu = _space(SimpleNamespace(**{**vars(CUDA), "cuda": False, "world": 1, "int8": False, "compile": False}), Fixed())
    assert (cpu["flavors"], cpu["offload_blocks"], cpu["placements"], cpu["states"], cpu["weights"]) == (
        ["full", "selective"], False, ["device"], ["fp32", "bf16"], [False])
    assert (cpu["fractions"], cpu["compiled"]) == ([0.0], [False])  # no partial offload on a CPU; eager
    fixed = _space(CUDA, Fixed(step_in_backward=True, offload_fraction=0.0, compile=False))
    assert (fixed["in_backward"], fixed["fractions"], fixed["compiled"]) == ([True], [0.0], [False])
    # the tiled MLP: weighed where a sequence spans 4 tiles or more, fixed where given
    short = _space(SimpleNamespace(**{**vars(CUDA), "mlp_tiles": 3}), Fixed())
    assert (short["tiled"], _space(CUDA, Fixed(tiled_mlp=True))["tiled"]) == ([False], [True])


@pytest.mark.parametrize("fixed", [
    dict(pure_bf16=True), dict(offload_weights=True), dict(offload_weights=False, optimizer="offload"),
    dict(pure_bf16=True, optimizer="device", state_precision="bf16"), dict(chunked_loss=True, state_precision="int8"),
    dict(blocks=("recompute", "offload"), flavor="offload-inputs"), dict(blocks=("keep", "keep"), flavor=None),
])
def test_narrowing_a_valid_set_of_fixed_choices_does_not_depend_on_the_registrys_order(fixed):
    from memtrain.planner import Fixed

    chosen = Fixed(**fixed)
    assert _space(CUDA, chosen, reversed(techniques.REGISTRY)) == _space(CUDA, chosen), fixed


def test_a_technique_words_its_own_reason_line():
    view = SimpleNamespace(chunkable=False, world=1, settings=SimpleNamespace(chunked_loss=False))
    assert techniques.chunked_loss.TECHNIQUE.reasons(view) == [
        "loss on the whole logits: memtrain does not chunk this model's loss"]
    assert techniques.distribution.TECHNIQUE.reasons(view) == []  # one process: no line


def test_what_a_run_that_cannot_plan_must_fix_comes_from_each_technique():
    from memtrain.planner import Fixed

    open_ = Fixed.of_choices(Choices(), n_blocks=2, device="cuda")[0].left_open()
    assert open_ == ["checkpointing='none' (or another policy)", "chunked_loss=False",
                     "optimizer.placement='device'", "optimizer.state_precision='fp32'",
                     "optimizer.step_in_backward=False"], open_
    offloaded = Choices(checkpointing="none", chunked_loss=False, optimizer=OptimizerChoice(placement="offload"))
    assert Fixed.of_choices(offloaded, n_blocks=2, device="cuda")[0].left_open() == []


def test_what_the_trainer_helper_cannot_do_comes_from_each_technique():
    from memtrain.hf_trainer import trainer_problems

    everything = Choices(compile=True, pure_bf16=True, optimizer=OptimizerChoice(state_precision="bf16"))
    assert [p.split(":")[0] for p in trainer_problems(everything)] == [
        "optimizer.state_precision='bf16'", "pure_bf16=True", "compile=True"]  # the registry's order
    assert techniques.compiled.TECHNIQUE.trainer_problems(everything) == [trainer_problems(everything)[-1]]
    assert all(t.trainer_problems(Choices()) == [] for t in techniques.REGISTRY)  # the defaults: nothing refused


def test_an_estimates_options_are_each_techniques_own():
    from memtrain.estimate.arguments import setup_options

    parts = [t.trace_options(Choices(offload_weights=True), checkpointing="none", optimizer="adamw")[0]
             for t in techniques.REGISTRY]
    keys = [k for part in parts for k in part]
    assert len(keys) == len(set(keys)) == 9, keys  # each option given by one technique
    # parameter offload streams the offloaded optimizer's master: the optimizer's options trace it offloaded
    assert techniques.optimizer.TECHNIQUE.trace_options(
        Choices(offload_weights=True), checkpointing="none", optimizer="adamw")[0]["optimizer"] == "adamw-offload"
    options, problems = setup_options(Choices(checkpointing="all"), checkpointing="every:2", optimizer="adamw",
                                      precision="fp32")
    assert options["checkpointing"] == "every:2" and problems[0].startswith("checkpointing='every:2' and"), problems


def test_what_a_resumed_run_cannot_change_comes_from_each_technique(monkeypatch):
    from memtrain.planner import PlanSettings
    from memtrain.run.replan import check_kept_optimizer

    kept = PlanSettings(micro_batch_size=1, accumulation=1, blocks=(), flavor="full", chunked_loss=False,
                        optimizer="offload", distribution="none", compile=False)
    asked = Choices(pure_bf16=True, optimizer=OptimizerChoice(state_precision="bf16"))
    assert [given for t in techniques.REGISTRY for given, _ in t.kept_differences(asked, kept)] == [
        "optimizer.state_precision='bf16'", "pure_bf16=True"]  # the registry's order
    assert techniques.weight_offload.TECHNIQUE.kept_differences(Choices(offload_weights=True), kept) == [
        ("offload_weights=True", "offload_weights=True")]
    assert all(t.kept_differences(Choices(), kept) == [] for t in techniques.REGISTRY)  # unset: the run's own

    class Kept(techniques.Technique):  # a technique added to the registry is asked too: the resume names none
        name = "kept"

        def kept_differences(self, choices, kept):
            return [("kept=1", "kept=")]

    monkeypatch.setattr(techniques, "REGISTRY", (*techniques.REGISTRY, Kept()))
    with pytest.raises(ConfigError, match=r"^kept=1: the run's optimizer is offload.* drop kept= or start a new run"):
        check_kept_optimizer(Choices(), kept)


def test_a_plans_estimate_options_are_each_techniques_own(monkeypatch):
    from memtrain.planner import PlanSettings, search
    from memtrain.techniques.optimizer import NamedOptimizer

    names = ("b0", "b1", "b2")
    s = PlanSettings(micro_batch_size=2, accumulation=4, blocks=("offload", "recompute", "keep"),
                     flavor="selective", chunked_loss=True, optimizer="offload-bf16-weights", distribution="none",
                     compile=False, state_precision="bf16", step_in_backward=False, offload_fraction=0.0)
    assert techniques.planned_options(s, names) == {
        "checkpointing": {"policies": {"b0": "offload", "b1": "recompute", "b2": "keep"}, "selective": ("matmul", "attention")},
        "chunked_loss": True, "optimizer": "adamw-offload", "state_precision": "bf16", "offload_fraction": 0.0,
        "step_in_backward": False, "weights_dtype": "bf16", "pure_bf16": False, "accumulation": 4,
        "tiled_mlp": False}
    # inputs offloaded only where a block recomputes; a named class offloaded keeps all of its state on the host
    named = NamedOptimizer("torch.optim.SGD")
    s = dataclasses.replace(s, blocks=("keep",) * 3, flavor="offload-inputs", optimizer="offload",
                            state_precision="fp32", optimizer_class=named, pure_bf16=False)
    options = techniques.planned_options(s, names)
    assert options["checkpointing"] == {"policies": dict.fromkeys(names, "keep")}
    assert (options["optimizer"], options["offload_fraction"], options["weights_dtype"]) == (named, 1.0, None)

    class Extra(techniques.Technique):  # a technique added to the registry is asked too: the estimate traces it
        name = "extra"

        def planned_options(self, settings, block_names):
            return {"offload_min_bytes": 7}

    seen = {}
    monkeypatch.setattr(techniques, "REGISTRY", (*techniques.REGISTRY, Extra()))
    monkeypatch.setattr(search, "trace", lambda *args, **kwargs: seen.update(kwargs) or SimpleNamespace())
    monkeypatch.setattr(search, "rank_peak", lambda *args: 0.0)
    monkeypatch.setattr(search, "step_batch", lambda *args: None)
    monkeypatch.setattr(search, "gradient_shard", lambda *args: 0.0)
    search.estimate_of(SimpleNamespace(model=None, device="cpu", precision="fp32", block_names=names), None, s)
    assert seen["offload_min_bytes"] == 7 and seen["accumulation"] == 4


def test_the_search_is_the_cross_product_of_each_techniques_axis(monkeypatch):
    from memtrain.planner.search import _configurations, _SearchRun
    from memtrain.planner.settings import Fixed
    from memtrain.techniques.view import SearchSpace

    assert sorted(t.name for t in techniques.SEARCH_ORDER) == sorted(t.name for t in techniques.REGISTRY)
    space = SearchSpace(flavors=["full", "selective"], offload_blocks=False, placements=["device", "offload"],
                         states=["fp32", "bf16"], distributions=["none"], losses=[False, True], weights=[False],
                         in_backward=[False, True])
    run = _SearchRun(micros=[1, 2], per_rank=2)
    found = _configurations(space, Fixed(), run, 1, "bf16-mixed")
    # the rules drop an offloaded optimizer stepping in backward; the optimizer skips a step in backward with
    # accumulation (it saves nothing)
    assert not any(c.optimizer == "offload" and c.step_in_backward for c in found)
    assert not any(c.step_in_backward and c.accumulation > 1 for c in found)
    assert any(c.step_in_backward and c.accumulation == 1 for c in found)
    # 2 flavors x 2 losses x 2 micro-batches x (device: fp32/bf16 x after/in backward, offload: fp32/bf16), less the
    # 2 x 2 x 2 device set-ups stepping in backward at micro-batch 1 (accumulation 2)
    assert len(found) == 2 * 2 * 2 * (4 + 2) - 2 * 2 * 2
    assert found[0] == dataclasses.replace(found[0], optimizer="device", state_precision="fp32", flavor="full",
                                           chunked_loss=False, micro_batch_size=1)  # the outermost values first

    class Eager(techniques.Technique):  # a technique in the search order is asked too
        name = "eager only"

        def skips(self, configuration, fixed, run):
            return configuration.chunked_loss

    monkeypatch.setattr(techniques, "SEARCH_ORDER", (*techniques.SEARCH_ORDER, Eager()))
    assert _configurations(space, Fixed(), run, 1, "bf16-mixed") == [c for c in found if not c.chunked_loss]


def test_a_setups_words_are_each_techniques_own():
    from memtrain.techniques.chunked_loss import with_unset_default

    setup = Choices(checkpointing="all", offload_activations=True, chunked_loss=True, pure_bf16=True,
                    optimizer=OptimizerChoice(state_precision="bf16", step_in_backward=True))
    assert [text for t in techniques.REGISTRY if (text := t.setup_text(setup))] == [
        "checkpointing all", "activations offloaded to host RAM", "a chunked loss",
        "AdamW on the device, bf16 moments, step in backward", "pure bf16 (bf16 weights, no master)"]
    assert techniques.optimizer.TECHNIQUE.setup_text(Choices(offload_weights=True)).startswith("AdamW offloaded")
    # an unset chunked loss, where no plan chooses: on with checkpointing, where the model's loss can be chunked
    assert with_unset_default(Choices(checkpointing="all"), True).chunked_loss is True
    assert with_unset_default(Choices(checkpointing="all"), False).chunked_loss is False
    assert with_unset_default(Choices(checkpointing="none"), True).chunked_loss is False
    assert with_unset_default(Choices(checkpointing="all", chunked_loss=False), True).chunked_loss is False


def test_a_plans_record_reads_as_the_rules_set_up_through_each_technique():
    from memtrain.planner import PlanSettings
    from memtrain.planner.checks import check_settings, setup_of
    from memtrain.planner.settings import Fixed

    s = PlanSettings(micro_batch_size=1, accumulation=1, blocks=("keep",), flavor="full", distribution="ddp",
                     optimizer="offload", chunked_loss=True, state_precision="bf16", offload_fraction=0.0)
    assert setup_of(s, 2, "bf16-mixed", chunkable=False) == SetUp(
        placement="offload", state_precision="bf16", step_in_backward=False, offload_fraction=None,
        optimizer=s.optimizer_class, pure_bf16=False, offload_weights=False, compile=False, chunked_loss=True,
        precision="bf16-mixed", processes=2, fsdp=False, chunkable=False, tiled_mlp=False)
    # a share offloaded is one only in (0, 1]: out of it, the optimizer names the value instead
    assert techniques.planned_setup(dataclasses.replace(s, offload_fraction=0.5)).offload_fraction == 0.5
    assert techniques.planned_setup(Fixed()) == SetUp(optimizer=Fixed().optimizer_class)  # nothing fixed
    with pytest.raises(ConfigError) as info:  # a hand-made record's values: the optimizer's own problems
        check_settings(dataclasses.replace(s, optimizer="device", distribution="none", offload_fraction=1.5,
                                           state_precision="x"), 1, 1, True, 1, True, "bf16-mixed")
    assert [p.split(" To resolve")[0] for p in info.value.problems[:2]] == [
        "state_precision='x' is not one of fp32, bf16, int8.",
        "offload_fraction=1.5: a share in [0, 1] of a device optimizer's state."]


def test_the_searchs_order_is_the_optimizer_then_compile_loss_micro_batch_and_flavor():
    """The candidates are composed (and tie-ranked) in the old loops' order: the optimizer outermost, the flavor
    innermost (techniques.SEARCH_ORDER); the registry's order would put the flavor first."""
    from memtrain.planner.search import _configurations, _SearchRun
    from memtrain.planner.settings import Fixed
    from memtrain.techniques.view import SearchSpace

    space = SearchSpace(flavors=["full", "selective"], offload_blocks=False, placements=["device", "offload"],
                         states=["fp32"], distributions=["none"], losses=[False, True], weights=[False],
                         in_backward=[False, True])
    run = _SearchRun(micros=[1, 2], per_rank=2)
    found = [(c.optimizer, c.step_in_backward, c.chunked_loss, c.micro_batch_size, c.flavor)
             for c in _configurations(space, Fixed(), run, 1, "bf16-mixed")]
    assert found == [(placement, sib, loss, b, flavor)
                     for placement, sib in (("device", False), ("device", True), ("offload", False))
                     for loss in (False, True) for b in (1, 2) for flavor in ("full", "selective")
                     if not (sib and b == 1)]  # a step in backward with accumulation saves nothing


def test_the_choices_switches_are_read_from_their_fields():
    from memtrain.choices import ON_OFF, SWITCHES

    assert SWITCHES == ("offload_activations", "chunked_loss", "offload_weights", "tiled_mlp")  # True, False or None
    assert ON_OFF == ("compile", "pure_bf16")  # True or False


def test_a_plans_words_are_each_techniques_own():
    from memtrain.planner import PlanSettings

    s = PlanSettings(micro_batch_size=1, accumulation=1, blocks=("recompute", "keep", "offload"), flavor="selective",
                     distribution="none", chunked_loss=True, offload_fraction=0.25, state_precision="bf16")
    assert (s.checkpointing, s.loss_text, s.optimizer_text) == (
        "1 recompute selective, 1 offload, 1 keep of 3", "chunked", "25% offloaded, bf16 moments")
