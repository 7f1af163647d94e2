"""Locating the project's committed data (calibration/, recipes/) from the package.

Relative to the project checkout that holds this package, never the current directory: a build
started from another folder must read (and hash) the same files.
"""

from __future__ import annotations

from pathlib import Path

from kokoro_opt.errors import UserError

PROJECT_ROOT = Path(__file__).resolve().parent.parent


def project_file(relative: str) -> Path:
    """A committed file of the project checkout (e.g. `calibration/sentences.txt`)."""
    candidate = PROJECT_ROOT / relative
    if not candidate.exists():
        raise UserError(
            f"{relative} not found beside the kokoro_opt package ({PROJECT_ROOT})",
            "install kokoro-opt from a checkout of the project (pip install -e .): it holds calibration/ and recipes/",
        )
    return candidate
