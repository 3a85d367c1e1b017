"""The checks of the planner's inputs: budgets, fixed choices and hand-made set-ups, each problem named with its
fix (``ConfigError`` collects them).
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterable
from typing import Any

from memtrain.choices import Choices
from memtrain.errors import ConfigError
from memtrain.message import Message, arg, marked
from memtrain.planner.settings import TECHNIQUES, Fixed, PlanSettings
from memtrain.report import parse_bytes
from memtrain.techniques import REGISTRY, SetUp, Terms, planned_setup
from memtrain.techniques import problems as rule_problems
from memtrain.techniques.optimizer import CHOICE_TERMS

# How the planner's set-ups read in the rules' messages: the placement is "optimizer".
SETTINGS_TERMS = Terms(labels={"placement": "optimizer", "optimizer": "optimizer_class"}, fixes={
    "offload-weights-device-optimizer": "pass optimizer 'offload' (or 'offload-bf16-weights'), or drop "
                                        f"{arg('offload_weights', True)}"})
# And its fixed choices, which the plan may also leave open: a run's ``Choices``, named as it writes them.
PLAN_TERMS = Terms(labels=CHOICE_TERMS.labels, values=CHOICE_TERMS.values, fixes={
    "chunked-loss-model": f"pass {arg('chunked_loss', False)} (or leave it to the plan)"})


# -- the checks ---------------------------------------------------------------------------------------------
def budget_bytes(value: Any, name: str = "budget") -> int | None:
    """A budget as bytes: an int, a size such as ``"24GiB"`` / ``"8000MB"``, or None / ``"unlimited"`` (None).

    Raises:
        ConfigError: a negative, zero, non-finite or unparsable value (naming ``name``).
    """
    problems: list[str] = []
    out = parse_budget(value, name, problems)
    ConfigError.raise_if(problems)
    return out


def parse_budget(value: Any, name: str, problems: list[str]) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool):
        problems.append(Message(f"{arg(name, value)} is not a size. To resolve this error, pass bytes or a size "
                                "such as '24GiB'."))
        return None
    if isinstance(value, (int, float)):
        if value == math.inf:
            return None
        if not math.isfinite(value) or value <= 0:
            problems.append(Message(f"{arg(name, value)} must be a positive number of bytes. To resolve this "
                                    "error, pass e.g. parse_bytes('24GiB'), or None for no limit."))
            return None
        return int(value)
    if isinstance(value, str):
        if value.strip().lower() in ("none", "unlimited", "inf"):
            return None
        try:
            return parse_bytes(value)
        except ConfigError as e:
            problems.append(Message(f"{arg(name)}: {marked(e)}"))
            return None
    problems.append(Message(f"{arg(name, value)} is not a size. To resolve this error, pass bytes or a size such as "
                            "'24GiB'."))
    return None


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def check_fixed(f: Fixed, n_blocks: int, cuda: bool, chunkable: bool, precision: str) -> None:
    """ConfigError for fixed choices this model, device or precision cannot take (the rules between the choices
    themselves are ``Choices``')."""
    problems = []
    letters = {"recompute": "R", "keep": "K", "offload": "O"}
    if f.blocks is not None and any(k not in letters for k in f.blocks):
        problems.append(f"the checkpointing layout names {sorted(set(f.blocks) - set(letters))}: each block is "
                        "'keep', 'recompute' or 'offload'. To resolve this error, give one policy per block, in the "
                        "model's order.")
    elif f.blocks is not None and len(f.blocks) != n_blocks:
        given = "".join(letters[k] for k in f.blocks)
        problems.append(f"{arg('checkpointing')}'s layout blocks({given}) names {len(f.blocks)} "
                        f"block{'s' if len(f.blocks) != 1 else ''}, not {n_blocks}: a layout has a letter per block of "
                        f"the model. To resolve this error, give {n_blocks} letters, in the model's order (R recompute, "
                        "K keep, O offload).")
    if not cuda and f.blocks is not None and "offload" in f.blocks:  # a layout's 'O' blocks: checkpointing's
        problems.append("activation offload on a CPU only copies within RAM. To resolve this error, drop it "
                        f"(the 'O' blocks of {arg('checkpointing')}) for a CPU run.")
    elif not cuda and f.flavor == "offload-inputs":
        problems.append("activation offload on a CPU only copies within RAM. To resolve this error, drop it "
                        f"({arg('offload_activations')}) for a CPU run.")
    # NOTE: a fixed optimizer offload is planned on the CPU too (CPUOffloadOptimizer runs there, the same code
    # path as on a GPU); the search never proposes one there.
    problems += rule_problems(planned_setup(f, precision=precision, chunkable=chunkable), PLAN_TERMS)
    ConfigError.raise_if(problems)


def check_choices(choices: Any, *, world_size: int, fsdp: bool | None) -> Choices:
    """``plan``'s choices (None: all the plan's), checked for a run of ``world_size`` ranks (``fsdp`` None: the plan
    compares DDP with FSDP2, so FSDP2's rules are not applied to the choices).

    Raises:
        ConfigError: not a ``Choices``, or choices such a run cannot take (``Choices.check_run``).
    """
    if choices is None:
        return Choices()
    if not isinstance(choices, Choices):
        raise ConfigError(f"choices={choices!r} is not a Choices. To resolve this error, pass Choices(...) or "
                          "Choices.from_dict(...).")
    choices.check_run(world_size=world_size, fsdp=bool(fsdp) and world_size > 1)
    return choices


def check_settings(s: PlanSettings, n_blocks: int, per_rank: int, cuda: bool, world: int, chunkable: bool,
                    precision: str) -> None:
    """ConfigError for a hand-made set-up the model, batch or device cannot take."""
    problems = []
    if not isinstance(s, PlanSettings):
        raise ConfigError(f"settings={s!r} must be a PlanSettings (e.g. plan(...).settings, or "
                          "dataclasses.replace of one).")
    if len(s.blocks) != n_blocks or any(k not in ("keep", "recompute", "offload") for k in s.blocks):
        problems.append(f"settings.blocks has {len(s.blocks)} entries (of kinds {sorted(set(s.blocks))}): the model "
                        f"has {n_blocks} blocks, each 'keep', 'recompute' or 'offload'. To resolve this error, give "
                        "one kind per block, in the model's order.")
    if s.micro_batch_size * s.accumulation != per_rank:
        problems.append(f"{arg('micro_batch_size')} {s.micro_batch_size} x accumulation {s.accumulation} is not "
                        f"the {per_rank} examples each rank takes per step. To resolve this error, pass a micro-batch "
                        f"among {divisors(per_rank)} with the accumulation that makes {per_rank}.")
    if not cuda and ("offload" in s.blocks or s.flavor == "offload-inputs"):
        problems.append("activation offload on a CPU only copies within RAM. To resolve this error, plan it for "
                        f"{arg('device', 'cuda')}.")
    if (s.distribution == "none") != (world == 1):
        problems.append(f"distribution {s.distribution!r} with {arg('world_size', world)}: one process is 'none', "
                        "several 'ddp' or 'fsdp2'. To resolve this error, pass the one for this world size.")
    problems += [text for technique in REGISTRY for text in technique.settings_problems(s)]
    problems += rule_problems(setup_of(s, world, precision, chunkable), SETTINGS_TERMS)
    ConfigError.raise_if(problems)


def setup_of(s: PlanSettings, world: int, precision: str, chunkable: bool | None = None) -> SetUp:
    """A set-up as the rules read it (a share of 0 offloaded is none; ``chunkable``: whether the model's loss can be
    chunked, None: not known)."""
    return planned_setup(s, precision=precision, processes=world, fsdp=s.distribution == "fsdp2",
                         chunkable=chunkable)


def check_plan_arguments(*, budget: Any, host_budget: Any, seq_len: int, global_batch_size: int, world_size: int,
                         micro_batch_size: int | None, device: str, precision: str, safety_margin: float,
                         techniques: Iterable[str] | None,
                         kept_share: float = 1.0) -> tuple[int | None, int | None, set[str], int]:
    """``plan``'s arguments checked, every problem at once: the budgets in bytes, the techniques allowed and the
    examples each rank takes per step.

    Raises:
        ConfigError: the problems found, each with its fix.
    """
    problems: list[str] = []
    budget_bytes = parse_budget(budget, "budget", problems)
    host_budget_bytes = parse_budget(host_budget, "host_budget", problems)
    for name, value in (("seq_len", seq_len), ("global_batch_size", global_batch_size), ("world_size", world_size)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            problems.append(f"{arg(name, value)} must be an integer >= 1. To resolve this error, pass one.")
    if micro_batch_size is not None and (isinstance(micro_batch_size, bool) or not isinstance(micro_batch_size, int)
                                         or micro_batch_size < 1):
        problems.append(f"{arg('micro_batch_size', micro_batch_size)} must be an integer >= 1, or None to choose it.")
    if device not in ("cuda", "cpu"):
        problems.append(f"{arg('device', device)} is not one of 'cuda', 'cpu'.")
    if precision not in ("fp32", "bf16-mixed", "fp16-mixed"):
        problems.append(f"{arg('precision', precision)} is not one of fp32, bf16-mixed, fp16-mixed.")
    if isinstance(safety_margin, bool) or not isinstance(safety_margin, (int, float)) or not 0 <= safety_margin < 0.9:
        problems.append(f"safety_margin={safety_margin!r} must be a fraction in [0, 0.9), e.g. 0.05.")
    if isinstance(kept_share, bool) or not isinstance(kept_share, numbers.Real) or not 0 < kept_share <= 1:
        # The library's own word: memtrain plan's --kept-labels refuses such a value itself.
        problems.append(f"kept_share={kept_share!r} must be a fraction in (0, 1]: the share of label positions "
                        "the loss counts (1: every position). To resolve this error, pass e.g. 0.5.")
    allowed = set(TECHNIQUES if techniques is None else techniques)
    if allowed - set(TECHNIQUES):
        problems.append(f"techniques: unknown {sorted(allowed - set(TECHNIQUES))}; known: {list(TECHNIQUES)}.")
    ConfigError.raise_if(problems)
    per_rank, remainder = divmod(global_batch_size, world_size)
    if remainder:
        problems.append(f"{arg('global_batch_size', global_batch_size)} does not split over "
                        f"{arg('world_size', world_size)} ranks. "
                        f"To resolve this error, pass a multiple of {world_size}.")
    elif micro_batch_size is not None and per_rank % micro_batch_size:
        problems.append(f"{arg('micro_batch_size', micro_batch_size)} does not divide the {per_rank} examples each "
                        f"rank takes per step. To resolve this error, pass one of {divisors(per_rank)}.")
    ConfigError.raise_if(problems)
    return budget_bytes, host_budget_bytes, allowed, per_rank
