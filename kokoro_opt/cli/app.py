"""The Typer app and what every command shares: the consoles, and one-line errors for mistakes in input."""

from __future__ import annotations

import errno
from collections.abc import Callable
from functools import wraps
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.markup import escape

from kokoro_opt.errors import UserError
from kokoro_opt.tables import plain

app = typer.Typer(
    help="Turn Kokoro-82M into the fastest artifact that still sounds like the original, measure it, serve it.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    # plain output (a screen reader, a braille display): --help as Click writes it, without Rich's boxed panels,
    # and as wide as its lines are (Click cuts a command's summary at 80 columns)
    **(
        {"rich_markup_mode": None, "context_settings": {"max_content_width": 10_000, "terminal_width": 10_000}} if plain() else {}
    ),
)
# soft_wrap: a message is one line however narrow the terminal (or 80 columns in a log), so a suggested command
# or a path copies whole; tables still fit the width
console = Console(soft_wrap=True)
err = Console(stderr=True, soft_wrap=True)

ArtifactsRoot = Annotated[Path, typer.Option("--artifacts", help="where artifacts are stored")]
# What every command that runs one artifact takes (select.resolve_artifact reads it)
ARTIFACT_HELP = "'best' (what serve picks), an artifact folder, a recipe's folder (its newest build), or an artifact id"

TrackingUri = Annotated[str | None, typer.Option(help="MLflow tracking URI (default: SQLite in experiments/)")]


# C0 and C1 controls but tab and line end: text from MLflow tags or a build record could move the cursor or retitle
# the terminal with escape sequences
_CONTROLS = {c: None for c in (*range(0x20), 0x7F, *range(0x80, 0xA0)) if chr(c) not in "\t\n"}


def _print_error(message: str, hint: str | None = None) -> None:
    # escaped: messages carry paths and pip extras like kokoro-opt[coreml], which are not markup
    said = (message + (f" — {hint}" if hint else "")).translate(_CONTROLS)  # messages may quote what others wrote
    err.print(f"[bold red]error:[/] {escape(said)}", highlight=False)


# what an interrupted command keeps, for the commands that keep something
ON_INTERRUPT = {
    "build": "completed stages stay cached; rerun the same command to resume",
    "evaluate": "evaluations already logged are skipped when the same command runs again",
    "tune": "finished trials stay in the study; rerun the same command to go on",
}


# what the file system refuses, and what to do about it (any other OSError is a defect, with its traceback)
_FILE_SYSTEM = {
    errno.ENOSPC: "free space there, or point --artifacts or KOKORO_OPT_CACHE at a larger disk",
    errno.EDQUOT: "your disk quota is used up there: free space, or point --artifacts or KOKORO_OPT_CACHE elsewhere",
    errno.EROFS: "that file system is read-only: point --artifacts, -o or KOKORO_OPT_CACHE at a writable folder",
}


def user_errors(command: Callable[..., Any]) -> Callable[..., Any]:
    """Print UserError as one line and exit 2: no traceback for mistakes in input. So too a path that is a file
    where a folder belongs (or the reverse), a full or read-only disk, and what MLflow refuses (a tracking URI it
    cannot use)."""

    @wraps(command)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return command(*args, **kwargs)
        except UserError as exc:
            _print_error(exc.message, exc.hint)
            raise typer.Exit(2) from None
        except (NotADirectoryError, IsADirectoryError, FileExistsError, PermissionError) as exc:
            _print_error(f"{exc.strerror}: {exc.filename}", "check the paths given: --artifacts, -o, sqlite URIs, the cache")
            raise typer.Exit(2) from None
        except OSError as exc:  # what the file system refuses, named with the file, and what the command kept
            if (hint := _FILE_SYSTEM.get(exc.errno or 0)) is None:
                raise
            kept = ON_INTERRUPT.get(command.__name__)
            where = f": {exc.filename}" if exc.filename else ""
            _print_error(f"{exc.strerror}{where}", hint + (f"; {kept}" if kept else ""))
            raise typer.Exit(2) from None
        except Exception as exc:
            if not type(exc).__module__.startswith("mlflow."):
                raise
            _print_error(f"MLflow: {str(exc).splitlines()[0][:400]}", "check --tracking-uri or MLFLOW_TRACKING_URI")
            raise typer.Exit(2) from None
        except KeyboardInterrupt:
            kept = ON_INTERRUPT.get(command.__name__)
            err.print(f"interrupted: {kept}" if kept else "interrupted")
            raise typer.Exit(130) from None

    return wrapper


def say_line(message: str) -> None:
    """A line on stderr, printed as it is: no markup (it may carry paths, or text others wrote) and no controls."""
    err.print(message.translate(_CONTROLS), markup=False, highlight=False)
