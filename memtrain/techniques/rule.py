"""A rule between two techniques (or between a technique and the model it runs on), written once with its test:
what it refuses, why, and the fix.

A rule's test reads one ``SetUp``, a flat view of a run's choices as far as a site knows them (``None``: not given,
not in use, or not known there). Every site that checks rules (``Choices`` at start-up, ``build_optimizer`` and the
planner's checks of fixed choices and hand-made set-ups, the search, which never proposes what a rule refuses) builds
a ``SetUp`` from its own arguments and asks ``memtrain.techniques.problems`` for the refusals, named in its own
``Terms`` ("optimizer.step_in_backward" in ``Choices``, "step_in_backward" in ``build_optimizer``). So a combination
is refused for one reason, in the same words, wherever it is caught, and adding a rule is one entry in its
technique's module.

Example:
    >>> rule = Rule("a-with-b", "a and b cannot go together.", "drop one of them", ("compile", "offload_weights"),
    ...             lambda s: bool(s.compile and s.offload_weights))
    >>> rule.problem(SetUp(compile=True, offload_weights=True), Terms())
    'compile=True with offload_weights=True: a and b cannot go together. To resolve this error, drop one of them.'
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from memtrain.message import Message, arg, marked


@dataclass(frozen=True, kw_only=True)
class SetUp:
    """A run's choices as one site knows them, for the rules; ``None``: not given, not in use, or not known.

    placement: the optimizer's state on the "device", or in host RAM ("offload"; "offload-bf16-weights" keeps bf16
        weights on the device).
    state_precision: AdamW's moments ("fp32", "bf16", "int8").
    step_in_backward: each parameter steps as its gradient is final.
    offload_fraction: a device optimizer's share of state in host RAM (0 counts as given where a site gives it).
    optimizer: the optimizer's class (``NamedOptimizer``; memtrain's AdamW by default).
    pure_bf16, offload_weights, compile: those techniques on (True) or off (False).
    offload_activations: activation offload asked for (True) or refused (False).
    checkpointing: the checkpointing policy (its "+offload" offloads the recomputed blocks' inputs).
    precision: the compute precision ("fp32", "bf16-mixed", "fp16-mixed"; fp16's GradScaler counts as the last).
    processes: the ranks of the run; fsdp: FSDP2 shards it.
    chunked_loss: the loss chunked (True) or whole (False).
    chunkable: a fact of the model where a site knows it: whether ``memtrain.loss`` can chunk its loss.
    has_blocks: a fact of the model where a site knows it: whether it has repeated blocks (``find_blocks`` found
        some).
    tiled_mlp: the blocks' MLPs computed over tiles of tokens (True) or whole (False).
    tileable: a fact of the model where a site knows it: whether ``memtrain.tiled_mlp`` finds an MLP to tile.
    """

    placement: str | None = None
    state_precision: str | None = None
    step_in_backward: bool | None = None
    offload_fraction: float | None = None
    optimizer: Any = None  # a NamedOptimizer (memtrain.techniques.optimizer, which imports this module)
    pure_bf16: bool | None = None
    offload_weights: bool | None = None
    compile: bool | None = None
    offload_activations: bool | None = None
    checkpointing: Any = None  # a Checkpointing
    precision: str | None = None
    processes: int | None = None
    fsdp: bool | None = None
    chunked_loss: bool | None = None
    chunkable: bool | None = None
    has_blocks: bool | None = None
    tiled_mlp: bool | None = None
    tileable: bool | None = None

    @property
    def several_processes(self) -> bool:
        return (self.processes or 1) > 1

    @property
    def adamw(self) -> bool:
        """Whether the optimizer is memtrain's AdamW (the default where none is named)."""
        return self.optimizer is None or self.optimizer.is_adamw

    def with_(self, **changes: Any) -> SetUp:
        return dataclasses.replace(self, **changes)


@dataclass(frozen=True)
class Terms:
    """How one site names a ``SetUp``'s fields in its messages: its labels (e.g. "optimizer.placement" for
    "placement"), the fixes it words itself (by rule name; each names its arguments with ``memtrain.message.arg``),
    and a value's text (by field) where ``repr`` is not it."""

    labels: Mapping[str, str] = field(default_factory=dict)
    fixes: Mapping[str, str] = field(default_factory=dict)
    values: Mapping[str, Callable[[Any], str]] = field(default_factory=dict)

    def given(self, name: str, value: Any) -> str:
        """E.g. "optimizer.placement='offload'", kept as an argument: marked text (``memtrain.message.arg``), a part
        of a message, which a ``Message`` reads (not for printing alone)."""
        label = self.labels.get(name, "world_size" if name == "processes" else name)
        if name in self.values:
            return arg(label, text=self.values[name](value))
        if not isinstance(value, (bool, int, float, str)):  # a class's name (as given), a policy: as their spelling
            return arg(label, getattr(value, "spelling", str(value)))
        return arg(label, value)


@dataclass(frozen=True)
class Rule:
    """One rule between techniques.

    name: a short identifier, e.g. "pure-bf16-int8".
    why: the reason, one sentence (the words every site's message shares).
    fix: the fix where a site names no better one, after "To resolve this error, ".
    involves: the ``SetUp`` fields the rule reads, in the order its message names them.
    refuses: its test: True where the set-up breaks it.
    shows_false: fields the message names even where False or 0 (the rule refuses their being off).
    planned_only: a rule of what the plan plans, not of the primitives (``build_optimizer`` does not ask it).

    ``fix`` may name what was given: "{first}" (the first field the message names), "{rest}" (the others) and
    "{but_last}" (all but the last). ``why`` and ``fix`` name arguments with ``memtrain.message.arg``; the rule keeps
    them as ``Message``s (their strings are the library's words).
    """

    name: str
    why: str
    fix: str
    involves: tuple[str, ...]
    refuses: Callable[[SetUp], bool] = field(repr=False, compare=False)
    shows_false: tuple[str, ...] = ()
    planned_only: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "why", Message(self.why))
        object.__setattr__(self, "fix", Message(self.fix))

    def message(self, given: str, fix: str | None = None) -> Message:
        """The problem in words: ``given`` (the site's own arguments and values), the reason, then the fix."""
        return Message(f"{marked(given)}: {marked(self.why)} To resolve this error, {marked(fix or self.fix)}.")

    def problem(self, setup: SetUp, terms: Terms) -> Message | None:
        """The refusal of ``setup`` in ``terms``' words, or None where the rule allows it."""
        if not self.refuses(setup):
            return None
        given = [terms.given(name, value) for name in self.involves
                 if _shown(name, value := getattr(setup, name)) or (value is not None and name in self.shows_false)]
        if not given:  # a rule whose test reads what its message does not name: its own name stands in
            given = [self.name]
        text = given[0] + (f" with {' and '.join(given[1:])}" if len(given) > 1 else "")
        fix = terms.fixes.get(self.name) or marked(self.fix).format(
            first=given[0], rest=" and ".join(given[1:]), but_last=" and ".join(given[:-1]) or given[0])
        return self.message(text, fix)


def problems_of(setup: SetUp, terms: Terms, rules: Iterable[Rule], *, primitives: bool = False) -> list[Message]:
    """The refusals of ``setup`` by ``rules``, in ``terms``' words, in the rules' order (``primitives``: only the
    rules of what the primitives can build, not those of what the plan plans)."""
    return [p for rule in rules if not (primitives and rule.planned_only)
            and (p := rule.problem(setup, terms)) is not None]


def _shown(name: str, value: Any) -> bool:
    """Whether a message names a field's value: one given and in use (not off, not fp32 moments, not memtrain's
    AdamW, not one process)."""
    if value is None or value is False:
        return False
    if not isinstance(value, (bool, int, float, str)):
        return not getattr(value, "is_adamw", False)  # a policy, or an optimizer class but memtrain's AdamW
    if name == "state_precision":
        return value != "fp32"
    if name == "processes":
        return value > 1
    return value is True or isinstance(value, str) or value != 0
