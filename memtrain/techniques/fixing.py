"""What a technique's setting fixes in a plan: the values the search keeps, the searches it closes, and notes.

Each ``Technique`` has ``fixed(choices, *, device, n_blocks) -> Fixing``: its share of the one translation of a run's
``Choices`` into what the planner keeps (``planner.settings.Fixed.of_choices`` merges the shares); ``closed`` names
the searches it rules out by their ``Technique.search`` names.

Example:
    >>> Fixing.merge([Fixing({"chunked_loss": True}), Fixing({"compile": None}, closed={"x"}, notes=("n",))])
    Fixing(values={'chunked_loss': True, 'compile': None}, closed=frozenset({'x'}), notes=('n',))
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Fixing:
    """One technique's share of a plan's fixed choices.

    values: the ``Fixed`` fields it sets (None: the search's).
    closed: the search's names (``SEARCH``) it rules out.
    notes: why a choice does nothing where the run trains (e.g. activation offload on a CPU).
    """

    values: Mapping[str, Any]
    closed: frozenset[str] = field(default_factory=frozenset)
    notes: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "closed", frozenset(self.closed))

    @staticmethod
    def merge(shares: Iterable[Fixing]) -> Fixing:
        """The shares of every technique as one (each sets its own fields)."""
        values: dict[str, Any] = {}
        closed: set[str] = set()
        notes: list[str] = []
        for share in shares:
            both = set(values) & set(share.values)
            assert not both, f"two techniques fix {sorted(both)}"  # each fixes its own fields
            values.update(share.values)
            closed |= share.closed
            notes += share.notes
        return Fixing(values, frozenset(closed), tuple(notes))
