"""One request in the engine: its pieces, its listener's playback deadline, its queue of audio to send."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import threading
import time
from collections import deque
from collections.abc import Sequence
from typing import Any

import numpy as np

from kokoro_opt.runtime.join import Joiner
from kokoro_opt.runtime.windowed import WindowedJob
from kokoro_opt.serve.encoders import Encoder
from kokoro_opt.serve.plan import Piece, as_pieces

# How long a worker waits, at most, for a listener's first audio to be sent before it runs the next unit. On two cores
# that unit's threads would otherwise take both from the event loop and the client, and the first bytes arrived ~2 ms
# later (docs/measurements/2026-12-07-first-sound.md).
FIRST_SEND_WAIT = 0.005


class Stream:
    """One request in the engine. The worker thread owns the synthesis state; the loop reads `queue`."""

    _ids = itertools.count(1)

    def __init__(
        self,
        pieces: Sequence[Piece | list[int]],
        pack: np.ndarray,
        speed: float,
        encoder: Encoder,
        streaming: bool,
        joiner: Joiner,
        first_sent: threading.Event | None = None,
    ) -> None:
        self.id = next(self._ids)
        self.pieces: deque[Piece] = deque(as_pieces(pieces))
        self.pack, self.speed, self.encoder, self.streaming, self.joiner = pack, speed, encoder, streaming, joiner
        self.loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue[bytes | BaseException | None] = asyncio.Queue()
        self.arrival = time.monotonic()
        self.first_out: float | None = None
        self.audio_out = 0.0  # seconds of audio handed out
        self.bytes_out = 0  # bytes of it queued for the sender (an encoder may hold the first audio back)
        self.jobs = 0
        self.cancelled = False
        self.cancelled_at = 0.0  # when `cancelled` was set (monotonic): how long its running unit took to stop
        self.finished = False
        self.run_options: Any = None
        self.job: tuple[Piece, bool, WindowedJob] | None = None  # a windowed job with windows still to decode
        self.starting = False  # a worker picked its next job and runs its front: no `job` yet, a window next
        self.held_since: float | None = None  # a whole answer held back for listeners since (WindowedJobs.defers)
        # set by whoever sends the stream's first audio on (an HTTP response) once it has: until then the worker
        # leaves the cores to it (Engine._let_first_audio_out). The worker takes it; the sender keeps its own.
        self.first_sent = first_sent

    def deadline(self) -> float:
        return self.arrival if self.first_out is None else self.first_out + self.audio_out

    def urgency(self) -> tuple[bool, float, int]:
        """The order streams are worked for: first chunks first (oldest first), then earliest deadline first."""
        return (not (self.streaming and self.jobs == 0), self.deadline(), self.id)

    def put(self, item: bytes | BaseException | None) -> None:
        with contextlib.suppress(RuntimeError):  # a closed loop: nobody is listening any more
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)


def new_listeners(streams: Sequence[Stream], besides: Stream) -> list[Stream]:
    """The streamed requests of `streams` other than `besides` whose listeners still wait for their first audio."""
    return [other for other in streams if other.streaming and other.first_out is None and other is not besides]


def waits_for_first_send(stream: Stream, streams: Sequence[Stream]) -> bool:
    """Whether a worker waits for `stream`'s first audio to be sent before its next unit: not while another listener
    still waits for its first audio (that listener's front is next, and listeners who start together would each
    wait for the ones before them)."""
    return not new_listeners(streams, stream)
