"""Each rule between two techniques exists once, in its technique's module (``memtrain.techniques``): the list,
each rule firing where it should (``Choices``, ``build_optimizer``, the planner's checks), its test written once
(every site asks ``memtrain.techniques.problems``), and its reason written nowhere else under memtrain/."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
import torch

from memtrain import techniques
from memtrain.choices import Choices, OptimizerChoice
from memtrain.errors import ConfigError
from memtrain.models import GPT, GPT_PRESETS
from memtrain.optim import build_optimizer
from memtrain.planner.checks import check_fixed
from memtrain.planner.settings import Fixed
from memtrain.techniques import SetUp, refuses
from memtrain.techniques.optimizer import NamedOptimizer

PACKAGE = Path(techniques.__file__).parent.parent
HYPER = dict(lr=1e-3)


def test_the_rules_are_listed_once_each():
    assert [r.name for r in techniques.RULES] == [
        "checkpoint-offload-inputs", "checkpoint-offload-blocks", "chunked-loss-model", "tiled-mlp-model",
        "tiled-mlp-compile", "gradients-before-ddp", "offload-optimizer-fsdp", "offload-optimizer-fsdp-moments",
        "offload-with-fraction", "offload-with-step-in-backward",
        "step-in-backward-with-fraction", "step-in-backward-fp16-scaler", "step-in-backward-per-parameter",
        "bf16-device-weights-precision", "named-optimizer-own-state",
        "pure-bf16-int8", "pure-bf16-precision", "pure-bf16-fsdp", "pure-bf16-cast-weights",
        "offload-weights-device-optimizer", "offload-weights-compile", "offload-weights-pure-bf16",
        "offload-weights-one-process", "fsdp-offload-streams-weights", "offload-weights-blocks",
    ]
    for technique in techniques.REGISTRY:  # each module's rules are all its technique's, and no rule is elsewhere
        module = sys.modules[type(technique).__module__]
        module_rules = [v for v in vars(module).values() if isinstance(v, techniques.Rule)]
        assert sorted(r.name for r in module_rules) == sorted(r.name for r in technique.rules), module.__name__
    for rule in techniques.RULES:
        assert rule.why.endswith(".") and rule.fix and not rule.fix.endswith("."), rule
        message = rule.message("a=1 with b=2")
        assert message.startswith("a=1 with b=2: ") and "To resolve this error, " in message, message


def _refusal(call) -> str:
    with pytest.raises(ConfigError) as info:
        call()
    return str(info.value)


# Each rule a typed set of choices can break, and the choices that break it.
CHOICES = {
    "pure-bf16-int8": lambda: Choices(pure_bf16=True, optimizer=OptimizerChoice(state_precision="int8")),
    "pure-bf16-precision": lambda: ConfigError.raise_if(Choices(pure_bf16=True).precision_problems("fp16-mixed")),
    "pure-bf16-fsdp": lambda: Choices(pure_bf16=True).check_run(world_size=2, fsdp=True),
    "pure-bf16-cast-weights": lambda: Choices(pure_bf16=True, optimizer=OptimizerChoice(
        placement="offload-bf16-weights")),
    "gradients-before-ddp": lambda: Choices(optimizer=OptimizerChoice(step_in_backward=True)).check_run(world_size=2),
    "offload-optimizer-fsdp": lambda: Choices(optimizer=OptimizerChoice(placement="offload-bf16-weights")).check_run(
        world_size=2, fsdp=True),
    "offload-optimizer-fsdp-moments": lambda: Choices(optimizer=OptimizerChoice(
        placement="offload", state_precision="bf16")).check_run(world_size=2, fsdp=True),
    "fsdp-offload-streams-weights": lambda: Choices(offload_weights=False, optimizer=OptimizerChoice(
        placement="offload")).check_run(world_size=2, fsdp=True),
    "offload-with-fraction": lambda: OptimizerChoice(placement="offload", offload_fraction=0.5),
    "offload-with-step-in-backward": lambda: OptimizerChoice(placement="offload", step_in_backward=True),
    "step-in-backward-with-fraction": lambda: OptimizerChoice(step_in_backward=True, offload_fraction=0.5),
    "offload-weights-device-optimizer": lambda: Choices(offload_weights=True,
                                                        optimizer=OptimizerChoice(placement="device")),
    "offload-weights-compile": lambda: Choices(offload_weights=True, compile=True),
    "offload-weights-pure-bf16": lambda: Choices(offload_weights=True, pure_bf16=True),
    "offload-weights-one-process": lambda: Choices(offload_weights=True).check_run(world_size=2),
    "checkpoint-offload-inputs": lambda: Choices(checkpointing="all+offload", offload_activations=False),
    "checkpoint-offload-blocks": lambda: Choices(checkpointing="blocks(RO)", offload_activations=False),
    "named-optimizer-own-state": lambda: OptimizerChoice(name="adafactor", state_precision="bf16"),
    # a run's choices with what its model lacks (train on a model without blocks asks this: tests/test_train.py)
    "offload-weights-blocks": lambda: ConfigError.raise_if(
        techniques.problems(Choices(offload_weights=True).setup(has_blocks=False))),
    "tiled-mlp-compile": lambda: Choices(tiled_mlp=True, compile=True),
    # a model with no MLP to tile (the estimate asks this of the model: tests/test_tiled_mlp.py)
    "tiled-mlp-model": lambda: ConfigError.raise_if(
        techniques.problems(Choices(tiled_mlp=True).setup(tileable=False))),
}


def _params(dtype: torch.dtype = torch.float32):
    return torch.nn.Linear(8, 4).to(dtype).named_parameters()


def _fp16_scaler() -> torch.amp.GradScaler:
    return torch.amp.GradScaler("cpu")


# Each rule the optimizer's builder checks, and the arguments that break it.
BUILD = {
    "pure-bf16-int8": lambda: build_optimizer(_params(torch.bfloat16), **HYPER, pure_bf16=True,
                                              state_precision="int8"),
    "pure-bf16-precision": lambda: build_optimizer(_params(torch.bfloat16), **HYPER, pure_bf16=True,
                                                   grad_scaler=_fp16_scaler()),
    "gradients-before-ddp": lambda: build_optimizer(_params(), **HYPER, step_in_backward=True, world_size=2),
    "step-in-backward-fp16-scaler": lambda: build_optimizer(_params(), **HYPER, step_in_backward=True,
                                                            state_precision="bf16", grad_scaler=_fp16_scaler()),
    "step-in-backward-per-parameter": lambda: build_optimizer(_params(), **HYPER, step_in_backward=True,
                                                              optimizer_class=torch.optim.LBFGS),
    "named-optimizer-own-state": lambda: build_optimizer(_params(), **HYPER, optimizer_class="lion",
                                                         state_precision="int8"),
}

# The planner's checks of fixed choices.
PLANNER = {
    "bf16-device-weights-precision": lambda: check_fixed(Fixed(optimizer="offload-bf16-weights"), 2, True, True,
                                                         "fp32"),
    "pure-bf16-int8": lambda: check_fixed(Fixed(pure_bf16=True, state_precision="int8"), 2, True, True,
                                          "bf16-mixed"),
    "pure-bf16-precision": lambda: check_fixed(Fixed(pure_bf16=True), 2, True, True, "fp16-mixed"),
    "step-in-backward-fp16-scaler": lambda: check_fixed(
        Fixed(step_in_backward=True, optimizer_class=NamedOptimizer.of("adafactor")), 2, True, True, "fp16-mixed"),
    "chunked-loss-model": lambda: check_fixed(Fixed(chunked_loss=True), 2, True, False, "fp32"),
}


@pytest.mark.parametrize("site,name", [(site, name) for site, table in
                                       (("choices", CHOICES), ("build", BUILD), ("planner", PLANNER))
                                       for name in table])
def test_each_rule_fires_with_its_reason(site, name):
    rule = next(r for r in techniques.RULES if r.name == name)
    call = {"choices": CHOICES, "build": BUILD, "planner": PLANNER}[site][name]
    message = _refusal(call)
    assert rule.why in message and "To resolve this error, " in message, (name, message)


def test_every_rule_is_proven_somewhere():
    assert {r.name for r in techniques.RULES} == set(CHOICES) | set(BUILD) | set(PLANNER)


def test_a_partial_offload_under_ddp_is_the_same_rule_in_build_optimizer():
    message = _refusal(lambda: build_optimizer(_params(), **HYPER, offload_fraction=0.5, world_size=2))
    assert techniques.optimizer.GRADIENTS_BEFORE_DDP.why in message and "offload_fraction=0" in message, message


def test_the_search_never_plans_a_step_in_backward_that_fp16_refuses():
    """The plan must not choose what build_optimizer then refuses: under fp16's scaler only fused AdamW (fp32
    moments) steps in backward. At 1 GiB the gpt-small's Adafactor fits only by stepping in backward, so the plan
    says nothing fits (it used to plan the step in backward, which train then refused)."""
    from memtrain.planner import plan
    from memtrain.planner.devices import known_gpu
    from memtrain.planner.search import _configurations, _SearchRun
    from memtrain.techniques.view import SearchSpace

    def space(states):
        return SearchSpace(flavors=[], offload_blocks=False, placements=["device"], states=states,
                            in_backward=[False, True], distributions=["none"], losses=[False], weights=[False])

    run = _SearchRun(micros=[1], per_rank=1)
    adafactor = Fixed(optimizer_class=NamedOptimizer.of("adafactor"))
    searched = _configurations(space(["fp32"]), adafactor, run, 1, "fp16-mixed")
    assert searched and not any(c.step_in_backward for c in searched), searched
    adamw = _configurations(space(["fp32", "bf16"]), Fixed(), run, 1, "fp16-mixed")
    assert {(c.state_precision, c.step_in_backward) for c in adamw} == {("fp32", False), ("fp32", True),
                                                                       ("bf16", False)}
    with torch.device("meta"):
        model = GPT(GPT_PRESETS["gpt-small"])
    with pytest.raises(ConfigError, match="no set-up fits"):
        plan(model, budget="1GiB", seq_len=512, global_batch_size=8, device="cuda", precision="fp16-mixed",
             device_profile=known_gpu("H100"), choices=Choices(optimizer=OptimizerChoice(name="adafactor",
                                                                                          placement="device")))


def test_the_searchs_pruning_obeys_the_rules():
    ddp = SetUp(processes=2)
    assert refuses(ddp.with_(step_in_backward=True)) and refuses(ddp.with_(offload_fraction=0.5))
    assert not refuses(SetUp(step_in_backward=True)) and not refuses(ddp.with_(step_in_backward=False))
    assert refuses(SetUp(step_in_backward=True, offload_fraction=0.25))
    assert not refuses(SetUp(step_in_backward=True, offload_fraction=0.0))
    # FSDP2 offloads its own shards (CPUOffloadPolicy): fp32 moments, the weights streamed with them.
    assert refuses(SetUp(placement="offload-bf16-weights", fsdp=True))
    assert not refuses(SetUp(placement="offload-bf16-weights", fsdp=False))
    assert not refuses(SetUp(placement="offload", fsdp=True, offload_weights=True, processes=2))
    assert refuses(SetUp(placement="offload", fsdp=True, offload_weights=False, processes=2))
    assert refuses(SetUp(placement="offload", fsdp=True, offload_weights=True, state_precision="bf16", processes=2))
    assert refuses(SetUp(placement="offload", fsdp=False, offload_weights=True, processes=2))  # DDP streams nothing


def test_every_site_asks_the_registry_and_no_other_module_tests_a_rule():
    """A rule's test is written once, as its ``refuses``: no module outside memtrain/techniques/ names a rule's
    test or builds a message from a rule itself, but for the two messages whose facts only the site knows
    (CPUOffloadOptimizer's running ranks and a foreign class with lean moments)."""
    constants = sorted(name for technique in techniques.REGISTRY
                       for name, value in vars(sys.modules[type(technique).__module__]).items()
                       if isinstance(value, techniques.Rule))
    assert len(constants) == len(techniques.RULES)
    sites = {}
    for path in PACKAGE.rglob("*.py"):
        if "techniques" in path.parts:
            continue
        text = path.read_text()
        for constant in constants:
            for hit in re.findall(rf"\b{constant}\.(?:message|refuses)\(", text):
                sites.setdefault(str(path.relative_to(PACKAGE.parent)), []).append(hit)
    assert sites == {"memtrain/optim/offload.py": ["GRADIENTS_BEFORE_DDP.message(", "NAMED_OWN_STATE.message("]}, \
        sites


def _joined(text: str) -> str:
    """Source with adjacent string literals joined (``"a "\\n  "b"`` -> ``"a b"``), so a wrapped sentence is found."""
    return re.sub(r"\"\s*\n\s*f?\"", "", text)


@pytest.mark.parametrize("rule", techniques.RULES, ids=lambda r: r.name)
def test_each_rules_reason_is_written_only_in_its_techniques_module(rule):
    sentence = rule.why.parts[0][:60]  # distinctive: the opening words of the reason (up to an argument it names)
    homes = sorted(str(path.relative_to(PACKAGE.parent)) for path in PACKAGE.rglob("*.py")
                   if sentence in _joined(path.read_text()))
    owner = next(t for t in techniques.REGISTRY if rule in t.rules)
    module = Path(sys.modules[type(owner).__module__].__file__)  # techniques/<name>.py, or a package's module
    assert homes == [str(module.relative_to(PACKAGE.parent))], (rule.name, sentence, homes)


class _UnchunkableLM(torch.nn.Module):
    """Blocks, but a loss ``memtrain.loss`` does not know how to chunk (not GPT, not a Hugging Face model)."""

    def __init__(self, blocks: int = 2):
        super().__init__()
        self.emb = torch.nn.Embedding(64, 8)
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(blocks))
        self.head = torch.nn.Linear(8, 64)

    def forward(self, x):
        h = self.emb(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


def test_a_loss_that_cannot_be_chunked_is_one_rule_in_the_same_words_wherever_the_model_is_known():
    """The chunked loss's rule with the model (it was five checks, each worded its own way): the planner's checks
    of fixed choices and of hand-made set-ups, a run without blocks, the estimator (memtrain estimate: the next test)."""
    from memtrain.config import TrainConfig
    from memtrain.estimate import estimate
    from memtrain.planner import PlanSettings
    from memtrain.planner.checks import check_settings
    from memtrain.run.replan import RunContext, plan_for_run

    why = next(r for r in techniques.RULES if r.name == "chunked-loss-model").why
    settings = PlanSettings(micro_batch_size=1, accumulation=1, blocks=("keep", "keep"), flavor="full",
                            chunked_loss=True, optimizer="device", distribution="none", compile=False)
    context = RunContext(seq_len=4, global_batch=2, device=torch.device("cpu"), world=1, precision="fp32")
    messages = {
        "fixed": _refusal(lambda: check_fixed(Fixed(chunked_loss=True), 2, True, False, "fp32")),
        "settings": _refusal(lambda: check_settings(settings, 2, 1, True, 1, False, "fp32")),
        "no blocks": _refusal(lambda: plan_for_run(torch.nn.Linear(8, 8), TrainConfig(
            choices=Choices(chunked_loss=True)), context)),
        "estimate": _refusal(lambda: estimate(_UnchunkableLM(), torch.zeros(2, 8, dtype=torch.long), device="cpu",
                                              setup=Choices(chunked_loss=True))),
    }
    for site, message in messages.items():
        assert message.startswith(f"chunked_loss=True: {why} To resolve this error, pass chunked_loss=False"), (
            site, message)
    assert messages["fixed"].endswith("(or leave it to the plan).")  # the planner's own fix: it could choose
    assert messages["settings"].endswith("pass chunked_loss=False.")  # a set-up given whole: no plan to leave it to
    assert not techniques.problems(SetUp(chunked_loss=True))  # a model not known: nothing to refuse
    assert not techniques.problems(SetUp(chunked_loss=False, chunkable=False))


def test_memtrain_estimate_names_the_loss_rule_in_flag_terms(tmp_path, capsys):
    transformers = pytest.importorskip("transformers")
    from memtrain.cli import main

    why = next(r for r in techniques.RULES if r.name == "chunked-loss-model").why
    transformers.MixtralConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                               num_key_value_heads=2, vocab_size=128, max_position_embeddings=256, head_dim=16,
                               num_local_experts=2, num_experts_per_tok=1).save_pretrained(tmp_path)  # a router loss
    assert main(["estimate", "--hf-config", str(tmp_path / "config.json"), "--seq-len", "64",
                 "--micro-batch-size", "2", "--chunked-loss", "--json"]) == 2
    assert f"--chunked-loss: {why} To resolve this error, pass --no-chunked-loss." in capsys.readouterr().err
