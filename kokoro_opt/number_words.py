"""Numbers as English words, and what currencies and units are called: the vocabulary normalize.py's rules speak."""

from __future__ import annotations

from num2words import num2words

DIGITS = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine")

CURRENCIES = {
    "$": ("dollar", "dollars", "cent", "cents"),
    "£": ("pound", "pounds", "penny", "pence"),
    "€": ("euro", "euros", "cent", "cents"),
    "¥": ("yen", "yen", "sen", "sen"),
    "₹": ("rupee", "rupees", "paisa", "paise"),
    "₩": ("won", "won", "jeon", "jeon"),
}
SCALE_LETTERS = {"k": "thousand", "K": "thousand", "m": "million", "M": "million", "mn": "million", "B": "billion",
                  "bn": "billion", "T": "trillion"}  # fmt: skip
UNITS = {
    "km/h": ("kilometer per hour", "kilometers per hour"),
    "m/s": ("meter per second", "meters per second"),
    "km²": ("square kilometer", "square kilometers"),
    "cm²": ("square centimeter", "square centimeters"),
    "m²": ("square meter", "square meters"),
    "ft²": ("square foot", "square feet"),
    "cm³": ("cubic centimeter", "cubic centimeters"),
    "m³": ("cubic meter", "cubic meters"),
    "mph": ("mile per hour", "miles per hour"),
    "kWh": ("kilowatt hour", "kilowatt hours"),
    "kW": ("kilowatt", "kilowatts"),
    "km": ("kilometer", "kilometers"),
    "kg": ("kilogram", "kilograms"),
    "cm": ("centimeter", "centimeters"),
    "mm": ("millimeter", "millimeters"),
    "mg": ("milligram", "milligrams"),
    "ml": ("milliliter", "milliliters"),
    "lbs": ("pound", "pounds"),
    "lb": ("pound", "pounds"),
    "GB": ("gigabyte", "gigabytes"),
    "MB": ("megabyte", "megabytes"),
    "TB": ("terabyte", "terabytes"),
    "GHz": ("gigahertz", "gigahertz"),
    "MHz": ("megahertz", "megahertz"),
    "kHz": ("kilohertz", "kilohertz"),
    "Hz": ("hertz", "hertz"),
    "GB/s": ("gigabyte per second", "gigabytes per second"),
    "MB/s": ("megabyte per second", "megabytes per second"),
    "Gbps": ("gigabit per second", "gigabits per second"),
    "Mbps": ("megabit per second", "megabits per second"),
    "kbps": ("kilobit per second", "kilobits per second"),
    "kB": ("kilobyte", "kilobytes"),
    "KB": ("kilobyte", "kilobytes"),
    "mL": ("milliliter", "milliliters"),
    "ms": ("millisecond", "milliseconds"),
    "µs": ("microsecond", "microseconds"),
    "μs": ("microsecond", "microseconds"),
    "ns": ("nanosecond", "nanoseconds"),
    "secs": ("second", "seconds"),
    "sec": ("second", "seconds"),
    "mins": ("minute", "minutes"),
    "min": ("minute", "minutes"),
    "hrs": ("hour", "hours"),
    "hr": ("hour", "hours"),
    "fps": ("frame per second", "frames per second"),
    "ft": ("foot", "feet"),
    "yd": ("yard", "yards"),
    "mi": ("mile", "miles"),
    "oz": ("ounce", "ounces"),
    "°C": ("degree Celsius", "degrees Celsius"),
    "°F": ("degree Fahrenheit", "degrees Fahrenheit"),
    "°": ("degree", "degrees"),
}
# after a space only: "5m" is as often five minutes ("timeout: 5m") as five meters
SPACED_UNITS = {"m": ("meter", "meters"), "g": ("gram", "grams"), "L": ("liter", "liters")}
# A lone m, g or L after these words is a label ("size 12 L", "Exercise 4 g)", "Top 3 m"), not a unit
UNIT_LABELS = frozenset(
    {"size", "sizes", "fig", "figure", "grade", "chapter", "room", "exercise", "top", "step", "level", "part", "section"}
    | {"page", "item", "question"}
)


def spelled(digits: str) -> str:
    """A run of digits read one by one ('007' -> 'zero zero seven')."""
    return " ".join(DIGITS[int(d)] for d in digits)


def digit_by_digit(n: int) -> str:
    return ("minus " if n < 0 else "") + spelled(str(abs(n)))


def cardinal(n: int) -> str:
    # Past 10^15 it is an ID or a card number, not a quantity (and num2words eventually overflows).
    if abs(n) >= 10**15:
        return digit_by_digit(n)
    # num2words puts commas in big numbers; they would become pauses (and clause splits). Its "and" after
    # hundreds is British: this reads American English ("one hundred one"), as misaki does.
    return num2words(n).replace(",", "").replace(" and ", " ")


def ordinal(n: int) -> str:
    return digit_by_digit(n) + "th" if n >= 10**15 else num2words(n, to="ordinal").replace(",", "").replace(" and ", " ")


# Past 15 digits a number is an ID or a card number, read digit by digit, and never through int(): Python refuses
# to convert a string of more than 4,300 digits (a ValueError, where untrusted text must not break the request).
LONGEST_QUANTITY = 15


def whole(digits: str) -> str:
    """A run of digits as a quantity ('1234' -> 'one thousand two hundred thirty-four'), or digit by digit."""
    if len(digits) > LONGEST_QUANTITY:
        return spelled(digits)
    return cardinal(int(digits or "0"))


def ordinal_of(digits: str) -> str:
    return whole(digits) + "th" if len(digits) > LONGEST_QUANTITY else ordinal(int(digits))


def year(n: int) -> str:
    return num2words(n, to="year").replace(",", "") if 1100 <= n <= 2099 else cardinal(n)


def number(s: str) -> str:
    """Digits (optionally with grouping commas and a decimal part) as words."""
    s = s.replace(",", "")
    integer, _, frac = s.partition(".")
    # "007" is read digit by digit
    leading_zero = len(integer) > 1 and integer.startswith("0")
    words = spelled(integer) if leading_zero else whole(integer)
    if frac:
        words += " point " + spelled(frac)
    return words


def plural(words: str) -> str:
    """'nineteen ninety' -> 'nineteen nineties' (for decades)."""
    if words.endswith("y"):
        return words[:-1] + "ies"
    return words + ("es" if words.endswith("x") else "s")


# Roman numerals espeak reads "Roman two": after a word that counts ("World War II", "Chapter IV", "Type II") a
# number, after a monarch's or a pope's name ("Henry VIII", "John Paul II") an ordinal; never alone ("Malcolm X", "I").
COUNTING_WORDS = (
    "World War|Chapter|Part|Volume|Book|Act|Scene|Episode|Title|Phase|Stage|Level|Type|Class|Grade|Section|"
    "Article|Appendix|Round|Season|Super Bowl|Apollo|Gemini|Mark|Vatican"
)
REGNAL_NAMES = (
    "Henry|Louis|Charles|Edward|George|William|Elizabeth|James|Richard|Philip|Frederick|Mary|Anne|Victoria|"
    "John Paul|Benedict|Pius|Leo|Gregory|Innocent|Clement|Peter|Catherine|Alexander|Nicholas|Ivan|Ludwig|"
    "Gustav|Carl|Felipe|Juan Carlos|Harald|Olav|Haakon|Ramesses|Ramses|Amenhotep|Thutmose|Ptolemy|Cleopatra|"
    "Selim|Suleiman|Mehmed|Murad|Napoleon"
)


_ROMAN = {"I": 1, "V": 5, "X": 10, "L": 50}


def roman(numeral: str) -> int | None:
    """The value of a Roman numeral below 90 written the usual way ("XIV": 14, "LVIII": 58); None otherwise ("IIII",
    "VX", "IL", "LL")."""
    values = [_ROMAN[c] for c in numeral if c in _ROMAN]
    if not numeral or len(values) != len(numeral):
        return None
    total = sum(-v if i + 1 < len(values) and v < values[i + 1] else v for i, v in enumerate(values))
    canonical = "".join(symbol * count for symbol, count in _roman_digits(total))
    return total if 0 < total < 90 and canonical == numeral else None


def _roman_digits(n: int) -> list[tuple[str, int]]:
    out: list[tuple[str, int]] = []
    for value, symbol in ((50, "L"), (40, "XL"), (10, "X"), (9, "IX"), (5, "V"), (4, "IV"), (1, "I")):
        out.append((symbol, n // value))
        n %= value
    return out
