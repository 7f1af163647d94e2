"""User-facing errors: a message naming what is wrong and a hint saying how to fix it."""

from __future__ import annotations

from typing import Any


class UserError(Exception):
    """An error caused by input (recipe, file, voice, text); the CLI prints it on one line, no traceback."""

    def __init__(self, message: str, hint: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint

    def __str__(self) -> str:
        return f"{self.message} ({self.hint})" if self.hint else self.message

    def __reduce__(self) -> tuple[Any, ...]:  # the hint survives a process boundary (select.py reads MLflow in a child)
        return (type(self), (self.message, self.hint))
