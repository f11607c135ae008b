"""The OpenAI HTTP schema the proxy accepts and emits: request bodies, errors, response chunks.

Bodies decode with msgspec (strict types, constraints), so every mistake becomes one 400 with an
OpenAI-style error body naming the parameter. vLLM's extra sampling fields are accepted the way vLLM's own
OpenAI server accepts them (``ignore_eos``, ``top_k``, ``min_tokens``, ``repetition_penalty``, ...).
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Union

import msgspec
from msgspec import Meta

from daemons.wire import SamplingParams

NonNegInt = Annotated[int, Meta(ge=0)]
PosInt = Annotated[int, Meta(ge=1)]
Penalty = Annotated[float, Meta(ge=-2.0, le=2.0)]


class ApiError(Exception):
    """An error the client caused or must hear about; becomes an OpenAI-style JSON body."""

    def __init__(self, status: int, message: str, param: str | None = None, type_: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param = status, message, param
        # A streamed error has no HTTP status of its own: the code says what happened (e.g. "timeout").
        self.code = code or {504: "timeout"}.get(status)
        self.type = type_ or {400: "invalid_request_error", 404: "not_found_error"}.get(status, "server_error")

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class StreamOptions(msgspec.Struct):
    include_usage: bool = False


class _Common(msgspec.Struct, kw_only=True):
    model: str
    max_tokens: PosInt | None = None
    temperature: Annotated[float, Meta(ge=0.0, le=2.0)] = 1.0
    top_p: Annotated[float, Meta(gt=0.0, le=1.0)] = 1.0
    n: Annotated[int, Meta(ge=1, le=1)] = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: Penalty = 0.0
    frequency_penalty: Penalty = 0.0
    user: str | None = None
    # vLLM's extra sampling fields
    top_k: Annotated[int, Meta(ge=-1)] = -1
    min_tokens: NonNegInt = 0
    ignore_eos: bool = False
    repetition_penalty: Annotated[float, Meta(gt=0.0, le=2.0)] = 1.0
    stop_token_ids: list[int] = []
    return_token_ids: bool = False  # vLLM's extension: the output token ids in each choice
    # scheduling priority: "normal" or "high" (also the x-llumnix-priority header)
    priority: str | int | None = None

    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        stops = [self.stop] if isinstance(self.stop, str) else self.stop
        return [s for s in stops if s]

    def sampling(self, max_tokens: int, logprobs: int | None) -> SamplingParams:
        return SamplingParams(
            max_tokens=max_tokens, temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
            seed=self.seed, stop_token_ids=list(self.stop_token_ids), ignore_eos=self.ignore_eos,
            min_tokens=self.min_tokens, logprobs=logprobs, presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty, repetition_penalty=self.repetition_penalty,
        )


class CompletionRequest(_Common, kw_only=True):
    # a string, a list of one string, or token ids (msgspec allows one list type in a union; checked later)
    prompt: Union[str, list[Union[str, int]]]
    logprobs: Annotated[int, Meta(ge=0, le=20)] | None = None
    echo: bool = False


class ContentPart(msgspec.Struct):
    type: str
    text: str = ""


class ChatMessage(msgspec.Struct):
    role: str
    content: Union[str, list[ContentPart], None] = None
    name: str | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        parts = []
        for part in self.content:
            if part.type != "text":
                raise ApiError(400, f"message content of type {part.type!r} is not supported; use text", "messages")
            parts.append(part.text)
        return "".join(parts)


class ChatRequest(_Common, kw_only=True):
    messages: Annotated[list[ChatMessage], Meta(min_length=1)]
    max_completion_tokens: PosInt | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Meta(ge=0, le=20)] | None = None


_PATH = re.compile(r"at `\$\.?([^`\[]*)")


def decode_body(body: bytes, kind: type[msgspec.Struct]) -> Any:
    if not body.strip():
        raise ApiError(400, "request body is empty; send a JSON object")
    try:
        return msgspec.json.decode(body, type=kind)
    except msgspec.ValidationError as exc:
        text = str(exc)
        m = _PATH.search(text)
        param = m.group(1).split(".")[0] if m and m.group(1) else None
        missing = re.search(r"missing required field `(\w+)`", text)
        if missing:
            param = missing.group(1)
        raise ApiError(400, text, param) from None
    except msgspec.DecodeError as exc:
        raise ApiError(400, f"request body is not valid JSON: {exc}") from None


PRIORITIES = {"normal": 0, "high": 1}


def parse_priority(value: str | int | None, header: str | None) -> int:
    raw = header if header is not None else value
    if raw is None:
        return 0
    if isinstance(raw, int) and not isinstance(raw, bool):
        if raw in PRIORITIES.values():
            return raw
    elif isinstance(raw, str) and raw.strip().lower() in PRIORITIES:
        return PRIORITIES[raw.strip().lower()]
    raise ApiError(400, f"priority must be one of {', '.join(PRIORITIES)}; got {raw!r}", "priority")


class StopChecker:
    """Stop strings, checked on the detokenized text; holds back text that may be the start of a stop."""

    def __init__(self, stops: list[str]):
        self.stops = stops
        self.hold = max((len(s) for s in stops), default=1) - 1
        self.text = ""
        self.sent = 0

    def feed(self, piece: str) -> tuple[str, bool]:
        """Add a token's text; return (text now safe to send, whether a stop string ended the output)."""
        self.text += piece
        if not self.stops:
            out, self.sent = self.text[self.sent:], len(self.text)
            return out, False
        start = max(0, self.sent - self.hold)
        cut = min((i for i in (self.text.find(s, start) for s in self.stops) if i >= 0), default=-1)
        if cut >= 0:
            out = self.text[self.sent:cut]
            self.text, self.sent = self.text[:cut], cut
            return out, True
        safe = max(self.sent, len(self.text) - self.hold)
        out, self.sent = self.text[self.sent:safe], safe
        return out, False

    def flush(self) -> str:
        out, self.sent = self.text[self.sent:], len(self.text)
        return out
