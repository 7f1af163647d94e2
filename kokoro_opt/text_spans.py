"""Where text may be cut: sentences, clauses and words, as spans of the text (chunking.py packs them into chunks).

A cut never falls where normalisation reads two words as one ("5 km", "March 3, 2024", "Dr. Smith"), and a
lone "." ends a sentence only where it is no abbreviation, initial or decimal point.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Callable

from kokoro_opt.normalize import MONTHS, NEVER_END, NOT_END_BEFORE_NUMBER, read_together
from kokoro_opt.number_words import SCALE_LETTERS, SPACED_UNITS, UNITS

__all__ = [
    "CLAUSE_MARKS",
    "Span",
    "Splitter",
    "clause_spans",
    "ends_at_clause",
    "last_words",
    "phoneme_sentence_spans",
    "plain_word_spans",
    "sentence_spans",
    "split_sentences",
    "trimmed",
    "word_spans",
]

Span = tuple[int, int]
Splitter = Callable[[str, int, int], list[Span]]

_CLOSERS = "\"”’')]"
_CLOSE = re.escape(_CLOSERS)  # for use inside [...]
# blank lines end headings too (Windows' line ends and the Unicode paragraph separator as well)
_SENTENCE_END = re.compile(rf"[.!?;:…]+[{_CLOSE}]*(?=\s|$)|\r?\n[ \t]*\r?\n|\u2029")
CLAUSE_MARKS = ",;:—–"  # a cut after one is at a clause, where a speaker pauses
_CLAUSE_END = re.compile(rf"[{CLAUSE_MARKS}]+[{_CLOSE}]*(?=\s)|—")
_PHONEME_END = re.compile(rf"[.!?;:…]+[{_CLOSE}]*(?=\s|$)")
_WORD = re.compile(r"\S+")
# what normalisation reads with the number before it: units, scales, a.m. / p.m. ("2 of", "40 to": words of their own)
_UNITS_AFTER = "|".join(re.escape(u) for u in sorted({*UNITS, *SPACED_UNITS, *SCALE_LETTERS}, key=len, reverse=True))
_AFTER_NUMBER = re.compile(rf"(?:(?i:[ap]\.?m\.?|thousand|million|billion|trillion)|{_UNITS_AFTER}|[€£%])[^\w\s]*")
_MONTHS = NOT_END_BEFORE_NUMBER | {m.lower() for m in MONTHS}
_NEXT = re.compile(r"\s*(\S)")
_WORD_BEFORE = re.compile(r"[\w.'’-]*$")
_INITIALS = re.compile(r"[A-Z]|(?:[A-Za-z]\.)+[A-Z]")  # "J." / "U.S." / "U.S.A."


def trimmed(text: str, bounds: list[int]) -> list[Span]:
    spans = []
    for a, b in itertools.pairwise(bounds):
        while a < b and text[a].isspace():
            a += 1
        while b > a and text[b - 1].isspace():
            b -= 1
        if a < b:
            spans.append((a, b))
    return spans


def ends_at_clause(text: str) -> bool:
    """Whether `text` ends with a clause mark, closing quotes and brackets aside (or has nothing to end)."""
    last = text.rstrip().rstrip(_CLOSERS)[-1:]
    return not last or last in CLAUSE_MARKS


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


def sentence_spans(text: str, start: int, end: int) -> list[Span]:
    bounds = [start]
    for m in _SENTENCE_END.finditer(text, start, end):
        if m.group(0)[0] in "\r\n\u2029":
            bounds.append(m.start())
        elif _is_sentence_end(text, m):
            bounds.append(m.end())
    return trimmed(text, [*bounds, end])


def clause_spans(text: str, start: int, end: int) -> list[Span]:
    bounds = [start]
    for m in _CLAUSE_END.finditer(text, start, end):
        # "March 3, 2024" / "1, 2, 3": a comma between numbers is not a pause worth splitting at
        if m.group(0).startswith(",") and text[m.start() - 1 : m.start()].isdigit() and _next_char(text, m.end(), end).isdigit():
            continue
        bounds.append(m.end())
    return trimmed(text, [*bounds, end])


def _glued(prev: str, word: str) -> bool:
    """Word pairs that normalisation reads together ("3:30 pm", "5 km", "March 3", "Dr. Smith"): never split."""
    if prev[-1:].isdigit() and _AFTER_NUMBER.fullmatch(word):
        return True
    key = prev.rstrip(".,").lower()
    if key.isdigit() and prev.endswith(",") and re.fullmatch(r"\d{4}\W*", word):  # "March 3, 2024"
        return True
    return (prev.endswith(".") and key in NEVER_END) or (key in _MONTHS and word[:1].isdigit())


def word_spans(text: str, start: int, end: int) -> list[Span]:
    spans: list[Span] = []
    prev = ""
    together = sorted(read_together(text[start:end]))  # a phone number, "25 December 2023": cut, each part reads otherwise
    k, reach = 0, -1  # the furthest end of the groups that start before the word: one pass, not a scan per word
    for m in _WORD.finditer(text, start, end):
        while k < len(together) and together[k][0] < m.start() - start:
            reach, k = max(reach, together[k][1]), k + 1
        if spans and (_glued(prev, m.group(0)) or m.start() - start < reach):
            spans[-1] = (spans[-1][0], m.end())
        else:
            spans.append(m.span())
        prev = m.group(0)
    return spans


def last_words(text: str) -> str:
    """The last word of `text` as the chunker cuts words: with the words read together with it ("World War I")."""
    spans = word_spans(text, 0, len(text))
    return text[spans[-1][0] : spans[-1][1]] if spans else ""


def plain_word_spans(text: str, start: int, end: int) -> list[Span]:
    return [m.span() for m in _WORD.finditer(text, start, end)]  # for a glued group that alone is too long


def phoneme_sentence_spans(text: str, start: int, end: int) -> list[Span]:
    return trimmed(text, [start, *(m.end() for m in _PHONEME_END.finditer(text, start, end)), end])


def split_sentences(text: str) -> list[str]:
    """Sentences (original text) ending at . ! ? ; : … or a blank line; not after abbreviations, initials, decimals."""
    return [text[a:b] for a, b in sentence_spans(text, 0, len(text))]
