"""Text front-end: normalisation, sentence splitting, phonemization (real espeak-ng) and chunking."""

from __future__ import annotations

import itertools
import re

import pytest

from kokoro_opt.chunking import Chunk, chunk_phonemes, chunk_text, split_sentences
from kokoro_opt.errors import UserError
from kokoro_opt.phrasing import FUNCTION_WORDS, phrase_end
from kokoro_opt.text import CONTEXT_TOKENS, normalize_text, phonemize, tokenize

PARAGRAPH = (
    "Dr. Smith arrived at the St. Louis office on March 3, 2024, at 3:30 pm, carrying a coffee that cost $3.50. "
    "He had flown 1,250 km from Boston, a trip that took about 2.5 hours; the weather, he said, was 20°C and sunny. "
    "Mrs. Jones, who had worked there since 1999, greeted him at the door. "
    "\u201cWe\u2019re behind schedule,\u201d she admitted, \u201cbut only by 3 days\u2014nothing serious.\u201d "
    "The team had finished 75% of the work, e.g. the database migration, the API redesign, the test suite, etc. "
    "Their budget of \u20ac120,000 was nearly spent, and the 2nd phase, which starts on 2024-04-15, needs another "
    "\u00a340,000 at least. Mr. Brown from accounting disagreed: he thought the numbers were fine, i.e. within "
    "the usual 10% margin. What did they decide? After a long discussion, which went on until 6:45 pm, they agreed "
    "to postpone the decision vs. rushing it. J. R. Miller, the project lead, sent a summary to all 42 engineers, "
    "and the 1st reply came within 5 minutes! Everyone seemed relieved\u2026 The next meeting is scheduled for "
    "Friday, and it will cover the remaining 25% of the plan, including the new office in the U.S. Army district "
    "near Main St. where the old warehouse used to be. In the 1990s, this area was mostly farmland, but now it "
    "hosts more than 300 companies, 12 restaurants and a small museum about the history of the region. "
    "Nobody expected the growth to be this fast, yet here we are, planning for the next 10 years. "
    "The city council approved a new railway line last autumn, and the first trains should run by 2027 if the "
    "contractors keep to their timetable. Rents have climbed 8.5% since then, which worries the older residents, "
    "many of whom remember when a house here sold for less than $40,000. Still, most people interviewed for the "
    "local paper were optimistic about the future, and the mayor, Ms. Garcia, promised to keep the museum open. "
    "Whether that promise survives the next election is, of course, another question entirely."
)


def _words(text: str) -> list[str]:
    return text.split()


# ---- normalisation ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("I have 1,234 apples.", "I have one thousand two hundred thirty-four apples."),
        ("101 and the 101st", "one hundred one and the one hundred first"),
        ("Pi is 3.14", "Pi is three point one four"),
        ("It costs $3.50.", "It costs three dollars fifty cents."),
        ("$1 or $0.99", "one dollar or ninety-nine cents"),
        ("£1.01 and €2", "one pound one penny and two euros"),
        ("$3.5 million", "three point five million dollars"),
        (
            "$1.5M, $2B, $3k and €4bn",
            "one point five million dollars, two billion dollars, three thousand dollars and four billion euros",
        ),
        ("$1.999 a litre", "one point nine nine nine dollars a litre"),
        (
            "It is -3°C, -$5 and -5€ at -40 km",
            "It is minus three degrees Celsius, minus five dollars and minus five euros at minus forty kilometers",
        ),
        ("COVID-19 and 5-10 km", "COVID-nineteen and five to ten kilometers"),
        (
            "pages 5-10, 1990-1995, 100-1000 mg",
            "pages five to ten, nineteen ninety to nineteen ninety-five, one hundred to one thousand milligrams",
        ),
        (
            "the 747-400, in 2023-12, 3-2, 9 - 5",
            "the seven hundred forty-seven-four hundred, in twenty twenty-three-twelve, three-two, nine \u2014 five",
        ),
        (
            "Due 12/25/2023, paid 25/12/2023",
            "Due December twenty-fifth, twenty twenty-three, paid the twenty-fifth of December, twenty twenty-three",
        ),
        (
            "At 10:30:15 AM, 1:05:01 and 12:00:00",
            "At ten thirty and fifteen seconds A-M, one oh five and one second and twelve o'clock",
        ),
        (
            "1-800-555-1234, 555.123.4567",
            "one, eight zero zero, five five five, one two three four, five five five, one two three, four five six seven",
        ),
        (
            "5-10% and 123 456.7890",
            "five to ten percent and one hundred twenty-three four hundred fifty-six point seven eight nine zero",
        ),
        (
            "Call (555) 123-4567 or 555-123-4567.",
            "Call five five five, one two three, four five six seven or five five five, one two three, four five six seven.",
        ),
        ("1/2 cup, 3/4 full, open 24/7", "one half cup, three quarters full, open twenty-four seven"),
        ("2 1/2 cups and 1 3/4 miles", "two and a half cups and one and three quarters miles"),
        (
            "Call 555-1234 or 555 123 4567",
            "Call five five five, one two three four or five five five, one two three, four five six seven",
        ),
        ("x < 5, y >= 3, x<5", "x less than five, y greater than or equal to three, x less than five"),
        ("Click <b>here</b>, use <br> or <div class=x>", "Click <b>here</b>, use <br> or <div class=x>"),
        (
            "Done \u2713, failed \u2717, \u2605\u2605\u2606 at 24:00",
            "Done check mark, failed cross mark, star star empty star at twenty-four hundred",
        ),
        ("Mail john.doe@example.com, see report.pdf; U.S.", "Mail john dot doe@example dot com, see report dot pdf; U.S."),
        ("I like it.Really, Mr.Smith", "I like it.Really, Mr.Smith"),  # a missing space, not an address
        ("Chapter one\r\n\r\nIt was late.\n\nThe end", "Chapter one. It was late. The end"),  # a heading is a stop
        ("\uff28\uff45\uff4c\uff4c\uff4f \u2462 Settings", "Hello three Settings"),
        (
            "\U0001f602\U0001f602 \U0001f44d\U0001f3fd\U0001f44d \U0001f1fa\U0001f1f8\U0001f1ec\U0001f1e7 \u2764\ufe0f\u2764",
            "\U0001f602 \U0001f602 \U0001f44d \U0001f3fd \U0001f44d \U0001f1fa\U0001f1f8 \U0001f1ec\U0001f1e7 \u2764 \u2764",
        ),
        ("Up 25% and -5%", "Up twenty-five percent and minus five percent"),
        ("the 1st, 2nd and 23rd", "the first, second and twenty-third"),
        ("In 1999 and the 1990s", "In nineteen ninety-nine and the nineteen nineties"),
        ("On March 3, 2024.", "On March third, twenty twenty-four."),
        ("On 2024-03-03.", "On March third, twenty twenty-four."),
        ("On 3 March 2024", "On the third of March, twenty twenty-four"),
        ("At 3:30 pm.", "At three thirty PM."),
        ("At 3:05, 12:00 and 7 a.m. Then", "At three oh five, twelve o'clock and seven A-M. Then"),
        ("Dr. Smith and Mr. Jones", "Doctor Smith and Mister Jones"),
        ("Mrs. and Ms. Lee vs. Prof. Kim", "Missus and Miz Lee versus Professor Kim"),
        ("e.g. this, i.e. that, etc.", "for example this, that is that, et cetera."),
        ("St. Louis is on Main St. today", "Saint Louis is on Main Street today"),
        ("Run 5 km, lift 1 kg", "Run five kilometers, lift one kilogram"),
        (
            "\u201cHi,\u201d he said \u2014 it\u2019s 1990\u20131995...",
            "\u201cHi,\u201d he said \u2014 it's nineteen ninety to nineteen ninety-five\u2026",
        ),
        ("mp3 and COVID-19", "mp three and COVID-nineteen"),
        ("  spaces\n\tand\u00a0tabs  ", "spaces and tabs"),
        # what developers and their screen readers send
        ("x != y, a && b, a || b, a -> b, f => g", "x not equals y, a and b, a or b, a arrow b, f arrow g"),
        ("5 - 3 = 2, x \u2212 1 and \u22125", "five minus three = two, x minus one and minus five"),
        ("Open 10 AM. Hours 9am-5pm, 10:00-11:30", "Open ten A-M. Hours nine A-M to five PM, ten o'clock to eleven thirty"),
        ("node v18.17.0 and 2.0.1", "node v eighteen point seventeen point zero and two point zero point one"),
        ("2024-01-15T14:30:00Z", "January fifteenth, twenty twenty-four fourteen thirty UTC"),
        (
            "1e-5, 3\u00d710^8, 2^10, x^2, x\u00b2",
            "one times ten to the power of minus five, three times ten to the power of eight, two to the power of ten, "
            "x squared, x squared",
        ),
        ("\u00a5100, \u20b9500 and 20\u20ac", "one hundred yen, five hundred rupees and twenty euros"),
        (
            "ping 192.168.1.1; edit ~/.bashrc, main.c and .env in C# on a 16:9 screen",
            "ping one nine two dot one six eight dot one dot one; edit ~/ dot bashrc, main dot c and dot env in C sharp on a "
            "sixteen to nine screen",
        ),
        ("100 ms, 60 fps, 3 GB/s", "one hundred milliseconds, sixty frames per second, three gigabytes per second"),
        (
            "3 m of rope, 5 g of salt, 2 L of water, 10 mi at 3 m/s; timeout: 5m; it raised \u00a35m and $2m",
            "three meters of rope, five grams of salt, two liters of water, ten miles at three meters per second; "
            "timeout: five m; it raised five million pounds and two million dollars",
        ),
        (
            "sizes 10 L and 12 XL, Exercise 4 g), Top 3 m, 2 g's",
            "sizes ten L and twelve XL, Exercise four g), Top three m, two g's",
        ),
        ("5x faster at 1920x1080", "five times faster at nineteen twenty by one thousand eighty"),
        (
            "1234 items, 1500 files, in 1850 prices rose, the 2020 elections",
            "one thousand two hundred thirty-four items, one thousand five hundred files, in eighteen fifty prices rose, "
            "the twenty twenty elections",
        ),
        ("pages 10\u221220, 100 km\u00b2, 3 m\u00b3", "pages ten to twenty, one hundred square kilometers, three cubic meters"),
        ("3 x 4 = 12, x - 1 = y, Options - verbose", "three times four = twelve, x minus one = y, Options \u2014 verbose"),
        ("Psalm 23:4 on a 16:9 screen", "Psalm twenty-three:four on a sixteen to nine screen"),
        (
            "World War II, Chapter IV, Henry VIII, John Paul II, Super Bowl LVIII; Malcolm X and George I think",
            "World War two, Chapter four, Henry the eighth, John Paul the second, Super Bowl fifty-eight; Malcolm X and "
            "George I think",
        ),
        ("At +44 20 7946 0958; 6'2\"", "At plus four four, two zero, seven nine four six, zero nine five eight; six foot two"),
        ("version 2.0.0.1 at 10.0.0.1", "version two point zero point zero point one at one zero dot zero dot zero dot one"),
    ],
)
def test_normalize_text(text: str, expected: str) -> None:
    assert normalize_text(text) == expected


def test_text_in_another_script_is_told_apart() -> None:
    """`say` notes it: espeak would read it by its letters' names."""
    from kokoro_opt.characters import latin_share

    assert latin_share("ありがとう") == latin_share("Привет мир") == 0.0
    assert latin_share("A naïve café, 5 km 😀") == latin_share("...") == 1.0


def test_a_run_of_whitespace_is_one_space() -> None:
    """Every space of a run once started a scan to its end: 100,000 of them took 35 s (a pasted log, a PDF's layout)."""
    assert normalize_text("a" + " \t\u00a0" * 70_000 + "- b") == "a \u2014 b"


def test_normalize_leaves_no_digits_in_prose() -> None:
    assert not re.search(r"\d", normalize_text(PARAGRAPH))


@pytest.mark.parametrize("text", ["1" * 4301, "$" + "9" * 5000 + ".50", "1" + ",000" * 1500, "7" * 5000 + "th", "-" + "4" * 4400])
def test_a_number_longer_than_python_converts_is_read_digit_by_digit(text: str) -> None:
    """Untrusted text: past 4,300 digits int() refuses (ValueError), and a request must not fail on it."""
    words = normalize_text(text).split()
    assert not re.search(r"\d", " ".join(words)) and len(words) > 4300


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


# ---- phonemes and tokens ----------------------------------------------------------------------------------


def test_phonemize_hello_world(vocab: dict[str, int]) -> None:
    ps = phonemize("Hello world.")
    assert ps and "ˈ" in ps and ps.endswith(".")
    assert len(tokenize(ps, vocab)) == len(ps)  # every symbol is in Kokoro's vocab


def test_a_capital_a_inside_a_sentence_is_the_letter() -> None:
    """Screen readers announce keys and options ("Press A"); espeak alone reads every "A" as the article."""
    for text in ("Press A to continue.", "Plan A or plan B.", "Option A"):
        assert "ˈA" in phonemize(text), text
    assert phonemize("A dog and a cat.").startswith("ə ")
    assert "ˈA" not in phonemize("Chapter one\n\nA cat sat.") and "ˈA" not in phonemize("Roses are red\nA violet is blue")
    assert phonemize("Read A Tale Of Two Cities").split()[1] == "ə"  # a title's article


def test_phonemize_uses_kokoro_symbols_only(vocab: dict[str, int]) -> None:
    ps = phonemize(PARAGRAPH)
    assert set(ps) <= set(vocab), set(ps) - set(vocab)
    assert "O" in phonemize("go") and "ɹ" in phonemize("red")  # misaki's E2M mapping is applied (o^ʊ -> O, r -> ɹ)
    assert "ɹɹ" not in phonemize("et cetera, euros")


def test_phonemize_loads_espeak_once() -> None:
    """The espeak backend is built once per language and reused: loading it is what makes a call slow."""
    from kokoro_opt import text

    phonemize("Warm up.")
    loaded = text._backend.cache_info().misses
    phonemize("A brand new sentence about 12 quick brown foxes.")
    phonemize("And another one, never seen before.")
    assert text._backend.cache_info().misses == loaded and text._backend.cache_info().hits >= 2


def test_phonemize_empty_and_bad_language() -> None:
    assert phonemize("") == ""
    assert phonemize("   ") == ""
    with pytest.raises(UserError):
        phonemize("hello", lang="xx-nonexistent")


def test_tokenize_drops_unknown_symbols(vocab: dict[str, int]) -> None:
    assert tokenize("a\u2603b", vocab) == [vocab["a"], vocab["b"]]
    assert tokenize("", vocab) == []


# ---- chunking ---------------------------------------------------------------------------------------------


def _check_chunks(chunks: list[Chunk], text: str, vocab: dict[str, int], limit: int) -> None:
    assert chunks
    for c in chunks:
        assert 0 < len(c.token_ids) <= limit <= CONTEXT_TOKENS
        assert c.token_ids == tokenize(c.phonemes, vocab)
    assert _words(" ".join(c.text for c in chunks)) == _words(text)  # no text lost, none duplicated


def test_chunk_paragraph(vocab: dict[str, int]) -> None:
    assert 1800 <= len(PARAGRAPH) <= 2200
    chunks = chunk_text(PARAGRAPH, vocab)
    _check_chunks(chunks, PARAGRAPH, vocab, 200)
    assert len(chunks[0].token_ids) <= 40 and len(_words(chunks[0].text)) >= 3
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
    assert len(_words(text)) > 1000
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
