"""Inputs at the edges of what Kokoro accepts. Every artifact must answer each of them with finite,
audible audio: quantization that overflows on a one-token utterance or a full context shows here
and nowhere in the timed corpus."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from kokoro_opt.audio import is_speechlike

EDGE_TEXTS = {"one word": "Yes.", "punctuation only": "?!"}
LONG_INPUT_TOKENS = 500


def edge_token_inputs(vocab: dict[str, int], long_text: str) -> dict[str, list[int]]:
    """Token ids of each edge input; the long one is the first 500 tokens of `long_text`."""
    from kokoro_opt.text import utterance_tokens

    inputs = {name: utterance_tokens(text, vocab) for name, text in EDGE_TEXTS.items()}
    inputs[f"{LONG_INPUT_TOKENS} tokens"] = utterance_tokens(long_text, vocab, LONG_INPUT_TOKENS)
    return inputs


def check_edge_inputs(synth: Callable[[list[int]], np.ndarray], inputs: dict[str, list[int]]) -> dict[str, str | None]:
    """Input name -> what is wrong with the model's answer to it (None: finite, audible audio)."""
    verdict: dict[str, str | None] = {}
    for name, tokens in inputs.items():
        try:
            verdict[name] = None if is_speechlike(synth(tokens)) else "NaN or silent output"
        except Exception as exc:  # a model that fails on an edge input fails the check; the timing already done is kept
            verdict[name] = f"raised {type(exc).__name__}: {str(exc)[:200]}"
    return verdict
