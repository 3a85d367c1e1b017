"""How a user writes a setting's field on the command line, declared once on the field itself.

A technique's setting type (``OptimizerChoice`` first) carries, on each field, its flag and its help
(``dataclasses.field(metadata=flag(...))``): the command line's flags, their parsing back into the setting, and the
flag names in its error messages all come from that one declaration, not from tables kept beside it.

Example:
    >>> from memtrain.choices import OptimizerChoice
    >>> [(name, f.name) for name, f in flags_of(OptimizerChoice)][:2]
    [('placement', '--offload-optimizer'), ('state_precision', '--optimizer-state')]
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from memtrain.errors import ConfigError

FlagKind = Literal["value", "switch", "on", "pairs"]


@dataclass(frozen=True)
class Flag:
    """A field's command-line flag.

    Attributes:
        name: the flag, e.g. "--optimizer-state".
        help: its help; "{unset}" stands for what leaving it out means (the plan decides, or ``off``).
        kind: "value" (``--flag VALUE``), "switch" (``--flag`` / ``--no-flag`` / neither: True, False, None), "on"
            (``--flag`` or not: True or False) or "pairs" (``--flag KEY=VALUE``, repeatable: a mapping).
        values: a switch whose field holds two values, not True and False: (the ``--flag`` one, the ``--no-flag`` one).
        more: such a switch's further values, each with the word its flag takes for it: ``(("offload-bf16-weights",
            "bf16-weights"),)`` is ``--offload-optimizer bf16-weights``.
        choices: the values a "value" flag takes.
        metavar: the value's name in the help.
        parse: the command line's parser of the value, by name (e.g. "fraction"), where the text is not the value.
        off: what leaving it out means where nothing is planned (``memtrain estimate``).
    """

    name: str
    help: str
    kind: FlagKind = "value"
    values: tuple[Any, Any] | None = None
    more: tuple[tuple[Any, str], ...] = ()
    choices: tuple[str, ...] | None = None
    metavar: str | None = None
    parse: str | None = None
    off: str = "off"

    @property
    def dest(self) -> str:
        """The argparse destination: ``--optimizer-state`` -> ``optimizer_state``."""
        return self.name.removeprefix("--").replace("-", "_")

    def help_text(self, *, planned: bool) -> str:
        return self.help.format(unset="default: the plan decides" if planned else f"default: {self.off}")

    def value_of(self, given: Any) -> Any:
        """The field's value for what the command line gave (None: not given)."""
        if self.kind == "on":
            return bool(given)
        if given is None:
            return None
        if self.kind == "switch" and self.values is not None:
            if isinstance(given, str):  # one of ``more``'s words (the command line took no other)
                return next(value for value, word in self.more if word == given)
            return self.values[0] if given else self.values[1]
        if self.kind == "pairs":
            return dict(given)
        return given

    def words_for(self, value: Any) -> list[str]:
        """The command-line words that give the field ``value`` (``value_of``'s inverse; none: the flag left out),
        e.g. ``["--optimizer-state", "bf16"]``, ``["--no-chunked-loss"]``, ``["--offload-optimizer",
        "bf16-weights"]``."""
        if value is None or self.kind == "on" and not value:
            return []
        if self.kind in ("switch", "on") and self.values is None:
            return [self.name if value else f"--no-{self.name[2:]}"]
        if self.kind == "switch":
            more = dict(self.more)
            return ([self.name, more[value]] if value in more else
                    [self.name if value == self.values[0] else f"--no-{self.name[2:]}"])
        if self.kind == "pairs":
            return [word for key, v in dict(value).items() for word in (self.name, f"{key}={v!r}")]
        return [self.name, str(value)]

    def argument_terms(self, field: str) -> tuple[dict[str, str], dict[str, tuple[str | None, str | None]],
                                                 dict[str, dict[str, str]]]:
        """How messages that name ``field`` (an argument, ``field=value``) read in flag terms: the flag of a
        value, the two flags of a switch, the flag each value of a two-valued switch stands for (by its ``repr``)."""
        if self.kind == "switch" and self.values is not None:
            on, off = self.values
            return {}, {}, {field: {repr(on): self.name, repr(off): f"--no-{self.name[2:]}",
                                    **{repr(value): f"{self.name} {word}" for value, word in self.more}}}
        if self.kind == "switch":
            return {}, {field: (self.name, f"--no-{self.name[2:]}")}, {}
        if self.kind == "on":
            return {}, {field: (self.name, None)}, {}
        return {field: self.name}, {}, {}


def flag(name: str, help: str, **options: Any) -> Mapping[str, Flag]:
    """A field's metadata declaring its flag: ``field(default=None, metadata=flag("--x", "...({unset})"))``."""
    return {"flag": Flag(name, help, **options)}


def flags_of(cls: type) -> list[tuple[str, Flag]]:
    """(field name, flag) of each field of the setting type ``cls`` that declares one, in field order."""
    return [(f.name, f.metadata["flag"]) for f in dataclasses.fields(cls) if "flag" in f.metadata]


# -- checks every setting type shares ------------------------------------------------------------------------------
def is_fraction(value: Any) -> bool:
    """A finite number in [0, 1] (not a bool)."""
    return (isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
            and 0.0 <= value <= 1.0)


def switch_problems(owner: Any, names: tuple[str, ...], prefix: str = "") -> list[str]:
    """The fields of ``owner`` that are not True, False or None (the plan decides), each with its fix (the field is
    not kept as an argument: the command line names a switch by its flag, which has no such value)."""
    return [f"{prefix}{name}={getattr(owner, name)!r} must be True, False, or None (the plan decides). To resolve "
            "this error, pass one of them." for name in names
            if getattr(owner, name) is not None and not isinstance(getattr(owner, name), bool)]


def known_fields(cls: type, values: Mapping[str, Any], what: str) -> dict[str, Any]:
    """``values`` as the keyword arguments of the setting type ``cls`` (ConfigError: not a mapping, or an unknown
    field, naming the known ones)."""
    if not isinstance(values, Mapping):
        raise ConfigError(f"{what}={values!r} is not a mapping of field names to values. To resolve this error, pass "
                          f"e.g. {{'{dataclasses.fields(cls)[0].name}': ...}}.")
    names = [f.name for f in dataclasses.fields(cls)]
    unknown = sorted(set(values) - set(names))
    if unknown:
        raise ConfigError(f"{what}: unknown {'field' if len(unknown) == 1 else 'fields'} {', '.join(unknown)}. To "
                          f"resolve this error, use {', '.join(names)}.")
    return dict(values)
