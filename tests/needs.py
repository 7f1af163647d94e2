"""What a test needs beyond the core install: `make test` installs every extra and .ci/run the system packages, so
there a missing one fails the test (CI must run it); elsewhere (`pip install -e '.[dev]'` alone) it skips, saying
how to install it."""

from __future__ import annotations

import importlib
import importlib.util
import os
import shutil
from types import ModuleType
from typing import NoReturn

import pytest


def missing(what: str, fix: str) -> NoReturn:
    message = f"{what} is not installed: {fix}"
    if os.environ.get("CI"):
        pytest.fail(message)
    pytest.skip(message, allow_module_level=True)


def module(name: str, fix: str) -> ModuleType:
    """The module, imported; a failure under CI, else a skip, when it is not installed."""
    if importlib.util.find_spec(name) is None:
        missing(name, fix)
    return importlib.import_module(name)


def modules(names: tuple[str, ...], fix: str) -> None:
    for name in names:
        module(name, fix)


def program(name: str, fix: str) -> str:
    """The program's path on PATH; a failure under CI, else a skip, when there is none."""
    found = shutil.which(name)
    if found is None:
        missing(name, fix)
    return found
