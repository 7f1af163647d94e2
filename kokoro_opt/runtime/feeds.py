"""The model's inputs, built in one place: every graph kokoro-opt makes or runs takes these three."""

from __future__ import annotations

import numpy as np

INPUT_NAMES = ("input_ids", "style", "speed")
OUTPUT_NAMES = ("audio", "durations")
PAD_ID = 0  # Kokoro wraps every utterance in one pad token on each side


def feed_arrays(token_ids: list[int], style: np.ndarray, speed: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(input_ids (1, n + 2) int64 with the pads, style (1, 256) float32, speed (1,) float32)."""
    return (
        np.array([[PAD_ID, *token_ids, PAD_ID]], dtype=np.int64),
        np.asarray(style, dtype=np.float32).reshape(1, -1),
        np.array([speed], dtype=np.float32),
    )


def model_feeds(
    token_ids: list[int], style: np.ndarray, speed: float = 1.0, names: tuple[str, ...] | list[str] = INPUT_NAMES
) -> dict[str, np.ndarray]:
    """The feed dict for a session; `names` for graphs that call the inputs otherwise (kokoro-onnx: tokens)."""
    return dict(zip(names, feed_arrays(token_ids, style, speed), strict=True))
