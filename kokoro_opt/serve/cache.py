"""Finished responses of recent requests, by what was asked: a repeated utterance is answered without
synthesis.

Screen readers speak the same short phrases ("button", "checkbox checked", "link, Settings") thousands
of times an hour; a repeat is answered from here in milliseconds instead of a front and a generator
run. Whole decoding is deterministic for a given input, voice and speed, so a stored body is what the
engine would make again (a streamed one joined at the seams of that run). A windowed stream's windows are
sized by the machine's speed and the listener's buffer at that moment, so a stored one is one of several
renderings that differ a little where their windows were cut (docs/serving.md, the audio cache).

A request sent with `Cache-Control: no-cache` is always synthesized (the benchmark measures synthesis
that way); its result is still stored. With `no-store` it is neither answered from here nor kept.
The store is bounded in bytes and evicts the least recently used; a body larger than a sixteenth of
it is not kept, so long paragraphs do not push out phrases.
"""

from __future__ import annotations

import sys
from collections import OrderedDict
from dataclasses import dataclass


@dataclass(frozen=True)
class CacheKey:
    """Everything a response's bytes depend on, for one served artifact."""

    text: str
    voice: str
    speed: float
    response_format: str
    streaming: bool


def entry_bytes(key: CacheKey, body: bytes) -> int:
    """What an entry holds in memory: its body, and its key's text (up to 4 bytes a character in Python)."""
    return len(body) + sys.getsizeof(key.text) + sys.getsizeof(key.voice)


class AudioCache:
    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._bodies: OrderedDict[CacheKey, bytes] = OrderedDict()
        self._size = 0

    @property
    def entry_limit(self) -> int:
        """The largest body kept."""
        return self.max_bytes // 16

    def get(self, key: CacheKey) -> bytes | None:
        body = self._bodies.get(key)
        if body is not None:
            self._bodies.move_to_end(key)
        return body

    def put(self, key: CacheKey, body: bytes) -> None:
        size = entry_bytes(key, body)
        if not body or size > self.entry_limit:
            return
        old = self._bodies.pop(key, None)
        self._size += size - (entry_bytes(key, old) if old is not None else 0)
        self._bodies[key] = body
        while self._size > self.max_bytes:
            evicted_key, evicted = self._bodies.popitem(last=False)
            self._size -= entry_bytes(evicted_key, evicted)

    def __len__(self) -> int:
        return len(self._bodies)

    @property
    def size(self) -> int:
        return self._size
