"""Where text is cut for synthesis: sentences, clauses, words, and the small first chunk a stream starts with.

Every chunk is measured by phonemizing it as a whole (text.py), so no chunk exceeds the model's context and no
text is dropped; a cut at words inside a sentence ends on a word that can end a phrase where one is near
(phrasing.py).
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

from kokoro_opt.characters import lone_surrogate
from kokoro_opt.errors import UserError
from kokoro_opt.phrasing import phrase_end
from kokoro_opt.text import CONTEXT_TOKENS, JOB_TOKENS, phonemize, tokenize
from kokoro_opt.text_spans import (
    Span,
    Splitter,
    clause_spans,
    ends_at_clause,
    phoneme_sentence_spans,
    plain_word_spans,
    sentence_spans,
    trimmed,
    word_spans,
)

__all__ = [
    "CONTEXT_WORDS",
    "Chunk",
    "chunk_phonemes",
    "chunk_text",
    "cut_phonemes",
    "says_something",
]

MIN_FIRST_WORDS = 3  # a first chunk may end at a comma only after this many words (not at a lone "Well,")
SPACE = " "  # the vocab's word boundary
# words a server feeds on each side of a cut at words (`chunk_text`'s context_words; serve/plan.Piece):
# docs/measurements/2026-12-07-first-chunk-endings.md
CONTEXT_WORDS = 2


@dataclass(frozen=True)
class Chunk:
    """A span of text to synthesize. A chunk cut at words inside its sentence may carry the words around the cut
    (`chunk_text`'s `context_words`): token ids its front reads but that are not its speech. `ahead`: a space and
    the words after it; `behind`: the words before it and a space."""

    text: str  # the original text span (not normalised), for captions
    phonemes: str
    token_ids: list[int]  # without the 0 pads, len <= max_tokens
    behind: list[int] = field(default_factory=list)
    ahead: list[int] = field(default_factory=list)
    in_word: bool = False  # it ends inside a spoken word (`cut_phonemes`): the next chunk goes on with that word


# Kokoro's pause and quote symbols: a chunk of these alone is spoken as a breath, so it has nothing to say
_PAUSES = frozenset(' ;:,.!?¡¿—…"«»“”()')


def says_something(chunk: Chunk) -> bool:
    """Whether a chunk has a sound besides pauses ("..." or "?!" alone do not; "%" and "5." do)."""
    return bool(chunk.token_ids) and any(symbol not in _PAUSES for symbol in chunk.phonemes)


# ---- chunking -------------------------------------------------------------------------------------------


def cut_phonemes(phonemes: str, vocab: dict[str, int], limit: int) -> list[tuple[str, bool]]:
    """Phonemes of one written word over `limit` tokens ("1,250" spoken as four words, a URL) in parts of at most
    `limit` tokens, each ending after the last space that fits (spoken with the part before it, as at every cut), or
    before a space the limit falls on (the space dropped: a job merging the parts puts it back, `plan.take_job`); inside
    a spoken word only where a part has no space. Each part with whether it ends inside a word, so a merge adds no
    space there: merged, the parts are the phonemes as they were."""
    parts: list[tuple[str, bool]] = []
    start = 0
    while start < len(phonemes):
        count, end, after_space = 0, len(phonemes), None
        for k in range(start, len(phonemes)):
            if phonemes[k] not in vocab:
                continue
            if count == limit:
                end = k
                break
            count += 1
            if phonemes[k] == SPACE and k > start:
                after_space = k + 1
        if end == len(phonemes):
            return [*parts, (phonemes[start:], False)]
        if after_space is not None:
            parts.append((phonemes[start:after_space], False))
            start = after_space
        else:
            on_space = phonemes[end] == SPACE
            parts.append((phonemes[start:end], not on_space))
            start = end + on_space
    return parts


class _Chunker:
    """Packs spans of `text` into chunks, measuring each candidate by phonemizing it as a whole. `phrasing`: a cut
    at words ends on a word that can end a phrase (English text; not for phoneme strings)."""

    def __init__(
        self,
        text: str,
        vocab: dict[str, int],
        phonemes_of: Callable[[str], str],
        splitters: Sequence[Splitter],
        phrasing: bool = False,
    ) -> None:
        self.text, self.vocab, self.phonemes_of, self.splitters = text, vocab, phonemes_of, splitters
        self.phrasing = phrasing
        self.word_cuts: dict[int, int] = {}  # id(chunk) -> where it ends, for chunks cut at words inside a sentence
        self.ahead_limits: dict[int, int] = {}  # id(chunk) -> the most context tokens after it (a first chunk's)

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
                at_words = level > 0 and self.splitters[level - 1] in (word_spans, plain_word_spans)
                if self.phrasing and at_words and j < len(spans) - 1:  # a cut inside a sentence, keeping at least half its words
                    j, chunk = self.phrase_ending(spans, i, j, chunk, (j - i) // 2 + 1)
                if at_words and j < len(spans) - 1:
                    self.cut_at(chunk, spans[j][1])
                chunks.append(chunk)
                i = j + 1
        return chunks

    def phrase_ending(self, words: list[Span], i: int, j: int, chunk: Chunk, keep: int) -> tuple[int, Chunk]:
        """Words i..j (`chunk`) cut inside their sentence, ended instead on the nearest word that can end a
        phrase, keeping `keep` words: spoken alone, a chunk's last word is drawn out (phrasing.py)."""
        end = i + phrase_end([self.text[a:b] for a, b in words[i : j + 1]], j - i, keep)
        return (j, chunk) if end == j else (end, self.chunk(words[i][0], words[end][1]))

    def split(self, span: Span, limit: int, level: int) -> list[Chunk]:
        """A span too long on its own: split at the next finer boundaries (clauses, then words)."""
        for k in range(level, len(self.splitters)):
            parts = self.splitters[k](self.text, *span)
            if len(parts) > 1:
                return self.pack(parts, limit, k + 1)
        # A single "word" longer than the limit (a long URL, a number normalisation spells out): cut its phonemes.
        whole = self.chunk(*span)
        parts = cut_phonemes(whole.phonemes, self.vocab, limit)
        return [
            Chunk(whole.text if k == 0 else "", part, tokenize(part, self.vocab), in_word=in_word)
            for k, (part, in_word) in enumerate(parts)
        ]

    def first(self, sentence: Span, limit: int, word_limit: int, context_words: int = 0) -> tuple[int, Chunk] | None:
        """A small first chunk: up to the first clause boundary with a few words, else as many words as fit, ending
        on the last of them that can end a phrase, of at least MIN_FIRST_WORDS (`phrase_ending`); at least the first
        word, if that alone fits `word_limit`: a word is never cut for latency's sake. Cut at words with
        `context_words`, the chunk and the words fed after it fit `limit` together: the first front reads both."""
        a, end = sentence
        for _, b in clause_spans(self.text, a, end):
            c = self.chunk(a, b)
            if len(c.token_ids) > limit:
                break
            if b == end or sum(any(ch.isalnum() for ch in w) for w in self.text[a:b].split()) >= MIN_FIRST_WORDS:
                return b, c
        words = word_spans(self.text, a, end)
        budget, best = limit, None
        while (found := self.fit(words, 0, budget) or self.fit(words[:1], 0, word_limit)) is not None:
            j, chunk = found
            if j < len(words) - 1 and self.phrasing:
                j, chunk = self.phrase_ending(words, 0, j, chunk, MIN_FIRST_WORDS)
            if j == len(words) - 1:
                return words[j][1], chunk
            own = len(chunk.token_ids)
            if best is not None and 4 * own < 3 * limit:
                break  # a quarter of the budget is the most a first chunk gives up: the last one, with what context fits
            best = j, chunk
            if j == 0 or own + len(self.ahead(words[j][1], end, context_words)) <= limit:
                break
            budget = own - 1  # its context does not fit beside it: a word or more shorter
        if best is None:
            return None
        j, chunk = best
        self.cut_at(chunk, words[j][1], limit - len(chunk.token_ids))
        return words[j][1], chunk

    def cut_at(self, chunk: Chunk, cut: int, room: int = CONTEXT_TOKENS) -> None:
        """Note that `chunk` ends at `cut`, at words inside its sentence (not at a clause mark), with at most `room`
        context tokens to follow it."""
        if not ends_at_clause(self.text[max(0, cut - 40) : cut]):  # a window: no quadratic scans
            self.word_cuts[id(chunk)] = cut
            self.ahead_limits[id(chunk)] = room

    def word_bound(self, cut: int, limit: int, words: int) -> int:
        """Where to look for `words` words from `cut` towards `limit` (after it or before it): a few hundred characters,
        on a space, not the whole sentence (a 4,000-character one has hundreds of cuts)."""
        reach = (words + 4) * 40
        if limit > cut:
            bound = min(limit, cut + reach)
            while bound < limit and not self.text[bound].isspace():
                bound += 1
            return bound
        bound = max(limit, cut - reach)
        while bound > limit and not self.text[bound - 1].isspace():
            bound -= 1
        return bound

    def ahead(self, cut: int, end: int, words: int, most: int = CONTEXT_TOKENS) -> list[int]:
        """A space and the first `words` words of text[cut:end] as token ids, as many of them as fit `most` tokens
        (none for 0 words)."""
        ids: list[int] = []
        spans = word_spans(self.text, cut, self.word_bound(cut, end, words))[:words]
        for k in range(len(spans), 0, -1):
            ids = [self.vocab[SPACE], *self.chunk(spans[0][0], spans[k - 1][1]).token_ids]
            if len(ids) <= most:
                return ids
        return []

    def behind(self, start: int, cut: int, words: int) -> list[int]:
        """The last `words` words of text[start:cut] and a space as token ids (none for 0 words)."""
        spans = word_spans(self.text, self.word_bound(cut, start, words), cut)[-words:] if words else []
        return [*self.chunk(spans[0][0], spans[-1][1]).token_ids, self.vocab[SPACE]] if spans else []

    def with_context(self, chunks: list[Chunk], sentences: list[Span], words: int, max_tokens: int) -> list[Chunk]:
        """`chunks` with `words` words of their sentence fed on each side of every cut at words inside it, where the
        chunks and their context fit `max_tokens`: on both sides of a cut or on neither (the two jobs' audio meets
        there, runtime/join.py)."""
        out = list(chunks)
        starts = [a for a, _ in sentences]
        for k in range(len(out) - 1):
            cut = self.word_cuts.get(id(chunks[k]))
            if cut is None or not (says_something(out[k]) and says_something(out[k + 1])):  # dropped by `chunk_text`
                continue
            a, b = sentences[bisect.bisect_right(starts, cut) - 1]
            room = min(self.ahead_limits.get(id(chunks[k]), max_tokens), max_tokens - len(out[k].behind) - len(out[k].token_ids))
            ahead, behind = self.ahead(cut, b, words, room), self.behind(a, cut, words)
            if ahead and behind and len(behind) + len(out[k + 1].token_ids) <= max_tokens:
                out[k], out[k + 1] = replace(out[k], ahead=ahead), replace(out[k + 1], behind=behind)
        return out


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
    context_words: int = 0,
) -> list[Chunk]:
    """Split text for synthesis: a small first chunk (fast time-to-first-audio; only a first word longer than
    `first_chunk_tokens` makes it bigger; None: none, as for a whole file), then whole sentences packed up to
    `chunk_tokens`; over-long sentences split at clauses, then words. No chunk exceeds `max_tokens` and no text
    is dropped. `context_words`: each cut at words inside a sentence gives the chunks on its two sides that many
    words of the other as context (`Chunk.behind` / `ahead`): spoken alone, a chunk's end is timed and intoned
    as an utterance's end, its start as an utterance's start (docs/measurements/2026-12-07-first-chunk-endings.md).
    The first chunk and its context then fit `first_chunk_tokens` together."""
    first_limit = {} if first_chunk_tokens is None else {"first_chunk_tokens": first_chunk_tokens}
    _check(vocab, chunk_tokens=chunk_tokens, max_tokens=max_tokens, **first_limit)
    if not isinstance(context_words, int) or context_words < 0 or (context_words and SPACE not in vocab):
        raise UserError(f"context_words must be 0 or more with a vocab that has a space, got {context_words!r}", "use e.g. 2")
    _check_text(text, "text")
    sentences = sentence_spans(text, 0, len(text))
    if not sentences:
        return []
    chunker = _Chunker(text, vocab, phonemize, (clause_spans, word_spans, plain_word_spans), phrasing=True)
    chunks: list[Chunk] = []
    rest = sentences
    # The first sentence with a word (a leading "..." alone is no useful first audio) gives the small first chunk.
    k = next((i for i, (a, b) in enumerate(sentences) if any(ch.isalnum() for ch in text[a:b])), None)
    if k is not None and first_chunk_tokens is not None:
        head = (sentences[0][0], sentences[k][1])
        limits = min(first_chunk_tokens, max_tokens), min(chunk_tokens, max_tokens)
        if (first := chunker.first(head, *limits, context_words)) is not None:
            end, chunk = first
            chunks.append(chunk)
            rest = trimmed(text, [end, head[1]]) + sentences[k + 1 :]
    chunks += chunker.pack(rest, min(chunk_tokens, max_tokens))
    if context_words:
        chunks = chunker.with_context(chunks, sentences, context_words, max_tokens)
    return [c for c in chunks if says_something(c)]


def _check_text(text: object, name: str) -> None:
    """Text is a str of Unicode characters: a lone surrogate (bytes decoded with surrogateescape, JSON's "\\ud800")
    is none, and espeak cannot take it."""
    if not isinstance(text, str):
        raise UserError(f"{name} must be a string, got {type(text).__name__}", f"pass the {name} to speak as str")
    if (position := lone_surrogate(text)) is not None:
        raise UserError(
            f"{name} has an invalid character at position {position} (a lone surrogate, not Unicode text)",
            "decode bytes as UTF-8 before passing them, e.g. data.decode('utf-8', errors='replace')",
        )


def chunk_phonemes(phonemes: str, vocab: dict[str, int], max_tokens: int = CONTEXT_TOKENS) -> list[Chunk]:
    """Split an already-phonemized string at sentence, then clause, then word boundaries (text = phoneme span)."""
    _check(vocab, max_tokens=max_tokens)
    _check_text(phonemes, "phonemes")
    chunker = _Chunker(phonemes, vocab, lambda s: s, (clause_spans, word_spans))
    chunks = chunker.pack(phoneme_sentence_spans(phonemes, 0, len(phonemes)), max_tokens)
    return [c for c in chunks if says_something(c)]
