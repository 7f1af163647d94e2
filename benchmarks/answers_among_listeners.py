"""Whole answers (`"stream": false`) arriving while listeners stream: do the listeners run dry, and how long
do the answers take (kokoro_opt/serve/modes.py `WindowedJobs.defers`, docs/serving.md).

    python benchmarks/answers_among_listeners.py --url http://127.0.0.1:8871 [--listeners 5] [--answers 2]
                                                 [--delay 0.5] [--rounds 3]

Start the server first with room for everyone (`kokoro-opt serve --artifact best --max-queue 12`). Each round
starts the listeners together, each streaming the default paragraph, and `--delay` seconds later the whole
answers for the same text, all with `Cache-Control: no-cache`. A listener underruns when playback from its
first byte would catch up with the bytes (as in `kokoro-opt bench-serve`). To compare two builds of the
server, run it against each in turn and alternate.
"""

from __future__ import annotations

import argparse
import asyncio

import httpx

from kokoro_opt.machine import describe, fingerprint
from kokoro_opt.serve.bench import PARAGRAPH
from kokoro_opt.serve.scenario import UNDERRUN_TOLERANCE, Sample, timed_request

SAMPLE_RATE = 24_000


async def one_round(client: httpx.AsyncClient, listeners: int, answers: int, delay: float) -> tuple[list[Sample], list[Sample]]:
    body = {"model": "kokoro", "input": PARAGRAPH, "voice": "alloy", "response_format": "pcm"}

    async def answer() -> Sample:
        await asyncio.sleep(delay)
        return await timed_request(client, {**body, "stream": False}, SAMPLE_RATE)

    streams = [timed_request(client, {**body, "stream": True}, SAMPLE_RATE) for _ in range(listeners)]
    done = await asyncio.gather(*streams, *(answer() for _ in range(answers)))
    return list(done[:listeners]), list(done[listeners:])


async def main(url: str, listeners: int, answers: int, delay: float, rounds: int) -> None:
    limits = httpx.Limits(max_connections=listeners + answers + 1)
    headers = {"Cache-Control": "no-cache"}
    print(f"{listeners} listeners, {answers} whole answers {delay} s later; client on {describe(fingerprint())}\n")
    print("| round | listeners underrun | worst lag (s) | TTFA max (s) | answers' time (s) | errors |")
    print("|---|---|---|---|---|---|")
    async with httpx.AsyncClient(base_url=url, timeout=600.0, limits=limits, headers=headers) as client:
        for n in range(1, rounds + 1):
            heard, whole = await one_round(client, listeners, answers, delay)
            ok = [s for s in heard if s.ok]
            underrun = sum(s.lag > UNDERRUN_TOLERANCE for s in ok)
            lag = max((s.lag for s in ok), default=float("nan"))
            ttfa = max((s.ttfa for s in ok), default=float("nan"))
            times = ", ".join(f"{s.total:.2f}" for s in whole if s.ok) or "-"
            errors = sorted({s.error for s in heard + whole if s.error})
            print(f"| {n} | {underrun}/{listeners} | {lag:.2f} | {ttfa:.2f} | {times} | {'; '.join(errors) or '-'} |")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", required=True, help="a running server")
    parser.add_argument("--listeners", type=int, default=5, help="streams started together")
    parser.add_argument("--answers", type=int, default=2, help="whole answers started --delay seconds later")
    parser.add_argument("--delay", type=float, default=0.5, help="seconds between the listeners and the answers")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    asyncio.run(main(args.url, args.listeners, args.answers, args.delay, args.rounds))
