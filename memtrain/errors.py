"""The two exceptions memtrain raises on purpose.

Every error says what happened (with the values), why, and the exact fix. ``ConfigError`` collects every
problem found in one configuration and raises once, so a user fixes them all in one go.
"""

from __future__ import annotations

from collections.abc import Iterable


class MemtrainError(Exception):
    """Base class of every error memtrain raises on purpose."""


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
        self.problems: tuple[str, ...] = (problems,) if isinstance(problems, str) else tuple(problems)
        if len(self.problems) == 1:
            message = self.problems[0]
        else:
            lines = "\n".join(f"  - {p}" for p in self.problems)
            message = f"{len(self.problems)} problems in the configuration:\n{lines}"
        super().__init__(message)

    @classmethod
    def raise_if(cls, problems: Iterable[str]) -> None:
        """Raises one ConfigError listing every problem, if there is any."""
        problems = list(problems)
        if problems:
            raise cls(problems)
