"""Structured output and tools, as a request asks for them: ``response_format`` (JSON mode, a JSON schema),
vLLM's ``structured_outputs`` (json, regex, choice, grammar, ...), and ``tools`` with ``tool_choice``.

What they become is one ``wire.StructuredOutputs`` in the request's sampling parameters: the engine compiles it
into a grammar and masks every step's logits with it (vLLM's structured output; the sim engine refuses it). The
checks here are the ones vLLM 0.32's OpenAI server makes before its engine sees the request (its
``ChatCompletionRequest`` validators), with its messages; a schema that no grammar backend accepts is refused
by the engine's own validation (``SamplingParams.verify``) on the instance, which the proxy answers with 400.

Tools follow vLLM's server: ``tool_choice`` "required" constrains the output to a JSON array of
``{"name": ..., "parameters": ...}`` objects (``required_schema``, vLLM's ``get_json_schema_from_tools``), a named
function to that function's parameters; the response then carries ``tool_calls`` (daemons/proxy/api/toolcalls.py).
"""

from __future__ import annotations

from typing import Any

import msgspec

from daemons.proxy.api.errors import ApiError
from daemons.wire import StructuredOutputs

_json = msgspec.json.encode
_CONSTRAINTS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")


class StructuredOutputsBody(msgspec.Struct, forbid_unknown_fields=True):
    """vLLM's ``structured_outputs`` request field (its ``StructuredOutputsParams``)."""

    json: str | dict[str, Any] | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: str | None = None
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None


def _bad(message: str, param: str | None = None) -> ApiError:
    return ApiError(400, message, param)


def _constraints(so: StructuredOutputsBody) -> dict[str, Any]:
    return {name: getattr(so, name) for name in _CONSTRAINTS if getattr(so, name) is not None}


def check_count(so: StructuredOutputsBody | None, tool_choice: Any = "none") -> None:
    """vLLM's ``check_structured_outputs_count``: one of json, regex and choice; not with a named tool."""
    if so is None:
        return
    if sum(getattr(so, k) is not None for k in ("json", "regex", "choice")) > 1:
        raise _bad("You can only use one kind of constraints for structured outputs ('json', 'regex' or 'choice').",
                   "structured_outputs")
    if _constraints(so) and tool_choice not in ("none", "auto", "required", None):
        raise _bad("You can only either use constraints for structured outputs or tools, not both.",
                   "structured_outputs")


def response_format_overrides(response_format: dict[str, Any] | None) -> dict[str, Any] | None:
    """What ``response_format`` sets in the structured outputs (None: nothing, as for "text")."""
    if response_format is None:
        return None
    kind = response_format.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"json_object": True}
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        if spec is None:
            raise _bad("When response_format type is 'json_schema', the 'json_schema' field must be provided.",
                       "response_format")
        if not isinstance(spec, dict) or not isinstance(spec.get("name"), str):
            raise _bad("response_format.json_schema must be an object with a string `name` and a `schema`",
                       "response_format")
        schema = spec.get("schema")
        if schema is not None and not isinstance(schema, dict):
            raise _bad("response_format.json_schema.schema must be a JSON object (a JSON Schema)", "response_format")
        return {"json": schema}
    if kind == "structural_tag":
        raise ApiError(400, "response_format type 'structural_tag' is not supported by this server; send "
                            "structured_outputs.structural_tag", "response_format", code="unsupported_parameter")
    raise _bad(f"response_format.type must be one of 'text', 'json_object', 'json_schema'; got {kind!r}",
               "response_format")


def build(so: StructuredOutputsBody | None, response_format: dict[str, Any] | None) -> StructuredOutputs | None:
    """The request's constraint (vLLM's ``structured_outputs_from_response_format`` and its checks)."""
    overrides = response_format_overrides(response_format)
    if overrides is None and so is None:
        return None
    so = so or StructuredOutputsBody()
    if overrides is not None:
        so = msgspec.structs.replace(so, **overrides)
    given = _constraints(so)
    if len(given) > 1:
        raise _bad("You can only use one kind of structured outputs constraint but multiple are specified: "
                   f"{', '.join(given)}", "structured_outputs")
    if not given:
        raise _bad("You must use one kind of structured outputs constraint but none are specified",
                   "structured_outputs")
    schema = so.json
    if isinstance(schema, dict):
        schema = _json(schema).decode()
    return StructuredOutputs(json=schema, regex=so.regex, choice=so.choice, grammar=so.grammar,
                             json_object=so.json_object, structural_tag=so.structural_tag,
                             disable_any_whitespace=so.disable_any_whitespace,
                             disable_additional_properties=so.disable_additional_properties,
                             whitespace_pattern=so.whitespace_pattern)


# ---------------------------------------------------------------- tools


class ToolChoice(msgspec.Struct, frozen=True):
    """What a chat request's tools ask of the output: kind "none", "auto", "required" or "named"."""

    kind: str
    name: str | None = None  # the function, for "named"
    parallel: bool = True  # parallel_tool_calls: False caps "required" at one call


def _params_or_empty(params: dict | None) -> dict:
    return params if params else {"type": "object", "properties": {}}


def tool_choice(tools: list[Any] | None, choice: Any, parallel: bool | None) -> ToolChoice:
    """vLLM's ``check_tool_usage``, with its messages."""
    if tools == []:
        raise _bad("`tools` must not be an empty array. Either provide at least one tool or omit the field entirely.",
                   "tools")
    if choice is None:
        choice = "auto" if tools else "none"
    if choice == "none":
        return ToolChoice("none")
    if tools is None:
        raise _bad("When using `tool_choice`, `tools` must be set.", "tool_choice")
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or tool.get("type", "function") != "function":
            raise _bad(f"tools[{i}] must be {{\"type\": \"function\", \"function\": {{\"name\": ..., "
                       "\"parameters\": {...}}}}", "tools")
        if fn.get("parameters") is not None and not isinstance(fn["parameters"], dict):
            raise _bad(f"tools[{i}].function.parameters must be a JSON object (a JSON Schema)", "tools")
    if choice in ("auto", "required"):
        return ToolChoice(choice, parallel=parallel is not False)
    if not isinstance(choice, dict):
        raise _bad(f'Invalid value for `tool_choice`: {choice}! Only named tools, "none", "auto" or "required" '
                   "are supported.", "tool_choice")
    usage = 'Correct usage: `{"type": "function", "function": {"name": "my_function"}}`'
    fn = choice.get("function")
    if not isinstance(fn, dict):
        raise _bad(f"Invalid value for `function`: `{fn}` in `tool_choice`! {usage}", "tool_choice.function")
    if "name" not in fn:
        raise _bad(f"Expected field `name` in `function` in `tool_choice`! {usage}", "tool_choice.function.name")
    name = fn["name"]
    if not isinstance(name, str) or not name:
        raise _bad(f"Invalid `name` in `function`: `{name}` in `tool_choice`! {usage}", "tool_choice.function.name")
    if not any(t["function"]["name"] == name for t in tools):
        raise _bad("The tool specified in `tool_choice` does not match any of the specified `tools`", "tool_choice")
    return ToolChoice("named", name, parallel is not False)


def required_schema(tools: list[dict], parallel: bool) -> dict:
    """vLLM's ``_get_json_schema_from_tools``: an array of one or more calls, each a function's name and
    parameters (``$defs`` of every tool's parameters gathered at the top)."""
    defs: dict[str, Any] = {}
    calls = []
    for tool in tools:
        fn = tool["function"]
        params = fn.get("parameters")
        if params is not None and "$defs" in params:
            params = dict(params)
            found = params.pop("$defs")
            if not isinstance(found, dict):
                raise _bad(f"`$defs` in the parameters of tool '{fn['name']}' must be an object, got "
                           f"{type(found).__name__}.", "tools")
            for name, schema in found.items():
                if name in defs and defs[name] != schema:
                    raise _bad(f"Tool definition '{name}' has multiple schemas, which is not supported.", "tools")
                defs[name] = schema
        calls.append({"properties": {"name": {"type": "string", "enum": [fn["name"]]},
                                     "parameters": _params_or_empty(params)},
                      "required": ["name", "parameters"]})
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"type": "object", "anyOf": calls}}
    if not parallel:
        schema["maxItems"] = 1
    if defs:
        schema["$defs"] = defs
    return schema


def tool_constraint(tools: list[dict], choice: ToolChoice) -> StructuredOutputs | None:
    """The grammar a forced tool choice puts on the output (None for "none" and "auto")."""
    if choice.kind == "required":
        return StructuredOutputs(json=_json(required_schema(tools, choice.parallel)).decode())
    if choice.kind == "named":
        fn = next(t["function"] for t in tools if t["function"]["name"] == choice.name)
        return StructuredOutputs(json=_json(_params_or_empty(fn.get("parameters"))).decode())
    return None
