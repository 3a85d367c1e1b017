"""The techniques, one module each, one ``Technique`` object each: its setting (a ``Choices`` field and its flag),
its rules with the others, its share of a plan's fixed choices, its values in the search, its reason line, its part
of an estimate's set-up, what the Trainer helper cannot do of it and what a resumed run cannot change of it.

``REGISTRY`` lists them; ``RULES`` is every rule between two techniques (or a technique and the model, such as a loss
that cannot be chunked), each written once in the module of the technique it restricts; ``SEARCH`` the names
``plan(techniques=...)`` takes; ``fixed_shares`` the one translation of a run's choices into what its plan keeps.
Every site that checks a combination (``Choices`` at start-up, ``build_optimizer``, the planner's checks and its
search, the estimator, a run without blocks) asks ``problems`` (or ``refuses``) with a ``SetUp`` of what it knows, so
a combination is refused for one reason, in the same words, wherever it is caught.

Example:
    >>> refuses(SetUp(pure_bf16=True, state_precision="int8"))
    True
    >>> problems(SetUp(offload_weights=True, compile=True))[0][:55]
    'offload_weights=True with compile=True: parameter offlo'
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from memtrain.techniques import (
    accumulation,
    activation_offload,
    checkpointing,
    chunked_loss,
    compiled,
    distribution,
    optimizer,
    pure_bf16,
    tiled_mlp,
    weight_offload,
)
from memtrain.techniques.fixing import Fixing
from memtrain.techniques.rule import Rule, SetUp, Terms, problems_of
from memtrain.techniques.technique import Technique
from memtrain.techniques.view import PlanView

# In the order a plan's reasons name them, which is also the order the search space is narrowed in: the optimizer's
# fixed placement before pure bf16 narrows the placements, and pure bf16 before parameter offload drops it.
REGISTRY: tuple[Technique, ...] = tuple(module.TECHNIQUE for module in (
    checkpointing, activation_offload, chunked_loss, tiled_mlp, optimizer, pure_bf16, weight_offload, accumulation,
    distribution, compiled))
# The search's cross product, outermost first (each technique's ``Technique.axis``): the order its candidates are
# composed and ranked in where two tie, so that a plan does not depend on the registry's order.
SEARCH_ORDER: tuple[Technique, ...] = tuple(module.TECHNIQUE for module in (
    distribution, optimizer, pure_bf16, compiled, chunked_loss, tiled_mlp, accumulation, checkpointing,
    weight_offload, activation_offload))
RULES: tuple[Rule, ...] = tuple(rule for technique in REGISTRY for rule in technique.rules)
SEARCH: tuple[str, ...] = tuple(name for technique in REGISTRY for name in technique.search)


ARGUMENTS = Terms()  # each field by its own name, e.g. "state_precision='int8'"


def problems(setup: SetUp, terms: Terms = ARGUMENTS, *, primitives: bool = False) -> list[str]:
    """Every rule's refusal of ``setup``, in ``terms``' words (none: the combination is allowed); ``primitives``:
    only the rules of what the primitives (``build_optimizer``) can build, not those of what the plan plans."""
    return problems_of(setup, terms, RULES, primitives=primitives)


def refuses(setup: SetUp) -> bool:
    """Whether any rule refuses ``setup`` (the search's test: it never proposes what a rule refuses)."""
    return any(rule.refuses(setup) for rule in RULES)


def fixed_shares(choices: Any, *, device: str, n_blocks: int) -> Fixing:
    """What a run's ``Choices`` fix in its plan: every technique's share (``Fixed.of_choices`` is its one reader)."""
    return Fixing.merge(technique.fixed(choices, device=device, n_blocks=n_blocks) for technique in REGISTRY)


def planned_options(settings: Any, block_names: Sequence[str]) -> dict[str, Any]:
    """A plan's one set-up ``settings`` (a ``PlanSettings``) as ``trace``'s keyword arguments: every technique's
    part (``Technique.planned_options``), each keyword given by one technique."""
    options: dict[str, Any] = {}
    for technique in REGISTRY:
        own = technique.planned_options(settings, block_names)
        assert not own.keys() & options.keys(), f"{technique.name} gives {sorted(own.keys() & options.keys())} again"
        options.update(own)
    return options


def planned_setup(record: Any, **run: Any) -> SetUp:
    """A plan's record (a ``PlanSettings``, ``Configuration`` or ``Fixed``) as the rules read it: every technique's
    part (``Technique.planned_setup``), with what the run adds (``precision``, ``processes``, ``fsdp``, the model's
    facts)."""
    return SetUp(**{k: v for technique in REGISTRY for k, v in technique.planned_setup(record).items()}, **run)


def chosen(settings: Any) -> dict[str, Any]:
    """A plan's one set-up ``settings`` (a ``PlanSettings``) as ``Choices``' keyword arguments that fix it: every
    technique's part (``Technique.chosen``), each field given by one technique."""
    fields: dict[str, Any] = {}
    for technique in REGISTRY:
        own = technique.chosen(settings)
        assert not own.keys() & fields.keys(), f"{technique.name} gives {sorted(own.keys() & fields.keys())} again"
        fields.update(own)
    return fields


def asked_precision(choices: Any, precision: str) -> tuple[str, str]:
    """The precision a run asks for, and why: where it leaves the precision "auto" and a technique computes in one
    only (``Technique.computes_in``: pure bf16, bf16 device weights), that one; else the run's own ("requested")."""
    if precision == "auto":
        for technique in REGISTRY:
            if (one := technique.computes_in(choices)) is not None:
                return one
    return precision, "requested"


def left_open(fixed: Any) -> list[str]:
    """The arguments that fix what a plan's ``Fixed`` leaves to the search, where no search runs."""
    return [text for technique in REGISTRY for text in technique.left_open(fixed)]


__all__ = ["REGISTRY", "RULES", "SEARCH", "SEARCH_ORDER", "Fixing", "PlanView", "Rule", "SetUp", "Technique",
           "Terms", "asked_precision", "chosen", "fixed_shares", "left_open", "planned_options",
           "planned_setup", "problems", "refuses"]
