"""Voice packs: lookup, blending (`jf_alpha(2)+jm_kumo(1)`) and style selection."""

from __future__ import annotations

import math
import re

import numpy as np

from kokoro_opt.errors import UserError

SAMPLE_RATE = 24_000

# OpenAI voices -> the five Kokoro voices real artifacts carry, matched on the voice's gender (Kokoro's
# names say it: jf_ = Japanese female, jm_ = male); jm_kumo is the only male voice, so it takes every male one.
OPENAI_VOICES: dict[str, str] = {
    "alloy": "jf_alpha",
    "ash": "jm_kumo",
    "ballad": "jm_kumo",
    "coral": "jf_gongitsune",
    "echo": "jm_kumo",
    "fable": "jm_kumo",
    "onyx": "jm_kumo",
    "nova": "jf_nezumi",
    "sage": "jf_tebukuro",
    "shimmer": "jf_alpha",
    "verse": "jm_kumo",
}
_OPENAI_MALE = {"ash", "ballad", "echo", "fable", "onyx", "verse"}


def openai_voice_map(voices: list[str]) -> dict[str, str]:
    """The table above where the artifact has the voice; otherwise a deterministic fallback.

    Fallback: same gender by Kokoro's naming (second letter f/m) when the artifact has any, else all
    voices; OpenAI names of a gender take that pool's voices in sorted order, round robin.
    """
    available = sorted(voices)
    if not available:
        return {}
    mapping: dict[str, str] = {}
    counters = {True: 0, False: 0}
    for name in OPENAI_VOICES:
        preferred = OPENAI_VOICES[name]
        if preferred in available:
            mapping[name] = preferred
            continue
        male = name in _OPENAI_MALE
        pool = [v for v in available if len(v) > 2 and v[2] == "_" and v[1] == ("m" if male else "f")] or available
        mapping[name] = pool[counters[male] % len(pool)]
        counters[male] += 1
    return mapping


_TERM = re.compile(r"^\s*([A-Za-z0-9_\-]+)\s*(?:\(\s*([0-9]*\.?[0-9]+)\s*\))?\s*$")


def parse_blend(spec: str) -> list[tuple[str, float]]:
    """`a(2)+b(1)` -> [(a, 2/3), (b, 1/3)]; a bare name has weight 1."""
    terms = []
    for part in spec.split("+"):
        match = _TERM.match(part)
        if not match:
            raise UserError(f"cannot read voice '{spec}'", "write a name or a blend like jf_alpha(2)+jm_kumo(1)")
        weight = float(match.group(2)) if match.group(2) else 1.0
        if not math.isfinite(weight):  # 309 digits and more
            raise UserError(f"voice '{spec}' has a weight too large for a number", "weights are relative: jf_alpha(2)+jm_kumo(1)")
        terms.append((match.group(1), weight))
    largest = max(w for _, w in terms)
    if largest <= 0:
        raise UserError(f"voice blend '{spec}' has zero total weight", "give at least one voice a positive weight")
    scaled = [(name, w / largest) for name, w in terms]  # first to at most 1: a sum of large weights would overflow
    total = sum(w for _, w in scaled)
    return [(name, w / total) for name, w in scaled]


def blend_voice(spec: str, packs: dict[str, np.ndarray], aliases: dict[str, str] | None = None) -> np.ndarray:
    """The (510, 1, 256) pack for a voice name or blend; unknown names list the known ones. OpenAI's voice
    names (alloy, ...) stand for the voices `aliases` maps them to, by default `openai_voice_map`'s."""
    mixed = None
    for name, weight in parse_blend(spec):
        if name not in packs:  # the map only for a name the packs lack: blend_voice runs for every utterance
            aliases = openai_voice_map(list(packs)) if aliases is None else aliases
            name = aliases.get(name, name)
        if name not in packs:
            openai = f"; or an OpenAI name: {', '.join(aliases)}" if aliases else ""
            raise UserError(f"unknown voice '{name}'", f"choose from: {', '.join(sorted(packs))}{openai}")
        part = packs[name].astype(np.float32) * weight
        mixed = part if mixed is None else mixed + part
    assert mixed is not None
    return mixed


def style_for(pack: np.ndarray, n_tokens: int) -> np.ndarray:
    """Kokoro indexes a voice pack by phoneme count: pack[len(phonemes) - 1], shape (1, 256)."""
    index = min(max(n_tokens, 1), pack.shape[0]) - 1
    return np.asarray(pack[index], dtype=np.float32).reshape(1, -1)
