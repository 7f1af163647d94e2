"""What makes the server look like OpenAI's audio API: request fields, voice names, errors, SSE events."""

from __future__ import annotations

import base64
import json
from typing import Any, Literal

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, field_validator

from kokoro_opt.voices import DEFAULT_VOICE, ascii_lower

OPENAI_MODELS = ("tts-1", "tts-1-hd", "gpt-4o-mini-tts", "kokoro")


_LANGUAGES = {"a": "American English", "b": "British English", "j": "Japanese", "z": "Mandarin", "e": "Spanish",
              "f": "French", "h": "Hindi", "i": "Italian", "p": "Brazilian Portuguese"}  # fmt: skip


def voice_entries(voices: list[str], aliases: dict[str, str]) -> list[dict[str, str]]:
    """`{id, name}` per voice: Kokoro's own (readable name from its prefix), then the OpenAI aliases."""
    entries = []
    for v in sorted(voices):
        lang, sex, sep = v[:1], v[1:2], v[2:3]
        if sep == "_" and lang in _LANGUAGES and sex in "fm":
            name = f"{v[3:].replace('_', ' ').title()} ({_LANGUAGES[lang]}, {'female' if sex == 'f' else 'male'})"
        else:
            name = v
        entries.append({"id": v, "name": name})
    entries += [{"id": a, "name": f"{a.title()} (OpenAI name for {target})"} for a, target in aliases.items()]
    return entries


# White space as ECMAScript's regular expressions (the OpenAPI document's) and Python's agree on it; `\s` differs
BLANK = r"\t\n\v\f\r \u00a0\u1680\u2000-\u200a\u2028\u2029\u202f\u205f\u3000\ufeff"
MAX_VOICE_CHARS = 1000  # a blend of many voices fits; the body limit stays far off
MAX_MODEL_CHARS = 256
MAX_INSTRUCTIONS_CHARS = 4096


class SpeechRequest(BaseModel):
    """OpenAI's `audio.speech.create` body. An unknown field is refused, as OpenAI does: a misspelt `speeed` would
    otherwise be a setting that silently changes nothing. Types are strict (a speed of "2" is refused, as the JSON
    schema says), so the OpenAPI document generated from this model is exactly what the server accepts."""

    model_config = ConfigDict(extra="forbid", strict=True)

    model: str = Field(
        default="kokoro",
        max_length=MAX_MODEL_CHARS,
        description="Any value: one artifact is served (GET /v1/models lists it and the OpenAI names)",
    )
    input: str = Field(description="The text to speak")  # limits: the OpenAPI document (openapi.py) and `parse`
    voice: str = Field(
        default=DEFAULT_VOICE,
        max_length=MAX_VOICE_CHARS,
        description="A voice of the artifact, an OpenAI voice name, or a blend like `jf_alpha(2)+jm_kumo(1)`; "
        'an object `{"id": "..."}` also works',
    )
    response_format: str = Field(default="mp3", description="Audio format; upper case is accepted too")
    speed: float = Field(default=1.0, ge=0.25, le=4.0, allow_inf_nan=False)
    stream_format: Literal["audio", "sse"] = Field(
        default="audio", description="`audio`: the encoded bytes; `sse`: `speech.audio.delta` events, then `speech.audio.done`"
    )
    instructions: str | None = Field(
        default=None, max_length=MAX_INSTRUCTIONS_CHARS, description="Accepted and ignored: Kokoro follows no instructions"
    )
    stream: bool = Field(
        default=True,
        description="Extension (as in Kokoro-FastAPI): false synthesizes the whole file first and sends it with exact lengths",
    )

    @field_validator("voice", mode="before")
    @classmethod
    def _voice_object(cls, value: Any) -> Any:
        # newer OpenAI clients may send {"id": "..."} for a voice
        return value.get("id") if isinstance(value, dict) else value

    @field_validator("response_format", mode="before")
    @classmethod
    def _lower(cls, value: Any) -> Any:
        return ascii_lower(value) if isinstance(value, str) else value


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorBody(BaseModel):
    """Every error the server sends, shaped like OpenAI's."""

    error: ErrorDetail


class ApiError(Exception):
    """An error response (`error_response`), raised anywhere in a request's handling."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 type_: str = "invalid_request_error", headers: dict[str, str] | None = None) -> None:  # fmt: skip
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type_, self.headers = status, message, param, code, type_, headers

    def response(self) -> JSONResponse:
        return error_response(self.status, self.message, type_=self.type_, param=self.param, code=self.code, headers=self.headers)


def error_response(
    status: int,
    message: str,
    *,
    type_: str = "invalid_request_error",
    param: str | None = None,
    code: str | None = None,
    headers: dict[str, str] | None = None,
) -> JSONResponse:
    # a message may quote what the client sent, lone surrogates included, which UTF-8 cannot carry
    message = message.encode("utf-8", "backslashreplace").decode("utf-8")
    body = {"error": {"message": message, "type": type_, "param": param, "code": code}}
    return JSONResponse(body, status_code=status, headers=headers)


# OpenAI's error codes for what a request's schema refuses, by pydantic's error type
_CODES = {
    "missing": "missing_required_parameter",
    "extra_forbidden": "unknown_parameter",
    "less_than_equal": "decimal_above_max_value",
    "less_than": "decimal_above_max_value",
    "greater_than_equal": "decimal_below_min_value",
    "greater_than": "decimal_below_min_value",
    "string_too_long": "string_above_max_length",
}


def validation_message(errors: list[Any]) -> tuple[str, str | None, str | None]:
    """Pydantic errors -> (one readable message, the offending field, OpenAI's code for it where it has one)."""
    first = errors[0]
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    param, code = (loc[0] if loc else None), _CODES.get(first.get("type", ""))
    if first.get("type") == "missing":
        return f"missing required parameter '{param}'", param, code
    if first.get("type") == "extra_forbidden":
        known = ", ".join(SpeechRequest.model_fields)
        return f"unrecognized request argument '{param}': the arguments are {known}", param, code
    if param is None:  # the body as a whole (a key that is no text, such as a lone surrogate)
        return f"invalid request body: {first.get('msg', 'invalid')}", None, code
    return f"invalid value for '{param}': {first.get('msg', 'invalid')}", param, code


def sse_event(kind: str, **fields: Any) -> bytes:
    return f"data: {json.dumps({'type': kind, **fields}, separators=(',', ':'))}\n\n".encode()


def sse_delta(audio: bytes) -> bytes:
    return sse_event("speech.audio.delta", audio=base64.b64encode(audio).decode("ascii"))


def sse_done(input_tokens: int, output_seconds: float) -> bytes:
    # OpenAI reports token usage; here the input tokens are phonemes and output "tokens" are audio frames of 20 ms.
    output_tokens = round(output_seconds * 50)
    usage = {"input_tokens": input_tokens, "output_tokens": output_tokens, "total_tokens": input_tokens + output_tokens}
    return sse_event("speech.audio.done", usage=usage)
