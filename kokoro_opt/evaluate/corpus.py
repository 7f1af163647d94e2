"""The held-out evaluation corpus (`kokoro_opt/data/eval_corpus.yaml`): sentences, short phrases (the
screen-reader slice, scored and budgeted apart), a long paragraph, a fixed set of voices and speeds,
and the hash that ties every logged evaluation to this exact text."""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from functools import lru_cache
from importlib import resources
from pathlib import Path

import yaml

from kokoro_opt.errors import UserError

KINDS = ("short", "long", "numbers", "abbreviations", "question", "list")
PHRASE = "phrase"  # the kind of every entry of `phrases:`, and of no sentence


@dataclass(frozen=True)
class Sentence:
    id: str
    kind: str
    source: str
    text: str


@dataclass(frozen=True)
class Utterance:
    """One scored item: a sentence spoken with a given voice and speed."""

    sentence: Sentence
    voice: str
    speed: float

    @property
    def key(self) -> str:
        return f"{self.sentence.id}/{self.voice}@{self.speed:g}"


@dataclass(frozen=True)
class Corpus:
    sentences: tuple[Sentence, ...]
    paragraph: str
    voices: tuple[str, ...]
    speeds: tuple[float, ...]
    phrases: tuple[Sentence, ...] = ()

    @property
    def sha256(self) -> str:
        """Hash of the content (not the YAML bytes): comments can change, the text cannot unnoticed."""
        payload = json.dumps(
            {
                "sentences": [asdict(s) for s in self.sentences],
                "paragraph": self.paragraph,
                "voices": self.voices,
                "speeds": self.speeds,
            }
            | ({"phrases": [asdict(s) for s in self.phrases]} if self.phrases else {}),
            sort_keys=True,
            ensure_ascii=False,
        )
        return hashlib.sha256(payload.encode()).hexdigest()

    def utterances(self, count: int, available_voices: list[str], phrases: int = 0) -> list[Utterance]:
        """The first `count` sentences, then the first `phrases` phrases; voices and speeds assigned
        round-robin over both (deterministic).

        A model without the corpus voices (the tiny test model) speaks with its own, in sorted order.
        """
        voices = [v for v in self.voices if v in available_voices] or sorted(available_voices)[: len(self.voices)]
        if not voices:
            raise UserError("the artifact carries no voices", "rebuild it: voices.npz is empty")
        picked = self.sentences[: max(1, count)] + self.phrases[: max(0, phrases)]
        return [
            Utterance(s, voices[i % len(voices)], self.speeds[(i // len(voices)) % len(self.speeds)])
            for i, s in enumerate(picked)
        ]


def _default_path() -> Path:
    return Path(str(resources.files("kokoro_opt") / "data" / "eval_corpus.yaml"))


@lru_cache(maxsize=4)
def load_corpus(path: Path | None = None) -> Corpus:
    source = path or _default_path()
    data = yaml.safe_load(source.read_text(encoding="utf-8"))
    sentences = tuple(Sentence(**row) for row in data["sentences"])
    phrases = tuple(Sentence(**row) for row in data.get("phrases") or [])
    ids = [s.id for s in sentences + phrases]
    if len(set(ids)) != len(ids):
        raise UserError(f"{source}: duplicate sentence ids", "give every sentence and phrase a unique id")
    unknown = {s.kind for s in sentences} - set(KINDS)
    if unknown:
        raise UserError(f"{source}: unknown sentence kinds {sorted(unknown)}", f"use one of {', '.join(KINDS)}")
    if {p.kind for p in phrases} - {PHRASE}:
        raise UserError(f"{source}: an entry of phrases: is not of kind {PHRASE}", f"give every phrase kind: {PHRASE}")
    return Corpus(
        sentences=sentences,
        paragraph=" ".join(str(data["paragraph"]["text"]).split()),
        voices=tuple(data["voices"]),
        speeds=tuple(float(s) for s in data["speeds"]),
        phrases=phrases,
    )
