"""Voice packs: lookup, blending (`jf_alpha(2)+jm_kumo(1)`) and style selection."""

from __future__ import annotations

import re
import string
from collections.abc import Collection

import numpy as np

from kokoro_opt.errors import UserError

SAMPLE_RATE = 24_000
DEFAULT_VOICE = "alloy"  # an OpenAI name: every artifact has it (openai_voice_map), whatever its voices

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
    "marin": "jf_gongitsune",  # the two OpenAI added for gpt-realtime and gpt-4o-mini-tts
    "cedar": "jm_kumo",
}
_OPENAI_MALE = {"ash", "ballad", "echo", "fable", "onyx", "verse", "cedar"}


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


_TERM = re.compile(r"^ *([A-Za-z0-9_\-]+) *(?:\( *([0-9]*\.?[0-9]+) *\))? *\Z")  # \Z: `$` passes a final newline


def parse_blend(spec: str) -> list[tuple[str, float]]:
    """`a(2)+b(1)` -> [(a, 2/3), (b, 1/3)]; a bare name has weight 1."""
    terms = []
    for part in spec.split("+"):
        match = _TERM.match(part)
        if not match:
            raise UserError(f"cannot read voice '{spec}'", "write a name or a blend like jf_alpha(2)+jm_kumo(1)")
        written = match.group(2) or "1"
        if not _weight_fits(written):
            raise UserError(
                f"voice '{spec}' gives {match.group(1)} a weight of {written[:20]}{'...' * (len(written) > 20)}",
                "weights are relative numbers above 0 such as 2 or 0.5 (drop a voice rather than weigh it 0), "
                "within 300 digits of the point",
            )
        terms.append((match.group(1), float(written)))
    total = sum(w for _, w in terms)
    return [(name, w / total) for name, w in terms]


def _weight_fits(written: str) -> bool:
    """A weight above 0 that a float holds as a positive finite number: at most 300 digits before the point, and
    at most 299 zeros after it before a digit that is not 0 (the OpenAPI document's pattern, serve/openapi.py)."""
    whole, _, fraction = written.partition(".")
    if whole := whole.lstrip("0"):
        return len(whole) <= 300
    significant = fraction.lstrip("0")
    return bool(significant) and len(fraction) - len(significant) <= 299


def unknown_voice(spec: str, names: list[str]) -> str | None:
    """The first voice of a name or blend, as given, that an artifact with voices `names` cannot give in any case
    (its OpenAI names included), or None; a spec that is no voice at all is a UserError (parse_blend)."""
    aliases = openai_voice_map(names)
    return next((name for name, _ in parse_blend(spec) if _voice_of(name, names, aliases) is None), None)


_ASCII_LOWER = str.maketrans(string.ascii_uppercase, string.ascii_lowercase)


def ascii_lower(text: str) -> str:
    """Names in any case, as the OpenAPI document's `[aA]` classes read them: ASCII letters only. str.lower would
    also make the Kelvin sign (U+212A) a `k`, a name the document refuses."""
    return text.translate(_ASCII_LOWER)


def _voice_of(name: str, names: Collection[str], aliases: dict[str, str] | None) -> str | None:
    """The voice `name` stands for in any case, or None. The OpenAI map is made only for a name the voices lack:
    blend_voice runs for every utterance."""
    if name in names or (name := ascii_lower(name)) in names:
        return name
    aliases = openai_voice_map(list(names)) if aliases is None else aliases
    return aliases[name] if aliases.get(name) in names else None


def check_voice(spec: str, names: list[str]) -> None:
    """blend_voice's error for a spec that artifact voices `names` cannot give, before any voice pack is loaded."""
    if (name := unknown_voice(spec, names)) is not None:
        raise _unknown(name, names, None)


def _unknown(name: str, names: list[str], aliases: dict[str, str] | None) -> UserError:
    known = openai_voice_map(names) if aliases is None else aliases
    openai = f"; or an OpenAI name: {', '.join(known)}" if known else ""
    return UserError(f"unknown voice '{name}'", f"choose from: {', '.join(sorted(names))}{openai}")


def blend_voice(spec: str, packs: dict[str, np.ndarray], aliases: dict[str, str] | None = None) -> np.ndarray:
    """The (510, 1, 256) pack for a voice name or blend, in any case ("Alloy", "JF_ALPHA": names are lower case);
    an unknown name is named as given, with the known ones. OpenAI's voice names (alloy, ...) stand for the voices
    `aliases` maps them to, by default `openai_voice_map`'s."""
    mixed = None
    for name, weight in parse_blend(spec):
        voice = _voice_of(name, packs, aliases)
        if voice is None:
            raise _unknown(name, list(packs), aliases)
        part = packs[voice].astype(np.float32) * weight
        mixed = part if mixed is None else mixed + part
    assert mixed is not None
    return mixed


def style_for(pack: np.ndarray, n_tokens: int) -> np.ndarray:
    """Kokoro indexes a voice pack by phoneme count: pack[len(phonemes) - 1], shape (1, 256)."""
    index = min(max(n_tokens, 1), pack.shape[0]) - 1
    return np.asarray(pack[index], dtype=np.float32).reshape(1, -1)
