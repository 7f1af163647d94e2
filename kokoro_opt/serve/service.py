"""What every route of the server shares: the engine, the limits, the queue slots and the drain on shutdown."""

from __future__ import annotations

import hashlib
import hmac
import logging
import math
import time
from typing import Any

from starlette.types import Scope

from kokoro_opt.errors import UserError
from kokoro_opt.select import Selection
from kokoro_opt.serve.cache import AudioCache, CacheKey
from kokoro_opt.serve.config import ServeConfig
from kokoro_opt.serve.connections import abort_connection
from kokoro_opt.serve.engine import Engine
from kokoro_opt.serve.metrics import Metrics
from kokoro_opt.serve.openai_compat import OPENAI_MODELS, ApiError, SpeechRequest
from kokoro_opt.voices import blend_voice, openai_voice_map

log = logging.getLogger("kokoro_opt.serve")
RETRY_SECONDS = "2"  # while warming up or shutting down: a restart or a warm-up takes seconds


def keys_match(given: str, expected: str) -> bool:
    """Compare API keys in constant time: digests of equal length, so neither content nor length leaks."""
    return hmac.compare_digest(hashlib.sha256(given.encode()).digest(), hashlib.sha256(expected.encode()).digest())


class Service:
    """What every route shares. `inflight` and the drain are touched only on the event loop (the SIGTERM
    handler runs there too: uvicorn installs it on the loop's thread)."""

    def __init__(self, selection: Selection, config: ServeConfig, engine: Engine, metrics: Metrics) -> None:
        self.selection, self.config, self.engine, self.metrics = selection, config, engine, metrics
        self.inflight = 0  # admitted speech requests (queue slots)
        self.planning: list[int] = []  # the input length of each admitted request still being cut into pieces
        # the ASGI scopes of /v1 requests in progress, from their headers on, by id: what a drain waits for and its
        # timeout cuts (`inflight` counts the speech requests admitted to the queue)
        self.open_scopes: dict[int, Scope] = {}
        self.cache = AudioCache(int(config.audio_cache_mb * 1024 * 1024))
        self.draining = False
        self._drain_deadline = math.inf
        self._cut = False  # the requests a drain's timeout cuts are cut once
        self._aliases: dict[str, str] | None = None

    @property
    def open_requests(self) -> int:
        return len(self.open_scopes)

    # ---- admission and shutdown ---------------------------------------------------------------------

    def admit(self) -> None:
        """Take a queue slot (give it back with `release`), or 429 with when one likely frees."""
        if self.inflight >= self.config.max_queue:
            busy = f"server busy: {self.inflight} of {self.config.max_queue} request slots in use (serve --max-queue)"
            raise ApiError(429, f"{busy}; retry after the Retry-After header's seconds",
                           type_="rate_limit_error", code="rate_limit_exceeded",
                           headers={"Retry-After": str(self.engine.retry_after(self.inflight, self.planning))})  # fmt: skip
        self.inflight += 1

    def release(self) -> None:
        self.inflight -= 1

    def begin_drain(self) -> None:
        """Stop taking requests (503, /ready too); the ones in flight may finish within `drain_timeout`."""
        if not self.draining:
            self.draining = True
            self._drain_deadline = time.monotonic() + self.config.drain_timeout
            log.info("draining: %d requests in flight get up to %.0f s to finish", self.inflight, self.config.drain_timeout)

    def drained(self) -> bool:
        """Draining and nothing left to wait for: every request finished, or the drain timeout passed."""
        if not self.draining:
            return False
        if self.open_requests and time.monotonic() >= self._drain_deadline:
            if not self._cut:  # their connections dropped now: each request ends as its client gone (its synthesis
                self._cut = True  # cancelled, a stream cut short), before uvicorn would cancel it under the app
                log.warning("drain timeout: cutting %d requests still in flight", self.open_requests)
                for scope in list(self.open_scopes.values()):
                    abort_connection(scope)
            return True
        return self.open_requests == 0

    @staticmethod
    def shutting_down() -> ApiError:
        return ApiError(503, "the server is shutting down: send the request again (to another instance, or to this one "
                        "once it is restarted)", type_="server_error", code="shutting_down",
                        headers={"Retry-After": RETRY_SECONDS, "Connection": "close"})  # fmt: skip

    def require_ready(self) -> None:
        engine = self.engine
        if engine.error is not None:
            raise ApiError(503, f"the model failed to load: {engine.error}", type_="server_error", code="load_failed",
                           headers={"Retry-After": "60"})  # fmt: skip
        if not engine.ready.is_set():
            raise ApiError(503, "the model is still warming up", type_="server_error", code="not_ready",
                           headers={"Retry-After": RETRY_SECONDS})  # fmt: skip

    # ---- what requests ask for ------------------------------------------------------------------------

    def cache_key(self, req: SpeechRequest) -> CacheKey | None:
        """Where this request's response is kept; None when the cache is off, or for SSE events."""
        if self.cache.max_bytes <= 0 or req.stream_format == "sse":
            return None
        return CacheKey(req.input, req.voice, req.speed, req.response_format, req.stream)

    @property
    def aliases(self) -> dict[str, str]:
        if self._aliases is None:
            assert self.engine.synth is not None
            self._aliases = openai_voice_map(self.engine.synth.voices)
        return self._aliases

    def pack(self, spec: str) -> Any:
        assert self.engine.synth is not None
        packs = self.engine.synth.packs
        try:
            return blend_voice(spec, packs, self.aliases)
        except UserError as exc:
            raise ApiError(400, exc.message + (f"; {exc.hint}" if exc.hint else ""), param="voice") from None

    def model_entries(self) -> list[dict[str, Any]]:
        art = self.selection.artifact
        created = int(art.path.stat().st_mtime)
        base = {"object": "model", "created": created, "owned_by": "kokoro-opt"}
        served = {"id": art.id, **base, "name": art.name, "reason": self.selection.reason, "mode": self.config.mode_name,
                  "workers": self.config.workers, "threads": self.config.session_threads(self.selection),
                  "scheduling": self.config.scheduling}  # fmt: skip
        return [served, *({"id": m, **base, "root": art.id} for m in OPENAI_MODELS)]
