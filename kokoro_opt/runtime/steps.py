"""Generator steps: where a job's speech lies among them and how windows tile it, from the front's durations.

A step is one input position of the generator (`STEP_SAMPLES` audio samples); a duration frame is `STEPS_PER_FRAME`
steps. Pure functions, shared by the windowed decoder (runtime/windowed.py) and whole jobs cut at a job's own
tokens (serve/engine.py).
"""

from __future__ import annotations

import numpy as np

from kokoro_opt.runtime.edges import final_silence_tokens

STEPS_PER_FRAME = 2  # the decoder's last frame-rate block upsamples by 2 before the generator
STEP_SAMPLES = 300  # audio samples per generator input step (12.5 ms at 24 kHz)
SEAM_STEPS = 1  # steps a job cut inside its sentence decodes past the cut into its context: half the seam's crossfade


def window_end(start: int, end: int, size: int, sliver: int) -> int:
    """Where a window of about `size` steps from `start` stops: a rest shorter than `sliver` steps is folded in."""
    stop = min(start + max(size, 1), end)
    return end if end - stop < sliver else stop


def window_spans(start: int, end: int, first: int, size: int) -> list[tuple[int, int]]:
    """[a, b) spans covering steps [start, end): a short first window for the first sound, then `size`-step
    ones; a last window shorter than a quarter of `size` is folded into the one before."""
    spans: list[tuple[int, int]] = []
    while start < end:
        stop = window_end(start, end, first if not spans else size, size // 4)
        spans.append((start, stop))
        start = stop
    return spans


def speech_steps(
    durations: np.ndarray, token_ids: list[int], symbols: dict[int, str], lead_frames: int, trail_frames: int
) -> tuple[int, int]:
    """Generator steps [start, end) worth decoding: from `lead_frames` before the leading pad ends to
    `trail_frames` into the final pause (the rest is silence the server trims anyway)."""
    total = int(np.sum(durations))
    speech_end = total - int(np.sum(durations[-final_silence_tokens(token_ids, symbols) :]))
    start = max(int(durations[0]) - lead_frames, 0)
    end = min(max(speech_end + trail_frames, start + 1), total)
    return STEPS_PER_FRAME * start, STEPS_PER_FRAME * end


def spoken_steps(durations: np.ndarray, context: tuple[int, int], steps: tuple[int, int]) -> tuple[int, int]:
    """Generator steps `steps` ([start, end)) with each side where context tokens were fed (`context`: how many
    before and after the spoken ones) moved to where the spoken tokens' frames begin or end, and SEAM_STEPS past
    it: the two jobs beside a cut overlap there, and the joiner crossfades them (runtime/join.py). `durations`: the
    front's, per token of the feed with the pads."""
    behind, ahead = context
    frames = np.cumsum(durations)
    total = STEPS_PER_FRAME * int(frames[-1])
    start = max(STEPS_PER_FRAME * int(frames[behind]) - SEAM_STEPS, 0) if behind else steps[0]
    end = min(STEPS_PER_FRAME * int(frames[len(durations) - 2 - ahead]) + SEAM_STEPS, total) if ahead else steps[1]
    return start, max(end, start + 1)
