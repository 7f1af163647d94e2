"""Tables printed whole wherever they go: a terminal, a pipe, a log file, CI output."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table


def print_table(console: Console, table: Table) -> None:
    """A terminal's width is respected; a pipe or file (rich assumes 80 columns) gets the table's own
    full width, so no column is cut to '1.…' in logs and CI output, however many there are."""
    if console.is_terminal:
        console.print(table)
        return
    natural = Console(width=100_000, file=console.file).measure(table).maximum
    Console(file=console.file, width=max(console.width, natural), no_color=console.no_color, highlight=False).print(table)
