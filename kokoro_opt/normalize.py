"""English text normalisation: turn numbers, money, dates, times, units and abbreviations into
words (the characters cleaned first, `characters.clean_unicode`), so espeak-ng reads them right.

Deterministic and offline. The rules are heuristics for running prose, not a full TN grammar.
"""

from __future__ import annotations

import re
from collections.abc import Callable

from kokoro_opt.characters import clean_unicode
from kokoro_opt.number_words import (
    COUNTING_WORDS,
    CURRENCIES,
    DIGITS,
    REGNAL_NAMES,
    SCALE_LETTERS,
    SPACED_UNITS,
    UNIT_LABELS,
    UNITS,
    cardinal,
    number,
    ordinal,
    ordinal_of,
    plural,
    roman,
    spelled,
    whole,
    year,
)

MONTHS = (
    "January",
    "February",
    "March",
    "April",
    "May",
    "June",
    "July",
    "August",
    "September",
    "October",
    "November",
    "December",
)
_MONTH_NUM = {m.lower(): i + 1 for i, m in enumerate(MONTHS)}
_MONTH_NUM.update({m[:3].lower(): i + 1 for i, m in enumerate(MONTHS)})
_MONTH_NUM["sept"] = 9
# Longest first so "March" is not matched as "Mar" + "ch".
_MONTH_RE = "|".join(sorted((k.capitalize() for k in _MONTH_NUM), key=len, reverse=True))

# Abbreviations (lower-case, without the final dot) whose "." never ends a sentence ...
NEVER_END = frozenset({"dr", "mr", "mrs", "ms", "prof", "st", "mt", "vs", "e.g", "i.e", "cf", "fig"})
# ... and those whose "." does not end one when a number follows ("No. 5", "Jan. 3", "approx. 5 km").
NOT_END_BEFORE_NUMBER = frozenset({"no", "approx", *(k for k in _MONTH_NUM if len(k) <= 4)})

_NUM = r"\d{1,3}(?:,\d{3})+(?:\.\d+)?|\d+(?:\.\d+)?"  # 1,234.5 | 1234.5 | 12
# A number followed by a suffix starts where a digit run starts: without it, a long run of digits is
# tried from each of its digits (4,000 digits took 3 s to normalize).
_NUM_START = r"(?<![\d,.])"
_SYMBOLS = "".join(CURRENCIES)
_AFTER_SYMBOLS = _SYMBOLS.replace("$", "")  # "5€", "100¥"; "5$" is rare enough to be something else
_SCALE = r"thousand|million|billion|trillion"
_LETTERS = r"bn|mn|[kKmMBT]"  # "£5m": the press writes millions so
_SIGN = r"(?:(?<![\w-])(?P<neg>-))?"  # a minus that is no hyphen ("-5", not "COVID-19")
_UNIT_RE = "|".join(re.escape(u) for u in sorted(UNITS, key=len, reverse=True))
_UNIT_AFTER = rf"(?:\s?(?P<unit>{_UNIT_RE})|\s(?P<spaced>{'|'.join(SPACED_UNITS)})(?!['’]))(?![\w/])"  # not "2 g's"

# Titles never end a sentence, so their "." is dropped; the others keep it when it also ends one.
_TITLES = {"Dr": "Doctor", "Mr": "Mister", "Mrs": "Missus", "Ms": "Miz", "Prof": "Professor", "Mt": "Mount"}
_ENDABLE = {"Jr": "Junior", "Sr": "Senior", "Inc": "Incorporated", "Ltd": "Limited"}
_ABBREVIATIONS: tuple[tuple[re.Pattern[str], str, bool], ...] = (
    *((re.compile(rf"\b{k}\.(?=\s|$)"), v, False) for k, v in _TITLES.items()),
    (re.compile(r"(?i)\bvs\.?(?=\s)"), "versus", False),
    (re.compile(r"(?i)\be\.g\."), "for example", False),
    (re.compile(r"(?i)\bi\.e\."), "that is", False),
    (re.compile(r"\b[Nn]o\.(?=\s*\d)"), "number", False),
    *((re.compile(rf"\b{k}\."), v, True) for k, v in _ENDABLE.items()),
    (re.compile(r"(?i)\betc\."), "et cetera", True),
    (re.compile(r"(?i)\bapprox\."), "approximately", True),
)


_PERIOD_ENDS = re.compile(r"\s*$|\s+[\"“(]?[A-Z]")


def _keeps_period(m: re.Match[str]) -> bool:
    """A consumed '.' also ended the sentence if text ends or a capital follows."""
    return _PERIOD_ENDS.match(m.string, m.end()) is not None


def _abbrev(pattern: re.Pattern[str], word: str, can_end: bool, text: str) -> str:
    def sub(m: re.Match[str]) -> str:
        return word + ("." if can_end and _keeps_period(m) else "")

    return pattern.sub(sub, text)


def _saint_or_street(m: re.Match[str]) -> str:
    # "St. Louis" precedes a name; "Main St." follows one (a capitalised word that does not start the sentence).
    after_name = re.search(r"[^.!?\s]\s+(?:[A-Z][a-z]+|\d+)\s+$", m.string[max(0, m.start() - 60) : m.start()])
    if re.compile(r"\s+[A-Z]").match(m.string, m.end()) and not after_name:
        return "Saint"
    return "Street" + ("." if _keeps_period(m) else "")


def _date(month: int, day: int, yr: str | None) -> str:
    out = f"{MONTHS[month - 1]} {ordinal(day)}"
    return f"{out}, {year(int(yr))}" if yr else out


def _iso_date(m: re.Match[str]) -> str:
    y, mo, d = int(m.group(1)), int(m.group(2)), int(m.group(3))
    if not (1 <= mo <= 12 and 1 <= d <= 31):
        return m.group(0)
    return _date(mo, d, str(y))


def _slash_date(m: re.Match[str]) -> str:
    """12/25/2023 as the US writes it; 25/12/2023 where the first number cannot be a month."""
    a, b = int(m.group(1)), int(m.group(2))
    if 1 <= a <= 12 and 1 <= b <= 31:
        return _date(a, b, m.group(3))
    if 1 <= b <= 12 and 13 <= a <= 31:
        return f"the {ordinal(a)} of {MONTHS[b - 1]}, {year(int(m.group(3)))}"
    return m.group(0)


def _phone(m: re.Match[str]) -> str:
    """Digit by digit, a pause between the groups: (555) 123-4567."""
    groups = [g for g in m.groups() if g and g.isdigit()]  # not the separator group
    return ", ".join(map(spelled, groups))


def _month_day(m: re.Match[str]) -> str:
    d = int(m.group(2))
    if not 1 <= d <= 31:
        return m.group(0)
    return _date(_MONTH_NUM[m.group(1).rstrip(".").lower()], d, m.group(3))


def _day_month(m: re.Match[str]) -> str:
    d = int(m.group(1))
    if not 1 <= d <= 31:
        return m.group(0)
    out = f"the {ordinal(d)} of {MONTHS[_MONTH_NUM[m.group(2).rstrip('.').lower()] - 1]}"
    return f"{out}, {year(int(m.group(3)))}" if m.group(3) else out


def _ampm(m: re.Match[str]) -> str:
    if not m.group("ap"):
        return ""
    # letters: espeak read "AM" as the word "am" ("A-M" it spells), "a.m." with a pause at the dot; "PM" it spells
    suffix = " A-M" if m.group("ap") in "Aa" else " PM"
    return suffix + ("." if m.group("dot") and _keeps_period(m) else "")


def _time(m: re.Match[str]) -> str:
    found = m.groupdict()
    if found.get("h24"):  # "24:00", the end of a day
        return "twenty-four hundred" + _ampm(m)
    h, mins, secs = int(m.group("h")), m.group("m") or None, found.get("s")
    words = cardinal(h)
    if mins is None or mins == "00":
        words += "" if m.group("ap") or mins is None else (" o'clock" if h <= 12 else " hundred")
    elif mins.startswith("0"):
        words += " oh " + DIGITS[int(mins[1])]
    else:
        words += " " + cardinal(int(mins))
    if secs and secs != "00":  # 10:30:15 -> "ten thirty and fifteen seconds"
        words += f" and {cardinal(int(secs))} second{'' if secs == '01' else 's'}"
    return words + _ampm(m)


def _apart(m: re.Match[str], words: str) -> str:
    """`words` in place of the match, apart from letters glued to it ("mp3" -> "mp three", "CA$10", "v1.2.3")."""
    before = m.string[m.start() - 1] if m.start() else " "
    after = m.string[m.end()] if m.end() < len(m.string) else " "
    return (" " if before.isalpha() else "") + words + (" " if after.isalpha() else "")


def _money(m: re.Match[str]) -> str:
    groups = m.groupdict()
    sym, amount = groups.get("sym") or groups["sym2"], groups["amt"]
    scale = groups["scale"] or SCALE_LETTERS.get(groups.get("letter") or "")
    one, many, sub_one, sub_many = CURRENCIES[sym]
    sign = "minus " if groups["neg"] else ""
    whole_s, _, frac = amount.replace(",", "").partition(".")
    if scale:  # "$3.5 million", "$3.5M" -> "three point five million dollars"
        return _apart(m, f"{sign}{number(amount)} {scale} {many}")
    if len(frac) > 2:  # "$1.999": no cents, a decimal
        return _apart(m, f"{sign}{number(amount)} {many}")
    cents = int((frac + "0")[:2]) if frac else 0
    parts = []
    if whole_s.strip("0") or not cents:
        parts.append(f"{whole(whole_s)} {one if whole_s.lstrip('0') == '1' else many}")
    if cents:
        parts.append(f"{cardinal(cents)} {sub_one if cents == 1 else sub_many}")
    return _apart(m, sign + " ".join(parts))


def _unit(m: re.Match[str]) -> str:
    amount, unit = m.group("amt"), m.group("unit")
    label = None if unit else re.search(r"(\w+)\.?\s+$", m.string[max(0, m.start() - 40) : m.start()])
    if label and label.group(1).lower() in UNIT_LABELS:
        return m.group(0)  # "size 12 L": its number is read as a number, its letter as a letter
    one, many = UNITS[unit] if unit else SPACED_UNITS[m.group("spaced")]
    return f"{'minus ' if m.group('neg') else ''}{number(amount)} {one if amount == '1' else many}"


def _said(m: re.Match[str], words: str) -> str:
    """`words` in place of a symbol, apart from the words beside it but not from the punctuation after it."""
    before = m.string[m.start() - 1] if m.start() else " "
    after = m.string[m.end()] if m.end() < len(m.string) else " "
    return (" " if not before.isspace() else "") + words + (" " if after.isalnum() or ord(after) > 0x2000 else "")


def _comparison(m: re.Match[str]) -> str:
    sign, equal = (m.group(1), m.group(2)) if m.group(1) else (m.group(3), m.group(4))
    return f" {'less than' if sign == '<' else 'greater than'}{' or equal to' if equal else ''} "


def _range(m: re.Match[str]) -> str:
    """ "5-10", "1990-1995", "10-15%" as "to", as an en dash between numbers is (characters.clean_unicode); a second
    number not above the first is no range ("747-400", "3-2", "2023-12")."""
    low, high = m.group(1), m.group(2)
    return f"{low} to {high}" if float(high) > float(low) else m.group(0)


# A 4-digit number before 1900 and a plural noun counts ("1234 items", "1500 files"), unless a word before it says it
# is a year ("in 1850 prices rose"); from 1900 on it is a year ("2020 elections"): news reads those more than counts.
_COUNTED = re.compile(r"\s+(?!(?:does|goes|makes|marks|means|remains|says|seems|sees|gets)\b)[a-z]{2,}[^ius\W]s\b")
_YEAR_CUE = re.compile(
    r"(?i)\b(?:in|since|by|until|till|from|to|and|or|through|than|with|vs|during|before|after|circa|year|early|late|mid|of|"
    r"the|fiscal|q[1-4])\s+$"
)


def _is_year(m: re.Match[str], digits: str) -> bool:
    if not re.fullmatch(r"1[1-9]\d\d|20\d\d", digits):
        return False
    if digits.startswith(("19", "20")):  # 1900-2099: "2020 elections", "1945 millions" are years
        return True
    return not _COUNTED.match(m.string, m.end()) or _YEAR_CUE.search(m.string, max(0, m.start() - 12), m.start()) is not None


def _plain_number(m: re.Match[str]) -> str:
    sign, digits = m.group(1), m.group(2)
    if not sign and _is_year(m, digits):  # a bare 4-digit number in prose is most often a year
        return _apart(m, year(int(digits)))
    return _apart(m, ("minus " if sign else "") + number(digits))


def _roman_after(m: re.Match[str]) -> str:
    value = roman(m.group(2))
    if value is None or re.match(r"I\s+[a-z]", m.string[m.start(2) :]):  # "George I think": the pronoun
        return m.group(0)
    return f"{m.group(1)} {cardinal(value) if m.group(1) in COUNTING_WORDS.split('|') else 'the ' + ordinal(value)}"


def _international_phone(m: re.Match[str]) -> str:
    """+44 20 7946 0958: "plus four four", then each group digit by digit, a pause between them."""
    groups = re.findall(r"\d+", m.group(0))
    if sum(map(len, groups)) < 8:  # "+5 10 20" is arithmetic, not a number to dial
        return m.group(0)
    return "plus " + ", ".join(map(spelled, groups))


def _dotted_quad(m: re.Match[str]) -> str:
    """An IPv4 address digit by digit with "dot"; after "version", "release" or "section" four numbers with "point"."""
    if re.search(r"(?i)\b(?:version|release|section|python)\s+$", m.string[max(0, m.start() - 12) : m.start()]):
        return _version(m.group(0))
    return " dot ".join(map(spelled, m.group(0).split(".")))


def _version(dotted: str) -> str:
    """ "2.0.1" -> "two point zero point one": each part a number."""
    return " point ".join(map(number, dotted.split(".")))


def _power(m: re.Match[str]) -> str:
    """ "1e-5", "3x10^8", "2^10" and superscripts: the exponent said, not dropped ("1e-5" was "one e five")."""
    minus = "minus " if (m.group("neg") or m.group("neg2")) == "-" else ""
    if m.group("mantissa"):
        return f"{m.group('mantissa')} times ten to the power of {minus}{m.group('exp')}"
    exponent = str(_SUPERSCRIPTS.index(m.group("sup"))) if m.group("sup") else m.group("exp2")
    return (
        f" to the power of {minus}{exponent}"
        if minus
        else {"2": " squared", "3": " cubed"}.get(exponent, f" to the power of {exponent}")
    )


_SUPERSCRIPTS = "⁰¹²³⁴⁵⁶⁷⁸⁹"
_MIXED = {"1/2": "a half", "1/3": "a third", "2/3": "two thirds", "1/4": "a quarter", "3/4": "three quarters"}
_FRACTIONS = {"1/2": "one half", "1/3": "one third", "2/3": "two thirds", "1/4": "one quarter", "3/4": "three quarters",
              "24/7": "twenty-four seven"}  # fmt: skip
_AMPM = r"(?:\s?(?P<ap>[AaPp])\.?\s?[Mm]\b(?P<dot>\.)?)"
_CLOCK = r"\d{1,2}(?::\d{2})?\s?[AaPp]\.?[Mm]\b\.?|\d{1,2}:\d{2}\b"  # a time: with a colon, or am/pm
_RULES: tuple[tuple[re.Pattern[str], str | Callable[[re.Match[str]], str]], ...] = (
    # a dot inside a word before a lowercase one, as in addresses and file names, is said ("example.com", "john.doe",
    # "report.pdf"); before a capital it is a missing space ("it.Really", "Mr.Smith")
    (re.compile(r"(?<=[A-Za-z]{2})\.(?=[a-z]{2})"), " dot "),
    # a one-letter extension ("main.c", "stdio.h") and a dotfile ("~/.bashrc", ".env"): said too
    (
        re.compile(
            r"(?<=[a-z]{2})\.(?=[chmors](?![\w.]))|(?<=[/~(])\.(?=[a-z]{2})"
            r"|(?:^|(?<=\s))\.(?=(?:env|git\w*|bash\w*|zsh\w*|vim\w*|npm\w*|docker\w*|config)\b)"
        ),
        " dot ",
    ),
    # an IPv4 address, digit by digit ("one nine two dot one six eight dot one dot one")
    (
        re.compile(r"(?<![\w.])(?:(?:25[0-5]|2[0-4]\d|1?\d?\d)\.){3}(?:25[0-5]|2[0-4]\d|1?\d?\d)(?![\d.])"),
        _dotted_quad,
    ),
    (re.compile(r"\b([CF])#(?!\w)"), r"\1 sharp"),  # C#, F#
    (re.compile(rf"\b({COUNTING_WORDS}|{REGNAL_NAMES})\s+([IVXL]+)\b"), _roman_after),
    (re.compile(r"\b(\d)'(\d{1,2})\"(?!\w)"), r"\1 foot \2"),  # a height: 6'2"
    # code and logic, read rather than dropped ("a || b" was "a b") or read as their opposite ("x != y": "x equals y")
    (re.compile(r"(?<=[\w)\]])\s*!==?\s*(?=[\w(\[\"'-])"), " not equals "),
    (re.compile(r"(?<=[\w)\]])\s*&&\s*(?=[\w(\[\"'!-])"), " and "),
    (re.compile(r"(?<=[\w)\]])\s*\|\|\s*(?=[\w(\[\"'!-])"), " or "),
    (re.compile(r"(?<=[\w)\]])\s*[-=]>\s*(?=[\w(\[\"'])"), " arrow "),
    # comparisons, spaced ("x < 5", "y >= 3") or before a number ("x<5"); a markup tag ("<b>", "</b>", "<br>") is not
    (re.compile(r"(?<=\w)\s+(<|>)(=?)\s+(?=[\w-])|(?<=\w)(<|>)(=?)(?=-?\d)"), _comparison),
    (re.compile(r"(?<![\w.])\.(\d)"), r"0.\1"),  # ".5" -> "0.5" -> "zero point five"; "$.50" -> "$0.50"
    # an ISO 8601 timestamp: its date, then its time ("2024-01-15T14:30:00Z")
    (
        re.compile(r"\b(\d{4}-\d{2}-\d{2})T(\d{1,2}:\d{2}(?::\d{2})?)(?:\.\d+)?(Z\b)?"),
        lambda m: f"{m.group(1)} {m.group(2)}" + (" UTC" if m.group(3) else ""),
    ),
    (re.compile(r"\b(\d{4})-(\d{2})-(\d{2})\b"), _iso_date),
    (re.compile(r"(?<![\d/])(\d{1,2})/(\d{1,2})/(\d{4})\b"), _slash_date),
    (re.compile(r"(?<![\w+.-])(?:\+?(1)[-. ])?(?:\((\d{3})\)\s?|(\d{3})([-. ]))(\d{3})(?(4)\4|-)(\d{4})\b"), _phone),
    (re.compile(r"(?<![\w+])\+\d{1,3}(?:[ .-]\d{1,4}){2,5}(?![\w.-])"), _international_phone),
    # "Call 555-1234": seven digits are a phone number after a word that says so, else a range or an id
    (
        re.compile(r"(?i)\b(call|phone|tel|telephone|fax|dial|ext|mobile|cell)(\.?:?\s+)(\d{3})-(\d{4})\b"),
        lambda m: m.group(1) + m.group(2) + ", ".join(map(spelled, m.group(3, 4))),
    ),
    (re.compile(r"(?<![\w.,-])(\d{1,4}(?:\.\d+)?)-(\d{1,4}(?:\.\d+)?)(?![\w-]|\.\d)"), _range),
    # a mixed number: "2 1/2 cups" -> "2 and a half cups"
    (re.compile(r"(?<![\w/.])(\d+) (1/2|1/3|2/3|1/4|3/4)(?![\w/])"), lambda m: f"{m.group(1)} and {_MIXED[m.group(2)]}"),
    (re.compile(r"(?<![\w/])(1/2|1/3|2/3|1/4|3/4|24/7)(?![\w/])"), lambda m: _FRACTIONS[m.group(1)]),
    (re.compile(rf"\b({_MONTH_RE})\.?\s+(\d{{1,2}})(?:st|nd|rd|th)?\b(?:,?\s+(\d{{4}})\b)?"), _month_day),
    (re.compile(rf"\b(\d{{1,2}})(?:st|nd|rd|th)?\s+({_MONTH_RE})\b\.?(?:,?\s+(\d{{4}})\b)?"), _day_month),
    # a ratio: "a 16:9 screen", "the 4:3 format", "ratio of 3:1" (one digit after the colon; "Psalm 23:4" is a verse)
    (re.compile(r"(?i)(?:(?<=\ba )|(?<=\ban )|(?<=\bthe )|(?<=\bratio )|(?<=\bof ))(\d{1,2}):(\d)(?![\d:])"), r"\1 to \2"),
    # a range of times: "9am-5pm", "10:00 - 11:30" (a dash between two times: "to")
    (re.compile(rf"(?<![\d:])({_CLOCK})\s*(?:-|\u2014)\s*(?={_CLOCK})"), r"\1 to "),
    (re.compile(rf"\b(?P<h>[01]?\d|2[0-3]):(?P<m>[0-5]\d):(?P<s>[0-5]\d)(?![:\d]){_AMPM}?"), _time),
    (re.compile(rf"\b(?:(?P<h>[01]?\d|2[0-3]):(?P<m>[0-5]\d)|(?P<h24>24):(?P<m24>00))(?!:?\d){_AMPM}?"), _time),
    (re.compile(rf"\b(?P<h>1[0-2]|[1-9])(?P<m>){_AMPM}"), _time),
    (re.compile(rf"{_SIGN}(?P<sym>[{_SYMBOLS}])\s?(?P<amt>{_NUM})(?:\s(?P<scale>{_SCALE})\b|(?P<letter>{_LETTERS})\b)?"), _money),
    (re.compile(rf"{_SIGN}{_NUM_START}(?P<amt>{_NUM})\s?(?P<sym2>[{_AFTER_SYMBOLS}])(?P<scale>)"), _money),
    (
        re.compile(rf"{_SIGN}{_NUM_START}(?P<amt>{_NUM})\s?%"),
        lambda m: ("minus " if m.group("neg") else "") + number(m.group("amt")) + " percent",
    ),
    (re.compile(r"%"), " percent"),
    (re.compile("[\u2713\u2714\u2705]\ufe0f?"), lambda m: _said(m, "check mark")),  # espeak names only some
    (re.compile("[\u2717\u2718\u274c]\ufe0f?"), lambda m: _said(m, "cross mark")),
    (re.compile("\u2605"), lambda m: _said(m, "star")),
    (re.compile("\u2606"), lambda m: _said(m, "empty star")),
    (re.compile(rf"{_SIGN}{_NUM_START}(?P<amt>{_NUM}){_UNIT_AFTER}"), _unit),
    (re.compile(r"\b(1[1-9]|20)(\d0)s\b"), lambda m: plural(year(int(m.group(1) + m.group(2))))),
    (re.compile(r"'(\d0)s\b"), lambda m: plural(cardinal(int(m.group(1))))),
    (re.compile(r"(?i)\b(\d+)(st|nd|rd|th)\b"), lambda m: ordinal_of(m.group(1))),
    (re.compile(r"#(?=\d)"), "number "),
    # versions and addresses: "2.0.1" -> "two point zero point one", "v1.2.3" -> "v one point two point three"
    (re.compile(r"(?<![\d.])\d+(?:\.\d+){2,}(?![\d.])"), lambda m: _apart(m, _version(m.group(0)))),
    # powers: "1e-5", "3x10^8" and "3×10^8", "2^10", "x²"; a multiplier ("5x faster") and a size ("1920x1080")
    (
        re.compile(
            rf"(?<![\w.,])(?P<mantissa>{_NUM})(?:[eE]|\s?[x×]\s?10\^)(?P<neg>[+-]?)(?P<exp>\d+)\b"
            rf"|(?<=[\w)])\s*\^\s*(?P<neg2>-?)(?P<exp2>\d+)|(?:(?<=[\d)])|(?<![A-Za-z][A-Za-z])(?<=[A-Za-z]))(?P<sup>[{_SUPERSCRIPTS}])"
        ),
        _power,
    ),
    (re.compile(rf"(?<![\w.,])({_NUM})x(?=[\s.,;:!?)]|$)"), r"\1 times"),
    (
        re.compile(r"(?<![\w.,])(?!0[xX])(\d+)\s?[x×]\s?(\d+)(?![\w.])(\s*=)?"),
        lambda m: f"{m.group(1)} {'times' if m.group(3) else 'by'} {m.group(2)}{m.group(3) or ''}",
    ),
    (re.compile(rf"(?:(?<![\w-])(-))?({_NUM})(?!\d)"), _plain_number),
    (re.compile(r"\s*&\s*"), " and "),
)


def read_together(text: str) -> list[tuple[int, int]]:
    """Spans of `text` that a rule reads as one across a space ("(555) 123-4567", "25 December 2023",
    "3:30 pm", "$3 million"): text cut inside one would be read part by part, as other words."""
    return [m.span() for pattern, _ in _RULES for m in pattern.finditer(text) if any(c.isspace() for c in m.group(0))]


# A capital A inside a sentence, before a lowercase word or a stop, is the letter ("Press A to continue", "plan A."),
# which espeak reads as the article; before a capitalized word it is a title's article ("Read A Tale Of ..."). Read
# before the characters are cleaned: a line break before it (a heading's end, a verse) is not a sentence's inside.
_LETTER_A = re.compile(r"(?<=[a-z][ \t])A(?=[ \t]+[a-z]|[.,;:!?)]|[ \t]*$)")


def normalize_text(text: str) -> str:
    """English text -> text with numbers, money, dates, times, units and abbreviations spelled out."""
    text = clean_unicode(_LETTER_A.sub("Eh", text))
    for pattern, word, can_end in _ABBREVIATIONS:
        text = _abbrev(pattern, word, can_end, text)
    text = re.sub(r"\bSt\.", _saint_or_street, text)
    for pattern, repl in _RULES:
        text = pattern.sub(repl, text)
    return re.sub(r"\s+", " ", text).strip()
