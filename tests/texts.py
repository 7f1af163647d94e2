"""Texts the text front-end's tests share."""

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


def words(text: str) -> list[str]:
    return text.split()
