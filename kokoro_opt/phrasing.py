"""Where a chunk cut inside a sentence may end: after a word that can end a phrase.

A chunk spoken alone is timed like a whole sentence, so its last word gets the final lengthening
(kokoro_opt.first_chunk). On a content word that is where a reader pauses anyway; on "the", "of" or "their"
it is a drawl no reader makes: spoken alone, such a word lasted up to 15x its length inside the sentence
(docs/measurements/2026-12-07-first-chunk-endings.md). The words are English, as the text front-end is.
"""

from __future__ import annotations

from collections.abc import Sequence

_GROUPS = (
    # articles, determiners and possessives
    "a an the this that these those every such no my your his its our their whose another several",
    # prepositions (ones that are also adverbs included: mid-sentence they are mostly prepositions)
    "of to in on at by for with from into onto over under about as than through between across after before during "
    "without within upon toward towards against among around behind below beneath beside beyond till until via per "
    "since despite except throughout amid",
    # conjunctions and relative words
    "and & or but nor if because although though while whereas unless whether which who whom where when",
    # auxiliaries and copulas, and their contractions
    "is are was were be been being am has have had do does did will would shall should can could may might must "
    "don't doesn't didn't isn't aren't wasn't weren't can't won't couldn't wouldn't shouldn't",
    # subject pronouns, their contractions, and words that lean on the next one ("up", "so", "it", "her", "some"
    # often end a phrase: not listed)
    "i we he she they i'm i've i'll i'd we're we've we'll they're they've they'll he's she's not very",
)
FUNCTION_WORDS = frozenset(word for group in _GROUPS for word in group.split())
_EDGES = "\"'“”‘’()[]{}«»,;:.!?"
_OPENERS = "\"'“‘([{«"  # a word after one begins a quotation: capitalized as a sentence's first


def ends_phrase(word: str, first: bool = False) -> bool:
    """Whether a chunk may end on `word` (one span of the chunker: a word, or words read together). A capitalized
    word other than a sentence's `first` is a name ("May", "vitamin A", "World War I"), and so can end one; not so
    a quotation's first word ('"The'), "I" and its contractions ("I'm"), or a word in capitals ("THE"), whose case
    says nothing of names."""
    raw = word.split()[-1]
    last = raw.strip(_EDGES).replace("’", "'")
    lower = last.lower()
    capitalized = last[:1].isupper() and not first and raw[:1] not in _OPENERS
    shouted = len(last) > 1 and last.isupper()
    pronoun = (lower == "i" and " " not in word.strip()) or lower.startswith("i'")  # "World War I" is a name
    if capitalized and not shouted and not pronoun:
        return True
    return lower not in FUNCTION_WORDS


def phrase_end(words: Sequence[str], last: int, keep: int) -> int:
    """The index of the word a chunk of `words[0..last]` should end at: `last`, or the nearest word before it
    that can end a phrase (`ends_phrase`), keeping at least `keep` words; `last` where none can."""
    for j in range(last, max(keep - 1, 0) - 1, -1):
        if ends_phrase(words[j], first=j == 0):
            return j
    return last
