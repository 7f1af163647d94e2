"""Sentence splitting and chunking: where text is cut into the pieces the model speaks (real espeak-ng)."""

from __future__ import annotations

import itertools
import re

import pytest

from kokoro_opt.chunking import Chunk, chunk_phonemes, chunk_text, cut_phonemes
from kokoro_opt.errors import UserError
from kokoro_opt.phrasing import FUNCTION_WORDS, phrase_end
from kokoro_opt.text import CONTEXT_TOKENS, phonemize, tokenize
from kokoro_opt.text_spans import ends_at_clause, last_words, split_sentences
from tests.texts import PARAGRAPH, words

# ---- sentences --------------------------------------------------------------------------------------------


def test_split_sentences_keeps_abbreviations_initials_and_decimals() -> None:
    text = "Dr. Smith paid $3.50 to J. R. Jones. He left at 3:30 pm; e.g. by bus, etc. and then? Home\u2026 The U.S. Army won!"
    assert split_sentences(text) == [
        "Dr. Smith paid $3.50 to J. R. Jones.",
        "He left at 3:30 pm;",
        "e.g. by bus, etc. and then?",
        "Home\u2026",
        "The U.S. Army won!",
    ]


def test_split_sentences_quotes_blank_lines_and_empty() -> None:
    assert split_sentences('He said "Stop." Then: go.') == ['He said "Stop."', "Then:", "go."]
    assert split_sentences("A heading\n\nThe body text.") == ["A heading", "The body text."]
    assert split_sentences("") == []
    assert split_sentences(" \n\t ") == []


# ---- chunking ---------------------------------------------------------------------------------------------


def _check_chunks(chunks: list[Chunk], text: str, vocab: dict[str, int], limit: int) -> None:
    assert chunks
    for c in chunks:
        assert 0 < len(c.token_ids) <= limit <= CONTEXT_TOKENS
        assert c.token_ids == tokenize(c.phonemes, vocab)
    assert words(" ".join(c.text for c in chunks)) == words(text)  # no text lost, none duplicated


def test_chunk_paragraph(vocab: dict[str, int]) -> None:
    assert 1800 <= len(PARAGRAPH) <= 2200
    chunks = chunk_text(PARAGRAPH, vocab)
    _check_chunks(chunks, PARAGRAPH, vocab, 200)
    assert len(chunks[0].token_ids) <= 40 and len(words(chunks[0].text)) >= 3
    assert all(c.phonemes == phonemize(c.text) for c in chunks)
    # The chunks' phonemes cover the whole paragraph's (espeak's context effects only differ at the seams).
    whole = len(tokenize(phonemize(PARAGRAPH), vocab))
    assert abs(sum(len(c.token_ids) for c in chunks) - whole) <= 0.02 * whole
    # Later chunks hold whole sentences.
    sentences = split_sentences(PARAGRAPH)
    assert any(c.text in sentences for c in chunks[1:])


def test_first_chunk_ends_at_first_clause_with_a_few_words(vocab: dict[str, int]) -> None:
    chunks = chunk_text("Hello there, my friend. It is a lovely day, and we should go outside.", vocab)
    assert chunks[0].text == "Hello there, my friend."  # "Hello there," alone has too few words
    text = "When the sun came up, the birds began to sing in the old oak trees behind the house."
    assert chunk_text(text, vocab)[0].text == "When the sun came up,"


def test_first_chunk_falls_back_to_words(vocab: dict[str, int]) -> None:
    text = "The extraordinarily complicated international negotiations regarding agricultural subsidies continued for weeks."
    chunks = chunk_text(text, vocab, first_chunk_tokens=30)
    assert len(chunks[0].token_ids) <= 30 and len(chunks) >= 2
    _check_chunks(chunks, text, vocab, 200)


def test_a_first_chunk_cut_at_words_ends_on_a_word_that_can_end_a_phrase(vocab: dict[str, int]) -> None:
    """Spoken alone, a chunk's last word gets a sentence's final lengthening: a function word alone lasted up to 15x its
    length in the sentence (kokoro_opt.phrasing)."""
    text = "The quick brown fox jumps over the lazy dog near the riverbank in the early morning light."
    for first_tokens in range(16, 72, 2):
        first, *rest = chunk_text(text, vocab, first_chunk_tokens=first_tokens)
        assert rest and len(first.token_ids) <= first_tokens
        assert first.text.split()[-1].lower() not in FUNCTION_WORDS, (first_tokens, first.text)
    assert chunk_text(text, vocab, first_chunk_tokens=40)[0].text == "The quick brown fox jumps"  # not "... over the"
    # a sentence that fits ends where it ends, and a chunk keeps its first few words whatever they are
    assert chunk_text("What are you looking at? Tell me.", vocab)[0].text == "What are you looking at?"
    leaning = "So this is what they are all waiting for and worrying about."
    assert len(chunk_text(leaning, vocab, first_chunk_tokens=12)[0].text.split()) >= 3
    # a capitalized word inside the sentence is a name, and words read together are judged as one
    assert chunk_text("In early May the committee met again to vote.", vocab, first_chunk_tokens=16)[0].text == "In early May"
    war = "After the end of World War I the soldiers of the many armies went home."
    assert chunk_text(war, vocab, first_chunk_tokens=40)[0].text == "After the end of World War I"
    assert phrase_end(["We", "all", "know", "that", "they’re"], 4, 1) == 2  # contractions lean on the next word too
    # but not "I" and its contractions, a quotation's first word or words in capitals: their case says nothing of names
    assert phrase_end(["At", "work", "I'll"], 2, 1) == phrase_end(["At", "work", "I’m"], 2, 1) == 1
    assert phrase_end(["Then", "he", "shouted", '"The'], 3, 1) == 2
    assert phrase_end(["He", "said", "(The"], 2, 1) == 1
    assert phrase_end(["THE", "OLD", "MAN", "SAT", "BY", "THE"], 5, 1) == 3
    assert phrase_end(["We", "met", "NASA"], 2, 1) == 2  # an acronym ends a phrase as any noun does


def test_a_long_sentence_cut_at_words_ends_its_pieces_where_a_phrase_can_end(vocab: dict[str, int]) -> None:
    """A job can end between two pieces of one sentence: its last word is then drawn out like a first chunk's."""
    text = (
        "The committee that was formed in the spring of last year to review the budget of the city and the plans "
        "for the new bridge over the river met again on a cold morning in the old town hall near the market square."
    )
    for piece_tokens in (40, 60, 80):
        pieces = chunk_text(text, vocab, first_chunk_tokens=None, chunk_tokens=piece_tokens)
        _check_chunks(pieces, text, vocab, piece_tokens)
        assert len(pieces) > 2 and not [p.text for p in pieces[:-1] if p.text.split()[-1].lower() in FUNCTION_WORDS]


def test_word_splits_keep_number_units_titles_and_dates_together(vocab: dict[str, int]) -> None:
    text = "Yesterday Dr. Smith walked 5 km to St. Louis at 3:30 pm on March 3, 2024 and paid $3 million for the old mill there."
    glued = {("Dr.", "Smith"), ("5", "km"), ("St.", "Louis"), ("3:30", "pm"), ("March", "3,"), ("3,", "2024"), ("$3", "million")}
    for first_tokens in range(6, 60, 3):
        chunks = chunk_text(text, vocab, first_chunk_tokens=first_tokens, chunk_tokens=40)
        _check_chunks(chunks, text, vocab, max(40, first_tokens))
        for left, right in itertools.pairwise(chunks):
            assert (left.text.split()[-1], right.text.split()[0]) not in glued


def test_only_units_and_scales_are_read_with_the_number_before_them() -> None:
    assert [last_words(t) for t in ("walked 5 km", "at 3 PM", "paid $3 million", "cut 50%", "4 m")] == [
        "5 km", "3 PM", "$3 million", "50%", "4 m"]  # fmt: skip
    assert [last_words(t) for t in ("in 2023 the", "1,234 is", "3 of", "40 to")] == ["the", "is", "of", "to"]


@pytest.mark.parametrize("text", ["Call (555) 123-4567 now, please.", "25 December 2023 was the day we met again at last."])
def test_a_cut_never_falls_inside_what_normalization_reads_as_one(text: str, vocab: dict[str, int]) -> None:
    """Cut inside, each part is read alone: "(555)" as a quantity, "25" and "December 2023" apart."""
    whole = next(m.group(0) for m in re.finditer(r"\(555\) 123-4567|25 December 2023", text))
    for first_tokens in range(4, 40, 3):  # pieces as the server cuts them (a group longer than a piece is cut by words)
        chunks = chunk_text(text, vocab, first_chunk_tokens=first_tokens, chunk_tokens=80)
        assert any(whole in c.text for c in chunks), [c.text for c in chunks]


def test_blank_lines_of_any_kind_end_a_heading() -> None:
    for blank in ("\n\n", "\r\n\r\n", "\n \t\n", "\u2029"):
        assert split_sentences(f"Title{blank}Body text here") == ["Title", "Body text here"]


def test_first_chunk_never_cuts_a_word(vocab: dict[str, int]) -> None:
    # "Yesterday" alone is ~10 tokens: with a 3-token budget the first chunk is that word, not a fragment of it.
    chunks = chunk_text("Yesterday we walked home.", vocab, first_chunk_tokens=3)
    assert chunks[0].text == "Yesterday" and chunks[1].text == "we walked home."


def test_thousand_word_sentence_without_punctuation(vocab: dict[str, int]) -> None:
    pangram = "the quick brown fox jumps over the lazy dog while seven wizards quietly hex nine jovial boxers "
    text = (pangram * 59).strip()  # 17 words x 59 = 1003 words, no punctuation at all
    assert len(words(text)) > 1000
    chunks = chunk_text(text, vocab)
    _check_chunks(chunks, text, vocab, 200)
    assert len(chunks[0].token_ids) <= 40
    big = chunk_text(text, vocab, chunk_tokens=CONTEXT_TOKENS)
    _check_chunks(big, text, vocab, CONTEXT_TOKENS)


def test_long_clause_splits_at_commas(vocab: dict[str, int]) -> None:
    text = "Intro here now. Then " + ", ".join(f"item number {i} in the very long list of things to buy" for i in range(40)) + "."
    chunks = chunk_text(text, vocab, chunk_tokens=120)
    _check_chunks(chunks, text, vocab, 120)
    assert all(c.text.endswith((",", ".")) for c in chunks[1:])  # split at clause boundaries, not mid-clause


def test_single_giant_word_is_cut(vocab: dict[str, int]) -> None:
    text = "https://example.com/" + "abcdefghij" * 60
    chunks = chunk_text(text, vocab, max_tokens=100)
    assert len(chunks) > 1 and all(len(c.token_ids) <= 100 for c in chunks)
    assert chunks[0].text == text


@pytest.mark.parametrize(
    ("text", "limit"),
    [("Pay 1,250 dollars.", 20), ("It costs $19.99 now.", 20), ("The total was 1234567890123 dollars.", 20),
     ("It was 987,654,321 points.", 10), ("Internationalization matters.", 6)],
)  # fmt: skip
def test_a_written_word_spoken_as_several_is_cut_between_them(text: str, limit: int, vocab: dict[str, int]) -> None:
    """A number spelled out is one written word and many spoken ones: cut where the pieces' limit falls, it is cut
    after a spoken word, and the pieces merged into one job again are the sentence's phonemes (no space doubled,
    none put inside a word that had to be cut: the last text's, at a slow speed's small pieces)."""
    from collections import deque

    from kokoro_opt.serve.plan import make_pieces, take_job

    pieces = make_pieces(text, vocab, limit // 2, limit)
    assert len(pieces) > 2 and all(len(p.tokens) <= limit and p.tokens[:1] != [vocab[" "]] for p in pieces)
    job = take_job(deque(pieces), CONTEXT_TOKENS, vocab[" "])
    unstressed = [vocab[s] for s in "ˈˌ"]  # phonemized apart, "321 points" stresses "one" less than "321" alone
    assert [t for t in job.tokens if t not in unstressed] == [t for t in tokenize(phonemize(text), vocab) if t not in unstressed]


def test_a_long_sentence_cut_at_words_is_read_in_linear_work(vocab: dict[str, int], monkeypatch: pytest.MonkeyPatch) -> None:
    """A 4,000-character sentence without a stop has ~140 cuts at words, each with context: looking for the words
    around each cut in the whole sentence took seconds (6.3 s for "a < 0 " x 682), before any audio."""
    import kokoro_opt.text_spans as text_spans
    from kokoro_opt.serve.plan import make_pieces

    scanned: list[int] = []
    read_together = text_spans.read_together
    monkeypatch.setattr(text_spans, "read_together", lambda text: scanned.append(len(text)) or read_together(text))
    text = "a < 0 " * 682
    pieces = make_pieces(text, vocab, 40, 80)
    assert len(pieces) > 100 and sum(p.behind != [] for p in pieces) > 100
    assert sum(scanned) < 20 * len(text)  # was ~140 whole-sentence scans


def test_phonemes_without_a_space_are_cut_at_the_limit(vocab: dict[str, int]) -> None:
    spoken = "wˈʌn θˈWzənd tˈu hˈʌndɹɪd"
    assert cut_phonemes(spoken, vocab, 8) == [("wˈʌn ", False), ("θˈWzənd ", False), ("tˈu ", False), ("hˈʌndɹɪd", False)]
    assert cut_phonemes("ˈATisˈɛvən mˈɪliən", vocab, 10) == [("ˈATisˈɛvən", False), ("mˈɪliən", False)]  # the space a cut's
    run = "təm" * 10  # a URL spelled without a pause: cut inside it, as nothing else can be
    assert cut_phonemes(run, vocab, 8) == [(run[:8], True), (run[8:16], True), (run[16:24], True), (run[24:], False)]


@pytest.mark.parametrize("text", ["", "   ", "\n\n", "...", "?!", "\u2014 \u2014", "()", "\u2026", '""', "-", "*", "\u2603"])
def test_degenerate_inputs_do_not_crash(text: str, vocab: dict[str, int]) -> None:
    chunks = chunk_text(text, vocab)
    assert isinstance(chunks, list)
    if not text.strip():
        assert chunks == []
    assert all(0 < len(c.token_ids) <= CONTEXT_TOKENS for c in chunks)


@pytest.mark.parametrize(
    "kwargs",
    [{"first_chunk_tokens": 0}, {"chunk_tokens": -1}, {"max_tokens": CONTEXT_TOKENS + 1}, {"max_tokens": 0}],
)
def test_invalid_arguments_raise_user_error(kwargs: dict[str, int], vocab: dict[str, int]) -> None:
    with pytest.raises(UserError):
        chunk_text("Hello.", vocab, **kwargs)


def test_empty_vocab_is_rejected() -> None:
    with pytest.raises(UserError):
        chunk_text("Hello.", {})


def test_chunk_phonemes(vocab: dict[str, int]) -> None:
    ps = " ".join([phonemize(PARAGRAPH)] * 3)
    chunks = chunk_phonemes(ps, vocab)
    for c in chunks:
        assert 0 < len(c.token_ids) <= CONTEXT_TOKENS and c.text == c.phonemes
    assert " ".join(c.phonemes for c in chunks) == ps  # nothing dropped
    small = chunk_phonemes(ps, vocab, max_tokens=64)
    assert all(len(c.token_ids) <= 64 for c in small)
    assert re.sub(r"\s", "", "".join(c.phonemes for c in small)) == re.sub(r"\s", "", ps)  # "—" splits without a space
    assert chunk_phonemes("", vocab) == []


def test_espeak_drops_nothing_of_long_words_or_repeated_letters() -> None:
    """espeak keeps a word's first ~150 letters and says a single letter repeated more than three times three
    times: a 4,096-letter word gave 55 s of audio instead of five minutes, 300 x's as many as 3. Both are now
    read whole, so what the server is sent is what it says."""
    assert phonemize("x x x x x x x x").count("ɛks") == 8
    assert phonemize("x X x X x").count("ɛks") == 5  # one letter to espeak, whatever its case
    assert phonemize("I I I I I I I").count("I") == 7
    assert phonemize("the the the the the").count("ðə") == 5  # words repeat as they are
    word = "abcdefghij" * 400
    assert len(phonemize(word)) > len(word)  # every letter read: ~1.07 phonemes a letter, not the first 150


LONG_FIRST = "The quick brown fox jumps over the lazy dog while the old farmer watches quietly from his porch."


def _ids(text: str, vocab: dict[str, int]) -> list[int]:
    return tokenize(phonemize(text), vocab)


def test_a_cut_at_words_gives_each_side_words_of_the_other_as_context(vocab: dict[str, int]) -> None:
    """Spoken alone, a chunk cut inside its sentence ends as an utterance ends (drawn out, falling) and the next one
    starts as an utterance starts: each is fed words of the other, which its front reads and its decoder does not
    speak. The first chunk and its context fit the first-chunk budget together (what the first front runs over)."""
    first, rest = chunk_text(LONG_FIRST, vocab, first_chunk_tokens=40, chunk_tokens=80, context_words=2)
    said, after = first.text.split(), rest.text.split()
    space = vocab[" "]
    assert first.ahead in ([space, *_ids(" ".join(after[:2]), vocab)], [space, *_ids(after[0], vocab)])
    assert rest.behind == [*_ids(" ".join(said[-2:]), vocab), space]
    assert not first.behind and not rest.ahead  # the sentence's own start and end
    assert len(first.token_ids) + len(first.ahead) <= 40
    alone = chunk_text(LONG_FIRST, vocab, first_chunk_tokens=40, chunk_tokens=80)
    assert all(not c.ahead and not c.behind for c in alone) and len(alone[0].token_ids) >= len(first.token_ids)


def test_context_goes_on_both_sides_of_a_cut_at_words_or_neither(vocab: dict[str, int]) -> None:
    """The two jobs beside a cut overlap there (runtime/join.py), so a cut has context on both sides or on none; a cut
    after a clause mark (a glued "July 4, 1776," cut at words) is a pause and has none; and a first chunk gives up at
    most a quarter of its budget for its context."""
    from kokoro_opt.first_chunk import benchmark_texts

    seams = 0
    for text in benchmark_texts():
        chunks = chunk_text(text, vocab, first_chunk_tokens=40, chunk_tokens=80, context_words=2)
        alone = chunk_text(text, vocab, first_chunk_tokens=40, chunk_tokens=80)
        assert not chunks[-1].ahead and not chunks[0].behind
        for before, after in itertools.pairwise(chunks):
            assert bool(before.ahead) == bool(after.behind), (before.text, after.text)
            assert not (before.ahead and ends_at_clause(before.text)), before.text
            seams += bool(before.ahead)
        assert 4 * len(chunks[0].token_ids) >= 3 * min(40, len(alone[0].token_ids)), chunks[0].text
        assert len(chunks[0].token_ids) + len(chunks[0].ahead) <= max(40, len(alone[0].token_ids))
    assert seams >= 20


def test_only_cuts_at_words_inside_a_sentence_get_context(vocab: dict[str, int]) -> None:
    """A clause mark or a sentence end is where a speaker pauses anyway: chunks cut there are spoken alone."""
    text = "After a long and winding journey, we finally arrived at the old house on the hill. It was late at night."
    chunks = chunk_text(text, vocab, first_chunk_tokens=40, chunk_tokens=80, context_words=3)
    assert chunks[0].text.endswith(",") and len(chunks) == 2
    assert all(not c.ahead and not c.behind for c in chunks)


def test_context_words_must_be_a_count_of_words(vocab: dict[str, int]) -> None:
    with pytest.raises(UserError, match="context_words"):
        chunk_text(LONG_FIRST, vocab, context_words=-1)
    with pytest.raises(UserError, match="context_words"):
        chunk_text(LONG_FIRST, {k: v for k, v in vocab.items() if k != " "}, context_words=2)
