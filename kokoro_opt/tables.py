"""How results and progress are printed: tables whole wherever they go (a terminal, a pipe, a log file, CI output),
and plain for a screen reader or a braille display when asked (`plain`)."""

from __future__ import annotations

import os
import time
from typing import Any

from rich.console import Console
from rich.progress import Progress, TaskID
from rich.table import Table

PLAIN_ENV = "KOKORO_OPT_PLAIN"


def plain() -> bool:
    """Whether output should read well to a screen reader or on a braille display (KOKORO_OPT_PLAIN=1, or
    TERM=dumb): tables without box-drawing characters, which are read out one by one ("box drawings light
    horizontal"), and no live progress bars, whose every redraw is read out again."""
    value = os.environ.get(PLAIN_ENV, "").strip().lower()
    return value not in ("", "0", "false", "no", "off") or os.environ.get("TERM") == "dumb"


def print_table(console: Console, table: Table) -> None:
    """A terminal's width is respected; a pipe or file (rich assumes 80 columns) gets the table's own
    full width, so no column is cut to '1.…' in logs and CI output, however many there are."""
    if plain():  # columns apart by spaces, a line a row, never cut to the terminal: "lat …" says nothing when read
        table.box, table.show_edge = None, False
    elif console.is_terminal:
        console.print(table)
        return
    natural = Console(width=100_000, file=console.file).measure(table).maximum
    Console(file=console.file, width=max(console.width, natural), no_color=console.no_color, highlight=False).print(table)


def make_progress(*columns: Any, **options: Any) -> Progress:
    """Rich's Progress; with plain output (`plain`) no bar, and a line for each step as its description changes."""
    return _LineProgress(*columns, **options) if plain() else Progress(*columns, **options)


class _LineProgress(Progress):
    """A Progress that draws nothing live and says where it is on a line of its own: the first step, then at most
    one line every `EVERY` seconds (an evaluation's steps are utterances: a line each was 140 lines read out), and the
    last step. A line is the step's description and, where the total is known, "k of n"."""

    EVERY = 5.0

    def __init__(self, *columns: Any, **options: Any) -> None:
        super().__init__(*columns, **{**options, "disable": True})
        self._last: tuple[str, float] | None = None

    def add_task(self, description: str, *args: Any, **kwargs: Any) -> TaskID:
        task = super().add_task(description, *args, **kwargs)
        self._say(task)
        return task

    def update(self, task_id: TaskID, **kwargs: Any) -> None:
        super().update(task_id, **kwargs)
        self._say(task_id)

    def advance(self, task_id: TaskID, advance: float = 1) -> None:
        super().advance(task_id, advance)
        self._say(task_id)

    def _say(self, task_id: TaskID) -> None:
        task = next(t for t in self.tasks if t.id == task_id)
        line = task.description + (f" ({task.completed:g} of {task.total:g})" if task.total else "")
        now, done = time.monotonic(), task.total is not None and task.completed >= task.total
        if not task.description or (
            self._last is not None and (line == self._last[0] or (now - self._last[1] < self.EVERY and not done))
        ):
            return
        self._last = (line, now)
        self.console.print(line, markup=False, highlight=False)
