"""Which artifact to serve: a path, an id, or `best` (tuned settings first, then evaluations).

The rule for `best`, in order:
1. a `tuned.json` written by `kokoro-opt tune` (the study's scalarised winner) on this machine — its
   artifact and its session/chunking settings; one tuned on another machine is not applied (the
   reason says so and what to run);
2. else, among artifacts still on disk and evaluated in MLflow, the fastest whose quality passes the
   budget (mean PESQ-WB >= 3.8 and no NaN/silent output vs fp32); fp32 itself always passes.
   Fastest = the highest speedup over fp32 measured side by side in its newest evaluation, since
   RTFs from different sessions are not comparable on a noisy machine. Evaluations measured on this
   machine (its fingerprint id) come first; with none, the best measured elsewhere, and the reason
   names the one command that evaluates it here;
3. else the newest fp32 artifact, else the newest artifact of any recipe that runs here.

Whatever the rule picks must run on this machine: a Core ML artifact off macOS is refused here with
the reason and the ONNX artifact to serve instead, before any server starts.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, StringConstraints

from kokoro_opt.artifacts import Artifact, open_artifact
from kokoro_opt.errors import UserError, read_validated
from kokoro_opt.runtime.availability import runtime_problem
from kokoro_opt.runtime.session import ExecutionMode, GraphLevel, SessionSettings
from kokoro_opt.store import Store

QUALITY_BUDGET_PESQ = 3.8
# The short-phrase slice (screen-reader announcements, exclamations) scores lower than sentences even
# when nothing is wrong: less speech per clip, so each difference weighs more. int8-mixed: 3.85.
QUALITY_BUDGET_PHRASE_PESQ = 3.6
TUNED_FILE = "tuned.json"


@dataclass
class Selection:
    artifact: Artifact
    settings: SessionSettings = field(default_factory=SessionSettings)
    chunking: dict[str, Any] = field(default_factory=dict)  # tune's: chunk sizes, crossfade, first window, context words
    reason: str = ""


def _by_id(root: Path, artifact_id: str) -> Artifact | None:
    """The artifact under `root` whose id starts with `artifact_id` (the newest copy of it); a prefix two ids
    share is an error, never a guess."""
    if not artifact_id:
        raise UserError("an empty artifact id", "give an artifact id, or a prefix of one: 49bf3e57")
    matches = [a for a in Store(root).artifacts() if a.id.startswith(artifact_id)]
    if exact := [a for a in matches if a.id == artifact_id]:  # a whole id is never ambiguous: others may extend it
        matches = exact
    if len({a.id for a in matches}) > 1:
        ids = ", ".join(sorted({a.id for a in matches}))
        raise UserError(f"artifact id '{artifact_id}' matches {ids} under {root}", "give more of the id")
    return matches[-1] if matches else None


def tuned_selection(root: Path, notes: list[str] | None = None) -> Selection | None:
    """`root`'s tuned.json, if it was tuned on this machine; why not goes to `notes`."""
    from kokoro_opt.machine import fingerprint, same_machine

    path = root / TUNED_FILE
    if not path.is_file():
        return None
    tuned = read_tuned(path)
    tuned_on = tuned["machine"]
    if not same_machine(tuned_on, fingerprint()):
        if notes is not None:
            notes.append(
                f"{path} was tuned on another machine ({tuned_on.get('cpu', '?')}, id {tuned_on.get('id', '?')}): not "
                f"applied here; tune here with kokoro-opt tune <recipe> --artifacts {root}"
            )
        return None
    if not tuned.get("applied", True):  # measured side by side, the winner was not sooner than the defaults
        if notes is not None:
            notes.append(f"{path}: {tuned.get('not_applied', 'its settings did not beat the defaults')}: the defaults serve")
        return None
    artifact = _by_id(root, tuned["artifact_id"])
    if artifact is None:
        if notes is not None:
            notes.append(f"{path} was tuned on artifact {tuned['artifact_id']}, which is not under {root}: not applied")
        return None
    if (newer := superseded_by(artifact)) is not None:
        if notes is not None:
            notes.append(
                f"{path} was tuned on {artifact.name} {artifact.id}, since built again as {newer.id}: not applied; "
                f"tune the new build with kokoro-opt tune <recipe> --artifacts {root}"
            )
        return None
    return Selection(artifact, tuned["session"], tuned["chunking"], f"tuned by study '{tuned['study']}' ({path})")


class _TunedChunking(BaseModel):
    """What tune writes of the serving settings (tuning.space.TrialSettings.chunking): these keys only, as numbers."""

    model_config = ConfigDict(extra="forbid", strict=True)
    first_chunk_tokens: int | None = None
    chunk_tokens: int | None = None
    crossfade_ms: float | int | None = None
    first_window_steps: int | None = None
    context_words: int | None = None


class _TunedSession(BaseModel):
    """tune's session settings (SessionSettings), of the values ONNX Runtime takes: a level it does not know was a
    KeyError when the server made its sessions."""

    model_config = ConfigDict(extra="forbid", strict=True)
    intra_op_num_threads: int = Field(0, ge=0, le=4096)
    inter_op_num_threads: int = Field(1, ge=1, le=4096)
    execution_mode: ExecutionMode = "sequential"
    graph_optimization_level: GraphLevel = "all"
    providers: list[Annotated[str, StringConstraints(pattern=r"^[A-Za-z]+ExecutionProvider$")]] = Field(
        default_factory=lambda: ["CPUExecutionProvider"], min_length=1, max_length=8
    )
    provider_options: list[dict[str, str | int | float | bool]] = Field(default_factory=list, max_length=8)
    enable_profiling: bool = False

    def settings(self) -> SessionSettings:
        return SessionSettings(**{**self.model_dump(), "providers": tuple(self.providers),
                                  "provider_options": tuple(self.provider_options)})  # fmt: skip


class _TunedFile(BaseModel):
    model_config = ConfigDict(extra="allow")
    artifact_id: str
    machine: dict[str, Any] = Field(default_factory=dict)
    applied: bool = True
    not_applied: str | None = None
    study: str = "?"
    session: _TunedSession = Field(default_factory=_TunedSession)
    chunking: _TunedChunking = Field(default_factory=_TunedChunking)


def read_tuned(path: Path) -> dict[str, Any]:
    """tuned.json, checked: the machine, session settings and chunking of known fields and types (a file anyone
    can edit must not set the server's api key or switch a limit off), or one UserError naming the field."""
    hint = f"delete {path}, or tune again: kokoro-opt tune <recipe> --artifacts {path.parent}"
    tuned = read_validated(path, _TunedFile, hint)
    kept = tuned.model_dump(include={"artifact_id", "machine", "applied", "not_applied", "study"})
    return {**kept, "session": tuned.session.settings(), "chunking": tuned.chunking.model_dump(exclude_none=True)}


def evaluated_selection(root: Path, tracking_uri: str | None) -> Selection | None:
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor
    from concurrent.futures.process import BrokenProcessPool

    from kokoro_opt.machine import fingerprint

    # The evaluation records are read in a child process: importing MLflow holds ~200 MB that a server would
    # keep for its lifetime (`bench-serve --windowed`, peak RSS: 690-701 MB with `--artifact best`, 497-505 MB
    # given the same artifact's path; AMD EPYC)
    try:
        with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as child:
            best = child.submit(_best_evaluated, root, tracking_uri, fingerprint()["id"]).result()
    except (BrokenProcessPool, BrokenPipeError, EOFError) as exc:  # the child died: no answer and no error of its own
        raise UserError(
            f"reading the evaluation records to pick 'best' failed: its process ended ({type(exc).__name__})",
            "pass --artifact <folder> instead of best, or check that this account can run kokoro-opt evaluate",
        ) from None
    if best is None:
        return None
    artifact = _by_id(root, best["artifact_id"])
    if artifact is None:
        return None
    reason = best["reason"]
    if not best["measured_here"]:
        reason += f"; to rank the artifacts on this machine, evaluate them here: kokoro-opt evaluate {artifact.path}"
    return Selection(artifact, reason=reason)


def _best_evaluated(root: Path, tracking_uri: str | None, machine_id: str) -> dict[str, Any] | None:
    from kokoro_opt.evaluate.ranking import best_evaluated

    return best_evaluated(
        tracking_uri,
        QUALITY_BUDGET_PESQ,
        available=lambda artifact_id: _runs_here(_by_id(root, artifact_id)),
        machine_id=machine_id,
        min_phrase_pesq=QUALITY_BUDGET_PHRASE_PESQ,
    )


def _runs_here(artifact: Artifact | None) -> bool:
    """On disk, its recipe's newest build, and runnable on this machine: a Core ML artifact another machine ranked
    first is not a pick off macOS, and an older build of a recipe built again is not one either (its evaluation may
    have timed faster by noise, or predate a fix in the code that made it)."""
    return artifact is not None and superseded_by(artifact) is None and runtime_problem(artifact) is None


def superseded_by(artifact: Artifact) -> Artifact | None:
    """The newer build in the artifact's recipe folder (what `artifacts/<recipe>` names), if there is one."""
    newest = open_artifact(artifact.path.parent)
    return None if newest.path == artifact.path else newest


def no_artifacts(root: Path) -> UserError:
    """The error for an artifacts folder with nothing built in it: the folder is relative to where the command runs,
    so a user who built in the checkout and runs elsewhere is told where it looked and how to point it there."""
    return UserError(
        f"no artifacts under {Path(root).resolve()}",
        "build the flagship with `make build` in the checkout, and run from there or pass --artifacts DIR",
    )


def resolve_artifact(
    spec: str, root: Path = Path("artifacts"), tracking_uri: str | None = None, runs_here: bool = True
) -> Selection:
    """`best`, a folder, or an artifact id (prefix) -> what to serve, and why; UserError if it cannot run here
    (`runs_here=False`: found, whether or not, for what only reads its files)."""
    selection = _resolve(spec, root, tracking_uri)
    if spec == "best" or names_a_path(spec):  # never spoken with as what its id names once changed (an id is
        selection.artifact.check_intact()  # checked as it is found: artifact_by_id fetches a changed copy again)
    problem = runtime_problem(selection.artifact) if runs_here else None
    if problem is not None:
        raise problem
    return selection


def artifact_by_id(spec: str, root: Path, tracking_uri: str | None = None, say: Callable[[str], None] | None = None) -> Artifact:
    """The artifact under `root` whose id starts with `spec`; else fetched from the MLflow artifact store
    (pushed by `kokoro-opt push` or `build --push` on another machine) and verified against its manifest. A copy
    here that changed since it was written is fetched again (an error if it was never pushed)."""
    from kokoro_opt.artifacts import REBUILD
    from kokoro_opt.remote import fetch_artifact

    say = say or _stderr
    found = _by_id(root, spec)
    if found is not None and (damage := found.damage()):
        say(f"{found.path}: {damage}: fetching it again")
        if (found := fetch_artifact(found.id, root, tracking_uri, say)) is None:  # built here and never pushed
            raise UserError(f"artifact {spec} under {root}: {damage}", REBUILD)
    found = found or fetch_artifact(spec, root, tracking_uri, say)
    if found is None:
        recipe = root / spec
        hint = (
            f"{recipe} is that recipe's folder: pass it, or one of its builds"
            if recipe.is_dir()
            else "check the id; on the machine that built it: kokoro-opt push <folder> --tracking-uri URI"
        )
        raise UserError(f"no artifact '{spec}' under {root} nor pushed to the MLflow store", hint)
    return found


def export_missing(root: Path, artifact: Artifact) -> bool:
    """Whether an artifact built from an fp32 export lacks it under `root` (a fetch killed before it arrived)."""
    from kokoro_opt.store import stage_chain

    chain = stage_chain(artifact)  # an fp32 export is its own reference (Store.reference_export)
    return bool(chain) and chain[0].kind == "export" and Store(root).reference_export(artifact) is None


def _stderr(message: str) -> None:
    print(message, file=sys.stderr)


def names_a_path(spec: str) -> bool:
    """Whether an artifact given on the command line is a path (an existing one, or one with a slash or a recipe's
    suffix: a typo, not an id) rather than an id, which is one name (letters, digits, '.', '_', '-')."""
    return Path(spec).exists() or "/" in spec or "\\" in spec or spec.endswith((".yaml", ".yml"))


def _resolve(spec: str, root: Path, tracking_uri: str | None) -> Selection:
    if spec != "best":
        if names_a_path(spec):
            return Selection(open_artifact(spec), reason=f"given as a path: {spec}")
        return Selection(artifact_by_id(spec, root, tracking_uri), reason=f"given as an id: {spec}")
    notes: list[str] = []
    # in turn: the evaluation records are read (MLflow, in a child process) only when nothing tuned is served
    pick = tuned_selection(root, notes) or evaluated_selection(root, tracking_uri)
    if pick is not None:
        pick.reason = "; ".join([pick.reason, *notes])
        return pick
    every = Store(root).artifacts()
    if not every:
        raise no_artifacts(root)
    fp32 = [a for a in every if a.name == "fp32"]
    runnable = [a for a in every if _runs_here(a)]
    chosen = (fp32 or runnable or every)[-1]
    reason = f"no tuning or evaluation records yet: newest {chosen.name} artifact"
    return Selection(chosen, reason="; ".join([reason, *notes]))
