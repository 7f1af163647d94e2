"""The search space of a study: which artifacts may be tuned (quality budget), which providers run
here, and how one Optuna trial turns into concrete settings.

The resolved space is pinned in the study (a user attribute) when the study is created, so every
worker and every resumed run samples exactly the same choices, even if new artifacts appear later.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from kokoro_opt.artifacts import Artifact
from kokoro_opt.chunking import CONTEXT_WORDS
from kokoro_opt.errors import UserError
from kokoro_opt.machine import usable_cpus
from kokoro_opt.runtime.join import CROSSFADE_MS
from kokoro_opt.runtime.session import SessionSettings
from kokoro_opt.store import Store
from kokoro_opt.text import JOB_TOKENS
from kokoro_opt.tuning.config import QualityConfig, SpaceConfig, TuneRecipe
from kokoro_opt.voices import unknown_voice

CPU = "CPUExecutionProvider"
# What an output identical to the fp32 reference scores: the P.862.2 ceiling, no WER change.
REFERENCE_QUALITY = {"pesq": 4.64, "wer_delta": 0.0}
METRIC_KEYS = {"pesq": "pesq_mean", "wer_delta": "wer_delta"}
Say = Callable[[str], None]


@dataclass
class Candidate:
    """One `artifact` choice: an artifact within the quality budget, with its .ort sibling if any."""

    key: str  # the choice label, "<recipe>@<id8>"
    name: str
    formats: dict[str, str]  # "onnx" / "ort" -> artifact id
    quality: float  # the recipe's quality metric (PESQ or WER delta) of the onnx artifact (else the ort one)
    reason: str
    windowed: bool = False  # it streams windowed by default: its first window size is searched too


@dataclass
class ResolvedSpace:
    candidates: list[Candidate]
    space: SpaceConfig
    quality_metric: str
    quality_objective: bool
    skipped: list[str] = field(default_factory=list)

    def candidate(self, key: str) -> Candidate:
        return next(c for c in self.candidates if c.key == key)

    def to_json(self) -> dict[str, Any]:
        return {
            "candidates": [asdict(c) for c in self.candidates],
            "space": self.space.model_dump(mode="json"),
            "quality_metric": self.quality_metric,
            "quality_objective": self.quality_objective,
            "skipped": self.skipped,
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> ResolvedSpace:
        return cls(
            [Candidate(**c) for c in data["candidates"]],
            SpaceConfig.model_validate(data["space"]),
            data["quality_metric"],
            bool(data["quality_objective"]),
            list(data.get("skipped", [])),
        )


@dataclass(frozen=True)
class TrialSettings:
    """What a trial measures and what tuned.json records: an artifact, ORT session options, chunking."""

    artifact_id: str
    session: SessionSettings
    first_chunk_tokens: int = 40
    chunk_tokens: int = JOB_TOKENS
    crossfade_ms: float = CROSSFADE_MS
    first_window_steps: int | None = None  # a windowed artifact's; None: the artifact's own
    context_words: int = CONTEXT_WORDS  # what the first-chunk budget was measured with, so serve speaks chunks so

    @property
    def chunking(self) -> dict[str, Any]:
        """What serve takes from tuned.json (ServeConfig fields)."""
        chunking: dict[str, Any] = {
            "first_chunk_tokens": self.first_chunk_tokens,
            "chunk_tokens": self.chunk_tokens,
            "crossfade_ms": self.crossfade_ms,
            "context_words": self.context_words,
        }
        if self.first_window_steps is not None:
            chunking["first_window_steps"] = self.first_window_steps
        return chunking


# ---- which artifacts -------------------------------------------------------------------------------


def _select(specs: list[str], root: Path, say: Say) -> list[Artifact]:
    every = Store(root).artifacts()
    chosen: dict[str, Artifact] = {}
    for spec in specs:
        if spec == "all":
            found = every
        else:  # a recipe name (its newest build) or an artifact id prefix
            named = [a for a in every if a.name == spec][-1:]
            found = named or [a for a in every if a.id.startswith(spec)]
        if not found:
            say(f"artifact '{spec}': not built under {root}, skipped")
        chosen.update((a.id, a) for a in found)
    return list(chosen.values())


def _is_reference(artifact: Artifact) -> bool:
    from kokoro_opt.evaluate.runners import reference_folder

    ref = reference_folder(artifact)
    return ref is not None and ref.resolve() == artifact.path.resolve()


def quality_of(
    artifact: Artifact, quality: QualityConfig, tracking_uri: str | None, root: Path, say: Say
) -> tuple[float, str] | None:
    """(metric value, why it passes) or None (with the logged reason). Never a made-up number: the
    reference passes by definition, anything else needs an evaluation record (made now if allowed)."""
    from kokoro_opt.evaluate.ranking import budget_problem, served
    from kokoro_opt.tuning.records import recorded_evaluation

    label = f"{artifact.name} {artifact.id[:8]}"
    if _is_reference(artifact):
        return REFERENCE_QUALITY[quality.metric], "the fp32 reference: within the budget by definition"
    pesq_budget = quality.metric == "pesq"

    def scored(metrics: dict[str, float]) -> bool:
        return math.isfinite(served(metrics).get("pesq_mean", math.nan) if pesq_budget else metrics.get("wer_delta", math.nan))

    metrics, source = recorded_evaluation(tracking_uri, artifact.id, scored), "MLflow evaluation record"
    if metrics is None and quality.evaluate_missing:
        from kokoro_opt.evaluate.run import evaluate_artifacts
        from kokoro_opt.evaluate.settings import evaluate_config

        say(f"{label}: no evaluation record, evaluating it first (quality budget)")
        results = evaluate_artifacts(
            [artifact], evaluate_config(artifact.manifest, **quality.evaluate.model_dump()), tracking_uri, root=root
        )
        metrics, source = (dict(results[0].metrics), "evaluated now") if results else (None, "")
    if metrics is None:
        say(f"{label}: no evaluation record of its quality, skipped (run kokoro-opt evaluate on it)")
        return None
    if problem := budget_problem(metrics, quality.min_pesq if pesq_budget else None, quality.min_phrase_pesq):
        say(f"{label}: {problem}, skipped")
        return None
    heard = served(metrics)  # a windowed artifact is heard as its stream: judged by its windowed scores
    mode = "windowed " if heard["windowed"] else ""
    value = heard["pesq_mean"] if pesq_budget else metrics.get("wer_delta", math.nan)
    if not math.isfinite(value):
        say(f"{label}: its evaluation has no wer_delta (evaluate it with --asr), skipped")
        return None
    if not pesq_budget and value > quality.max_wer_delta:
        say(f"{label}: WER delta {value:.3f} > budget {quality.max_wer_delta}, skipped")
        return None
    return float(value), f"{mode if pesq_budget else ''}{METRIC_KEYS[quality.metric]} {value:.3f} within the budget ({source})"


def ort_source(artifact: Artifact) -> str | None:
    """The artifact an .ort artifact was converted from (the stage before its `ort` stage)."""
    from kokoro_opt.store import stage_chain

    chain = stage_chain(artifact)
    return chain[-2].key if len(chain) >= 2 and chain[-1].kind == "ort" else None


def gather_candidates(recipe: TuneRecipe, root: Path, tracking_uri: str | None, say: Say) -> list[Candidate]:
    passing: list[tuple[Artifact, str, float, str]] = []
    for artifact in _select(recipe.space.artifacts, root, say):
        fmt = artifact.model_file.suffix.lstrip(".")
        if fmt not in ("onnx", "ort"):
            say(f"{artifact.name} {artifact.id[:8]}: {artifact.model_file.name} does not run on ONNX Runtime, skipped")
        elif fmt not in recipe.space.model_format:
            say(f"{artifact.name} {artifact.id[:8]}: .{fmt} is not in space.model_format, skipped")
        elif recipe.measure.voice and (lacking := unknown_voice(recipe.measure.voice, artifact.voice_names)):
            say(f"{artifact.name} {artifact.id[:8]}: has no voice '{lacking}' (measure.voice), skipped")
        elif (q := quality_of(artifact, recipe.quality, tracking_uri, root, say)) is not None:
            passing.append((artifact, fmt, *q))
    groups: dict[str, Candidate] = {}
    for artifact, fmt, value, reason in sorted(passing, key=lambda p: p[1] != "onnx"):  # onnx bases first
        source = ort_source(artifact) if fmt == "ort" else None
        if source is not None and source in groups:
            groups[source].formats["ort"] = artifact.id
            continue
        key, windowed = f"{artifact.name}@{artifact.id[:8]}", artifact.windowed_by_default  # the mode serve uses
        groups[artifact.id] = Candidate(key, artifact.name, {fmt: artifact.id}, value, reason, windowed)
    return list(groups.values())


def available_providers(space: SpaceConfig, say: Say) -> dict[str, dict[str, list[str]]]:
    import onnxruntime as ort

    here = set(ort.get_available_providers())
    kept = {name: opts for name, opts in space.providers.items() if name in here}
    for name in space.providers:
        if name not in here:
            say(f"{name}: not available in this onnxruntime build ({', '.join(sorted(here))}), skipped")
    return kept


def resolve_space(recipe: TuneRecipe, root: Path, tracking_uri: str | None, say: Say) -> ResolvedSpace:
    skipped: list[str] = []

    def note(message: str) -> None:
        skipped.append(message)
        say(message)

    candidates = gather_candidates(recipe, root, tracking_uri, note)
    if not candidates:
        raise UserError(
            f"no artifact under {root} can be tuned",
            "see the notes above; build and evaluate one: kokoro-opt build recipes/fp32.yaml",
        )
    providers = available_providers(recipe.space, note)
    if not providers:
        raise UserError("none of space.providers is available here", f"add {CPU} to the tuning recipe")
    cpus = usable_cpus()  # hardware threads: tune measures whether a core's second one pays
    intra = [n for n in recipe.space.intra_op_num_threads if n <= cpus]
    if not intra:  # every one would oversubscribe the CPUs: nothing worth measuring
        raise UserError(
            f"every space.intra_op_num_threads choice is above this machine's {cpus} CPUs",
            f"add {cpus} (or 0, ONNX Runtime's default) to the tuning recipe",
        )
    if len(intra) < len(recipe.space.intra_op_num_threads):
        note(f"intra_op_num_threads above this machine's {cpus} CPUs dropped")
    first = first_chunk_sizes(recipe, candidates, root, note)
    space = recipe.space.model_copy(update={"providers": providers, "intra_op_num_threads": intra, "first_chunk_tokens": first})
    return ResolvedSpace(candidates, space, recipe.quality.metric, recipe.quality.use == "objective", skipped)


def first_chunk_sizes(recipe: TuneRecipe, candidates: list[Candidate], root: Path, say: Say) -> list[int]:
    """The space's first_chunk_tokens within the first-chunk prosody budget, measured on the candidate
    closest to fp32 (the timing is the model's: int8-mixed keeps fp32's durations on every sentence)."""
    from kokoro_opt.evaluate.corpus import load_corpus
    from kokoro_opt.first_chunk import DurationModel, distortion_by_size, within_budget

    sizes, budget = recipe.space.first_chunk_tokens, recipe.quality.max_first_chunk_distortion
    if budget is None:
        return sizes
    onnx = [c for c in candidates if "onnx" in c.formats]
    if not onnx:
        say("first-chunk timing not measured: no .onnx candidate (an .ort graph cannot be cut to its front)")
        return sizes
    best = max(onnx, key=lambda c: c.quality if recipe.quality.metric == "pesq" else -c.quality)
    artifact = next(a for a in Store(root).artifacts() if a.id == best.formats["onnx"])
    texts = [s.text for s in load_corpus().sentences]  # each first chunk timed as `serve` speaks it, with its context
    measured = distortion_by_size(DurationModel(artifact), sizes, texts, context_words=CONTEXT_WORDS)
    say(f"first chunk alone vs in its sentence, timing distortion ({best.key}): "
        + ", ".join(f"{k} tokens {v:.2f}" for k, v in sorted(measured.items())))  # fmt: skip
    kept = within_budget(sizes, measured, budget)
    if not kept:
        raise UserError(
            f"every first_chunk_tokens choice is timed beyond quality.max_first_chunk_distortion {budget}",
            "add larger sizes to space.first_chunk_tokens, or raise the budget",
        )
    if len(kept) < len(sizes):
        say(f"first_chunk_tokens {', '.join(str(k) for k in sizes if k not in kept)} dropped: "
            f"distortion above quality.max_first_chunk_distortion {budget}")  # fmt: skip
    return kept


# ---- one trial ---------------------------------------------------------------------------------------


def _pick(trial: Any, name: str, choices: list[Any]) -> Any:
    """Suggest only real choices: a pinned (one-element) setting is not a search dimension."""
    return choices[0] if len(choices) == 1 else trial.suggest_categorical(name, choices)


def suggest(trial: Any, resolved: ResolvedSpace) -> TrialSettings:
    s = resolved.space
    candidate = resolved.candidate(_pick(trial, "artifact", [c.key for c in resolved.candidates]))
    fmt = _pick(trial, "model_format", sorted(candidate.formats))
    provider = _pick(trial, "provider", sorted(s.providers))
    options = {opt: _pick(trial, f"{provider}.{opt}", choices) for opt, choices in sorted(s.providers[provider].items())}
    mode = _pick(trial, "execution_mode", s.execution_mode)
    session = SessionSettings(
        intra_op_num_threads=_pick(trial, "intra_op_num_threads", s.intra_op_num_threads),
        # ORT uses the inter-op pool only in parallel mode: sampling it otherwise would only add noise
        inter_op_num_threads=_pick(trial, "inter_op_num_threads", s.inter_op_num_threads) if mode == "parallel" else 1,
        execution_mode=mode,
        graph_optimization_level=_pick(trial, "graph_optimization_level", s.graph_optimization_level),
        providers=(provider,) if provider == CPU else (provider, CPU),
        provider_options=() if provider == CPU else (options, {}),
    )
    first = _pick(trial, "first_chunk_tokens", s.first_chunk_tokens)
    return TrialSettings(
        candidate.formats[fmt],
        session,
        first,
        max(first, _pick(trial, "chunk_tokens", s.chunk_tokens)),  # the server needs first <= later chunks
        float(_pick(trial, "crossfade_ms", s.crossfade_ms)),
        _pick(trial, "first_window_steps", s.first_window_steps) if candidate.windowed else None,
    )
