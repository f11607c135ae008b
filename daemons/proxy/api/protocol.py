"""The OpenAI HTTP schema the proxy accepts and emits: request bodies, errors, response chunks.

Bodies decode with msgspec (strict types, constraints), so every mistake becomes one 400 with an
OpenAI-style error body naming the parameter. vLLM's extra sampling fields are accepted the way vLLM's own
OpenAI server accepts them (``ignore_eos``, ``top_k``, ``min_tokens``, ``repetition_penalty``, ...).

Structured output (``response_format``, ``structured_outputs``) and tools are parsed and checked in
daemons/proxy/api/structured.py. Fields of OpenAI's or vLLM's API that the proxy does not implement (logit_bias,
beam search, vLLM's removed ``guided_*`` fields, ...) are declared here too, so that a request using one is refused with a 400 naming it
instead of being served as if the field were not there (``unsupported()``); unknown fields are ignored.
The same structs describe the request bodies in ``/openapi.json`` (``openapi_components``).
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal, Union

import msgspec
from msgspec import Meta

from daemons.proxy.api.errors import ApiError
from daemons.proxy.api.structured import (StructuredOutputsBody, ToolChoice, build, check_count, tool_choice,
                                      tool_constraint)
from daemons.wire import SamplingParams, StructuredOutputs

__all__ = ["ApiError"]  # its home is daemons/proxy/api/errors.py; most of the proxy imports it from here

# Counts are bounded where they enter: an integer past 64 bits cannot go on the wire (msgpack), and no count of
# tokens or sequences comes near 2**31.
COUNT_MAX = 2**31 - 1
NonNegInt = Annotated[int, Meta(ge=0, le=COUNT_MAX)]
PosInt = Annotated[int, Meta(ge=1, le=COUNT_MAX)]
Penalty = Annotated[float, Meta(ge=-2.0, le=2.0)]
Int64 = Annotated[int, Meta(ge=-(2**63), le=2**63 - 1)]
TokenId = Annotated[int, Meta(ge=0, le=2**31 - 1)]

MAX_N = 32
MAX_SESSION_CHARS = 256  # longest session name (prompt_cache_key, or the session header) accepted  # most sequences one request may ask for (n): each is a request of its own on the cluster


class StreamOptions(msgspec.Struct):
    include_usage: bool = False


class _Common(msgspec.Struct, kw_only=True):
    model: str
    max_tokens: PosInt | None = None
    temperature: Annotated[float, Meta(ge=0.0, le=2.0)] = 1.0
    top_p: Annotated[float, Meta(gt=0.0, le=1.0)] = 1.0
    n: Annotated[int, Meta(ge=1, le=MAX_N)] = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: Int64 | None = None
    presence_penalty: Penalty = 0.0
    frequency_penalty: Penalty = 0.0
    user: str | None = None
    # vLLM's extra sampling fields
    top_k: Annotated[int, Meta(ge=-1, le=COUNT_MAX)] = -1
    min_tokens: NonNegInt = 0
    ignore_eos: bool = False
    repetition_penalty: Annotated[float, Meta(gt=0.0, le=2.0)] = 1.0
    stop_token_ids: list[TokenId] = []
    return_token_ids: bool = False  # vLLM's extension: the output token ids in each choice
    return_tokens_as_token_ids: bool = False  # vLLM's extension: logprobs name tokens "token_id:<id>"
    # scheduling priority: "normal" or "high" (also the x-llumnix-priority header)
    priority: str | int | None = None
    # OpenAI's prompt caching: the session (a conversation, an agent's loop) whose turns share a prefix, and how
    # long its cached prefix should be kept ("in_memory" or "24h"); daemons/proxy/api/sessions.py reads them
    prompt_cache_key: Annotated[str, Meta(max_length=MAX_SESSION_CHARS)] | None = None
    prompt_cache_retention: Literal["in_memory", "in-memory", "24h"] | None = None
    # Structured output (daemons/proxy/api/structured.py): OpenAI's response_format, vLLM's structured_outputs
    response_format: dict[str, Any] | None = None
    structured_outputs: StructuredOutputsBody | None = None
    # Not implemented: accepted only at their "off" value (see unsupported()).
    logit_bias: dict[str, float] | None = None
    use_beam_search: bool = False
    prompt_logprobs: int | None = None
    # vLLM 0.32 removed these (its server ignores them); refused here rather than served unconstrained
    guided_json: Any = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    def unsupported(self) -> None:
        """Refuse fields we do not implement when they ask for something (a 400 naming the field)."""
        for name in self._NOT_OFF:
            value = getattr(self, name)
            if value is not None and value is not False and value != {} and value != []:
                if name.startswith("guided_"):
                    raise ApiError(400, f"`{name}` was removed from vLLM's API; use `structured_outputs` (or "
                                        "`response_format`)", name, code="unsupported_parameter")
                raise ApiError(400, f"`{name}` is not supported by this server", name, code="unsupported_parameter")

    _NOT_OFF = ("logit_bias", "use_beam_search", "prompt_logprobs", "guided_json", "guided_regex", "guided_choice",
                "guided_grammar")

    def structured(self) -> StructuredOutputs | None:
        """The grammar ``response_format`` and ``structured_outputs`` put on the output (None: unconstrained)."""
        check_count(self.structured_outputs)
        return build(self.structured_outputs, self.response_format)

    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        stops = [self.stop] if isinstance(self.stop, str) else self.stop
        return [s for s in stops if s]

    def sampling(self, max_tokens: int, logprobs: int | None,
                 structured: StructuredOutputs | None = None) -> SamplingParams:
        return SamplingParams(
            max_tokens=max_tokens, temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
            seed=self.seed, stop_token_ids=list(self.stop_token_ids), ignore_eos=self.ignore_eos,
            min_tokens=self.min_tokens, logprobs=logprobs, presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty, repetition_penalty=self.repetition_penalty,
            structured=structured,
        )


class CompletionRequest(_Common, kw_only=True):
    # a string, a list of one string, or token ids (msgspec allows one list type in a union; checked later)
    prompt: Union[str, list[Union[str, TokenId]]]
    logprobs: Annotated[int, Meta(ge=0, le=20)] | None = None
    echo: bool = False
    best_of: PosInt | None = None  # only as many as n: every sequence generated is returned
    suffix: str | None = None

    def unsupported(self) -> None:
        super().unsupported()
        if self.echo:
            raise ApiError(400, "`echo` is not supported by this server", "echo", code="unsupported_parameter")
        if self.suffix:
            raise ApiError(400, "`suffix` is not supported by this server", "suffix", code="unsupported_parameter")
        if self.best_of is not None and self.best_of != self.n:
            raise ApiError(400, f"`best_of` must equal n ({self.n}): this server returns every sequence it generates",
                           "best_of", code="unsupported_parameter")


class ContentPart(msgspec.Struct):
    type: str
    text: str = ""


class ChatMessage(msgspec.Struct):
    role: str
    content: Union[str, list[ContentPart], None] = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None  # an assistant's earlier calls: passed to the chat template
    tool_call_id: str | None = None  # a tool message: the call it answers

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


def _messages(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """The messages as the chat template sees them (vLLM's shape: tool calls with arguments as given)."""
    out = []
    for m in messages:
        message: dict[str, Any] = {"role": m.role, "content": m.text()}
        if m.tool_calls:
            message["tool_calls"] = m.tool_calls
        if m.tool_call_id is not None:
            message["tool_call_id"] = m.tool_call_id
        if m.name is not None:
            message["name"] = m.name
        out.append(message)
    return out


class ChatRequest(_Common, kw_only=True):
    messages: Annotated[list[ChatMessage], Meta(min_length=1)]
    max_completion_tokens: PosInt | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Meta(ge=0, le=20)] | None = None
    chat_template_kwargs: dict[str, Any] | None = None  # passed to the chat template, as vLLM does
    add_generation_prompt: bool = True
    # Tools (daemons/proxy/api/structured.py): passed to the chat template; "required" and a named function
    # constrain the output to calls
    tools: list[Any] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    # Not implemented (see unsupported())
    functions: list[Any] | None = None
    function_call: Any = None
    audio: Any = None
    modalities: list[str] | None = None
    prediction: Any = None
    chat_template: str | None = None
    continue_final_message: bool = False
    echo: bool = False

    def unsupported(self) -> None:
        super().unsupported()
        for name in ("functions", "audio", "prediction", "chat_template", "continue_final_message", "echo"):
            value = getattr(self, name)
            if value is not None and value is not False and value != []:
                raise ApiError(400, f"`{name}` is not supported by this server", name, code="unsupported_parameter")
        if self.function_call is not None and self.function_call != "none":
            raise ApiError(400, "`function_call` is not supported by this server; use `tools` and `tool_choice`",
                           "function_call", code="unsupported_parameter")
        if self.modalities is not None and any(m != "text" for m in self.modalities):
            raise ApiError(400, "only the text modality is supported", "modalities", code="unsupported_parameter")
        if self.top_logprobs is not None and not self.logprobs:
            raise ApiError(400, "when using `top_logprobs`, `logprobs` must be set to true", "top_logprobs")

    def prompt_messages(self) -> list[dict[str, Any]]:
        return _messages(self.messages)

    def tool_choice_of(self) -> ToolChoice:
        return tool_choice(self.tools, self.tool_choice, self.parallel_tool_calls)

    def structured(self) -> StructuredOutputs | None:
        """A forced tool choice's grammar replaces response_format's and structured_outputs' (as vLLM's
        server does); "auto" and "none" leave them."""
        choice = self.tool_choice_of()
        check_count(self.structured_outputs, self.tool_choice if self.tools else "none")
        forced = tool_constraint(self.tools, choice) if self.tools else None
        return forced if forced is not None else build(self.structured_outputs, self.response_format)


class TokenizeRequest(msgspec.Struct, kw_only=True):
    """vLLM's /tokenize: a completion prompt or chat messages (exactly one of the two)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None  # default: true for a prompt, false for messages (as vLLM)
    add_generation_prompt: bool = True
    return_token_strs: bool = False
    chat_template_kwargs: dict[str, Any] | None = None

    def prompt_messages(self) -> list[dict[str, Any]]:
        return _messages(self.messages or [])


class DetokenizeRequest(msgspec.Struct, kw_only=True):
    model: str | None = None
    tokens: list[int]


class LoadLoraAdapterRequest(msgspec.Struct, kw_only=True):
    """vLLM's /v1/load_lora_adapter: an adapter's name and its directory (as the instances see it)."""

    lora_name: str = ""
    lora_path: str = ""
    load_inplace: bool = False  # vLLM's reload; here a load of a served name from its own path is harmless


class UnloadLoraAdapterRequest(msgspec.Struct, kw_only=True):
    """vLLM's /v1/unload_lora_adapter."""

    lora_name: str = ""
    lora_int_id: int | None = None  # vLLM's, ignored: adapters are named


class ErrorInfo(msgspec.Struct):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(msgspec.Struct):
    """Every 4xx and 5xx body (``ApiError.body``)."""

    error: ErrorInfo


def openapi_components(kinds: list[type]) -> tuple[list[dict], dict[str, dict]]:
    """JSON Schemas (OpenAPI 3.1 components) of request and response structs: (one $ref per kind, components)."""
    return msgspec.json.schema_components(kinds, ref_template="#/components/schemas/{name}")


_NULL = {"type": "null"}
_OFF = "not supported: accepted only as shown (absent, null, empty or off)"
# The values of the unsupported fields that unsupported() lets through, for /openapi.json: a client that
# follows the document is never refused.
UNSUPPORTED_SCHEMAS: dict[str, dict] = {
    "logit_bias": {"anyOf": [_NULL, {"type": "object", "maxProperties": 0}]},
    "use_beam_search": {"const": False},
    "prompt_logprobs": _NULL,
    "guided_json": _NULL,
    "guided_regex": _NULL,
    "guided_choice": _NULL,
    "guided_grammar": _NULL,
    "echo": {"const": False},
    "suffix": {"anyOf": [_NULL, {"const": ""}]},
    "best_of": _NULL,  # or equal to n
    "functions": {"anyOf": [_NULL, {"type": "array", "maxItems": 0}]},
    "function_call": {"anyOf": [_NULL, {"const": "none"}]},
    "audio": _NULL,
    "prediction": _NULL,
    "modalities": {"anyOf": [_NULL, {"type": "array", "items": {"const": "text"}}]},
    "chat_template": _NULL,
    "continue_final_message": {"const": False},
}


def document_schemas(schemas: dict[str, dict], model: str, max_model_len: int) -> None:
    """Narrow the generated request schemas (in place) to what the proxy serves: its one model, the context
    limit, the priorities, the prompt forms, and the "off" values of the unsupported fields."""
    for name in ("CompletionRequest", "ChatRequest", "ChatMessage"):
        props = schemas.get(name, {}).get("properties", {})
        for field, schema in UNSUPPORTED_SCHEMAS.items():
            if field in props:
                props[field] = {**schema, "description": _OFF}
        if name == "ChatMessage":
            continue
        props["model"] = {"type": "string", "enum": [model]}
        for field in ("max_tokens", "max_completion_tokens"):
            if field in props:
                props[field] = {"anyOf": [{"type": "integer", "minimum": 1, "maximum": max_model_len}, _NULL],
                                "default": None}
        props["priority"] = {"anyOf": [{"type": "string", "enum": list(PRIORITIES)},
                                       {"type": "integer", "enum": list(PRIORITIES.values())}, _NULL], "default": None}
    schemas["CompletionRequest"]["properties"]["prompt"] = {"anyOf": [
        {"type": "string"}, {"type": "array", "items": {"type": "string"}, "minItems": 1, "maxItems": 1},
        {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 2**31 - 1}, "minItems": 1}]}


def derive_seed(seed: int | None, k: int) -> int | None:
    """The seed of the k-th sequence of a seeded request with n > 1 (seed + k, as vLLM; wraps in int64)."""
    if seed is None:
        return None
    return (seed + k + 2**63) % 2**64 - 2**63


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
    except RecursionError:  # msgspec stops at the interpreter's recursion limit (about a thousand levels)
        raise ApiError(400, "request body is not valid JSON for this server: it is nested too deeply") from None


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
        # Only the text a stop string could still start in is kept: what is held back, and the ``hold``
        # characters sent before it (a stop may begin there and end in the next token). Work per token is
        # bounded by the stops' number and length, whatever the output's.
        self.text = ""
        self.sent = 0  # how much of ``text`` went out

    def feed(self, piece: str) -> tuple[str, bool]:
        """Add a token's text; return (text now safe to send, whether a stop string ended the output)."""
        if not self.stops:  # nothing is held back (nor kept: the output's text would grow with every token)
            return piece, False
        # A stop not found before ends in this piece: look only where that can be (from len(s) - 1 characters
        # before it), and not before the ``hold`` characters ahead of what is unsent.
        end = len(self.text) + 1
        text = self.text + piece
        start = max(0, self.sent - self.hold)
        cut = min((i for i in (text.find(s, max(start, end - len(s))) for s in self.stops) if i >= 0), default=-1)
        if cut >= 0:
            out = text[self.sent:cut]
            self.text, self.sent = text[:cut], cut
            return out, True
        safe = max(self.sent, len(text) - self.hold)
        out = text[self.sent:safe]
        keep = max(0, safe - self.hold)
        self.text, self.sent = text[keep:], safe - keep
        return out, False

    def flush(self) -> str:
        out, self.sent = self.text[self.sent:], len(self.text)
        return out
