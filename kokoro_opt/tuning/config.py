"""The tuning recipe: what `kokoro-opt tune` searches, how it measures, and how it picks the winner.

One strict pydantic model validates the whole YAML up front; every problem becomes one UserError
line naming the field (the same wording as build recipes, through `kokoro_opt.recipe_yaml.explain`).
A one-element list pins a setting: it is applied to every trial but not searched.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from kokoro_opt.errors import UserError
from kokoro_opt.recipe_yaml import NAME_PATTERN, explain, name_from_file, read_yaml_mapping, require_kind
from kokoro_opt.runtime.session import ExecutionMode, GraphLevel
from kokoro_opt.select import QUALITY_BUDGET_PESQ, QUALITY_BUDGET_PHRASE_PESQ
from kokoro_opt.serve.bench import PARAGRAPH
from kokoro_opt.serve.config import MAX_CROSSFADE_MS
from kokoro_opt.text import CONTEXT_TOKENS

DEFAULT_STORAGE = "sqlite:///experiments/optuna.db"
RTF_TEXT = "The birch canoe slid on the smooth planks. Glue the sheet to the dark blue background."


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class SpaceConfig(Strict):
    """The search space. Lists are the choices; artifacts are filtered by the quality budget first."""

    artifacts: list[str] = Field(
        default_factory=lambda: ["all"], min_length=1, description="recipe names, artifact ids, or 'all'"
    )
    model_format: list[Literal["onnx", "ort"]] = Field(default_factory=lambda: ["onnx", "ort"], min_length=1)
    providers: dict[str, dict[str, list[str]]] = Field(
        default_factory=lambda: {"CPUExecutionProvider": {}}, min_length=1, description="provider -> option -> choices"
    )
    intra_op_num_threads: list[int] = Field(default_factory=lambda: [1, 2, 4], min_length=1)
    inter_op_num_threads: list[int] = Field(default_factory=lambda: [1, 2], min_length=1, description="used in parallel mode")
    execution_mode: list[ExecutionMode] = Field(default_factory=lambda: ["sequential", "parallel"], min_length=1)
    graph_optimization_level: list[GraphLevel] = Field(default_factory=lambda: ["basic", "extended", "all"], min_length=1)
    first_chunk_tokens: list[int] = Field(default_factory=lambda: [24, 32, 40, 56], min_length=1)
    chunk_tokens: list[int] = Field(default_factory=lambda: [100, 150, 200, 300], min_length=1)
    crossfade_ms: list[float] = Field(default_factory=lambda: [10.0], min_length=1)
    first_window_steps: list[int] = Field(
        default_factory=lambda: [8, 12, 16, 24], min_length=1, description="a new listener's first window (windowed artifacts)"
    )

    @field_validator("providers")
    @classmethod
    def _provider_names(cls, value: dict[str, dict[str, list[str]]]) -> dict[str, dict[str, list[str]]]:
        for name, options in value.items():
            if not name.endswith("ExecutionProvider"):
                raise ValueError(f"'{name}' is not an ONNX Runtime provider name (e.g. CPUExecutionProvider)")
            if any(not choices for choices in options.values()):
                raise ValueError(f"every option of {name} needs at least one choice")
            if name == "CPUExecutionProvider" and options:  # a trial's CPU session takes no provider options
                raise ValueError(f"{name} takes no options here: give it {{}} and search the CPU with the space's "
                                 "session fields (intra_op_num_threads, execution_mode, graph_optimization_level)")  # fmt: skip
        return value

    @model_validator(mode="after")
    def _ranges(self) -> SpaceConfig:
        if min(self.intra_op_num_threads) < 0 or min(self.inter_op_num_threads) < 1:
            raise ValueError("thread counts must be >= 1 (intra_op 0 = ORT's default)")
        tokens = [*self.first_chunk_tokens, *self.chunk_tokens]
        if min(tokens) < 1 or max(tokens) > CONTEXT_TOKENS:
            raise ValueError(f"chunk sizes must be within 1..{CONTEXT_TOKENS} tokens")
        if min(self.first_chunk_tokens) > max(self.chunk_tokens):
            raise ValueError("no first_chunk_tokens choice is <= a chunk_tokens choice")
        if min(self.crossfade_ms) < 0 or max(self.crossfade_ms) > MAX_CROSSFADE_MS:
            raise ValueError(f"crossfade_ms must be within 0..{MAX_CROSSFADE_MS:g} ms, as serve takes it")
        if min(self.first_window_steps) < 4 or max(self.first_window_steps) > 400:
            raise ValueError("first_window_steps must be within 4..400 steps")
        return self


class MeasureConfig(Strict):
    """What one trial measures. TTFA: request -> first chunk's audio for `paragraph`, as the server does it."""

    paragraph: str = Field(PARAGRAPH, min_length=1)
    rtf_text: str = Field(RTF_TEXT, min_length=1, description="1-2 sentences: RTF = synthesis seconds / audio seconds")
    voice: str | None = Field(None, description="None: the artifact's first voice")
    speed: float = Field(1.0, ge=0.25, le=4.0)
    warmup: int = Field(1, ge=0, le=5, description="untimed TTFA+RTF runs on a freshly loaded session")
    ttfa_runs: int = Field(3, ge=1, le=50)
    rtf_runs: int = Field(2, ge=1, le=50)
    max_sessions: int = Field(3, ge=2, le=32, description="loaded ORT sessions kept for reuse across trials (LRU)")


class PruneConfig(Strict):
    """Stop a trial after its first timed run if that run is `factor` x worse than the complete trials of its
    artifact (their median, or their best)."""

    enabled: bool = True
    factor: float = Field(2.0, gt=1.0)
    reference: Literal["median", "best"] = "median"
    min_trials: int = Field(2, ge=1, description="complete trials of the same artifact before pruning starts")


class EvaluateOverrides(Strict):
    """Settings of the evaluation run for an artifact without a quality record (on top of its recipe's)."""

    runs: int = Field(1, ge=1, le=50)
    warmup: int = Field(1, ge=0, le=10)
    sentences: int = Field(4, ge=1, le=200)
    phrases: int = Field(12, ge=0, le=100, description="short phrases scored apart (their own budget, min_phrase_pesq)")
    threads: int = Field(2, ge=1, le=64)
    profile: bool = False
    asr: bool = False


class QualityConfig(Strict):
    metric: Literal["pesq", "wer_delta"] = "pesq"
    use: Literal["objective", "constraint"] = Field("objective", description="a third objective, or only the budget filter")
    min_pesq: float = Field(QUALITY_BUDGET_PESQ, ge=1.0, le=4.64)
    min_phrase_pesq: float = Field(
        QUALITY_BUDGET_PHRASE_PESQ, ge=1.0, le=4.64, description="the short-phrase slice's budget, where it was scored"
    )
    max_wer_delta: float = Field(0.02, ge=0.0)
    max_first_chunk_distortion: float | None = Field(
        1.25,
        ge=1.0,
        description="first_chunk_tokens choices whose first chunk, spoken as the server speaks it (alone, with the "
        "words after a cut at words fed as context), is timed more than this factor off the same words in their "
        "sentence are dropped from the space (kokoro_opt.first_chunk); null keeps all",
    )
    evaluate_missing: bool = Field(True, description="evaluate artifacts without a record first (else: skip them)")
    evaluate: EvaluateOverrides = Field(default_factory=EvaluateOverrides)


Objective = Literal["ttfa_p50", "rtf_p50", "quality"]


class BestConfig(Strict):
    """The scalarised rule over the Pareto front: each objective scaled to [0, 1] across the front (0 = best),
    weighted and summed; the lowest score wins (ties: the earliest trial)."""

    weights: dict[Objective, float] = Field(default_factory=lambda: {"ttfa_p50": 1.0, "rtf_p50": 0.5, "quality": 0.5})
    max_rtf_p50: float | None = Field(0.9, gt=0.0, description="a stream must stay ahead of playback")

    @field_validator("weights")
    @classmethod
    def _weighs_something(cls, value: dict[str, float]) -> dict[str, float]:
        if any(not weight >= 0 for weight in value.values()) or not any(weight > 0 for weight in value.values()):
            raise ValueError("weights must be >= 0 and one of them > 0 (a negative weight picks the worst of that objective)")
        return value


class SamplerConfig(Strict):
    kind: Literal["tpe", "nsga2"] = "tpe"
    seed: int = 0
    startup_trials: int = Field(8, ge=1, le=1000, description="random trials before the model-based sampling")


class WorkersConfig(Strict):
    """How worker processes (on this machine or others) share one study."""

    heartbeat_seconds: int = Field(10, ge=1, le=600, description="a running trial reports that it is alive this often")
    stale_after_seconds: int = Field(
        60, ge=2, le=86_400, description="a trial silent this long belongs to a killed worker: it fails, its place is freed"
    )

    @model_validator(mode="after")
    def _order(self) -> WorkersConfig:
        if self.stale_after_seconds <= self.heartbeat_seconds:
            raise ValueError("workers.stale_after_seconds must be longer than workers.heartbeat_seconds")
        return self


class TuneRecipe(Strict):
    name: str = Field(pattern=NAME_PATTERN)
    description: str = ""
    study: str | None = Field(None, description="Optuna study name (default: the recipe name)")
    storage: str = Field(DEFAULT_STORAGE, description="any RDB URL Optuna supports")
    trials: int = Field(30, ge=1, le=100_000)
    sampler: SamplerConfig = Field(default_factory=SamplerConfig)
    space: SpaceConfig = Field(default_factory=SpaceConfig)
    measure: MeasureConfig = Field(default_factory=MeasureConfig)
    prune: PruneConfig = Field(default_factory=PruneConfig)
    quality: QualityConfig = Field(default_factory=QualityConfig)
    best: BestConfig = Field(default_factory=BestConfig)
    compare_rounds: int = Field(7, ge=1, le=100, description="interleaved TTFA rounds, tuned vs defaults")
    workers: WorkersConfig = Field(default_factory=WorkersConfig)

    @property
    def study_name(self) -> str:
        return self.study or self.name

    def space_hash(self) -> str:
        """What a resumed study must keep: the space, the measurement and the quality rule."""
        payload = self.model_dump(
            mode="json",
            include={"space": True, "measure": True, "quality": True},
            exclude={"measure": {"max_sessions"}, "quality": {"evaluate", "evaluate_missing"}},  # no effect on the numbers
        )
        return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:16]


def parse_tune_recipe(data: dict[str, object], origin: str = "tuning recipe") -> TuneRecipe:
    try:
        return TuneRecipe.model_validate(data)
    except ValidationError as exc:
        raise UserError(f"{origin}: {'; '.join(explain(e) for e in exc.errors())}") from None


def load_tune_recipe(path: str | Path) -> TuneRecipe:
    path = Path(path)
    data = read_yaml_mapping(path, "tuning recipe", "recipes/tune-cpu.yaml")
    require_kind(data, path, "tuning")
    name_from_file(data, path)
    return parse_tune_recipe(data, str(path))
