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


def check_edge_inputs(synth: Callable[[list[int]], np.ndarray], inputs: dict[str, list[int]]) -> dict[str, bool]:
    """Input name -> whether the model's audio for it is finite and not silent (an error counts as not)."""
    verdict = {}
    for name, tokens in inputs.items():
        try:
            verdict[name] = is_speechlike(synth(tokens))
        except Exception:  # a model that fails on an edge input fails the check; the timing already done is kept
            verdict[name] = False
    return verdict
