"""Messages that keep, as data, the arguments they name: the library says ``out_dir='x'``, the command ``--out 'x'``.

A message names an argument with ``arg`` inside its f-string; ``Message`` reads it back into parts (text and
``Arg``). ``str(message)`` is the library's wording; ``message.render(name_of)`` is a caller's (the command line
renders each ``Arg`` as its flag, from the settings' field metadata), with no guessing which words are arguments.
``ConfigError`` and ``MemtrainError`` keep their messages so; a message given as a plain string has no ``Arg``.

Example:
    >>> message = Message(f"{arg('out_dir', '/tmp/x')} is a file. To resolve this error, pass {arg('resume', True)}.")
    >>> str(message)
    "out_dir='/tmp/x' is a file. To resolve this error, pass resume=True."
    >>> message.render(lambda a: a.name.upper() if isinstance(a, Arg) else a.command)
    'OUT_DIR is a file. To resolve this error, pass RESUME.'
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

# Pairs of private-use characters mark a named argument inside a message's text until ``Message`` reads it: never
# printed (a ``Message``'s string has none), and no user's text (a path, another library's error) holds the pairs; a
# mark left open is read as text.
_ARG, _WORDS, _VALUE, _END = "\ue000\ue0a0", "\ue000\ue0a1", "\ue000\ue0a2", "\ue000\ue0a3"


class _Whatever:
    """``arg(name, WHATEVER)``: the argument itself, whatever its value ("drop optimizer.state_precision=")."""

    def __repr__(self) -> str:
        return "WHATEVER"


WHATEVER = _Whatever()
_BARE = object()


@dataclass(frozen=True)
class Arg:
    """An argument a message names.

    Attributes:
        name: as the library spells it: an argument (``out_dir``), or a setting's field (``optimizer.placement``).
        value: the value as the message writes it (``repr``, or the text given); "" for the argument whatever its
            value (``name=``); None for its bare name.
    """

    name: str
    value: str | None = None

    def __str__(self) -> str:
        return self.name if self.value is None else f"{self.name}={self.value}"


@dataclass(frozen=True)
class Words:
    """Advice the library words in its own terms (``library``) and the command line in its (``command``), where
    the command has no flag for the argument, e.g. "or pass a writable cache_dir"."""

    library: str
    command: str

    def __str__(self) -> str:
        return self.library


def arg(name: str, value: Any = _BARE, *, text: str | None = None) -> str:
    """``name`` in a message, for ``Message`` to keep: ``name=repr(value)`` (``text`` as written where given, e.g.
    "3e-3"), ``name=`` for ``WHATEVER``, the bare name without a value."""
    if text is None and value is not _BARE:
        text = "" if value is WHATEVER else repr(value)
    return f"{_ARG}{name}{_END}" if text is None else f"{_ARG}{name}{_VALUE}{text}{_END}"


def words(library: str, command: str) -> str:
    """Advice in both terms, for ``Message`` to keep (``Words``)."""
    return f"{_WORDS}{library}{_VALUE}{command}{_END}"


class Message(str):
    """A message whose string is the library's wording, with the arguments it names kept as ``parts``.

    ``Message(text)`` reads the marks ``arg`` and ``words`` left in ``text``; a ``Message`` given is returned as is.
    """

    parts: tuple[str | Arg | Words, ...]
    marked: str  # the text with its marks, for a message built from this one (``ConfigError``'s joined problems)

    def __new__(cls, text: str) -> Message:
        if isinstance(text, Message):
            return text
        parts = tuple(_parts(str(text)))
        message = super().__new__(cls, "".join(map(str, parts)))
        message.parts, message.marked = parts, str(text)
        return message

    def render(self, name_of: Callable[[Arg | Words], str]) -> str:
        """The message with each ``Arg`` and ``Words`` as ``name_of(part)`` gives it (text parts as they are)."""
        return "".join(part if isinstance(part, str) else name_of(part) for part in self.parts)


def marked(text: str | BaseException) -> str:
    """``text`` with its marks (a ``Message``'s, or an error's message), to build a longer message from it, e.g.
    ``f"the run's config: {marked(error)}"``."""
    if isinstance(text, BaseException):
        text = getattr(text, "message", None) or str(text)
    return text.marked if isinstance(text, Message) else text


def _parts(text: str) -> list[str | Arg | Words]:
    """``text``'s parts: the text between marks, and each mark read back (a mark left open stays text)."""
    parts: list[str | Arg | Words] = []
    while True:
        start = min((i for i in (text.find(_ARG), text.find(_WORDS)) if i >= 0), default=-1)
        end = text.find(_END, start) if start >= 0 else -1
        if end < 0:
            return parts + ([text] if text else [])
        if start:
            parts.append(text[:start])
        body = text[start + len(_ARG):end]
        if text.startswith(_WORDS, start):
            library, _, command = body.partition(_VALUE)
            parts.append(Words(library, command))
        else:
            name, sep, value = body.partition(_VALUE)
            parts.append(Arg(name, value if sep else None))
        text = text[end + len(_END):]
