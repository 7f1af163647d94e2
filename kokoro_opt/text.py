"""Text front-end: English text -> normalised text -> Kokoro phonemes -> token ids, in chunks that fit the model.

Shared by calibration, evaluation and the HTTP server. espeak-ng is the copy bundled by espeakng_loader
(as misaki does), so this works offline and never depends on a system install.
"""

from __future__ import annotations

import itertools
import logging
import re
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from kokoro_opt.characters import clean_unicode
from kokoro_opt.errors import UserError
from kokoro_opt.normalize import MONTHS, NEVER_END, NOT_END_BEFORE_NUMBER, normalize_text, read_together
from kokoro_opt.phrasing import phrase_end

__all__ = [
    "CONTEXT_TOKENS",
    "Chunk",
    "chunk_phonemes",
    "chunk_text",
    "normalize_text",
    "phonemize",
    "split_sentences",
    "tokenize",
]

CONTEXT_TOKENS = 510  # Kokoro's 512 positions minus the two 0 pad tokens
JOB_TOKENS = 200  # the largest job the server merges pieces into: a few sentences
MIN_FIRST_WORDS = 3  # a first chunk may end at a comma only after this many words (not at a lone "Well,")


@dataclass(frozen=True)
class Chunk:
    text: str  # the original text span (not normalised), for captions
    phonemes: str
    token_ids: list[int]  # without the 0 pads, len <= max_tokens


# Kokoro's pause and quote symbols: a chunk of these alone is spoken as a breath, so it has nothing to say
_PAUSES = frozenset(' ;:,.!?¡¿—…"«»“”()')


def says_something(chunk: Chunk) -> bool:
    """Whether a chunk has a sound besides pauses ("..." or "?!" alone do not; "%" and "5." do)."""
    return bool(chunk.token_ids) and any(symbol not in _PAUSES for symbol in chunk.phonemes)


Span = tuple[int, int]
Splitter = Callable[[str, int, int], list[Span]]

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


# ---- splitting ------------------------------------------------------------------------------------------

_CLOSERS = "\"”’')]"
_CLOSE = re.escape(_CLOSERS)  # for use inside [...]
# blank lines end headings too (Windows' line ends and the Unicode paragraph separator as well)
_SENTENCE_END = re.compile(rf"[.!?;:…]+[{_CLOSE}]*(?=\s|$)|\r?\n[ \t]*\r?\n|\u2029")
_CLAUSE_END = re.compile(rf"[,;:—–]+[{_CLOSE}]*(?=\s)|—")
_PHONEME_END = re.compile(rf"[.!?;:…]+[{_CLOSE}]*(?=\s|$)")
_WORD = re.compile(r"\S+")
_AFTER_NUMBER = re.compile(r"(?i)(?:[ap]\.?m\.?|[a-z°%]{1,3}(?:/h)?|[€£]|thousand|million|billion|trillion)[^\w\s]*")
_MONTHS = NOT_END_BEFORE_NUMBER | {m.lower() for m in MONTHS}
_NEXT = re.compile(r"\s*(\S)")
_WORD_BEFORE = re.compile(r"[\w.'’-]*$")
_INITIALS = re.compile(r"[A-Z]|(?:[A-Za-z]\.)+[A-Z]")  # "J." / "U.S." / "U.S.A."


def _trimmed(text: str, bounds: list[int]) -> list[Span]:
    spans = []
    for a, b in itertools.pairwise(bounds):
        while a < b and text[a].isspace():
            a += 1
        while b > a and text[b - 1].isspace():
            b -= 1
        if a < b:
            spans.append((a, b))
    return spans


def _is_sentence_end(text: str, m: re.Match[str]) -> bool:
    """Only a lone '.' is ambiguous: abbreviations, initials and 'etc. and' do not end a sentence."""
    if m.group(0).rstrip(_CLOSERS) != ".":
        return True
    nxt = _next_char(text, m.end(), len(text))
    if not nxt:
        return True
    found = _WORD_BEFORE.search(text[max(0, m.start() - 40) : m.start()])  # a window: no quadratic scans
    word = found.group(0) if found else ""
    if word.lower() in NEVER_END or _INITIALS.fullmatch(word):
        return False
    if word.lower() in NOT_END_BEFORE_NUMBER and nxt.isdigit():
        return False
    return not nxt.islower()


def _next_char(text: str, pos: int, end: int) -> str:
    """The next non-space character in text[pos:end], or ''."""
    found = _NEXT.match(text, pos, end)
    return found.group(1) if found else ""


def _sentence_spans(text: str, start: int, end: int) -> list[Span]:
    bounds = [start]
    for m in _SENTENCE_END.finditer(text, start, end):
        if m.group(0)[0] in "\r\n\u2029":
            bounds.append(m.start())
        elif _is_sentence_end(text, m):
            bounds.append(m.end())
    return _trimmed(text, [*bounds, end])


def _clause_spans(text: str, start: int, end: int) -> list[Span]:
    bounds = [start]
    for m in _CLAUSE_END.finditer(text, start, end):
        # "March 3, 2024" / "1, 2, 3": a comma between numbers is not a pause worth splitting at
        if m.group(0).startswith(",") and text[m.start() - 1 : m.start()].isdigit() and _next_char(text, m.end(), end).isdigit():
            continue
        bounds.append(m.end())
    return _trimmed(text, [*bounds, end])


def _glued(prev: str, word: str) -> bool:
    """Word pairs that normalisation reads together ("3:30 pm", "5 km", "March 3", "Dr. Smith"): never split."""
    if prev[-1:].isdigit() and _AFTER_NUMBER.fullmatch(word):
        return True
    key = prev.rstrip(".,").lower()
    if key.isdigit() and prev.endswith(",") and re.fullmatch(r"\d{4}\W*", word):  # "March 3, 2024"
        return True
    return (prev.endswith(".") and key in NEVER_END) or (key in _MONTHS and word[:1].isdigit())


def _word_spans(text: str, start: int, end: int) -> list[Span]:
    spans: list[Span] = []
    prev = ""
    together = read_together(text[start:end])  # a phone number, "25 December 2023": cut, each part reads otherwise
    for m in _WORD.finditer(text, start, end):
        if spans and (_glued(prev, m.group(0)) or any(a < m.start() - start < b for a, b in together)):
            spans[-1] = (spans[-1][0], m.end())
        else:
            spans.append(m.span())
        prev = m.group(0)
    return spans


def _plain_word_spans(text: str, start: int, end: int) -> list[Span]:
    return [m.span() for m in _WORD.finditer(text, start, end)]  # for a glued group that alone is too long


def _phoneme_sentence_spans(text: str, start: int, end: int) -> list[Span]:
    return _trimmed(text, [start, *(m.end() for m in _PHONEME_END.finditer(text, start, end)), end])


def split_sentences(text: str) -> list[str]:
    """Sentences (original text) ending at . ! ? ; : … or a blank line; not after abbreviations, initials, decimals."""
    return [text[a:b] for a, b in _sentence_spans(text, 0, len(text))]


# ---- chunking -------------------------------------------------------------------------------------------


class _Chunker:
    """Packs spans of `text` into chunks, measuring each candidate by phonemizing it as a whole."""

    def __init__(
        self, text: str, vocab: dict[str, int], phonemes_of: Callable[[str], str], splitters: Sequence[Splitter]
    ) -> None:
        self.text, self.vocab, self.phonemes_of, self.splitters = text, vocab, phonemes_of, splitters

    def chunk(self, a: int, b: int) -> Chunk:
        ps = self.phonemes_of(self.text[a:b])
        return Chunk(self.text[a:b], ps, tokenize(ps, self.vocab))

    def fit(self, spans: list[Span], i: int, limit: int) -> tuple[int, Chunk] | None:
        """The longest run spans[i..j] that fits in `limit` tokens, or None if spans[i] alone does not."""

        def attempt(j: int) -> Chunk | None:
            c = self.chunk(spans[i][0], spans[j][1])
            return c if len(c.token_ids) <= limit else None

        if (chunk := attempt(i)) is None:
            return None
        good, bad, step = i, len(spans), 1
        # Gallop then bisect: O(log n) phonemizer calls per chunk even for a 1000-word sentence.
        while good + step < len(spans):
            if (c := attempt(good + step)) is None:
                bad = good + step
                break
            good, chunk, step = good + step, c, step * 2
        while bad - good > 1:
            mid = (good + bad) // 2
            if (c := attempt(mid)) is None:
                bad = mid
            else:
                good, chunk = mid, c
        return good, chunk

    def pack(self, spans: list[Span], limit: int, level: int = 0) -> list[Chunk]:
        chunks: list[Chunk] = []
        i = 0
        while i < len(spans):
            if (found := self.fit(spans, i, limit)) is None:
                chunks.extend(self.split(spans[i], limit, level))
                i += 1
            else:
                j, chunk = found
                chunks.append(chunk)
                i = j + 1
        return chunks

    def split(self, span: Span, limit: int, level: int) -> list[Chunk]:
        """A span too long on its own: split at the next finer boundaries (clauses, then words)."""
        for k in range(level, len(self.splitters)):
            parts = self.splitters[k](self.text, *span)
            if len(parts) > 1:
                return self.pack(parts, limit, k + 1)
        # A single "word" longer than the limit (a long URL, a digit string): cut its phoneme stream.
        whole = self.chunk(*span)
        chunks, piece, count = [], "", 0
        for ch in whole.phonemes:
            if ch in self.vocab and count == limit:
                chunks.append(Chunk(whole.text if not chunks else "", piece, tokenize(piece, self.vocab)))
                piece, count = "", 0
            piece += ch
            count += ch in self.vocab
        chunks.append(Chunk(whole.text if not chunks else "", piece, tokenize(piece, self.vocab)))
        return chunks

    def first(self, sentence: Span, limit: int, word_limit: int) -> tuple[int, Chunk] | None:
        """A small first chunk: up to the first clause boundary with a few words, else as many words as fit
        (at least the first word, if that alone fits `word_limit`: a word is never cut for latency's sake)."""
        a, end = sentence
        for _, b in _clause_spans(self.text, a, end):
            c = self.chunk(a, b)
            if len(c.token_ids) > limit:
                break
            if b == end or sum(any(ch.isalnum() for ch in w) for w in self.text[a:b].split()) >= MIN_FIRST_WORDS:
                return b, c
        words = _word_spans(self.text, a, end)
        found = self.fit(words, 0, limit) or self.fit(words[:1], 0, word_limit)
        if found is None or found[0] == len(words) - 1:
            return (words[found[0]][1], found[1]) if found else None
        j = phrase_end([self.text[s:e] for s, e in words], found[0], MIN_FIRST_WORDS)  # not "... climbed the"
        return words[j][1], found[1] if j == found[0] else self.chunk(a, words[j][1])


def _check(vocab: dict[str, int], **limits: int) -> None:
    if not vocab:
        raise UserError("the phoneme vocab is empty", "pass Kokoro's vocab (phoneme symbol -> id) from its config.json")
    for name, value in limits.items():
        if not isinstance(value, int) or value < 1:
            raise UserError(f"{name} must be a positive integer, got {value!r}", "use e.g. 40 / 200 / 510")
    if limits.get("max_tokens", 0) > CONTEXT_TOKENS:
        raise UserError(f"max_tokens={limits['max_tokens']} exceeds Kokoro's context", f"use at most {CONTEXT_TOKENS} tokens")


def chunk_text(
    text: str,
    vocab: dict[str, int],
    first_chunk_tokens: int | None = 40,
    chunk_tokens: int = JOB_TOKENS,
    max_tokens: int = CONTEXT_TOKENS,
) -> list[Chunk]:
    """Split text for synthesis: a small first chunk (fast time-to-first-audio; only a first word longer than
    `first_chunk_tokens` makes it bigger; None: none, as for a whole file), then whole sentences packed up to
    `chunk_tokens`; over-long sentences split at clauses, then words. No chunk exceeds `max_tokens` and no text
    is dropped."""
    first_limit = {} if first_chunk_tokens is None else {"first_chunk_tokens": first_chunk_tokens}
    _check(vocab, chunk_tokens=chunk_tokens, max_tokens=max_tokens, **first_limit)
    if not isinstance(text, str):
        raise UserError(f"text must be a string, got {type(text).__name__}", "pass the text to speak as str")
    sentences = _sentence_spans(text, 0, len(text))
    if not sentences:
        return []
    chunker = _Chunker(text, vocab, phonemize, (_clause_spans, _word_spans, _plain_word_spans))
    chunks: list[Chunk] = []
    rest = sentences
    # The first sentence with a word (a leading "..." alone is no useful first audio) gives the small first chunk.
    k = next((i for i, (a, b) in enumerate(sentences) if any(ch.isalnum() for ch in text[a:b])), None)
    if k is not None and first_chunk_tokens is not None:
        head = (sentences[0][0], sentences[k][1])
        limits = min(first_chunk_tokens, max_tokens), min(chunk_tokens, max_tokens)
        if (first := chunker.first(head, *limits)) is not None:
            end, chunk = first
            chunks.append(chunk)
            rest = _trimmed(text, [end, head[1]]) + sentences[k + 1 :]
    chunks += chunker.pack(rest, min(chunk_tokens, max_tokens))
    return [c for c in chunks if says_something(c)]


def chunk_phonemes(phonemes: str, vocab: dict[str, int], max_tokens: int = CONTEXT_TOKENS) -> list[Chunk]:
    """Split an already-phonemized string at sentence, then clause, then word boundaries (text = phoneme span)."""
    _check(vocab, max_tokens=max_tokens)
    chunker = _Chunker(phonemes, vocab, lambda s: s, (_clause_spans, _word_spans))
    chunks = chunker.pack(_phoneme_sentence_spans(phonemes, 0, len(phonemes)), max_tokens)
    return [c for c in chunks if says_something(c)]
