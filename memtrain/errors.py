"""The two exceptions memtrain raises on purpose.

Every error says what happened (with the values), why, and the exact fix. ``ConfigError`` collects every
problem found in one configuration and raises once, so a user fixes them all in one go.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TypeVar

from memtrain.message import Message, marked

T = TypeVar("T")


class MemtrainError(Exception):
    """Base class of every error memtrain raises on purpose. Its ``message`` keeps the arguments it names
    (``memtrain.message``); ``str()`` is the library's wording."""

    def __init__(self, *args: object):
        text = args[0] if args and isinstance(args[0], str) else None
        super().__init__(*((str(Message(text)), *args[1:]) if text is not None else args))
        self.message = Message(text if text is not None else str(self))


class ConfigError(MemtrainError, ValueError):
    """One or more problems with the arguments or configuration given to memtrain.

    Args:
        problems: one message, or several; each names the bad value and the fix.

    Example:
        >>> problems = []
        >>> problems.append("every=0: it must be >= 1. To resolve this error, pass every=1 (every block).")
        >>> ConfigError.raise_if(problems)
        Traceback (most recent call last):
        ...
        memtrain.errors.ConfigError: every=0: it must be >= 1. To resolve this error, pass every=1 (every block).
    """

    def __init__(self, problems: str | Iterable[str]):
        self.problems: tuple[Message, ...] = tuple(map(Message, (problems,) if isinstance(problems, str) else problems))
        if len(self.problems) == 1:
            message = self.problems[0]
        else:
            lines = "\n".join(f"  - {marked(p)}" for p in self.problems)
            message = f"{len(self.problems)} problems in the configuration:\n{lines}"
        super().__init__(marked(message))

    @staticmethod
    def gathered(problems: list[str], check: Callable[[], T]) -> T | None:
        """``check()``'s value; or None, with its ConfigError's problems added to ``problems``: several checks'
        problems gathered, to be raised at once (``raise_if``)."""
        try:
            return check()
        except ConfigError as e:
            problems += e.problems
            return None

    @classmethod
    def raise_if(cls, problems: Iterable[str]) -> None:
        """Raises one ConfigError listing every problem, if there is any."""
        problems = list(problems)
        if problems:
            raise cls(problems)


def describe_exception(error: BaseException, *, max_chars: int = 600) -> str:
    """``Type: message`` of another library's exception for one of memtrain's, keeping its cause.

    The whole message when it is short; else its first line (what failed) and its last (often the reason, after
    lines of context), joined by " ... ". The exception's ``__cause__`` (``raise ... from e``) is added the same
    way, since a wrapper's message alone ("Error while loading the model") often hides it.
    """
    text = f"{type(error).__name__}: {_shorten(str(error), max_chars)}"
    cause = error.__cause__
    if cause is not None and cause is not error:
        text += f" (caused by {type(cause).__name__}: {_shorten(str(cause), max_chars)})"
    return text


def _shorten(message: str, max_chars: int) -> str:
    lines = [line.strip() for line in message.strip().splitlines() if line.strip()]
    if not lines:
        return "(no message)"
    whole = " ".join(lines)
    if len(whole) <= max_chars:
        return whole
    first, last = lines[0], lines[-1]
    joined = first if len(lines) == 1 else f"{first} ... {last}"
    return joined if len(joined) <= max_chars else joined[: max_chars - 3] + "..."
