"""Text front-end: normalisation, phonemization (real espeak-ng) and tokens. Sentences and chunks: test_chunking.py."""

from __future__ import annotations

import re

import pytest

from kokoro_opt.errors import UserError
from kokoro_opt.text import normalize_text, phonemize, tokenize
from tests.texts import PARAGRAPH

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
        ("The 16:9 format. A 4:3 TV.", "The sixteen to nine format. A four to three TV."),  # a sentence's first word too
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
