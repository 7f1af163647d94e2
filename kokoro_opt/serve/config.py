"""How `kokoro-opt serve` runs: chunk sizes, streaming modes, limits. Validated up front, with the fix named."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, replace
from typing import Any

from kokoro_opt.chunking import CONTEXT_WORDS
from kokoro_opt.errors import UserError
from kokoro_opt.hashing import content_key
from kokoro_opt.runtime.join import CROSSFADE_MS
from kokoro_opt.runtime.session import SessionSettings, shared_by
from kokoro_opt.select import Selection
from kokoro_opt.serve.capacity import CAPACITY_FILE, DEFAULT_QUEUE, Capacity, measured_capacity
from kokoro_opt.store import store_of
from kokoro_opt.text import CONTEXT_TOKENS, JOB_TOKENS

MAX_WORKERS = 2  # what was measured (docs/serving.md)
MAX_CROSSFADE_MS = 200.0  # a seam's crossfade: longer ones blur the words on each side
MAX_CONTEXT_WORDS = 8
_COUNTS = ("first_chunk_tokens", "chunk_tokens", "piece_tokens", "first_window_steps", "workers", "max_queue",
           "max_input_chars", "max_input_tokens", "max_body_bytes", "context_words")  # fmt: skip
_OPTIONAL = ("piece_tokens", "first_window_steps")
_SECONDS_AND_SIZES = ("crossfade_ms", "request_timeout", "body_timeout", "drain_timeout", "audio_cache_mb")
_NO_FLAG = ("piece_tokens", "max_body_bytes")  # settings with no `serve` option (tuned.json, the library)
# what a Host header names (connections.LoopbackHost compares them): a name or an IPv4 address, or [an IPv6 one], a
# port allowed; "*": any
_LABEL = r"[A-Za-z0-9_](?:[A-Za-z0-9_-]*[A-Za-z0-9_])?"
_HOST = re.compile(rf"\*|(?:{_LABEL}(?:\.{_LABEL})*\.?|\[[0-9A-Fa-f:.]+\])(?::\d{{1,5}})?")


def _flag(name: str) -> str:
    """How a user names a setting: its `serve` option, else the field (request_timeout is `--timeout`)."""
    if name in _NO_FLAG:
        return name
    return "--timeout" if name == "request_timeout" else "--" + name.replace("_", "-")


@dataclass(frozen=True)
class ServeConfig:
    first_chunk_tokens: int = 40  # the first job: small, so first audio comes fast
    chunk_tokens: int = JOB_TOKENS  # the largest later job (merged pieces), at most 510
    piece_tokens: int | None = None  # sentences are packed into pieces up to this; None = 2 x first_chunk_tokens
    context_words: int = CONTEXT_WORDS  # words fed on each side of a cut at words inside a sentence (plan.Piece)
    crossfade_ms: float = CROSSFADE_MS
    trim_silence: bool = True  # cut Kokoro's ~0.9 s of silence at each seam to a natural pause (join.py)
    cap_edges: bool = False  # the decoder skips most of that silence (an artifact with the edges stage)
    windowed: bool = False  # front once per job, generator in windows (for_selection: on where the artifact can)
    first_window_steps: int | None = None  # a new listener's first window (steps); None: the artifact's (windows stage)
    workers: int = 1  # streams worked for at once: 1, or 2 windowed (engine.py)
    max_queue: int = DEFAULT_QUEUE  # admitted requests (chunking, waiting or streaming); more get 429 (capacity.py)
    request_timeout: float = 300.0
    body_timeout: float = 30.0  # seconds a request's body may take to arrive, before any queue slot is taken
    max_input_chars: int = 4096  # OpenAI's limit
    # The work a request may ask for: phoneme tokens after normalization, weighted by 1/speed below 1
    # (slower speech decodes more frames per token). A 4096-character paragraph of prose is ~4,700.
    max_input_tokens: int = 6000
    # every body the OpenAPI document allows fits: 4,096 characters of input and of instructions, each
    # up to 12 bytes as JSON (an escaped surrogate pair), are 98 KB; the limit is at least what
    # max_input_chars needs (`body_bytes`)
    max_body_bytes: int = 128 * 1024
    api_key: str | None = None
    # served on a loopback address, Host names answered besides this machine's (a reverse proxy's public name;
    # "*": any): connections.LoopbackHost
    allowed_hosts: tuple[str, ...] = ()
    public_metrics: bool = False  # with an api_key, /metrics needs it too unless this is set
    drain_timeout: float = 30.0  # on SIGTERM: seconds streams in flight may take to finish before the exit
    warmup: bool = True
    audio_cache_mb: float = 8.0  # finished responses kept for repeats (cache.py): ~130 phrases as pcm; 0: off

    def __post_init__(self) -> None:
        # settings also come from files (tuned.json): a NaN limit would compare False and switch its check off
        for name in _COUNTS:
            if not (type(value := getattr(self, name)) is int or (value is None and name in _OPTIONAL)):
                raise UserError(f"{_flag(name)} must be a whole number, not {value!r}")
        for name in _SECONDS_AND_SIZES:
            if not (type(value := getattr(self, name)) in (int, float) and math.isfinite(value)):
                raise UserError(f"{_flag(name)} must be a finite number, not {value!r}")
        for name in ("first_chunk_tokens", "chunk_tokens", "max_queue", "max_input_chars", "max_input_tokens", "max_body_bytes"):
            if getattr(self, name) < 1:
                raise UserError(f"{_flag(name)} must be at least 1, not {getattr(self, name)}", "use a positive number")
        if not 0 <= self.context_words <= MAX_CONTEXT_WORDS:
            raise UserError(f"--context-words must be 0 to {MAX_CONTEXT_WORDS}, not {self.context_words}", "use e.g. 2; 0: none")
        if self.crossfade_ms > MAX_CROSSFADE_MS:
            raise UserError(f"--crossfade-ms must be at most {MAX_CROSSFADE_MS:g}, not {self.crossfade_ms:g}", "use e.g. 10")
        if self.chunk_tokens > CONTEXT_TOKENS:
            raise UserError(f"--chunk-tokens must be at most {CONTEXT_TOKENS} (Kokoro's context), not {self.chunk_tokens}")
        if self.first_chunk_tokens > self.chunk_tokens:
            raise UserError(
                f"--first-chunk-tokens {self.first_chunk_tokens} is larger than --chunk-tokens {self.chunk_tokens}",
                "the first chunk is the smallest job: lower it, or raise --chunk-tokens",
            )
        for name in self.allowed_hosts:
            if not _HOST.fullmatch(name):
                raise UserError(f"--allowed-host {name!r} is not a host name",
                                "give the name clients send in their Host header, e.g. --allowed-host tts.example.com "
                                "(no scheme, no path; '*': any)")  # fmt: skip
        if not 1 <= self.workers <= MAX_WORKERS:
            raise UserError(f"--workers must be 1 to {MAX_WORKERS}, not {self.workers}", "use --workers 1, or 2 with --windowed")
        if self.workers > 1 and not self.windowed:
            raise UserError(
                f"--workers {self.workers} needs windowed serving: whole-graph jobs run one at a time "
                "(two at once measured slower)",
                "add --windowed with an artifact built with the windows stage, or drop --workers",
            )
        if self.first_window_steps is not None and not 4 <= self.first_window_steps <= 400:
            raise UserError(f"--first-window-steps must be 4 to 400, not {self.first_window_steps}", "use e.g. 12 (0.15 s)")
        for name in ("crossfade_ms", "audio_cache_mb", "drain_timeout"):
            if getattr(self, name) < 0:
                raise UserError(f"{_flag(name)} must be >= 0, not {getattr(self, name):g}", "use 0 to switch it off")
        for name in ("request_timeout", "body_timeout"):
            if getattr(self, name) <= 0:
                raise UserError(f"{_flag(name)} must be > 0 seconds, not {getattr(self, name):g}", "use e.g. 30")
        key = self.api_key
        if key is not None and not (key and key.isascii() and key.isprintable() and key.strip() == key):
            raise UserError(  # HTTP clients send headers in ASCII: any other key could never be sent
                "--api-key must be printable ASCII, without spaces at its ends", "e.g. one from: openssl rand -hex 24"
            )
        if self.public_metrics and not self.api_key:  # /metrics is public already
            raise UserError("--public-metrics changes nothing without --api-key", "set --api-key, or drop --public-metrics")

    @property
    def body_bytes(self) -> int:
        """The largest request body read: `max_body_bytes`, or what `max_input_chars` of input and the instructions
        take as JSON at 12 bytes a character, when more (an input within the character limit is never a 413)."""
        from kokoro_opt.serve.openai_compat import MAX_INSTRUCTIONS_CHARS

        return max(self.max_body_bytes, 12 * (self.max_input_chars + MAX_INSTRUCTIONS_CHARS) + 4096)

    @property
    def pieces(self) -> int:
        return min(self.piece_tokens or 2 * self.first_chunk_tokens, self.chunk_tokens)

    @property
    def scheduling(self) -> str:
        """A key of what decides how a stream's work is cut and ordered: a capacity measured under other chunks or
        windows is not this server's."""
        chunks = (self.first_chunk_tokens, self.chunk_tokens, self.pieces, self.context_words)
        return content_key(*chunks, self.first_window_steps, self.crossfade_ms, self.trim_silence)

    @property
    def mode_name(self) -> str:
        """The serving mode as capacity records and /v1/models name it: each mode sustains its own count."""
        return "windowed" if self.windowed else "whole-capped" if self.cap_edges else "whole"

    def mode(self) -> str:
        """What a listener gets, for the start-up line."""
        if self.windowed:
            workers = f", {self.workers} workers with a share of the threads each" if self.workers > 1 else ""
            return "streaming windowed: the front once per job, the generator in windows sent as they are decoded" + workers
        return "whole jobs" + (" with capped edges" if self.cap_edges else "")

    @classmethod
    def for_selection(cls, selection: Selection, **overrides: Any) -> ServeConfig:
        """Tuned chunking from the selection, then explicit (non-None) overrides on top. `windowed` left unset
        (None) follows the artifact: on where its windows stage measured windowed speech at the whole
        decoding's quality (Artifact.windowed_by_default) and edge capping was not asked for; True on an
        artifact without the windows stage is an error."""
        known = set(cls.__dataclass_fields__)
        tuned = {k: v for k, v in selection.chunking.items() if k in known}
        chosen = {k: v for k, v in overrides.items() if v is not None}
        if "windowed" not in chosen:
            chosen["windowed"] = selection.artifact.windowed_by_default and not chosen.get("cap_edges", False)
        try:
            config = cls(**{**tuned, **chosen})
        except UserError as exc:
            if not (from_tuning := sorted(set(tuned) - set(chosen))):
                raise
            raise UserError(  # the message names options the user may never have typed: say where the values came from
                f"{exc.message} ({', '.join(f'{k}={tuned[k]!r}' for k in from_tuning)} came from tuning"
                + (f": {selection.reason})" if selection.reason else ")"),
                "pass the option to override the tuned value, or run kokoro-opt tune again",
            ) from None
        if "max_queue" not in chosen and (measured := config.measured_capacity(selection)) is not None:
            config = replace(config, max_queue=measured.admits)  # what this machine sustains in this mode
        if "first_window_steps" in chosen and not config.windowed:  # a tuned value rides along; an asked one must act
            raise UserError(
                f"--first-window-steps {chosen['first_window_steps']} sets the first window of windowed serving, "
                f"and this server decodes {config.mode_name} jobs",
                "add --windowed (an artifact built with the windows stage), or drop --first-window-steps",
            )
        if config.cap_edges and not selection.artifact.capabilities.edges:
            raise UserError(edges_missing(selection.artifact.name), "serve an artifact built with it, or drop --cap-edges")
        if config.windowed and not selection.artifact.capabilities.windowed:
            raise UserError(windows_missing(selection.artifact.name), "serve an artifact built with it, or drop --windowed")
        if config.windowed and config.cap_edges:  # windows decode only the speech already, with its real context
            raise UserError("--windowed and --cap-edges both skip the edge silence", "use one of them (--windowed)")
        return config

    def measured_capacity(self, selection: Selection) -> Capacity | None:
        """This machine's `bench-serve --capacity` record for the selected artifact in this mode, if any."""
        art = selection.artifact
        threads = self.session_threads(selection)
        return measured_capacity(store_of(art).root, art.id, self.mode_name, self.workers, threads, self.scheduling)

    def session_settings(self, selection: Selection) -> SessionSettings:
        """What the engine's sessions run with: the selection's settings, their threads split among the workers."""
        return shared_by(selection.settings, self.workers)

    def session_threads(self, selection: Selection) -> int:
        """The threads each worker's sessions get; 0: ONNX Runtime's default, every core."""
        return self.session_settings(selection).resolved().intra_op_num_threads

    def admission(self, selection: Selection, asked: bool) -> str:
        """The start-up line on the queue limit: asked for, measured here, or the unmeasured default."""
        line = f"admits {self.max_queue} requests at once"
        if asked:
            return line + " (--max-queue)"
        if (measured := self.measured_capacity(selection)) is not None:
            return f"{line}: this machine sustains {measured.describe()} ({store_of(selection.artifact).root / CAPACITY_FILE})"
        return (
            f"{line}: the default, as nothing was measured for this artifact in {self.mode_name} mode on this machine "
            f"with these workers, threads and chunks ({store_of(selection.artifact).root / CAPACITY_FILE}; "
            "bench-serve --capacity measures it, and serve then admits that many)"
        )


def edges_missing(artifact: str | None) -> str:
    return f"cap_edges needs an ONNX artifact built with the edges stage; {artifact or 'this artifact'} has none"


def windows_missing(artifact: str | None) -> str:
    return f"windowed needs an ONNX artifact built with the windows stage; {artifact or 'this artifact'} has none"


def mode_reason(artifact: Any, asked: bool | None, windowed: bool, cap_edges: bool = False) -> str:
    """Why an artifact that can stream windowed serves the mode it does, for the startup line."""
    if not artifact.capabilities.windowed or asked is not None:
        return " (--windowed)" if windowed else " (--no-windowed)" if asked is False else ""
    if cap_edges:
        return " (--cap-edges: whole jobs, as windows already skip the edge silence)"
    record = artifact.build.find("windows")
    if record is None:  # fetched without build.json: the artifact's own files are all there is to quote
        if windowed:
            return " (by default: its windows stage measured it within the default budget; no build record to quote)"
        return " (windowed on request, --windowed)"
    if windowed:  # the record may come from another machine: only numbers are quoted
        gate = record.get("gate") if isinstance(record.get("gate"), dict) else {}
        if gate.get("judged", True) is False:
            return " (by default: random weights make no speech for the windows gate to judge)"
        figures = [(name, gate.get(key), unit) for name, key, unit in GATE_FIGURES]
        measured = ", ".join(f"{name} {value:.2f}{unit}" for name, value, unit in figures if type(value) in (int, float))
        measured = measured or "within its default budget"
        return f" (by default: windowed vs whole decoding measured {measured}; --no-windowed for whole jobs)"
    below = record.get("below_default_budget")
    reasons = "; ".join(str(r)[:200] for r in below) if isinstance(below, list) else ""
    return " (windowed on request, --windowed: " + (reasons or "built before the default budget") + ")"


GATE_FIGURES = (  # what the startup line quotes of the windows gate
    ("PESQ", "pesq_mean", ""),
    ("phrases", "phrase_pesq_mean", ""),
    ("worst", "utterance_pesq_min", ""),
    ("4-12 kHz", "high_band_db_max", " dB"),
)
