"""How the sensitivity analysis measures a variant: its audio against fp32's on held-out sentences
(`AudioScorer`, summed up as a `Quality`), and each node's share of the model's compute.
The policy that decides from these numbers is passes.sensitivity."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from kokoro_opt.artifacts import Artifact
from kokoro_opt.recipe import QuantizeStage
from kokoro_opt.runtime.session import profile_prefix

PESQ_MAX = 4.64


@dataclass(frozen=True)
class Quality:
    mean_pesq: float
    min_pesq: float
    max_high_band_db: float
    durations_equal: float  # fraction of sentences
    finite: bool

    def passes(self, cfg: QuantizeStage, pesq_tolerance: float = 0.0) -> bool:
        return (
            self.finite
            and self.mean_pesq >= cfg.quality_budget_pesq - pesq_tolerance
            and self.min_pesq >= cfg.min_sentence_pesq - pesq_tolerance
            and self.max_high_band_db <= cfg.max_high_band_db
            and self.durations_equal >= cfg.min_durations_equal
        )

    @property
    def sensitivity(self) -> float:
        """Higher = hurts more. Non-finite output or static is worst."""
        if not self.finite:
            return float("inf")
        return (PESQ_MAX - self.mean_pesq) + self.max_high_band_db + (1 - self.durations_equal)


class AudioScorer:
    """Scores a quantized variant against fp32 audio on the held-out sentences."""

    def __init__(self, source: Artifact, sentences: list[str], threads: int = 0) -> None:
        from kokoro_opt.runtime.session import SessionSettings
        from kokoro_opt.runtime.synth import Synthesizer
        from kokoro_opt.text import utterance_tokens

        self.settings = SessionSettings(intra_op_num_threads=threads)
        reference = Synthesizer(source, self.settings)
        voices = sorted(reference.packs)
        self.source = source
        self.sample_rate = reference.sample_rate
        self.feeds = []
        self.references = []
        for i, sentence in enumerate(sentences):
            tokens = utterance_tokens(sentence, reference.vocab)
            pack = reference.packs[voices[i % len(voices)]]
            self.feeds.append((tokens, pack))
            self.references.append(reference.run_tokens(tokens, pack))

    def __call__(self, model_file: Path) -> Quality:
        from kokoro_opt.evaluate.metrics import high_band_ratio_db, pesq_wb
        from kokoro_opt.runtime.synth import Synthesizer

        variant = Synthesizer(self.source, self.settings, model_file=model_file)
        pesqs, ratios, equal, finite = [], [], 0, True
        for (tokens, pack), ref in zip(self.feeds, self.references, strict=True):
            result = variant.run_tokens(tokens, pack)
            audio = result.audio
            if not np.all(np.isfinite(audio)) or float(np.abs(audio).max()) < 1e-4:
                finite = False
                pesqs.append(1.0)
                continue
            score = pesq_wb(ref.audio, audio, self.sample_rate)
            pesqs.append(1.0 if np.isnan(score) else score)  # no speech found: PESQ's floor
            ratios.append(high_band_ratio_db(ref.audio, audio, self.sample_rate))
            equal += int(np.array_equal(result.durations, ref.durations))
        return Quality(
            mean_pesq=float(np.mean(pesqs)),
            min_pesq=float(np.min(pesqs)),
            # either way: static and hiss add 4-12 kHz energy, a muffled output loses it (as the speech gate)
            max_high_band_db=float(max((abs(r) for r in ratios), default=float("inf"))),
            durations_equal=equal / len(self.feeds),
            finite=finite,
        )


def _macs(args: dict[str, Any]) -> float:
    """Multiply-accumulates of one Conv/MatMul run, from the shapes an ORT profile records."""
    inputs = [next(iter(t.values())) for t in args.get("input_type_shape", [])]
    outputs = [next(iter(t.values())) for t in args.get("output_type_shape", [])]
    if not inputs or not outputs:
        return 0.0
    if args.get("op_name") == "Conv":
        return float(np.prod(outputs[0]) * np.prod(inputs[1][1:])) if len(inputs) > 1 else 0.0
    # MatMul: the profile leaves out a weight ORT has pre-packed and released; A's last axis is the inner dimension.
    return float(np.prod(outputs[0]) * inputs[0][-1])


def node_cost_shares(model_file: Path, feeds: list[dict[str, np.ndarray]]) -> dict[str, float]:
    """Each Conv/MatMul node's share of the model's multiply-accumulates on real inputs.

    MACs come from the tensor shapes in an ORT profile of the fp32 model: unlike measured times they
    are deterministic, so the same recipe picks the same blocks on every machine.
    """
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.enable_profiling = True
    options.profile_file_prefix = profile_prefix()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC  # keep node names
    session = ort.InferenceSession(str(model_file), options, providers=["CPUExecutionProvider"])
    for feed in feeds:
        session.run(None, feed)
    trace_file = Path(session.end_profiling())
    trace = json.loads(trace_file.read_text(encoding="utf-8"))
    trace_file.unlink()
    macs: dict[str, float] = {}
    for event in trace:
        name = event.get("name", "")
        if event.get("cat") == "Node" and name.endswith("_kernel_time") and event["args"].get("op_name") in ("Conv", "MatMul"):
            macs[name[: -len("_kernel_time")]] = macs.get(name[: -len("_kernel_time")], 0.0) + _macs(event["args"])
    total = sum(macs.values()) or 1.0
    return {name: m / total for name, m in macs.items()}
