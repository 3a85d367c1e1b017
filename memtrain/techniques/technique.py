"""A technique's part in memtrain, as one object: the ``Choices`` fields it owns, its rules with the others, what its
setting fixes in a plan, its values in the search, its reason line, its part of an estimate's set-up, what the
Hugging Face Trainer helper cannot do of it and how it applies it there, and what a resumed run cannot change of it. Each technique's module
subclasses ``Technique`` once (``TECHNIQUE``) and overrides what the technique has; ``memtrain.techniques.REGISTRY``
lists them, and the planner, the checks, the reasons, the estimator, the Trainer helper and resume loop over it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar

from memtrain.techniques.fixing import Fixing
from memtrain.techniques.rule import Rule
from memtrain.techniques.view import PlanView, SearchProblem, SearchRun, SearchSpace


class Technique:
    """One technique; the defaults are those of a technique with no field, rule, search or reason.

    name: the technique in words ("chunked loss").
    fields: the ``Choices`` fields it owns.
    rules: its rules with the other techniques.
    search: the names the search knows it by (``plan(techniques=...)``).
    """

    name: ClassVar[str]
    fields: ClassVar[tuple[str, ...]] = ()
    rules: ClassVar[tuple[Rule, ...]] = ()
    search: ClassVar[tuple[str, ...]] = ()

    def fixed(self, choices: Any, *, device: str, n_blocks: int) -> Fixing:
        """Its share of a plan's fixed choices, from a run's ``Choices`` (None fields: the search's)."""
        return Fixing({})

    def left_open(self, fixed: Any) -> list[str]:
        """The arguments that fix what a plan's ``Fixed`` leaves to the search, where no search runs."""
        return []

    def candidates(self, space: SearchSpace, problem: SearchProblem, allowed: frozenset[str]) -> None:
        """Fills in its values of the search's ``space`` (``allowed``: the search names the plan may use)."""

    def narrow(self, space: SearchSpace, fixed: Any) -> None:
        """Narrows the ``space`` to what its fixed choices keep (after every technique filled it in)."""

    def axis(self, space: SearchSpace, fixed: Any, run: SearchRun) -> list[dict[str, Any]]:
        """Its values in the search's cross product, from the narrowed ``space``: one mapping of ``Configuration``
        fields per value (one empty mapping: it adds no field)."""
        return [{}]

    def skips(self, configuration: Any, fixed: Any, run: SearchRun) -> bool:
        """Whether the search leaves out ``configuration`` (a ``Configuration`` no rule refuses) for this technique's
        sake: it would save nothing, or the search does not try it."""
        return False

    def reasons(self, view: PlanView) -> list[str]:
        """Its line in a plan's reasons: what was chosen, and what the best alternative costs."""
        return []

    def planned_setup(self, record: Any) -> dict[str, Any]:
        """Its fields of a plan's record (a ``PlanSettings``, a ``Configuration``, or a ``Fixed``, whose None is
        "not fixed") as the rules' ``SetUp`` reads them."""
        return {}

    def computes_in(self, choices: Any) -> tuple[str, str] | None:
        """The one precision its setting in ``choices`` (a ``Choices``) computes in, with why (a run's precision
        "auto" resolves to it); None: it takes any."""
        return None

    def chosen(self, settings: Any) -> dict[str, Any]:
        """Its ``Choices`` fields that fix it as a plan's one set-up ``settings`` (a ``PlanSettings``) has it: a run
        given them gets that set-up again (``PlanSettings.choices``; ``Fixed.of_choices`` reads them back)."""
        return {}

    def settings_problems(self, settings: Any) -> list[str]:
        """What is wrong with its values in a hand-made ``PlanSettings`` (a value it has no meaning for), each with
        what it takes."""
        return []

    def planned_text(self, settings: Any) -> str:
        """Its part of a plan's one set-up ``settings`` (a ``PlanSettings``) in a few words, for the summary's
        columns ("" where it has none)."""
        return ""

    def setup_text(self, setup: Any) -> str:
        """Its part of one set-up ``setup`` (a ``Choices``; None fields: off) in a few words, for ``memtrain
        estimate``'s header ("" where it is off or has none)."""
        return ""

    def trainer_problems(self, choices: Any) -> list[str]:
        """What the Hugging Face Trainer helper (``memtrain.hf``'s ``prepare_model`` / ``MemtrainTrainer``) cannot
        do of its setting in ``choices`` (a ``Choices``), in words naming the fix (none: it applies it, or it is
        off)."""
        return []

    def trainer_default(self, choices: Any) -> dict[str, Any]:
        """Its fields' values where ``choices`` (a ``Choices``) leaves them open, for the Hugging Face Trainer helper:
        no plan runs there (none: open is off)."""
        return {}

    def trainer_arguments_problems(self, choices: Any, arguments: Any) -> list[str]:
        """What its setting in ``choices`` contradicts in the Trainer's ``arguments`` (its ``TrainingArguments``), in
        words naming the fix."""
        return []

    def prepare_model(self, model: Any, choices: Any, *, chunk_tokens: int) -> dict[str, Any]:
        """Applies its setting in ``choices`` to a Hugging Face causal LM ``model`` (unwrapped), in place, for the
        Trainer helper's ``prepare_model``: its part of what that returns (``Prepared``'s fields; ``reasons``: its
        lines), empty where it changes nothing of the model."""
        return {}

    def trainer_step(self, model: Any, choices: Any) -> Any:
        """The context each of the Trainer helper's training steps runs in for its setting in ``choices`` (``model``:
        the unwrapped model), or None."""
        return None

    def trace_options(self, setup: Any, *, checkpointing: Any, optimizer: Any) -> tuple[dict[str, Any], list[str]]:
        """Its part of ``estimate``'s one set-up ``setup`` (a ``Choices``; None fields: off) as ``trace``'s keyword
        arguments, with its contradictions with the ``checkpointing=`` / ``optimizer=`` arguments in words naming the
        fix (where there is one, its options keep their defaults, so the other arguments are still checked)."""
        return {}, []

    def planned_options(self, settings: Any, block_names: Sequence[str]) -> dict[str, Any]:
        """Its part of a plan's one set-up ``settings`` (a ``PlanSettings``) as ``trace``'s keyword arguments, for the
        planner's full estimate of it (``block_names``: the model's blocks, in the plan's order)."""
        return {}

    def kept(self, kept: Any) -> dict[str, Any]:
        """What a plan must keep of its setting where a run's optimizer state exists already (``kept``: the
        ``PlanSettings`` it was built for), as ``Fixed`` fields: what the state's layout depends on."""
        return {}

    def kept_differences(self, choices: Any, kept: Any) -> list[tuple[str, str]]:
        """Where ``choices`` (a run's ``Choices``; None fields: the run's own) ask for another setting of it than
        ``kept`` (the ``PlanSettings`` of a run whose optimizer state exists already: a resume, a re-plan) holds,
        and the state cannot follow: (what was asked, what to drop) per field, e.g.
        ("optimizer.state_precision='bf16'", "optimizer.state_precision=")."""
        return []

    def __repr__(self) -> str:
        return f"<technique {self.name}>"
