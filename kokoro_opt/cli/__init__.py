"""The `kokoro-opt` command line: a thin shell over the library (kokoro_opt.build, .runtime, .serve, ...).

Each module registers its commands on the one Typer app (cli/app.py), in the order `--help` lists them.
"""

from __future__ import annotations

import sys

from kokoro_opt.cli import artifact_commands, measure_commands, serve_commands  # noqa: F401  (they register commands)
from kokoro_opt.cli.app import app

__all__ = ["app", "main"]


def main() -> None:
    try:
        app()
    except BrokenPipeError:
        sys.exit(0)
