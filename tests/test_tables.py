"""Benchmark and comparison tables reach a log file or CI output whole, not cut to 80 columns."""

from __future__ import annotations

import io

from rich.console import Console
from rich.table import Table

from kokoro_opt.tables import print_table

HEADERS = [f"metric {i} p50" for i in range(14)]
ROW = [f"{1000 + i}.{i:03d}" for i in range(14)]


def _table() -> Table:
    table = Table(title="bench-serve")
    for header in HEADERS:
        table.add_column(header, no_wrap=True)
    table.add_row(*ROW)
    return table


def test_a_table_written_to_a_file_keeps_every_column_whole() -> None:
    plain = io.StringIO()
    Console(file=plain).print(_table())
    assert "…" in plain.getvalue(), "rich cuts a wide table to 80 columns when it writes to a file"

    whole = io.StringIO()
    print_table(Console(file=whole), _table())
    text = whole.getvalue()
    assert "…" not in text
    assert all(header in text for header in HEADERS) and all(value in text for value in ROW)


def test_a_terminal_keeps_its_own_width() -> None:
    out = io.StringIO()
    print_table(Console(file=out, force_terminal=True, width=100, color_system=None), _table())
    assert max(len(line) for line in out.getvalue().splitlines()) <= 100
