"""Text front-end: English text -> normalised text -> Kokoro phonemes -> token ids (chunking.py cuts text into
chunks that fit the model).

Shared by calibration, evaluation and the HTTP server. espeak-ng is the copy bundled by espeakng_loader
(as misaki does), so this works offline and never depends on a system install.
"""

from __future__ import annotations

import logging
import re
import threading
from functools import lru_cache
from typing import Any

from kokoro_opt.characters import clean_unicode
from kokoro_opt.errors import UserError
from kokoro_opt.normalize import normalize_text

__all__ = ["CONTEXT_TOKENS", "normalize_text", "phonemize", "tokenize", "utterance_tokens"]

CONTEXT_TOKENS = 510  # Kokoro's 512 positions minus the two 0 pad tokens
JOB_TOKENS = 200  # the largest job the server merges pieces into: a few sentences

# espeak-ng keeps global state and is not thread-safe; the server phonemizes from several threads.
_LOCK = threading.Lock()
_LOG = logging.getLogger("kokoro_opt.espeak")
_LOG.setLevel(logging.ERROR)  # phonemizer warns about every word-count mismatch; those are harmless here
_MISAKI_OPTIONS: dict[str, Any] = {"preserve_punctuation": True, "with_stress": True, "tie": "^"}  # as misaki/espeak.py


@lru_cache(maxsize=8)
def _backend(lang: str) -> Any:
    # Same setup as misaki/espeak.py: the bundled library and data, never a system espeak.
    import espeakng_loader
    from phonemizer.backend import EspeakBackend
    from phonemizer.backend.espeak.wrapper import EspeakWrapper

    EspeakWrapper.set_library(espeakng_loader.get_library_path())
    EspeakWrapper.set_data_path(espeakng_loader.get_data_path())
    try:
        # remove-flags: a foreign word ("café") must not come back as "(fr)...(en)" and be read as letters.
        return EspeakBackend(lang, language_switch="remove-flags", words_mismatch="ignore", logger=_LOG, **_MISAKI_OPTIONS)
    except RuntimeError as exc:
        raise UserError(f"espeak-ng cannot phonemize language {lang!r}: {exc}", "use e.g. 'en-us' or 'en-gb'") from exc


def _kokoro_english(ps: str, british: bool) -> str:
    """espeak IPA -> Kokoro's symbols; mirrors misaki's EspeakFallback (what Kokoro's own pipeline does)."""
    from misaki.espeak import EspeakFallback

    for old, new in EspeakFallback.E2M:  # diphthongs -> A I O W Y, 'r' -> 'ɹ', 'ɚ' -> 'əɹ', 'ɐ' -> 'ə', ...
        ps = ps.replace(old, new)
    ps = re.sub(r"(\S)\u0329", r"ᵊ\1", ps).replace("\u0329", "")  # syllabic consonants
    if british:
        ps = ps.replace("e^ə", "ɛː").replace("iə", "ɪə").replace("ə^ʊ", "Q")
    else:
        ps = ps.replace("o^ʊ", "O").replace("ɜːɹ", "ɜɹ").replace("ɜː", "ɜɹ").replace("ɪə", "iə").replace("ː", "")
    # Kokoro v1.0 symbols (misaki version None): flap 'ɾ' is 'T', glottal stop 'ʔ' is 't'.
    ps = ps.replace("o", "ɔ").replace("ɾ", "T").replace("ʔ", "t")
    # Beyond misaki: 'ɚɹ' ("et cetera") becomes 'əɹɹ'; Kokoro's lexicon never has a doubled 'ɹ'.
    return re.sub("ɹ+", "ɹ", ps.replace("^", ""))


@lru_cache(maxsize=8)
def _other_language(lang: str) -> Any:
    from misaki.espeak import EspeakG2P

    try:
        return EspeakG2P(language=lang)
    except RuntimeError as exc:
        raise UserError(f"espeak-ng cannot phonemize language {lang!r}: {exc}", "use e.g. 'en-us' or 'en-gb'") from exc


# espeak drops what it is given here, unsaid: a word's letters past ~150, and single-letter words repeated more
# than three times ("x x x x" is said "x x x"). A long word is read in pieces, repeated letters as a list.
_LONG_WORD = re.compile(r"\w{61,}")
_REPEATED_LETTER = re.compile(r"(?i)\b(\w)(?:\s+\1\b){3,}")  # "x X x X": the same letter to espeak


def _nothing_dropped(text: str) -> str:
    text = _LONG_WORD.sub(lambda m: " ".join(m[0][i : i + 30] for i in range(0, len(m[0]), 30)), text)
    return _REPEATED_LETTER.sub(lambda m: ", ".join(m[0].split()), text)


def _phonemize(text: str, lang: str) -> str:
    english = lang.startswith("en")
    norm = _nothing_dropped(normalize_text(text) if english else clean_unicode(text))
    if not norm:
        return ""
    with _LOCK:
        if english:
            out = _backend(lang).phonemize([norm])
            ps = _kokoro_english(out[0] if out else "", british=lang.startswith("en-gb"))
        else:
            ps = _other_language(lang)(norm)[0]
    return re.sub(r"\s+", " ", ps).strip()


# chunk_text measures the same spans repeatedly and the server sees repeated texts; long texts stay uncached
# so the cache stays a few MB.
_phonemize_cached = lru_cache(maxsize=1024)(_phonemize)
_CACHE_MAX_CHARS = 4000


def clear_phoneme_cache() -> None:
    """Forget every phonemized text: a timed request then phonemizes as a server does a text it has not seen."""
    _phonemize_cached.cache_clear()


def phonemize(text: str, lang: str = "en-us") -> str:
    """Normalise (English rules for 'en-*') and phonemize with espeak-ng into Kokoro's phoneme symbols."""
    if not isinstance(text, str):
        raise UserError(f"text must be a string, got {type(text).__name__}", "pass the text to speak as str")
    lang = lang.strip().lower()
    return _phonemize_cached(text, lang) if len(text) <= _CACHE_MAX_CHARS else _phonemize(text, lang)


def tokenize(phonemes: str, vocab: dict[str, int]) -> list[int]:
    """Phoneme string -> token ids; symbols the model does not know are dropped."""
    get = vocab.get
    return [i for i in map(get, phonemes) if i is not None]


def utterance_tokens(text: str, vocab: dict[str, int], limit: int = CONTEXT_TOKENS) -> list[int]:
    """One utterance's token ids, whole (not chunked), at most `limit` of them (the model's context)."""
    return tokenize(phonemize(text), vocab)[:limit]
