"""Prometheus metrics: one registry per app, so several servers can live in one process (tests)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from kokoro_opt.machine import proc_status_kib

_LATENCY_BUCKETS = (0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 10.0, 30.0, 60.0)
_RELEASE_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 10.0)
_RTF_BUCKETS = (0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.7, 1.0, 1.5, 2.0, 5.0)


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("kokoro_requests", "Speech requests by outcome", ["format", "stream", "status"], registry=r)
        self.errors = Counter("kokoro_errors", "Error responses and aborted streams by code", ["code"], registry=r)
        self.ttfa = Histogram(
            "kokoro_ttfa_seconds", "Request arrival to first audio bytes sent", ["stream"], buckets=_LATENCY_BUCKETS, registry=r
        )
        self.response = Histogram(
            "kokoro_response_seconds", "Request arrival to last byte sent", ["stream"], buckets=_LATENCY_BUCKETS, registry=r
        )
        self.rtf = Histogram("kokoro_rtf", "Synthesis seconds per second of audio, per job", buckets=_RTF_BUCKETS, registry=r)
        self.audio_seconds = Counter("kokoro_audio_seconds", "Seconds of audio synthesized", registry=r)
        self.synth_seconds = Counter("kokoro_synthesis_seconds", "Seconds the worker spent synthesizing", registry=r)
        self.jobs = Counter("kokoro_jobs", "Synthesis jobs run (merged pieces)", registry=r)
        self.cache_hits = Counter("kokoro_cache_hits", "Requests answered from the audio cache (repeats)", registry=r)
        self.cancelled = Counter("kokoro_cancelled", "Requests cancelled (client gone or timed out)", registry=r)
        self.dropped = Counter("kokoro_dropped_pieces", "Queued pieces dropped by cancellation", registry=r)
        self.cancel_release = Histogram(
            "kokoro_cancel_release_seconds",
            "Cancellation to the worker being free of the request (its running job or window stopped; 0 if none ran)",
            buckets=_RELEASE_BUCKETS,
            registry=r,
        )
        self.queue_depth = Gauge("kokoro_queue_depth", "Text pieces waiting for synthesis", registry=r)
        self.active = Gauge("kokoro_active_requests", "Admitted requests (being chunked, queued or streaming)", registry=r)
        self.open = Gauge(
            "kokoro_open_requests", "/v1 requests from their headers to their last byte (a drain waits for them)", registry=r
        )
        self.busy = Gauge("kokoro_worker_busy", "1 while a worker runs a job or window", registry=r)
        self.ready = Gauge("kokoro_ready", "1 once the model is loaded and warmed up", registry=r)
        self.rss = Gauge("kokoro_process_rss_bytes", "Resident memory of the server process", registry=r)
        self.rss.set_function(lambda: float(_process().memory_info().rss))
        self.peak_rss = Gauge("kokoro_process_peak_rss_bytes", "Peak resident memory of the server process", registry=r)
        self.peak_rss.set_function(_peak_rss_bytes)

    def bind(
        self,
        queue_depth: Callable[[], float],
        active: Callable[[], float],
        busy: Callable[[], float],
        ready: Callable[[], float],
        open_requests: Callable[[], float] = lambda: 0.0,
    ) -> None:
        """Gauges read live state at scrape time instead of being kept in sync by hand."""
        self.queue_depth.set_function(queue_depth)
        self.active.set_function(active)
        self.open.set_function(open_requests)
        self.busy.set_function(busy)
        self.ready.set_function(ready)

    def observe_job(self, compute_s: float, audio_s: float) -> None:
        self.jobs.inc()
        self.synth_seconds.inc(compute_s)
        self.audio_seconds.inc(audio_s)
        if audio_s > 0:
            self.rtf.observe(compute_s / audio_s)

    def render(self) -> bytes:
        return generate_latest(self.registry)


def _process() -> Any:
    import psutil

    return psutil.Process()


def _peak_rss_bytes() -> float:
    """The kernel's high-water mark (Linux VmHWM); elsewhere psutil's peak where it has one, else current."""
    if (kib := proc_status_kib("VmHWM")) is not None:
        return float(kib * 1024)
    info = _process().memory_info()
    return float(getattr(info, "peak_wset", info.rss))
