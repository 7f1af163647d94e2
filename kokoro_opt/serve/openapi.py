"""The OpenAPI document as the server's contract: every request body, status code, error body and header
it sends, so that a generated client (or schemathesis, tests/test_serve_contract.py) knows the API.

FastAPI writes the document from the routes; this module gives it what the routes cannot say by
themselves: the speech body (read by hand, to bound its size and shape errors like OpenAI's) with the
served artifact's voices and this server's limits, the error responses of each route, and no 422
(validation errors are 400 here, as at OpenAI).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any, Literal

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel

from kokoro_opt.serve.config import ServeConfig
from kokoro_opt.serve.encoders import MEDIA_TYPES, supported_formats
from kokoro_opt.serve.openai_compat import BLANK, MAX_VOICE_CHARS, ErrorBody, ErrorDetail, SpeechRequest

DESCRIPTION = (
    "OpenAI-compatible text to speech (`POST /v1/audio/speech`) with Kokoro. Errors are OpenAI's "
    '`{"error": {"message", "type", "param", "code"}}`. A method a path does not list gets 405 with an '
    "`Allow` header naming the ones it does."
)


class Health(BaseModel):
    status: Literal["ok"]
    ready: bool


class Ready(BaseModel):
    status: Literal["ready"]
    artifact: str


class NotReady(BaseModel):
    status: Literal["loading", "failed", "draining"]
    error: str | None


class ModelEntry(BaseModel):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    name: str | None = None  # the served artifact: its recipe, and why it is served
    reason: str | None = None
    mode: Literal["windowed", "whole", "whole-capped"] | None = None  # how the served artifact is decoded (ServeConfig.mode_name)
    workers: int | None = None
    threads: int | None = None  # each worker's session threads; 0: ONNX Runtime's default, every core
    scheduling: str | None = None  # a key of the served chunks and windows (ServeConfig.scheduling): capacity records name it
    root: str | None = None  # an OpenAI model name: the artifact it stands for


class ModelList(BaseModel):
    object: Literal["list"]
    data: list[ModelEntry]


class Voice(BaseModel):
    id: str
    name: str


class VoiceList(BaseModel):
    voices: list[Voice]


_RETRY_AFTER = {"Retry-After": {"description": "Seconds to wait before trying again", "schema": {"type": "integer"}}}
_ERRORS: dict[int, tuple[str, bool]] = {  # status -> (when, carries Retry-After)
    400: ("Invalid request: the message names the field and what is wrong", False),
    401: ("Missing or wrong API key (send `Authorization: Bearer <key>`)", False),
    404: ("No such model", False),
    408: ("The request body did not arrive within the server's --body-timeout", False),
    413: (
        "Too large: the body is over the byte limit, or the input makes more phoneme tokens after normalization "
        "than the server's --max-input-tokens (the message names both numbers)",
        False,
    ),
    415: ("The body is not sent as `Content-Type: application/json`", False),
    429: ("Too many requests in progress", True),
    500: ("Synthesis failed", False),
    503: ("Not ready (loading or warming up), failed to load, or shutting down", True),
    504: ("The answer took longer than the server's --timeout (a stream: its next audio did)", False),
}


def errors(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """OpenAPI responses for these error statuses, each with OpenAI's error body."""
    found: dict[int | str, dict[str, Any]] = {}
    for status in statuses:
        when, retry = _ERRORS[status]
        found[status] = {"model": ErrorBody, "description": when, **({"headers": _RETRY_AFTER} if retry else {})}
    return found


def ok(model: type[BaseModel], description: str) -> dict[int | str, dict[str, Any]]:
    return {200: {"model": model, "description": description}}


def not_ready() -> dict[int | str, dict[str, Any]]:
    return {503: {"model": NotReady, "description": "Loading, failed to load, or shutting down", "headers": _RETRY_AFTER}}


def metrics_response() -> dict[int | str, dict[str, Any]]:
    return {200: {"description": "Prometheus text exposition", "content": {"text/plain": {"schema": {"type": "string"}}}}}


def _event(kind: str, **properties: Any) -> dict[str, Any]:
    return {"type": "object", "required": ["type", *properties], "properties": {"type": {"const": kind}, **properties}}


_COUNT = {"type": "integer", "minimum": 0}
_USAGE = {"type": "object", "required": ["input_tokens", "output_tokens", "total_tokens"],
          "properties": {"input_tokens": _COUNT, "output_tokens": _COUNT, "total_tokens": _COUNT}}  # fmt: skip
# Open API 3.1 describes an event stream by one event (Open API 3.2's `itemSchema`): its `data` is JSON.
SSE_EVENT = {
    "type": "object",
    "required": ["data"],
    "properties": {
        "data": {
            "type": "string",
            "contentMediaType": "application/json",
            "contentSchema": {
                "oneOf": [
                    _event("speech.audio.delta", audio={"type": "string", "contentEncoding": "base64"}),
                    _event("speech.audio.done", usage=_USAGE),
                    _event("error", error=ErrorDetail.model_json_schema()),
                ]
            },
        }
    },
}


def speech_responses() -> dict[int | str, dict[str, Any]]:
    audio = {MEDIA_TYPES[f]: {"schema": {"type": "string", "format": "binary"}} for f in supported_formats()}
    events = {"text/event-stream": {"schema": SSE_EVENT}}
    description = (
        "The audio, streamed as it is synthesized (`stream: true`, chunked: a stream cut short ends without "
        "its last chunk), or whole with its length (`stream: false`); with `stream_format: sse`, "
        "`speech.audio.delta` events then `speech.audio.done` (missing when the stream was cut)"
    )
    return {200: {"description": description, "content": {**audio, **events}}, **errors(400, 408, 413, 415, 429, 500, 503, 504)}


def voice_pattern(names: Iterable[str]) -> str:
    """The voices the server accepts, as a regular expression: a name in any case, or a blend of names with
    positive weights, `a(2)+b(0.5)+c` (voices.parse_blend). A weight is a number above 0 with at most 300 digits
    before its point and at most 299 zeros after it before a digit that is not, the server's rule on the digits
    (a float holds those as finite and above 0)."""
    ordered = sorted(set(names), key=lambda n: (-len(n), n))
    name = "(?:" + "|".join("".join(_any_case(c) for c in n) for n in ordered) + ")"
    positive = r"(?:0*[1-9][0-9]{0,299}(?:\.[0-9]+)?|0*\.0{0,299}[1-9][0-9]*)"
    term = rf" *{name} *(?:\( *{positive} *\) *)?"
    return rf"^{term}(?:\+{term})*$"


def _any_case(c: str) -> str:
    """One character of a name, as the server reads it: "Alloy" and "JF_ALPHA" are alloy and jf_alpha."""
    return f"[{c.lower()}{c.upper()}]" if c.lower() != c.upper() else re.escape(c)


def speech_body(voices: Iterable[str], config: ServeConfig) -> dict[str, Any]:
    """The request body of POST /v1/audio/speech, for this artifact's voices and this server's limits."""
    schema = SpeechRequest.model_json_schema()
    props = schema["properties"]
    props["input"].update(minLength=1, maxLength=config.max_input_chars, pattern=f"[^{BLANK}]")
    props["input"]["description"] = (
        f"The text to speak: up to {config.max_input_chars} characters with at least one that is not a space, "
        f"and up to {config.max_input_tokens} phoneme tokens after normalization (413 past that)"
    )
    name = {"type": "string", "maxLength": MAX_VOICE_CHARS, "pattern": voice_pattern(voices)}
    voice = props["voice"]
    props["voice"] = {
        "anyOf": [name, {"type": "object", "properties": {"id": name}, "required": ["id"]}],
        "default": voice["default"],
        "description": voice["description"],
    }
    # in any case, as the server reads it: an enum would refuse "MP3"
    props["response_format"]["pattern"] = "^(?:" + "|".join("".join(map(_any_case, f)) for f in supported_formats()) + ")$"
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}


_FOREIGN_HOST = {
    "description": "Served on a loopback address, a request whose Host is not this machine (a web page's DNS rebinding)",
    "content": {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorBody"}}},
}


def install(app: FastAPI) -> None:
    """Have `app.openapi()` return the contract: FastAPI's document without its 422 responses (this
    server answers every invalid request with 400 and OpenAI's error body)."""

    def document() -> dict[str, Any]:
        if app.openapi_schema is None:
            doc = get_openapi(title=app.title, version=app.version, summary=app.summary, description=app.description,
                              routes=app.routes)  # fmt: skip
            for operations in doc.get("paths", {}).values():
                for operation in operations.values():
                    operation.get("responses", {}).pop("422", None)
                    operation.setdefault("responses", {})["421"] = _FOREIGN_HOST  # every route, before routing
            schemas = doc.get("components", {}).get("schemas", {})
            for unused in ("HTTPValidationError", "ValidationError"):
                schemas.pop(unused, None)
            app.openapi_schema = doc
        return app.openapi_schema

    app.openapi = document  # type: ignore[method-assign]
