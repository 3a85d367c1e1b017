"""The typed policy ``Checkpointing``: its spellings, round trips, errors, and that it configures a model as
the apply_checkpointing call it stands for."""

from __future__ import annotations

import pytest
import torch
from checkpointing_parity import assert_grads_equal, gpt, gpt_step
from helpers import tiny_gpt
from torch import nn

from memtrain import (
    ConfigError,
    apply_checkpointing,
    measure,
)
from memtrain.checkpointing import checkpointed_blocks


@pytest.mark.parametrize("value", ["none", "all", "every:3", "selective", "selective(matmul)",
                                   "selective(matmul,attention,conv)", "blocks(RRKO)", "all+offload",
                                   "every:2+offload", "blocks(ROK)+offload", "blocks(RRK)+selective",
                                   "blocks(RKO)+selective(matmul)+offload", True, False, None, 4])
def test_checkpointing_parse_round_trips_its_str(value):
    from memtrain.checkpointing import Checkpointing

    policy = Checkpointing.parse(value)
    assert Checkpointing.parse(str(policy)) == policy, (value, str(policy))
    assert Checkpointing.parse(policy) is policy
    hash(policy)  # a frozen, hashable value: plans compare and cache them



def test_checkpointing_parse_spellings():
    from memtrain.checkpointing import Checkpointing, SelectivePolicy

    assert Checkpointing.parse(" Every:2 ") == Checkpointing(mode="every", every=2)
    assert Checkpointing.parse(True) == Checkpointing() == Checkpointing(mode="all")
    assert Checkpointing.parse(None) == Checkpointing.parse(False) == Checkpointing(mode="none")
    assert Checkpointing.parse("selective") == Checkpointing(mode="selective", selective=SelectivePolicy())
    assert Checkpointing.parse("blocks(rko)").blocks == ("recompute", "keep", "offload")
    assert Checkpointing.parse("all+offload").offload_inputs
    assert str(Checkpointing(mode="selective", selective=SelectivePolicy(keep=["matmul"]))) == "selective(matmul)"



_POLICY_CASES = {
    "none": ({}, "none"),
    "all": ({}, "all"),
    "every:3": ({"every": 3}, "every:3"),
    "selective": ({"selective": ("matmul",)}, "selective(matmul)"),
    "blocks": ({"policies": {"blocks.0": "offload", "blocks.1": "keep", "blocks.2": "recompute",
                             "blocks.3": "keep", "blocks.4": "offload"}}, "blocks(OKRKO)"),
    "all+offload": ({"offload": True}, "all+offload"),
    "blocks+offload": ({"policies": {f"blocks.{i}": p for i, p in enumerate("recompute keep offload keep recompute"
                                                                             .split())}, "offload": True},
                       "blocks(RKOKR)+offload"),
    "blocks+selective": ({"policies": {f"blocks.{i}": p for i, p in enumerate("recompute keep offload keep recompute"
                                                                               .split())}, "selective": ("matmul",)},
                         "blocks(RKOKR)+selective(matmul)"),
}



@pytest.mark.parametrize("case", list(_POLICY_CASES))
def test_checkpointing_apply_matches_apply_checkpointing(case):
    """Each mode configures the model exactly as the apply_checkpointing call it stands for, and its
    block_policies say what each block does."""
    from memtrain.checkpointing import Checkpointing
    from memtrain.offload import ActivationOffloader, CpuTransport

    kwargs, spelling = _POLICY_CASES[case]
    policy = Checkpointing.parse(spelling)
    by_policy, by_call = tiny_gpt(5, seq_len=64, dropout=0.1, seed=0), tiny_gpt(5, seq_len=64, dropout=0.1, seed=0)
    offloader = ActivationOffloader(CpuTransport(), min_bytes=1, host_budget_bytes=2**24, slab_bytes=2**16)
    apply_checkpointing(by_policy)  # "none" must remove what is there
    names = policy.apply(by_policy, offloader=offloader)
    expected = [] if case == "none" else apply_checkpointing(by_call, offloader=offloader, **kwargs)
    assert names == expected == checkpointed_blocks(by_policy), (names, expected)

    def specs(model):
        return {name: (m.forward.spec.policy, m.forward.spec.selective, m.forward.spec.offloader is not None)
                for name, m in model.named_modules() if name in checkpointed_blocks(model)}

    assert specs(by_policy) == specs(by_call)
    per_block = policy.block_policies(5)
    assert [f"blocks.{i}" for i, p in enumerate(per_block) if p != "keep"] == names, per_block
    assert [f"blocks.{i}" for i, p in enumerate(per_block) if p == "offload"] == [
        name for name, (kind, _, _) in specs(by_policy).items() if kind == "offload"]
    torch.manual_seed(1)
    gpt_step(by_policy).backward()
    torch.manual_seed(1)
    gpt_step(by_call).backward()
    assert_grads_equal(by_policy, by_call)



def test_a_layout_recomputed_selectively_trains_as_plain_training():
    """A plan's mixed layout with its selective flavor, written as a policy: gradients bit-equal to no checkpointing
    (dropout included: the recompute replays the RNG), and its saved bytes between the same layout recomputed whole
    and keeping every block (the selective blocks keep their matmul and attention outputs)."""
    from memtrain.checkpointing import Checkpointing

    saved, models = {}, {}
    for spelling in ("none", "blocks(RRKK)", "blocks(RRKK)+selective"):
        model = models[spelling] = tiny_gpt(4, seq_len=64, dropout=0.1, seed=0)
        Checkpointing.parse(spelling).apply(model)
        torch.manual_seed(1)
        saved[spelling] = measure(lambda m=model: gpt_step(m), model=model).activation_bytes
    assert_grads_equal(models["none"], models["blocks(RRKK)+selective"])
    assert saved["blocks(RRKK)"] < saved["blocks(RRKK)+selective"] < saved["none"], saved


@pytest.mark.parametrize("value, match", [
    ("every:0", "every:K recomputes one block in K"), ("sometimes", "not a checkpointing policy"), (0, "must be >= 1"),
    (2.5, "not a checkpointing policy"), ("auto", "planner"), ("blocks(RX)", "'x' is not a block letter"),
    ("selective(softmax)", "unknown op kinds"), ("none+offload", "offload_inputs=True with mode='none'"),
    ("blocks(RK)+selective(softmax)", "unknown op kinds"), ("blocks(KO)+selective", "no block recomputes"),
])
def test_checkpointing_parse_errors_name_the_accepted_spellings(value, match):
    from memtrain.checkpointing import Checkpointing

    with pytest.raises(ConfigError, match=match) as e:
        Checkpointing.parse(value)
    if "not a checkpointing policy" in match:
        assert "'every:K'" in str(e.value) and "To resolve this error" in str(e.value), str(e.value)



def test_checkpointing_reports_every_problem_at_once():
    from memtrain.checkpointing import Checkpointing

    with pytest.raises(ConfigError) as e:
        Checkpointing(mode="all", every=2, selective=("matmul",), blocks=("keep", "swap"), offload_inputs="yes")
    assert len(e.value.problems) == 5, e.value.problems
    with pytest.raises(ConfigError, match="is not a checkpointing mode"):
        Checkpointing(mode="some")
    with pytest.raises(ConfigError, match="needs one policy per block"):
        Checkpointing(mode="blocks")
    with pytest.raises(ConfigError, match="names 3 blocks, but GPT has 2"):
        Checkpointing.parse("blocks(RKR)").apply(gpt(n_layer=2))
    with pytest.raises(ConfigError, match="names 3 blocks, not 4"):
        Checkpointing.parse("blocks(RKR)").block_policies(4)



def test_a_block_layout_on_a_model_without_detected_blocks_is_a_config_error():
    from memtrain.checkpointing import Checkpointing

    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))  # no repeated blocks
    policy = Checkpointing.parse("blocks(RK)")
    for call in (lambda: policy.arguments(model), lambda: policy.apply(model)):
        with pytest.raises(ConfigError) as info:
            call()
        message = str(info.value)
        assert "blocks(RK)" in message and "no repeated blocks" in message and "To resolve this error" in message, (
            message)



@pytest.mark.parametrize("spelling, fragment", [("blocks", "a letter per block"), ("blocks()", "a letter per block"),
                                                ("blocks(RXK)", "'x'")])
def test_a_block_layout_spelling_without_valid_letters_names_the_spelling(spelling, fragment):
    from memtrain.checkpointing import Checkpointing

    with pytest.raises(ConfigError) as info:
        Checkpointing.parse(spelling)
    message = str(info.value)
    assert fragment in message and "blocks(RRK)" in message and "To resolve this error" in message, message



def test_mode_blocks_without_policies_names_the_spelling():
    from memtrain.checkpointing import Checkpointing

    with pytest.raises(ConfigError, match=r"blocks\(RRK\)"):
        Checkpointing(mode="blocks")
