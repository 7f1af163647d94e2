"""Timing one setting the way the server runs it: TTFA of a paragraph and RTF of a sentence or two.

Both go through the serve engine's own code, not a copy of it. TTFA = request -> the first job's
audio: `Engine.first_audio` (planning, the first job as for a new streaming request, synthesis, the
joiner). RTF = synthesis seconds / audio seconds for a short text cut by `Engine.plan` and merged by
`Engine.next_job` into jobs up to `chunk_tokens` (a listener ahead of playback, the server's steady
state), each run and timed by `Engine.run_job`. Loaded sessions are cached per (model file, session
settings): reloading a 325 MB model every trial would cost more than measuring it.
"""

from __future__ import annotations

import gc
import json
import statistics
import time
from collections import OrderedDict, deque
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from kokoro_opt.artifacts import Artifact
from kokoro_opt.errors import UserError
from kokoro_opt.runtime.session import SessionSettings
from kokoro_opt.runtime.synth import Synthesizer
from kokoro_opt.select import Selection
from kokoro_opt.serve.config import ServeConfig
from kokoro_opt.serve.engine import FIRST_JOB_BUDGET, Engine
from kokoro_opt.store import Store
from kokoro_opt.text import clear_phoneme_cache
from kokoro_opt.tuning.config import MeasureConfig
from kokoro_opt.tuning.space import TrialSettings
from kokoro_opt.voices import blend_voice

_SETTLE = 0.02  # seconds between timed runs: lets ORT's spinning threads of the previous run go idle


def settings_key(settings: SessionSettings) -> str:
    return json.dumps(asdict(settings), sort_keys=True, default=str)


class SessionCache:
    """Loaded synthesizers by (artifact, session settings), least recently used evicted first."""

    def __init__(self, root: Path, max_sessions: int = 3) -> None:
        self.root, self.max_sessions = root, max_sessions
        self._artifacts: dict[str, Artifact] = {}
        self._loaded: OrderedDict[tuple[str, str], Synthesizer] = OrderedDict()

    def artifact(self, artifact_id: str) -> Artifact:
        if artifact_id not in self._artifacts:
            found = [a for a in Store(self.root).artifacts() if a.id == artifact_id]
            if not found:
                raise UserError(
                    f"artifact {artifact_id} of this study is not under {self.root}", "build it here, or pass --artifacts"
                )
            self._artifacts[artifact_id] = found[-1]
        return self._artifacts[artifact_id]

    def get(self, artifact_id: str, settings: SessionSettings) -> tuple[Synthesizer, float]:
        """(synthesizer, load seconds; 0.0 when it was cached)."""
        key = (artifact_id, settings_key(settings))
        if key in self._loaded:
            self._loaded.move_to_end(key)
            return self._loaded[key], 0.0
        while len(self._loaded) >= self.max_sessions:
            self._loaded.popitem(last=False)
            gc.collect()  # free the evicted session's weights before the next one loads
        started = time.perf_counter()
        synth = Synthesizer(self.artifact(artifact_id), settings)
        self._loaded[key] = synth
        return synth, time.perf_counter() - started


class Bench:
    """Measures one (loaded synthesizer, chunking) pair."""

    def __init__(self, synth: Synthesizer, settings: TrialSettings, measure: MeasureConfig) -> None:
        self.synth, self.measure = synth, measure
        selection = Selection(synth.artifact, synth.settings, settings.chunking, "tuning")
        self.config = ServeConfig.for_selection(selection, warmup=False)  # windowed where serve would be
        self.engine = Engine(selection, self.config)
        self.engine.attach(synth)  # the engine's own job path on our cached session; its worker thread is not started
        self.pack = blend_voice(measure.voice or synth.voices[0], synth.packs)  # a name, an OpenAI name or a blend
        for field in ("paragraph", "rtf_text"):
            if not self.engine.plan(getattr(measure, field)):
                raise UserError(f"measure.{field} has nothing to say", "give it words, not only punctuation")

    def ttfa(self) -> float:
        clear_phoneme_cache()  # each TTFA run is a new request: phonemizing is measured, not recalled
        time.sleep(_SETTLE)
        started = time.perf_counter()
        self.engine.first_audio(self.measure.paragraph, self.pack, self.measure.speed)
        return time.perf_counter() - started

    def rtf(self) -> float:
        pieces = deque(self.engine.plan(self.measure.rtf_text))
        time.sleep(_SETTLE)
        compute = audio = 0.0
        budget = FIRST_JOB_BUDGET
        while pieces:
            job, _ = self.engine.next_job(pieces, budget)
            budget = self.config.chunk_tokens
            out, seconds = self.engine.run_job(job, self.pack, self.measure.speed)
            compute += seconds
            audio += len(out) / self.synth.sample_rate
        return compute / max(audio, 1e-9)

    def warm_up(self) -> None:
        for _ in range(self.measure.warmup):
            self.ttfa()
            self.rtf()


@dataclass
class Comparison:
    """Tuned vs default settings on the same artifact, TTFA measured interleaved in one session."""

    artifact_id: str
    rounds: int
    defaults_ttfa: list[float]
    tuned_ttfa: list[float]

    @property
    def defaults_p50(self) -> float:
        return statistics.median(self.defaults_ttfa)

    @property
    def tuned_p50(self) -> float:
        return statistics.median(self.tuned_ttfa)

    @property
    def ratio(self) -> float:
        """tuned / defaults: below 1 means the tuned settings give first audio sooner."""
        return self.tuned_p50 / self.defaults_p50

    def to_json(self) -> dict[str, Any]:
        return {
            "artifact_id": self.artifact_id,
            "rounds": self.rounds,
            "defaults_ttfa_p50": self.defaults_p50,
            "tuned_ttfa_p50": self.tuned_p50,
            "ttfa_ratio": self.ratio,
            "speedup": 1.0 / self.ratio,
            "defaults": {"session": asdict(SessionSettings().resolved()), "chunking": defaults_for(self.artifact_id).chunking},
        }


def defaults_for(artifact_id: str) -> TrialSettings:
    """What `kokoro-opt serve` uses without tuning: default session options and default chunking."""
    base = ServeConfig()
    return TrialSettings(artifact_id, SessionSettings(), base.first_chunk_tokens, base.chunk_tokens, base.crossfade_ms)


def compare_with_defaults(cache: SessionCache, tuned: TrialSettings, measure: MeasureConfig, rounds: int) -> Comparison:
    defaults = defaults_for(tuned.artifact_id)
    benches = [Bench(cache.get(s.artifact_id, s.session)[0], s, measure) for s in (defaults, tuned)]
    for bench in benches:
        bench.warm_up()
    times: list[list[float]] = [[], []]
    for r in range(rounds):
        for i in (0, 1) if r % 2 == 0 else (1, 0):  # ABBA: drift and load hit both alike
            times[i].append(benches[i].ttfa())
    return Comparison(tuned.artifact_id, rounds, times[0], times[1])
