"""The Typer app and what every command shares: the consoles, and one-line errors for mistakes in input."""

from __future__ import annotations

from collections.abc import Callable
from functools import wraps
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.markup import escape

from kokoro_opt.errors import UserError

app = typer.Typer(
    help="Turn Kokoro-82M into the fastest artifact that still sounds like the original, measure it, serve it.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
)
# soft_wrap: a message is one line however narrow the terminal (or 80 columns in a log), so a suggested command
# or a path copies whole; tables still fit the width
console = Console(soft_wrap=True)
err = Console(stderr=True, soft_wrap=True)

ArtifactsRoot = Annotated[Path, typer.Option("--artifacts", help="where artifacts are stored")]
# What every command that runs one artifact takes (select.resolve_artifact reads it)
ARTIFACT_HELP = "'best' (what serve picks), an artifact folder, a recipe's folder (its newest build), or an artifact id"

TrackingUri = Annotated[str | None, typer.Option(help="MLflow tracking URI (default: SQLite in experiments/)")]


def user_errors(command: Callable[..., Any]) -> Callable[..., Any]:
    """Print UserError as one line and exit 2: no traceback for mistakes in input."""

    @wraps(command)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return command(*args, **kwargs)
        except UserError as exc:
            # escaped: messages carry paths and pip extras like kokoro-opt[coreml], which are not markup
            text = escape(exc.message + (f" — {exc.hint}" if exc.hint else ""))
            err.print(f"[bold red]error:[/] {text}", highlight=False)
            raise typer.Exit(2) from None
        except KeyboardInterrupt:
            err.print("interrupted: completed stages stay cached; rerun the same command to resume")
            raise typer.Exit(130) from None

    return wrapper


def say_line(message: str) -> None:
    """A progress line on stderr, printed as it is (no markup: it may carry paths)."""
    err.print(message, markup=False, highlight=False)
