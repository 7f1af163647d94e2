"""How a request's text becomes synthesis jobs, and what a job costs.

Text is cut once into *pieces* (`chunk_text`: a small first chunk, then sentences packed up to
`piece_tokens`, long sentences cut at clauses, then words; nothing is ever truncated). The worker then merges consecutive
pieces into one job as large as the listener's buffered audio allows (see `Engine`), up to
`chunk_tokens`. So the first job is small (fast first audio) and later ones grow to full chunks once
the stream is ahead of real time; under load jobs stay at one piece so no stream falls behind.
Merging appends token ids with a space between them, which is what phonemizing the joined text gives.
A piece cut at words inside its sentence carries a few words on each side of the cut as context: its job's
front reads them, its decoder speaks the piece's own frames (and a step past the cut, where the two jobs are
crossfaded), so neither side of the cut is timed and intoned as an utterance's end or start (`Piece`).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from kokoro_opt.chunking import CONTEXT_WORDS, chunk_text
from kokoro_opt.text import CONTEXT_TOKENS


@dataclass(frozen=True)
class Piece:
    """Token ids a job speaks (`tokens`), and the token ids its front reads before and after them without
    speaking them: the words around a cut at words inside a sentence (`chunking.Chunk`), else none."""

    tokens: list[int]
    behind: list[int] = field(default_factory=list)
    ahead: list[int] = field(default_factory=list)
    in_word: bool = False  # it ends inside a spoken word: merged with the next piece without a space (`take_job`)

    def __len__(self) -> int:
        """The tokens the front runs over: what the job costs."""
        return len(self.behind) + len(self.tokens) + len(self.ahead)

    @property
    def feed(self) -> list[int]:
        return [*self.behind, *self.tokens, *self.ahead]

    @property
    def spoken(self) -> int:
        """The tokens of its input it speaks (`len` counts its context too)."""
        return len(self.tokens)

    @property
    def context(self) -> tuple[int, int]:
        """(tokens before, tokens after) the spoken ones in `feed`."""
        return len(self.behind), len(self.ahead)


def as_pieces(pieces: Iterable[Piece | list[int]]) -> list[Piece]:
    """Pieces, token lists taken as pieces without context."""
    return [p if isinstance(p, Piece) else Piece(list(p)) for p in pieces]


def make_pieces(
    text: str,
    vocab: dict[str, int],
    first_chunk_tokens: int,
    piece_tokens: int,
    context_words: int = CONTEXT_WORDS,
    max_tokens: int = CONTEXT_TOKENS,
) -> list[Piece]:
    """Each piece in order; the first piece is the small first chunk.

    Pieces should be whole sentences where possible: every job boundary is an utterance end for Kokoro,
    with end-of-utterance intonation, so a cut inside a sentence gets `context_words` words of context on each side,
    where a piece and its context fit `max_tokens`.
    """
    chunks = chunk_text(text, vocab, first_chunk_tokens, piece_tokens, max_tokens, context_words)
    # the space after a cut is spoken before it: its frames are the pause between the two words
    return [Piece([*c.token_ids, *c.ahead[:1]], c.behind, c.ahead[1:], c.in_word) for c in chunks]


def frames_bound(tokens: int, speed: float) -> int:
    """The tokens a piece or job of `tokens` may hold at `speed`: below speed 1 each token makes 1/speed as
    many frames, and a job's memory (the decoder's activations; windowed, the front's) grows with its
    frames. So slow speech gets proportionally smaller jobs and never more frames than a job at speed 1:
    the peak memory a server reaches under its load holds for every speed."""
    return max(1, math.floor(tokens * min(speed, 1.0)))


def take_job(pieces: deque[Piece], budget_tokens: int, space_id: int | None) -> Piece:
    """Pop the first piece and merge following ones while the job, its context included, stays within the
    budget (and 510). A space goes between two pieces, unless one is there already (a piece cut at words ends with
    the space its next piece follows) or the first ends inside a word."""
    first = pieces.popleft()
    tokens, ahead, in_word = list(first.tokens), first.ahead, first.in_word
    limit = min(budget_tokens, CONTEXT_TOKENS)
    while pieces:
        following = pieces[0]
        glue = _glue(tokens, following, in_word, space_id)
        if len(first.behind) + len(tokens) + len(glue) + len(following.tokens) + len(following.ahead) > limit:
            break
        tokens += glue + pieces.popleft().tokens
        ahead, in_word = following.ahead, following.in_word
    return Piece(tokens, first.behind, ahead, in_word)


def _glue(tokens: list[int], following: Piece, in_word: bool, space_id: int | None) -> list[int]:
    """The space a merge puts between `tokens` and the next piece: none where one is there already or a word goes on."""
    spaced = in_word or space_id is None or space_id in (*tokens[-1:], *following.tokens[:1])
    return [] if spaced else [space_id]


def spoken_tokens(pieces: Sequence[Piece], space_id: int | None) -> int:
    """The tokens a request speaks: its pieces' own, and the spaces merging them puts back (`take_job`). The same for
    any cut: a slow request is cut into smaller pieces, and the pieces' own tokens alone counted 1% fewer at speed
    0.25 than at 1."""
    count, last, in_word = 0, [], False
    for i, piece in enumerate(pieces):
        count += len(piece.tokens) + (len(_glue(last, piece, in_word, space_id)) if i else 0)
        last, in_word = piece.tokens, piece.in_word
    return count


@dataclass
class CostModel:
    """Job compute seconds ~ load * (fixed + per_token * tokens / min(speed, 1)).

    The shape (a per-run cost plus a per-token cost: small jobs cost more per token) is measured at
    warm-up with two job sizes; `load` then tracks the machine (other processes, thermal) job by job.
    Slower speech means more audio frames to decode per token, faster is not counted as cheaper.
    """

    fixed: float = 0.05
    per_token: float = 0.03
    load: float = 1.0

    def calibrate(self, small: tuple[int, float], large: tuple[int, float]) -> None:
        (n1, t1), (n2, t2) = small, large
        self.per_token = max((t2 - t1) / (n2 - n1), 1e-4) if n2 > n1 else t2 / max(n2, 1)
        self.fixed = max(t1 - self.per_token * n1, 0.0)
        self.load = 1.0

    def _shape(self, tokens: int, speed: float) -> float:
        return self.fixed + self.per_token * tokens / min(speed, 1.0)

    def predict(self, tokens: int, speed: float = 1.0) -> float:
        return self.load * self._shape(tokens, speed)

    def observe(self, tokens: int, speed: float, seconds: float) -> None:
        ratio = seconds / max(self._shape(tokens, speed), 1e-6)
        self.load = 0.7 * self.load + 0.3 * min(max(ratio, 0.2), 5.0)  # one outlier moves it only so far

    def tokens_within(self, seconds: float, speed: float = 1.0) -> int:
        """The largest job predicted to finish within `seconds` (0 if even a tiny one would not)."""
        spare = seconds / self.load - self.fixed
        return max(0, math.floor(spare * min(speed, 1.0) / self.per_token))


def queue_seconds(slacks: Sequence[float], units: Sequence[float], safety: float = 0.7) -> float:
    """Seconds the next unit may take so that every other listener, served after it in deadline order with
    its own next unit, still hears audio before its buffer runs out (`slacks`: their buffered seconds; `units`:
    the seconds of each one's next unit, in the same order). Bounding by the tightest listener alone lets four
    buffers run dry together."""
    queued, least = 0.0, math.inf
    for slack, price in sorted(zip(slacks, units, strict=True)):
        queued += price
        least = min(least, safety * slack - queued)
    return least


def bridge_steps(
    finish_seconds: float,
    buffered_seconds: float,
    step_seconds: float,
    cost: Callable[[int], float],
    most: int,
    safety: float = 0.7,
) -> int:
    """Steps of a window between a job's first window and its finish: the fewest whose audio, added to the
    `buffered_seconds` its listener has, lasts while that window (`cost(steps)` seconds) and then the finish
    run, each priced with `safety`; `most` if no fewer do."""
    for steps in range(1, most):
        if finish_seconds + cost(steps) <= safety * (buffered_seconds + steps * step_seconds):
            return steps
    return most


def smallest_heard_window(first: int, steps: int) -> int:
    """The fewest steps a listener already hearing audio gets in one window (see `window_steps`)."""
    return max(first, steps // 2)


def window_steps(
    first: int,
    steps: int,
    *,
    streaming: bool,
    heard: bool,
    cover_seconds: float,
    step_seconds: float,
    fit_steps: int | None = None,
    safety: float = 0.7,
) -> int:
    """Generator steps in a windowed job's next window.

    A request nobody hears before it ends (not streaming) gets `2 x steps`: a short phrase in one window.
    A listener already hearing audio gets `steps`, or `fit_steps` if fewer fit before the other listeners
    need theirs, but never below half of `steps`: smaller windows are mostly overlap, and four streams of
    them fell behind for good (measured: 12 of 12 underran with a floor of 24 steps). A new
    listener's first window is `first` steps, or enough audio to last `cover_seconds`, up to `steps`: the
    engine prices this stream's next window and, when other new listeners wait for their first audio
    (first windows go first), their fronts and first windows too.
    """
    if not streaming:
        return 2 * steps
    if heard:
        return max(smallest_heard_window(first, steps), min(steps, steps if fit_steps is None else fit_steps))
    needed = math.ceil(cover_seconds / safety / step_seconds)
    return max(first, min(needed, steps))
