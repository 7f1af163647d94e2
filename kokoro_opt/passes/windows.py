"""windows stage: the graphs and statistics for decoding the generator window by window, measured and gated.

The model is unchanged. The stage cuts it into the graphs windowed decoding runs (kokoro_opt/passes/
windows_split.py) and writes them into the artifact (`windows/`). On calibration utterances of many lengths
and every voice it measures the exact input moments of every generator InstanceNorm beside a summary of
the same utterance's front, fits the predictor of one from the other (kokoro_opt/runtime/stats_predictor.py)
and stores it beside the graphs (`windows/norm_predictor.npz`), with the window settings in `kokoro.json`
(`windows`). `serve` then runs the front once per job, predicts the job's statistics from it and runs the
generator in windows, so the first sound waits for the front and one short window; a short job finishes
with one whole-generator run after its first window (kokoro_opt/runtime/windowed.py).

Windowed audio is not the whole decoding's: a window cannot normalize over the sentence it has not
decoded yet, and predicted statistics are close to the sentence's, not equal. The gate compares, on corpus
sentences and the short-phrase slice, what a lone listener hears with the same samples decoded whole (the
model's audio: the front and the whole generator compute it bit for bit) by PESQ-WB, worst utterance and
4-12 kHz energy, and refuses the artifact below the budget.
"""

from __future__ import annotations

import hashlib
import shutil
import threading
import time
from collections import OrderedDict
from pathlib import Path
from typing import Any

import numpy as np
from pydantic import BaseModel

from kokoro_opt.artifacts import WINDOWED_BY_DEFAULT, Artifact
from kokoro_opt.contract import Pass
from kokoro_opt.errors import UserError
from kokoro_opt.passes.common import set_runtime_meta, stage_record
from kokoro_opt.passes.compress import CARRIED
from kokoro_opt.passes.speech_gate import gate_failures, gate_utterances, require_within_budget, score, summarise
from kokoro_opt.recipe import SpeechGate, WindowsStage
from kokoro_opt.runtime.stats_predictor import PREDICTOR_FILE, StatsPredictor, front_summary
from kokoro_opt.runtime.windowed import STEP_SAMPLES, WINDOWS_DIR, FrontOutput, WindowedDecoder, WindowSettings

PIECE_TOKENS = (12, 24, 48)  # calibration sentences are also cut into pieces of these sizes: every length is covered


def calibration_pieces(vocab: dict[str, int], sentences: int) -> list[list[int]]:
    """Token ids of the first `sentences` calibration sentences, whole and cut into pieces of each size."""
    from kokoro_opt.chunking import chunk_text
    from kokoro_opt.passes.qdq import CALIBRATION_CORPUS, calibration_corpus
    from kokoro_opt.text import utterance_tokens

    texts = calibration_corpus()
    if sentences > len(texts):
        raise UserError(
            f"windows.calibration_sentences is {sentences} but {CALIBRATION_CORPUS} has {len(texts)}", "lower it or add sentences"
        )
    pieces = []
    for text in texts[:sentences]:
        pieces.append(utterance_tokens(text, vocab))
        for size in PIECE_TOKENS:
            pieces += [c.token_ids for c in chunk_text(text, vocab, first_chunk_tokens=size, chunk_tokens=size)]
    return [p for p in pieces if p]


def fit_predictor(decoder: WindowedDecoder, probe: MomentsProbe, pieces: list[list[int]], progress: Any = None) -> StatsPredictor:
    """Every voice speaks every piece: its front's summary and its norms' exact moments, then the fit."""
    from kokoro_opt.voices import style_for

    synth = decoder.synth
    summaries, means, variances = [], [], []
    for _, pack in sorted(synth.packs.items()):
        for ids in pieces:
            style = style_for(pack, len(ids))
            front = decoder.front(ids, style)
            summaries.append(front_summary(front))
            _, mean, var = probe.moments(ids, style)
            means.append(mean)
            variances.append(var)
            if progress:
                progress()
    return StatsPredictor.fit(np.stack(summaries), np.stack(means), np.stack(variances))


def measure(decoder: WindowedDecoder, cfg: WindowsStage) -> dict[str, Any]:
    """Windowed vs whole decoding, speech span, on the gate's utterances. The reference is the whole generator
    over the job's front: model.onnx's audio bit for bit, since the cut graphs carry the model's shapes and
    are fused as it is (docs/measurements/2026-12-05-front-shapes.md); and a job that finished already ran it."""
    synth, whole_reference = decoder.synth, WholeReference(decoder)
    rows = []
    for utterance, tokens in gate_utterances(cfg, synth.voices, synth.vocab):
        pack = synth.packs[utterance.voice]
        windowed, job = decoder.speak(tokens, pack)
        start, end = job.speech
        whole = whole_reference(job.front, job.whole)  # a finished job ran it
        reference = whole[start * STEP_SAMPLES : end * STEP_SAMPLES]
        if len(reference) != len(windowed):
            raise UserError(
                f"windowed decoding gave {len(windowed)} samples where the durations say {len(reference)}",
                "report this: the windows do not tile the speech",
            )
        rows.append(score(utterance, reference, windowed, synth.sample_rate, tokens=len(tokens), windows=job.windows))
    return summarise(rows)


# The whole generator's audio over each gate utterance's front, by what makes it (the graph, the output gain, the
# feeds): a build runs the windows stage and then the fuse stage in one process, and both gates score against the
# same audio. Oldest first out past the budget, which holds the largest gate's (48 sentences and the phrases).
_WHOLE_AUDIO: OrderedDict[tuple[str, ...], np.ndarray] = OrderedDict()
_WHOLE_AUDIO_BYTES = 256 << 20
_WHOLE_AUDIO_LOCK = threading.Lock()


class WholeReference:
    """`decoder.whole_audio(front)`, remembered when the decoder runs the unfused whole generator graph."""

    def __init__(self, decoder: WindowedDecoder) -> None:
        from kokoro_opt.hashing import file_sha256

        self.decoder = decoder
        graph = decoder.graphs.whole_generator
        self.made_by: tuple[str, ...] | None = None  # a fused generator's audio is its own: not remembered
        if decoder.fused is None and graph is not None:
            digest = hashlib.sha256(graph).hexdigest() if isinstance(graph, bytes) else file_sha256(Path(graph))
            self.made_by = (digest, repr(float(decoder.synth.audio_gain)))

    def __call__(self, front: FrontOutput, made: np.ndarray | None = None) -> np.ndarray:
        """The audio, read-only; `made`: that audio, when a finished job already ran it."""
        if self.made_by is None:
            return made if made is not None else self.decoder.whole_audio(front)
        feeds = hashlib.sha256()
        for name, value in front.generator_feeds().items():
            feeds.update(f"{name}:{value.dtype}:{value.shape};".encode())
            feeds.update(np.ascontiguousarray(value).tobytes())
        key = (*self.made_by, feeds.hexdigest())
        with _WHOLE_AUDIO_LOCK:
            found = _WHOLE_AUDIO.get(key)
        if found is not None:
            return found
        audio = (made if made is not None else self.decoder.whole_audio(front)).view()
        audio.flags.writeable = False
        with _WHOLE_AUDIO_LOCK:
            _WHOLE_AUDIO[key] = audio
            while sum(a.nbytes for a in _WHOLE_AUDIO.values()) > _WHOLE_AUDIO_BYTES and len(_WHOLE_AUDIO) > 1:
                _WHOLE_AUDIO.popitem(last=False)
        return audio


class MomentsProbe:
    """The whole model with every generator norm's input moments as extra outputs: what the table pools."""

    def __init__(self, synth: Any, model: Any) -> None:
        from kokoro_opt.passes.windows_split import moments_model
        from kokoro_opt.runtime.session import make_session

        self.synth = synth
        self.session = make_session(moments_model(model)[0].SerializeToString(), synth.settings)

    def moments(self, token_ids: list[int], style: np.ndarray, speed: float = 1.0) -> tuple[float, np.ndarray, np.ndarray]:
        """(frames, mean, var) of every generator norm's input over this whole utterance."""
        return utterance_moments(self.session, self.synth.feeds(token_ids, style, speed))


def utterance_moments(session: Any, feeds: dict[str, np.ndarray]) -> tuple[float, np.ndarray, np.ndarray]:
    """(frames, mean, var) of each measured norm's input over one utterance, from a `moments_model` session."""
    outputs = [np.asarray(x) for x in session.run(None, feeds)]
    return float(np.sum(outputs[1])), np.concatenate(outputs[2::2]), np.concatenate(outputs[3::2])


STATISTICS = f"{WINDOWS_DIR}/{PREDICTOR_FILE}"  # the measured decision: locked beside the recipe's lock


def run_windows(source: Artifact, cfg: WindowsStage, out: Path, decisions: dict[str, Any] | None = None) -> dict[str, Any]:
    """`decisions`: the predictor locked for this recipe (locks.py; decisions["files"] names the file), applied
    instead of fitted: measuring what it is fitted on is most of the stage's time."""
    import onnx

    from kokoro_opt.passes.windows_split import window_graphs
    from kokoro_opt.runtime.synth import Synthesizer
    from kokoro_opt.tables import make_progress

    started = time.perf_counter()
    shutil.copy2(source.model_file, out / "model.onnx")
    synth = Synthesizer(source, load=False)
    settings = WindowSettings(
        first_steps=cfg.first_steps,
        steps=cfg.steps,
        overlap_steps=cfg.overlap_steps,
        lead_overlap_steps=cfg.lead_overlap_steps,
        lead_frames=cfg.lead_frames,
        trail_frames=cfg.trail_frames,
        finish_steps=cfg.finish_steps,
    )
    model = onnx.load(str(source.model_file))
    try:
        graphs, _ = window_graphs(model)
    except KeyError as exc:
        raise UserError(
            f"the windows stage cannot find {exc} in {source.model_file.name}",
            "put windows after export-derived ONNX stages (not after coreml or ort)",
        ) from exc
    decoder = WindowedDecoder(synth, graphs, settings=settings)
    locked = (decisions or {}).get("files", {}).get(STATISTICS)
    pieces = calibration_pieces(synth.vocab, cfg.calibration_sentences)
    if locked is not None:
        predictor = StatsPredictor.load(locked)
    else:
        probe = MomentsProbe(synth, model)
        with make_progress(transient=True) as progress:
            total = len(pieces) * len(synth.packs)
            task = progress.add_task(f"norm statistics ({len(pieces)} utterances x {len(synth.packs)} voices)", total=total)
            predictor = fit_predictor(decoder, probe, pieces, lambda: progress.advance(task))
    decoder.statistics = predictor
    del model
    measured = time.perf_counter() - started
    scores = measure(decoder, cfg)
    require_within_budget(
        scores,
        cfg,
        source,
        "windowed decoding",
        "measure the statistics on more sentences (windows.calibration_sentences) or drop the windows stage",
    )
    below_default = gate_failures(scores, cfg.default_budget)
    if not scores["judged"]:
        below_default = []  # noise is not judged: the tiny model streams windowed like a passing artifact
    if below_default:
        print(f"windows: served whole by default (ask for --windowed): {'; '.join(below_default)} (default_budget)")
    written = graphs.save(out / WINDOWS_DIR)
    predictor.save(out / WINDOWS_DIR / PREDICTOR_FILE)
    meta = {k: getattr(settings, k) for k in settings.__dataclass_fields__}
    set_runtime_meta(out, "windows", {**meta, WINDOWED_BY_DEFAULT: not below_default})
    return stage_record(
        "windows",
        cfg,
        out,
        started,
        graphs=written,
        hoisted=graphs.job is not None,
        calibration_utterances=len(pieces),
        statistics_seconds=round(measured, 1),
        statistics_from="lock" if locked is not None else "measured",
        gate=scores,
        served_by_default=not below_default,
        below_default_budget=below_default,
        decisions={"statistics": STATISTICS},
        decision_scores=scores,
    )


class WindowsDecisions(BaseModel):
    """The windows stage's measured choice as a lock keeps it: the file of the fitted statistics predictor."""

    statistics: str


PASS = Pass(
    "windows",
    WindowsStage,
    run_windows,
    libraries=("onnx", "onnxruntime"),
    produces=(WINDOWS_DIR,),
    carries=CARRIED,  # the model is the input's, unchanged
    grants=("windowed",),
    # how jobs start and finish changes what the gate hears, not the fitted statistics: the lock still applies
    judged_by=(*SpeechGate.model_fields, "default_budget", "finish_steps", "lead_overlap_steps"),
    keeps=("edges",),
    reads=("kokoro_opt/data/eval_corpus.yaml", "calibration/sentences.txt"),
    decides=True,
    decisions_model=WindowsDecisions,
    decision_files=(STATISTICS,),
)
