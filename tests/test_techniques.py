"""The registry of techniques (``memtrain.techniques``): each setting field owned by one technique and declared
once, in its module; the rules' messages read in each site's terms; the rules of what the plan plans apart from
those of what the primitives build."""

from __future__ import annotations

import dataclasses
import sys

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
                                                       "offload_weights"]


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
    assert message.startswith("step_in_backward=True with nproc=4: DDP averages"), message
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

    assert TECHNIQUES == ("checkpointing", "selective", "offload-activations", "chunked-loss", "offload-optimizer",
                          "bf16-weights", "optimizer-state", "step-in-backward", "offload-weights")


@pytest.mark.parametrize("choices,device,values,closed,notes", [
    (Choices(), "cuda", {}, set(), 0),
    (Choices(checkpointing="every:2", offload_activations=True), "cuda",
     {"blocks": ("recompute", "offload", "recompute", "offload"), "flavor": "offload-inputs"}, set(), 0),
    (Choices(checkpointing="all+offload"), "cpu", {"blocks": ("recompute",) * 4, "flavor": "full"},
     {"offload-activations"}, 1),
    (Choices(offload_activations=False), "cuda", {"flavor": None}, {"offload-activations"}, 0),
    (Choices(optimizer=OptimizerChoice(placement="device")), "cuda", {"optimizer": "device", "offload_fraction": 0.0},
     {"offload-optimizer", "bf16-weights"}, 0),
    (Choices(optimizer=OptimizerChoice(name="adafactor", state_precision="fp32")), "cuda",
     {"state_precision": "fp32"}, {"optimizer-state"}, 0),
])
def test_each_techniques_share_of_the_fixed_choices(choices, device, values, closed, notes):
    """``Fixed.of_choices`` is the techniques' shares merged: a policy fixes the layout (offload_activations=True
    offloads what it keeps), refusing activation offload closes its search, a device optimizer closes the offloaded
    ones, a foreign class closes lean moments; on a CPU activation offload is off, with a note."""
    from memtrain.planner import TECHNIQUES, Fixed

    fixed, allowed, found = Fixed.of_choices(choices, n_blocks=4, device=device)
    assert {k: getattr(fixed, k) for k in values} == values
    assert set(TECHNIQUES) - allowed == closed and len(found) == notes, (allowed, found)


def test_what_a_run_that_cannot_plan_must_fix_comes_from_each_technique():
    from memtrain.planner import Fixed

    open_ = Fixed.of_choices(Choices(), n_blocks=2, device="cuda")[0].left_open()
    assert open_ == ["checkpointing='none' (or another policy)", "chunked_loss=False",
                     "optimizer.placement='device'", "optimizer.state_precision='fp32'",
                     "optimizer.step_in_backward=False"], open_
    offloaded = Choices(checkpointing="none", chunked_loss=False, optimizer=OptimizerChoice(placement="offload"))
    assert Fixed.of_choices(offloaded, n_blocks=2, device="cuda")[0].left_open() == []
