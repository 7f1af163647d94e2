"""The pass contract: what every stage declares once, next to its code (Olive's shape).

A pass is one config class and one function from artifact to artifact. Its cache key covers
everything its output depends on: its config, its input's key, its own code version, the content
of every project data file it reads and the versions of the libraries that write its output. Its
*decision key* leaves out the code and library versions: measured decisions (the sensitivity
analysis' choice of INT8 blocks) stay valid across them and are re-checked, not re-made (locks.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from kokoro_opt.hashing import content_key, file_sha256
from kokoro_opt.paths import project_file

# run(input artifact, config, output folder) -> the stage record for the manifest
PassRunner = Callable[[Any, Any, Path], dict[str, Any]]


@dataclass(frozen=True)
class Pass:
    kind: str
    config: type[BaseModel]
    run: PassRunner
    version: str  # bump when the code changes what the pass writes: old cache entries stop matching
    reads: tuple[str, ...] = ()  # project data files (relative to the checkout) whose content shapes the output
    libraries: tuple[str, ...] = ()  # packages whose version shapes the output
    produces: tuple[str, ...] = ()  # side files written beside the model
    consumes: tuple[str, ...] = ()  # side files read from the input artifact, when present
    # run(..., decisions=None | locked) measures decisions or applies locked ones, and returns
    # record["decisions"] (+ "decision_scores") for the recipe's lock (locks.py)
    decides: bool = False

    def data_hashes(self) -> dict[str, str]:
        return {name: file_sha256(project_file(name)) for name in self.reads}

    def library_versions(self) -> dict[str, str]:
        found = {}
        for package in self.libraries:
            try:
                found[package] = metadata.version(package)
            except metadata.PackageNotFoundError:
                found[package] = "absent"
        return found

    def decision_key(self, cfg: BaseModel, input_decision_key: str) -> str:
        """Inputs only (config, input chain, data): identical on every machine and library version."""
        return content_key(self.kind, cfg.model_dump(mode="json"), input_decision_key, self.data_hashes())

    def cache_key(self, cfg: BaseModel, input_key: str, extra: Any = None) -> str:
        """Everything the output depends on; `extra` for inputs that are not config (locked decisions)."""
        parts = [self.kind, self.version, cfg.model_dump(mode="json"), input_key, self.data_hashes(), self.library_versions()]
        return content_key(*parts, *([extra] if extra is not None else []))
