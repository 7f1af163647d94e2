"""The docs name what exists: every project file and relative link in the README and docs/ (the dated measurement
logs are history and may name what was removed since), every benchmark script listed in docs/benchmarks.md, and
each command summed up in `kokoro-opt --help`."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
GUIDES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
PROJECT_FILE = re.compile(r"\b((?:kokoro_opt|benchmarks|tests|recipes|calibration)/[\w./-]+\.(?:py|yaml|c|json|txt))\b")
LINK = re.compile(r"\]\(([^)#:\s]+)(?:#[^)]*)?\)")


def test_the_guides_name_files_that_exist() -> None:
    missing = [
        f"{doc.relative_to(ROOT)}: {name}"
        for doc in GUIDES
        for name in PROJECT_FILE.findall(doc.read_text(encoding="utf-8"))
        if not (ROOT / name).exists()
    ]
    assert not missing, missing


def test_the_guides_links_resolve() -> None:
    broken = [
        f"{doc.relative_to(ROOT)}: {target}"
        for doc in GUIDES
        for target in LINK.findall(doc.read_text(encoding="utf-8"))
        if not (doc.parent / target).exists()
    ]
    assert not broken, broken


def test_every_benchmark_script_is_listed() -> None:
    listed = set(re.findall(r"^\| `(\w+\.py)` \|", (ROOT / "docs" / "benchmarks.md").read_text(encoding="utf-8"), re.M))
    scripts = {p.name for p in (ROOT / "benchmarks").glob("*.py") if p.name != "__init__.py"}
    assert scripts == listed, (sorted(scripts - listed), sorted(listed - scripts))


def test_each_command_is_summed_up_in_one_paragraph() -> None:
    """`kokoro-opt COMMAND --help` shows a command's docstring with its line breaks, which the terminal's own wrapping
    then breaks again: each paragraph is one line of the docstring, the first one the summary `--help` lists."""
    import inspect

    from kokoro_opt.cli import app

    broken = [c.callback.__name__ for c in app.registered_commands if "\n" in inspect.getdoc(c.callback).replace("\n\n", "")]
    assert not broken, broken
