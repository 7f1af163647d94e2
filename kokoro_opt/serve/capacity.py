"""How many simultaneous real-time streams a machine sustains, and the queue limit `serve` takes from it.

`bench-serve --capacity` streams the paragraph to 1, 2, 4, 6, ... clients, each round started together, up to the first count
the server does not sustain, then to each count between the last one sustained and that one (6 sustained and 8
not: 7). A count is sustained with every request admitted and complete, no listener's playback
catching up with its bytes (0 underruns) and first audio within 0.5 s (TTFA p95 over the simultaneous starts), or
within twice one listener's alone on a machine where one listener alone waits longer (never over 1.5 s).
A count that misses once is run again and counts if that run sustains it: one slow minute (four streams
0.07 s short, then three runs with none) otherwise set every later `serve` on a machine that carries 6 to
admit 2. The largest count
sustained is recorded per machine (and its usable cores), artifact, serving mode, workers, threads and scheduling
(`ServeConfig.scheduling`) in the artifact store's `capacity.json`, and `serve`
admits that many requests by default on that machine (more get 429 with Retry-After): a queue sized by a guess
either turns listeners away the machine could serve or admits ones it cannot.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from kokoro_opt.artifacts import write_json_atomic

CAPACITY_FILE = "capacity.json"
COUNTS = (1, 2, 4, 6, 8, 10, 12, 16)
TTFA_P95_LIMIT = 0.5  # seconds: first audio of the simultaneous listeners, p95 over the rounds
# ... or within this many times one listener's first audio alone, where that is already longer: whole decoding
# of a 40-token first job takes ~0.65 s on a 2-core Intel Xeon, so a fixed 0.5 s would measure that machine's
# single-listener latency (capacity 0) instead of what more listeners cost
TTFA_GROWTH = 2.0
TTFA_P95_CEILING = 1.5  # seconds: never more, so a machine that slow records 0 streams (serve still admits 1)
DEFAULT_QUEUE = 4  # what serve admits where nothing was measured
RUNS_PER_COUNT = 2  # a count not sustained is run again before the probe stops there


def ttfa_limit(alone: dict[str, Any] | None) -> float:
    """The TTFA p95 the simultaneous listeners are held to, given one listener's scenario alone (None: unknown)."""
    return min(max(TTFA_P95_LIMIT, TTFA_GROWTH * alone["ttfa_p95"]), TTFA_P95_CEILING) if alone else TTFA_P95_LIMIT


def sustains(summary: dict[str, Any], limit: float = TTFA_P95_LIMIT) -> bool:
    """Whether one streaming scenario (scenario.Scenario.summary) kept every listener fed, first audio within `limit`."""
    complete = summary["ok"] == summary["requests"] and not summary["rejected_429"] and not summary["errors"]
    return complete and summary["underruns"] == 0 and summary["ttfa_p95"] <= limit


def next_count(results: dict[int, bool]) -> int | None:
    """The client count a probe runs next, given each count's result so far (True: sustained); None: done.
    The coarse steps (`COUNTS`) find the first count not sustained, then the counts below it are tried upwards
    from the last sustained one, so a machine that carries 7 records 7, not 6."""
    below = 0
    for clients in COUNTS:
        if clients not in results:
            return clients
        if not results[clients]:
            for between in range(below + 1, clients):
                if between not in results:
                    return between
                if not results[between]:
                    return None
            return None
        below = clients
    return None


def sustained(summaries: list[dict[str, Any]]) -> tuple[int, float]:
    """(the largest client count sustained in one of its runs with every smaller count measured sustained too, 0
    when not even one; the TTFA limit that applied: from one listener's first run)."""
    streams = [s for s in summaries if s["mode"] == "stream"]
    limit = ttfa_limit(next((s for s in streams if s["clients"] == 1), None))
    best = 0
    for clients in sorted({s["clients"] for s in streams}):
        if not any(sustains(s, limit) for s in streams if s["clients"] == clients):
            break
        best = clients
    return best, limit


@dataclass(frozen=True)
class Capacity:
    artifact_id: str
    mode: str  # ServeConfig.mode_name: "windowed" | "whole" | "whole-capped"
    workers: int
    streams: int
    machine: dict[str, Any]
    measured: str
    ttfa_limit: float = TTFA_P95_LIMIT
    threads: int = 0  # each worker's session threads (ServeConfig.session_threads); 0: ONNX Runtime's, every core
    scheduling: str = ""  # ServeConfig.scheduling: the chunks and windows the count was measured with

    @property
    def admits(self) -> int:
        """The requests `serve` admits at once by default after this measurement: a machine that sustains no stream
        in real time still serves one listener at a time."""
        return max(self.streams, 1)

    def describe(self) -> str:
        at_least = "at least " * (self.streams == max(COUNTS))  # the probe tries no more
        return (
            f"{at_least}{self.streams} simultaneous real-time stream{'' if self.streams == 1 else 's'} "
            f"({self.mode}, {self.workers} worker"
            f"{'s' if self.workers > 1 else ''}{_threads_text(self.threads)}; first audio within {self.ttfa_limit:.2f} s), "
            f"measured by bench-serve --capacity on {self.measured[:10]}"
        )


def _threads_text(threads: int) -> str:
    return f" of {threads} thread{'s' if threads > 1 else ''}" if threads else ""


def record_capacity(
    root: Path,
    artifact_id: str,
    mode: str,
    workers: int,
    streams: int,
    ttfa_limit: float = TTFA_P95_LIMIT,
    threads: int = 0,
    scheduling: str = "",
) -> Capacity:
    """Keep the measurement for this machine, replacing an earlier one of the same artifact, mode, workers, threads
    and scheduling."""
    from kokoro_opt.machine import fingerprint

    measured = datetime.now(UTC).isoformat(timespec="seconds")
    found = Capacity(artifact_id, mode, workers, streams, fingerprint(), measured, round(ttfa_limit, 3), threads, scheduling)
    kept = [c for c in _read(root) if _key(c) != _key(found)]
    root.mkdir(parents=True, exist_ok=True)
    write_json_atomic(root / CAPACITY_FILE, {"measurements": [asdict(c) for c in [*kept, found]]})
    return found


def measured_capacity(
    root: Path, artifact_id: str, mode: str, workers: int, threads: int = 0, scheduling: str = ""
) -> Capacity | None:
    """This machine's measurement for the artifact and mode, served with as many workers of as many threads and the
    same scheduling, on as many cores (an affinity or a quota changes what one machine carries), if any."""
    from kokoro_opt.machine import fingerprint, same_machine

    here = fingerprint()
    cores = ("usable_cores", "usable_cpus")
    matches = [
        c
        for c in _read(root)
        if (c.artifact_id, c.mode, c.workers, c.threads, c.scheduling) == (artifact_id, mode, workers, threads, scheduling)
        and same_machine(c.machine, here)
        and all(c.machine.get(k) == here.get(k) for k in cores)
    ]
    return matches[-1] if matches else None


def _key(c: Capacity) -> tuple[Any, ...]:
    cores = c.machine.get("usable_cores"), c.machine.get("usable_cpus")
    return c.artifact_id, c.mode, c.workers, c.threads, c.scheduling, c.machine.get("id"), cores


def _read(root: Path) -> list[Capacity]:
    """The records kept, each checked: a record that is not one (a hand edit, another tool) is passed over, so
    serve falls back to the default for it and says so; none of its values can switch admission off."""
    path = root / CAPACITY_FILE
    try:
        entries = json.loads(path.read_text(encoding="utf-8"))["measurements"]
    except (OSError, ValueError, RecursionError, KeyError, TypeError):
        return []  # none yet, or unreadable
    return [kept for entry in entries if (kept := _record(entry)) is not None] if isinstance(entries, list) else []


def _record(entry: Any) -> Capacity | None:
    if not isinstance(entry, dict):
        return None
    known = {f.name for f in fields(Capacity)}  # a newer version's extra fields are not this one's
    try:
        c = Capacity(**{k: v for k, v in entry.items() if k in known})
    except TypeError:  # a field missing
        return None
    texts = all(isinstance(v, str) for v in (c.artifact_id, c.mode, c.measured)) and isinstance(c.machine, dict)
    counts = type(c.workers) is int and type(c.streams) is int and 0 <= c.streams <= max(COUNTS)
    counts = counts and type(c.threads) is int and c.threads >= 0 and isinstance(c.scheduling, str)
    limit = type(c.ttfa_limit) in (int, float) and 0 < c.ttfa_limit <= TTFA_P95_CEILING
    return c if texts and counts and limit else None
