"""The engine's warm-up before its first request: espeak loaded, both job sizes run once (a session's first run is
slow), and the cost models the scheduler plans with fitted to this machine."""

from __future__ import annotations

import logging
import time
from typing import Any

from kokoro_opt.serve.modes import WindowedJobs

log = logging.getLogger("kokoro_opt.serve")
WARMUP_TEXT = "Warming up, so that the first listener never waits for a cold start."


def warm_up(engine: Any) -> None:  # an Engine (engine.py imports this module)
    """Load espeak, run both job sizes (the first run of a session is slow), fit the cost models."""
    synth = engine.synth
    assert synth is not None
    started = time.perf_counter()
    pieces = engine.plan(WARMUP_TEXT)
    pack = synth.packs[synth.voices[0]]
    flat = [t for p in pieces for t in p.tokens] or [engine.space_id or 1]
    timings: dict[int, float] = {}
    windows: dict[int, float] = {}
    for size in (engine.config.first_chunk_tokens, engine.config.first_chunk_tokens, engine.config.chunk_tokens):
        tokens = (flat * (size // len(flat) + 1))[:size]
        # the repeated small size keeps its second, warm timing
        timings[size], seen = engine.mode.time_job(tokens, pack)
        windows.update(seen)
    small, large = engine.config.first_chunk_tokens, engine.config.chunk_tokens
    engine.cost.calibrate((small, timings[small]), (large, timings[large]))
    if windows:
        engine.window_cost.calibrate(min(windows.items()), max(windows.items()))
    log.info(
        "ready: warmed up in %.1f s; a job%s costs %.0f ms + %.1f ms per token",
        time.perf_counter() - started,
        "'s front" if engine.windows else "",
        1000 * engine.cost.fixed,
        1000 * engine.cost.per_token,
    )
    if isinstance(engine.mode, WindowedJobs):
        engine.mode.say_phrase_bridge()
