"""Voice packs: lookup, blending (`jf_alpha(2)+jm_kumo(1)`) and style selection."""

from __future__ import annotations

import re

import numpy as np

from kokoro_opt.errors import UserError

SAMPLE_RATE = 24_000

_TERM = re.compile(r"^\s*([A-Za-z0-9_\-]+)\s*(?:\(\s*([0-9]*\.?[0-9]+)\s*\))?\s*$")


def parse_blend(spec: str) -> list[tuple[str, float]]:
    """`a(2)+b(1)` -> [(a, 2/3), (b, 1/3)]; a bare name has weight 1."""
    terms = []
    for part in spec.split("+"):
        match = _TERM.match(part)
        if not match:
            raise UserError(f"cannot read voice '{spec}'", "write a name or a blend like jf_alpha(2)+jm_kumo(1)")
        weight = float(match.group(2)) if match.group(2) else 1.0
        terms.append((match.group(1), weight))
    total = sum(w for _, w in terms)
    if total <= 0:
        raise UserError(f"voice blend '{spec}' has zero total weight", "give at least one voice a positive weight")
    return [(name, w / total) for name, w in terms]


def blend_voice(spec: str, packs: dict[str, np.ndarray], aliases: dict[str, str] | None = None) -> np.ndarray:
    """The (510, 1, 256) pack for a voice name or blend; unknown names list the known ones."""
    aliases = aliases or {}
    mixed = None
    for name, weight in parse_blend(spec):
        name = aliases.get(name, name)
        if name not in packs:
            raise UserError(f"unknown voice '{name}'", f"choose from: {', '.join(sorted(packs))}")
        part = packs[name].astype(np.float32) * weight
        mixed = part if mixed is None else mixed + part
    assert mixed is not None
    return mixed


def style_for(pack: np.ndarray, n_tokens: int) -> np.ndarray:
    """Kokoro indexes a voice pack by phoneme count: pack[len(phonemes) - 1], shape (1, 256)."""
    index = min(max(n_tokens, 1), pack.shape[0]) - 1
    return np.asarray(pack[index], dtype=np.float32).reshape(1, -1)
