"""Locating the project's committed data (calibration/, recipes/) from an installed package."""

from __future__ import annotations

from pathlib import Path

from kokoro_opt.errors import UserError

PROJECT_ROOT = Path(__file__).resolve().parent.parent


def repo_file(relative: str) -> Path:
    """A committed file, looked up in the working directory first, then beside the package."""
    for base in (Path.cwd(), PROJECT_ROOT):
        candidate = base / relative
        if candidate.exists():
            return candidate
    raise UserError(f"{relative} not found", "run kokoro-opt from a checkout of the project (it holds calibration/ and recipes/)")
