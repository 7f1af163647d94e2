"""The pass contract: what every stage declares once, next to its code (Olive's shape).

A pass is one config class and one function from artifact to artifact. Its cache key covers
everything its output depends on: its config, its input's key, its own code (the source of its module
and of every kokoro_opt module that module imports, `code_key`), the content of every project data file
it reads and the versions of the libraries that write its output. Its *decision key* leaves out the
code and library versions: measured decisions (the sensitivity analysis' choice of INT8 blocks) stay
valid across them and are re-checked, not re-made (locks.py).

What a pass leaves beside the model is declared too, and the build engine (build.py) holds it to that:
`produces` (the side files it may write), `consumes` (those it reads from its input when present: declared for
the reader, and the tests hold every one to a pass that produces it),
`carries` (those of its input that stay true of its output: the engine copies them, the pass never
does), `grants` (capabilities its output has, manifest.Capabilities), `keeps` (its input's
capabilities that survive it), `needs` (those its input must have) and `after` (stages whose output it rewrites).
Which stage may follow which follows from the last four (`check_order`).
"""

from __future__ import annotations

import ast
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ValidationError

from kokoro_opt.errors import UserError, first_problem
from kokoro_opt.hashing import content_key, file_sha256, text_sha256
from kokoro_opt.machine import installed_versions
from kokoro_opt.paths import PROJECT_ROOT, project_file

# run(input artifact, config, output folder) -> the stage record for the build record
PassRunner = Callable[[Any, Any, Path], dict[str, Any]]
PACKAGE = "kokoro_opt"
# Modules whose code cannot change what a pass writes: the recipe schema (its values are in the key
# already), error texts, printing, this contract (the key's own recipe).
NOT_OUTPUT_SHAPING = frozenset({"kokoro_opt.recipe", "kokoro_opt.errors", "kokoro_opt.tables", "kokoro_opt.contract"})


@dataclass(frozen=True)
class Pass:
    kind: str
    config: type[BaseModel]
    run: PassRunner
    reads: tuple[str, ...] = ()  # project data files (relative to the checkout) whose content shapes the output
    libraries: tuple[str, ...] = ()  # packages whose version shapes the output
    produces: tuple[str, ...] = ()  # side files (or folders) it may write beside the model
    consumes: tuple[str, ...] = ()  # side files it reads from its input, when present
    carries: tuple[str, ...] = ()  # side files of its input still true of its output: the engine copies them
    grants: tuple[str, ...] = ()  # capabilities its output has
    keeps: tuple[str, ...] = ()  # capabilities of its input its output keeps
    needs: tuple[str, ...] = ()  # capabilities its input must have (a stage before it granted them)
    after: tuple[str, ...] = ()  # stages that must come before it: it rewrites what only they make
    # run(..., decisions=None | locked) measures decisions or applies locked ones, and returns
    # record["decisions"] (+ "decision_scores") for the recipe's lock (locks.py)
    decides: bool = False
    decisions_model: type[BaseModel] | None = None  # the shape of its locked decisions, checked before they apply
    # files of its output that hold its decisions (too large for JSON): the lock keeps them beside it and a
    # locked run gets them as decisions["files"] = {name: path}
    decision_files: tuple[str, ...] = ()
    # config fields that only judge the output (a gate's budget, what it checks on): out of the decision key,
    # so changing a budget checks the locked decision again instead of measuring it again
    judged_by: tuple[str, ...] = ()
    # what the machine must have to run it (a working compiler): raises a UserError naming the fix, before a build runs
    # its first stage that is not cached
    machine_check: Callable[[], object] | None = None

    def check_decisions(self, decisions: dict[str, Any], lock: Path) -> None:
        """A lock is a file anyone can edit: decisions that do not have the shape this pass reads are one error."""
        if self.decisions_model is None:
            return
        try:
            self.decisions_model.model_validate(decisions)
        except ValidationError as exc:
            raise UserError(
                f"{lock}: the decisions of stage '{self.kind}' do not fit it ({first_problem(exc)})",
                "restore the lock from git, or rebuild with --reanalyze to measure and lock them again",
            ) from None

    def data_hashes(self) -> dict[str, str]:
        return {name: file_sha256(project_file(name)) for name in self.reads}

    def library_versions(self) -> dict[str, str]:
        return installed_versions(self.libraries, absent="absent")

    def code_key(self) -> str:
        """The source of the module defining `run` and of every kokoro_opt module it imports, transitively
        (comments, docstrings and formatting left out): a change to any of them makes new cache keys."""
        return code_key(self.run.__module__)

    def decision_key(self, cfg: BaseModel, input_decision_key: str) -> str:
        """Inputs only (config, input chain, data): identical on every machine and library version."""
        decided_by = cfg.model_dump(mode="json", exclude=set(self.judged_by))
        return content_key(self.kind, decided_by, input_decision_key, self.data_hashes())

    def cache_key(self, cfg: BaseModel, input_key: str, extra: Any = None) -> str:
        """Everything the output depends on; `extra` for inputs that are not config (locked decisions)."""
        parts = [self.kind, self.code_key(), cfg.model_dump(mode="json"), input_key, self.data_hashes(), self.library_versions()]
        return content_key(*parts, *([extra] if extra is not None else []))


def _module_file(module: str, root: Path = PROJECT_ROOT) -> Path | None:
    base = root / module.replace(".", "/")
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def _imported(tree: ast.AST, module: str, root: Path) -> set[str]:
    """kokoro_opt modules `tree` imports anywhere (at the top or inside a function)."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith(PACKAGE)}
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith(PACKAGE) and not node.level:
            for alias in node.names:  # `from package import module` needs the module, not the whole package
                submodule = f"{node.module}.{alias.name}"
                found.add(submodule if _module_file(submodule, root) is not None else node.module)
    return {name for name in found if name != module and _module_file(name, root) is not None}


def _normalized(tree: ast.AST) -> str:
    """The code without docstrings: what runs, not how it reads."""
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        first = body[0] if isinstance(body, list) and body else None
        if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str):
            node.body = body[1:] or [ast.Pass()]  # type: ignore[attr-defined]
    return ast.dump(tree, include_attributes=False)


@cache
def _module_code(name: str, root: Path) -> tuple[str, frozenset[str]] | None:
    """(hash of the module's normalized code, the kokoro_opt modules it imports); None if it has no file."""
    path = _module_file(name, root)
    if path is None:
        return None
    tree = ast.parse(path.read_text(encoding="utf-8"))
    imports = frozenset(_imported(tree, name, root))
    return text_sha256(_normalized(tree)), imports


@cache
def source_closure(module: str, root: Path = PROJECT_ROOT) -> tuple[tuple[str, str], ...]:
    """(module, hash of its normalized code) for `module` and every kokoro_opt module it reaches by imports,
    read from the package under `root`."""
    seen: dict[str, str] = {}
    stack = [module]
    while stack:
        name = stack.pop()
        if name in seen or name in NOT_OUTPUT_SHAPING or (code := _module_code(name, root)) is None:
            continue
        seen[name] = code[0]
        stack.extend(code[1] - seen.keys())
    return tuple(sorted(seen.items()))


@cache
def code_key(module: str) -> str:
    return content_key(source_closure(module))


def check_order(kinds: list[str], passes: dict[str, Pass]) -> None:
    """Refuse a chain where a stage drops a capability an earlier stage made, naming both stages, or where a
    stage needs a capability or a stage no stage before it made or was, naming a stage that would be."""
    held: dict[str, str] = {}  # capability -> the stage that made it
    for i, kind in enumerate(kinds):
        p = passes[kind]
        for cap in p.needs:
            if cap not in held:
                makers = sorted(other.kind for other in passes.values() if cap in other.grants)
                raise UserError(
                    f"stage '{kind}' needs what a '{makers[0]}' stage makes ({cap}), and no stage before it does",
                    f"put '{kind}' after a '{makers[0]}' stage",
                )
        missing = [before for before in p.after if before not in kinds[:i]]
        if missing:
            raise UserError(
                f"stage '{kind}' rewrites what a '{missing[0]}' stage makes, and no stage before it is one",
                f"put '{kind}' after a '{missing[0]}' stage (its order: {', '.join(p.after)}, then '{kind}')",
            )
        dropped = {cap: maker for cap, maker in held.items() if cap not in p.keeps and cap not in p.grants}
        if dropped:
            cap, maker = next(iter(dropped.items()))
            raise UserError(
                f"stage '{kind}' after stage '{maker}' drops what '{maker}' made ({cap}): "
                f"'{kind}' rewrites what it was made from",
                f"put '{maker}' after '{kind}' (or last)",
            )
        held = {**{cap: maker for cap, maker in held.items() if cap in p.keeps}, **dict.fromkeys(p.grants, kind)}


def declared_outputs(p: Pass) -> set[str]:
    """What a pass's output folder may hold at its top level besides the model and runtime files."""
    return set(p.produces) | set(p.carries)
