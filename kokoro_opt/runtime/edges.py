"""Edge capping at run time: the `edge_keep` feed that lets the decoder skip the silence at the edges.

Kokoro frames every utterance with silence: the leading pad token gets 12-18 frames (0.3-0.45 s) and the
final punctuation and pad ~10-15 more, which the server then trims. The decoder (90% of the compute)
decodes them anyway. With `edge_keep` = [lead, trail, trail_tokens] the decoder's frame inputs are cut
to `lead` frames of the leading pad and `trail` frames of the last `trail_tokens` tokens. Everything
that sees the whole utterance still does: the duration, F0 and energy predictors run on every frame,
and so does the harmonic source (SineGen's phase is a running sum from frame 0; cutting before it
moved the speech's phase and cost ~0.5 PESQ). The decoder's InstanceNorm statistics were measured
to need no correction (docs/stages.md). `edge_keep` is an overridable initializer whose default
keeps every frame, so a caller that does not feed it gets the artifact's audio unchanged. The graph side
(adding the input) is the `edges` stage's: kokoro_opt/passes/edge_input.py.
"""

from __future__ import annotations

import numpy as np

EDGE_INPUT = "edge_keep"
KEEP_ALL = 1 << 40  # frames: more than any utterance has, so nothing is cut

FRAME_SAMPLES = 600  # 24 kHz audio samples per decoder frame (25 ms)
_FINAL_PUNCTUATION = set(".!?…,;:—–-\"'”’)]»")


def final_silence_tokens(token_ids: list[int], symbols: dict[int, str]) -> int:
    """Tokens at the end that Kokoro fills with the final pause: the closing pad, plus the punctuation before it."""
    return 2 if token_ids and symbols.get(token_ids[-1], "") in _FINAL_PUNCTUATION else 1


def edge_keep(lead_frames: int, trail_frames: int, token_ids: list[int], symbols: dict[int, str]) -> np.ndarray:
    """The `edge_keep` feed for one utterance."""
    return np.array([lead_frames, trail_frames, final_silence_tokens(token_ids, symbols)], dtype=np.int64)


def removed_frames(durations: np.ndarray, keep: np.ndarray) -> tuple[int, int]:
    """(leading, trailing) frames the graph cuts for these durations: the graph's own arithmetic."""
    lead = max(int(durations[0]) - int(keep[0]), 0)
    trail = max(int(np.sum(durations[-int(keep[2]) :])) - int(keep[1]), 0)
    return lead, min(trail, int(np.sum(durations)) - lead - 1)
