"""Two running servers side by side: the same requests alternated one at a time, for a change to the server
or the runtime that `kokoro-opt bench-serve` alone, run after run, cannot tell from the machine's drift.

    python benchmarks/servers_side_by_side.py --a http://127.0.0.1:8891 --b http://127.0.0.1:8892 [--rounds 10]
                                              [--no-stream]

Start the two servers first, e.g. one from a checkout of the old code and one from the new, on the same
artifact (`kokoro-opt serve --artifact DIR --port 8891`). Each round sends every text to both, one request at
a time, in turns whose order flips every round, with `Cache-Control: no-cache` (synthesized, never from the
audio cache); `--no-stream` asks for whole files (`"stream": false`) instead. The table prints, per text,
the median and quartiles of the time to the first bytes and to the whole response.
"""

from __future__ import annotations

import argparse
import statistics
import time

TEXTS = (
    "button",
    "checkbox checked",
    "Close dialog",
    "Heading level 2",
    "menu, 5 items",
    "link, Settings",
    "The old lighthouse keeper climbed the stairs every evening at dusk. He lit the great lamp.",
)
PHRASE_CHARS = 30  # texts shorter than this are the short phrases of the summary line


def timed(url: str, text: str, stream: bool = True) -> tuple[float, float]:
    """Seconds to the first bytes of audio and to the whole response."""
    import httpx

    body = {"model": "tts-1", "input": text, "voice": "alloy", "response_format": "pcm", "stream": stream}
    began, first = time.perf_counter(), None
    with httpx.stream("POST", f"{url}/v1/audio/speech", json=body, headers={"Cache-Control": "no-cache"}, timeout=120) as r:
        r.raise_for_status()
        for chunk in r.iter_raw():
            if first is None and chunk:
                first = time.perf_counter() - began
    return first if first is not None else float("nan"), time.perf_counter() - began


def quartiles(values: list[float]) -> str:
    ordered = sorted(values)
    n = len(ordered)
    return f"{1000 * statistics.median(ordered):.0f} ({1000 * ordered[n // 4]:.0f}-{1000 * ordered[(3 * n) // 4]:.0f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--a", required=True, help="URL of the first server (e.g. the old code)")
    parser.add_argument("--b", required=True, help="URL of the second server (e.g. the new code)")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--no-stream", dest="stream", action="store_false", help="whole files, not streams")
    args = parser.parse_args()

    from rich.console import Console
    from rich.table import Table

    from kokoro_opt.machine import describe, fingerprint

    urls = {"a": args.a.rstrip("/"), "b": args.b.rstrip("/")}
    samples: dict[tuple[str, str], list[tuple[float, float]]] = {(k, t): [] for k in urls for t in TEXTS}
    for name in urls:  # caches and arenas warm; not counted
        for text in TEXTS:
            timed(urls[name], text, args.stream)
    for n in range(args.rounds):
        for text in TEXTS:
            for name in ("a", "b") if n % 2 == 0 else ("b", "a"):
                samples[name, text].append(timed(urls[name], text, args.stream))
                time.sleep(0.05)  # a listener's pause: pools go idle between requests, as they do in use

    console = Console()
    console.print(describe(fingerprint()))
    table = Table(title=f"a = {urls['a']}, b = {urls['b']}: {args.rounds} rounds, ms, median (quartiles)")
    for column in ("text", "a: first bytes", "b: first bytes", "a: complete", "b: complete"):
        table.add_column(column, justify="left" if column == "text" else "right")
    for text in TEXTS:
        a, b = samples["a", text], samples["b", text]
        table.add_row(text[:28], *(quartiles([s[i] for s in x]) for i in (0, 1) for x in (a, b)))
    console.print(table)
    for name in urls:
        phrases = [s[0] for t in TEXTS if len(t) < PHRASE_CHARS for s in samples[name, t]]
        console.print(f"{name}: short phrases, first bytes p50 {1000 * statistics.median(phrases):.1f} ms")


if __name__ == "__main__":
    main()
