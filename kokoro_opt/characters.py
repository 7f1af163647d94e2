"""What characters become before the rules read them: Unicode punctuation as the few symbols Kokoro's vocab has,
control characters as spaces, compatibility forms as plain ones, emoji apart. And how much of a text is Latin."""

from __future__ import annotations

import re
import unicodedata

# Curly single quotes/primes -> apostrophe ("don’t" must stay one word), guillemets -> the curly quotes in
# Kokoro's vocab, hyphen look-alikes -> "-", the minus sign -> its word (it is never a hyphen), exotic spaces -> " ",
# invisible characters dropped: variation selectors too, with which espeak kept one word of a name ("❤️": "red").
_UNICODE = {
    **str.maketrans(
        "\u2018\u2019\u201a\u2032\u00b4`\u00ab\u00bb\u201e\u2033\u2010\u2011\u2012\u2015\u00a0\u2007\u2009\u200a\u202f\t",
        "''''''\u201c\u201d\u201c\"---\u2014      ",
        "\u200b\ufeff\u00ad\ufe0e\ufe0f",
    ),
    0x2212: " minus ",  # between digits a range's dash: clean_unicode puts "-" there first
}

# C0, DEL and C1 but line ends: a blank line ends a heading (text_spans.py)
_CONTROLS = {c: " " for c in (*range(0x20), 0x7F, *range(0x80, 0xA0)) if chr(c) not in "\n\r"}


def _compatible(c: str) -> bool:
    """Full-width ASCII (typed with CJK input methods) and circled or parenthesized numbers and letters: read as
    the plain characters they stand for (NFKC), which espeak would otherwise name letter by letter or drop."""
    code = ord(c)
    return 0xFF01 <= code <= 0xFF5E or 0x2460 <= code <= 0x24FF or 0x3251 <= code <= 0x32BF


def _emoji_apart(text: str) -> str:
    """A space between two symbols in a row ("😂😂", "✅✅"): espeak reads a run of them as one word and keeps
    only the first word of each name ("facefaceface"), and so it did with a skin tone ("👍🏽": "thumbs medium"),
    which is named apart ("thumbs up medium skin tone"). A flag's second letter stays with its first; symbols
    joined by a zero-width joiner are one."""
    out: list[str] = []
    symbol = half_flag = False  # the last character (skin tones aside) was a symbol; an odd letter
    for c in text:
        code = ord(c)
        if 0x1F3FB <= code <= 0x1F3FF:
            out.append(" " + c)
            continue
        letter = 0x1F1E6 <= code <= 0x1F1FF  # regional indicators: two make a flag
        is_symbol = unicodedata.category(c) == "So"
        if symbol and is_symbol and not (letter and half_flag):
            out.append(" ")
        half_flag = letter and not half_flag
        symbol = is_symbol
        out.append(c)
    return "".join(out)


_EQUATION_MINUS = re.compile(r"(?:(?<=[\d)])|(?<![A-Za-z][A-Za-z])(?<=[A-Za-z])) - (?=(?:\d+(?:\.\d+)?|[A-Za-z]\b|\() ?=(?!=))")


def clean_unicode(text: str) -> str:
    """Unicode quotes, dashes and spaces -> the few symbols Kokoro's vocab has; control characters -> spaces
    (espeak reads NUL as the end of the text: "hello\x00world" would say "hello")."""
    text = re.sub(r"(?<=\d)\u2212(?=\d)", "-", text)  # "10−20", from a PDF: a range's dash; `_range` reads it
    text = unicodedata.normalize("NFC", text.translate(_CONTROLS)).translate(_UNICODE)
    if any(map(_compatible, text)):
        text = "".join(unicodedata.normalize("NFKC", c) if _compatible(c) else c for c in text)
    text = _emoji_apart(text)
    text = re.sub(r"(?<=\d)\s*\u2013\s*(?=\d)", " to ", text)  # 1990–1995
    # a blank line (a heading's end) is a stop where nothing ends the line: pieces hold several sentences
    text = re.sub(r"(?<=[^\s.!?;:…,])[ \t]*(?:\r?\n[ \t]*){2,}|(?<=[^\s.!?;:…,])[ \t]*\u2029", ". ", text)
    text = re.sub(r"\s+", " ", text.replace("\u2013", "\u2014"))  # one space: a run of them made the next rule quadratic
    # "5 - 3 = 2", "x - 1 = y": an equation's minus between numbers or one-letter names, not a pause
    text = _EQUATION_MINUS.sub(" minus ", text)
    text = re.sub(r"\s+-{1,2}\s+|--", " \u2014 ", text)
    text = re.sub(r"\.{3,}|(?:\.\s){2,}\.", "\u2026", text)
    return re.sub(r"\s+", " ", text).strip()


def lone_surrogate(text: str) -> int | None:
    """Where `text` holds a lone surrogate, or None: no Unicode text, though Python strings carry them (bytes decoded
    with surrogateescape, JSON's "\\ud800"), and espeak cannot take one."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        return exc.start
    return None


def latin_share(text: str) -> float:
    """The share of the text's letters that are Latin (1.0 without letters): Kokoro-82M here speaks English, and
    espeak reads another script by its letters' names ("Japanese letter")."""
    letters = [c for c in text if c.isalpha()]
    return sum(unicodedata.name(c, "").startswith("LATIN") for c in letters) / len(letters) if letters else 1.0
