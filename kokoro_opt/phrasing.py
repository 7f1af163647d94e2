"""Where a chunk cut inside a sentence may end: after a word that can end a phrase.

A chunk spoken alone is timed like a whole sentence, so its last word gets the final lengthening
(kokoro_opt.first_chunk). On a content word that is where a reader pauses anyway; on "the", "of" or "their"
it is a drawl no reader makes: spoken alone, such a word lasted up to 12x its length inside the sentence
(docs/measurements/2026-12-07-first-chunk-endings.md). English function words; other text never matches.
"""

from __future__ import annotations

from collections.abc import Sequence

_GROUPS = (
    # articles, determiners and possessives
    "a an the this that these those every each either neither some any no such my your his her its our their whose",
    # prepositions
    "of to in on at by for with from into onto over under about as than through between across after before during "
    "without within upon toward towards against among around behind below beneath beside beyond till until via per",
    # conjunctions and relative words
    "and or but nor if because although though while whereas unless whether which who whom where when",
    # auxiliaries and copulas
    "is are was were be been being am has have had do does did will would shall should can could may might must",
    # subject pronouns and words that lean on the next one ("up", "so", "it" often end a phrase: not listed)
    "i we he she they not very",
)
FUNCTION_WORDS = frozenset(word for group in _GROUPS for word in group.split())
_EDGES = "\"'“”‘’()[]{}«»,;:.!?"


def phrase_end(words: Sequence[str], last: int, keep: int) -> int:
    """The index of the word a chunk of `words[0..last]` should end at: `last`, or the nearest word before it
    that is not a function word, keeping at least `keep` words; `last` where every candidate is one."""
    for j in range(last, max(keep - 1, 0) - 1, -1):
        if words[j].split()[-1].strip(_EDGES).lower() not in FUNCTION_WORDS:
            return j
    return last
