"""How results and progress are printed: tables whole wherever they go (a terminal, a pipe, a log file, CI output),
and plain for a screen reader or a braille display when asked (`plain`)."""

from __future__ import annotations

import os
from typing import Any

from rich.console import Console
from rich.progress import Progress, TaskID
from rich.table import Table

PLAIN_ENV = "KOKORO_OPT_PLAIN"


def plain() -> bool:
    """Whether output should read well to a screen reader or on a braille display (KOKORO_OPT_PLAIN=1, or
    TERM=dumb): tables without box-drawing characters, which are read out one by one ("box drawings light
    horizontal"), and no live progress bars, whose every redraw is read out again."""
    return os.environ.get(PLAIN_ENV, "").strip() not in ("", "0") or os.environ.get("TERM") == "dumb"


def print_table(console: Console, table: Table) -> None:
    """A terminal's width is respected; a pipe or file (rich assumes 80 columns) gets the table's own
    full width, so no column is cut to '1.…' in logs and CI output, however many there are."""
    if plain():
        table.box, table.show_edge = None, False  # columns apart by spaces, a line a row
    if console.is_terminal:
        console.print(table)
        return
    natural = Console(width=100_000, file=console.file).measure(table).maximum
    Console(file=console.file, width=max(console.width, natural), no_color=console.no_color, highlight=False).print(table)


def make_progress(*columns: Any, **options: Any) -> Progress:
    """Rich's Progress; with plain output (`plain`) no bar, and a line for each step as its description changes."""
    return _LineProgress(*columns, **options) if plain() else Progress(*columns, **options)


class _LineProgress(Progress):
    """A Progress that draws nothing live and prints each new description on a line of its own."""

    def __init__(self, *columns: Any, **options: Any) -> None:
        super().__init__(*columns, **{**options, "disable": True})

    def add_task(self, description: str, *args: Any, **kwargs: Any) -> TaskID:
        self._say(description)
        return super().add_task(description, *args, **kwargs)

    def update(self, task_id: TaskID, *, description: str | None = None, **kwargs: Any) -> None:
        if description is not None and description != next(t.description for t in self.tasks if t.id == task_id):
            self._say(description)
        super().update(task_id, description=description, **kwargs)

    def _say(self, description: str) -> None:
        if description:
            self.console.print(description, markup=False, highlight=False)
