"""Two units of work one after the other, or at once on the same ONNX Runtime sessions: what
`serve --workers 2` rests on (kokoro_opt/serve/engine.py, docs/serving.md).

    python benchmarks/concurrent_units.py [--windowed artifacts/int8-mixed] [--whole artifacts/int8-mixed]

Each pair runs in turn on one Python thread, then on two threads at once, alternated, and the table
prints the medians and the throughput ratio. The last rows time four new listeners' fronts and 12-step
first windows: with one worker and with two, when does each of them get its first audio.
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

SENTENCE = "The old lighthouse keeper climbed the stairs every evening at dusk."
PHRASE = "Checkbox checked."


def in_turn_and_at_once(first: Callable[[], object], second: Callable[[], object], runs: int) -> tuple[float, float]:
    """Median seconds for the two calls one after the other, and on two threads at once."""
    first(), second()  # the first run of a shape allocates
    in_turn, at_once = [], []
    for _ in range(runs):
        began = time.perf_counter()
        first(), second()
        in_turn.append(time.perf_counter() - began)
        threads = [threading.Thread(target=first), threading.Thread(target=second)]
        began = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        at_once.append(time.perf_counter() - began)
    return statistics.median(in_turn), statistics.median(at_once)


def first_audio_times(start_one: Callable[[], object], workers: int, listeners: int = 4) -> list[float]:
    """Seconds from a common start until each of `listeners` new listeners has its first window, `workers` at a time."""
    done: list[float] = []
    began = time.perf_counter()

    def worker(count: int) -> None:
        for _ in range(count):
            start_one()
            done.append(time.perf_counter() - began)

    threads = [threading.Thread(target=worker, args=(listeners // workers,)) for _ in range(workers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return sorted(done)


def whole_graph_pairs(whole: Any, runs: int, table: Any) -> None:
    """Rows for two whole-graph jobs of a sentence and of a phrase (what the default one worker runs)."""
    from kokoro_opt.chunking import chunk_text

    for text in (SENTENCE, PHRASE):
        tokens = [t for c in chunk_text(text, whole.vocab, first_chunk_tokens=400, chunk_tokens=400) for t in c.token_ids]
        job = lambda tokens=tokens: whole.run_tokens(tokens, whole.voices[0])  # noqa: E731
        a, b = in_turn_and_at_once(job, job, runs)
        table.add_row(
            f"two whole-graph jobs, {len(tokens)} tokens ({whole.artifact.name})",
            f"{1000 * a:.0f}",
            f"{1000 * b:.0f}",
            f"{a / b:.2f}x",
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--windowed", type=Path, default=Path("artifacts/int8-mixed"))
    parser.add_argument("--whole", type=Path, default=Path("artifacts/int8-mixed"))
    parser.add_argument("--runs", type=int, default=12)
    parser.add_argument("--threads", type=int, default=2, help="ORT intra-op threads of every session")
    args = parser.parse_args()

    from rich.console import Console
    from rich.table import Table

    from kokoro_opt.artifacts import open_artifact
    from kokoro_opt.chunking import chunk_text
    from kokoro_opt.machine import describe, fingerprint
    from kokoro_opt.runtime.session import SessionSettings
    from kokoro_opt.runtime.synth import Synthesizer
    from kokoro_opt.runtime.windowed import WindowedDecoder

    settings = SessionSettings(intra_op_num_threads=args.threads)
    table = Table(title=f"two units in turn or at once, {args.threads} ORT threads ({describe(fingerprint())})")
    for column in ("units", "in turn ms", "at once ms", "throughput"):
        table.add_column(column, justify="right")

    whole_graph_pairs(Synthesizer(open_artifact(args.whole), settings), args.runs, table)

    synth = Synthesizer(open_artifact(args.windowed), settings, load=False)
    decoder = WindowedDecoder.of_artifact(synth)
    pack = synth.packs[synth.voices[0]]
    tokens = [t for c in chunk_text(SENTENCE, synth.vocab, first_chunk_tokens=400, chunk_tokens=400) for t in c.token_ids]
    job = decoder.start(tokens, pack)
    start = job.speech[0]

    def window(steps: int) -> Callable[[], object]:
        return lambda: decoder.window(job.front, start, start + steps, job.stats, None, job.constants)

    units: dict[str, Callable[[], object]] = {
        f"front, {len(tokens)} tokens": lambda: decoder.start(tokens, pack),
        "12-step window": window(12),
        "80-step window": window(80),
        "160-step window": window(160),
    }
    front = f"front, {len(tokens)} tokens"
    for x, y in (
        (front, front),
        ("80-step window", "80-step window"),
        ("160-step window", "160-step window"),
        (front, "80-step window"),
        (front, "12-step window"),
    ):
        a, b = in_turn_and_at_once(units[x], units[y], args.runs)
        table.add_row(f"{x} + {y}", f"{1000 * a:.0f}", f"{1000 * b:.0f}", f"{a / b:.2f}x")

    def new_listener() -> None:
        decoder.next_window(decoder.start(tokens, pack), 12)

    new_listener()
    by_workers = {w: [first_audio_times(new_listener, w) for _ in range(args.runs)] for w in (1, 2)}
    for w, runs in by_workers.items():
        medians = [1000 * statistics.median(r[i] for r in runs) for i in range(4)]
        table.add_row(
            f"four new listeners, {w} worker{'s' * (w > 1)}: first audio of the 1st-4th",
            "",
            " / ".join(f"{m:.0f}" for m in medians),
            "",
        )
    Console(width=160).print(table)


if __name__ == "__main__":
    main()
