"""Structured output and tools at the proxy: what a request's response_format, structured_outputs, tools and
tool_choice become on the wire (vLLM's server's rules and messages), and how a forced tool choice's output is
answered as tool calls (daemons/proxy/api/structured.py, daemons/proxy/api/toolcalls.py)."""

from __future__ import annotations

import json

import msgspec
import pytest

from daemons import wire
from daemons.proxy.api.protocol import ApiError, ChatRequest, CompletionRequest, decode_body
from daemons.proxy.api.render import Choice, Job
from daemons.proxy.api.structured import ToolChoice, required_schema
from daemons.proxy.api.toolcalls import ToolCalls

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "the weather",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                          "required": ["city"]}}},
         {"type": "function", "function": {"name": "now"}}]


def chat(**extra) -> ChatRequest:
    body = {"model": "m", "messages": [{"role": "user", "content": "x"}], **extra}
    return decode_body(json.dumps(body).encode(), ChatRequest)


def completion(**extra) -> CompletionRequest:
    return decode_body(json.dumps({"model": "m", "prompt": "x", **extra}).encode(), CompletionRequest)


def refused(make, param: str | None, match: str, **extra) -> ApiError:
    with pytest.raises(ApiError, match=match) as exc:
        req = make(**extra)
        req.structured()
    assert exc.value.status == 400 and exc.value.param == param
    return exc.value


def test_response_format_and_structured_outputs_become_the_wire_constraint():
    assert completion().structured() is None
    assert completion(response_format={"type": "text"}).structured() is None
    assert completion(response_format={"type": "json_object"}).structured() == wire.StructuredOutputs(json_object=True)
    got = chat(response_format={"type": "json_schema", "json_schema": {"name": "n", "schema": SCHEMA}}).structured()
    assert json.loads(got.json) == SCHEMA and got.json_object is None
    assert completion(structured_outputs={"regex": "[a-z]+"}).structured() == wire.StructuredOutputs(regex="[a-z]+")
    assert chat(structured_outputs={"choice": ["a", "b"]}).structured().choice == ["a", "b"]
    assert completion(structured_outputs={"grammar": 'root ::= "x"'}).structured().grammar == 'root ::= "x"'
    assert completion(structured_outputs={"json": '{"type": "string"}'}).structured().json == '{"type": "string"}'
    both = completion(structured_outputs={"disable_any_whitespace": True}, response_format={"type": "json_object"})
    assert both.structured() == wire.StructuredOutputs(json_object=True, disable_any_whitespace=True)
    # it travels: sampling parameters carry it, encoded and decoded with the Submit
    sp = chat(response_format={"type": "json_object"})
    sub = wire.Submit("r", [1, 2], sp.sampling(5, None, sp.structured()), "tcp://127.0.0.1:5")
    assert wire.decode(wire.encode(sub)).sampling.structured == wire.StructuredOutputs(json_object=True)


def test_bad_constraints_are_400_with_vllms_messages():
    refused(chat, "response_format", "the 'json_schema' field must be provided", response_format={"type": "json_schema"})
    refused(chat, "response_format", "string `name`", response_format={"type": "json_schema", "json_schema": {}})
    refused(completion, "response_format", "must be one of", response_format={"type": "yaml"})
    refused(completion, "structured_outputs", r"only use one kind of constraints for structured outputs \('json'",
            structured_outputs={"regex": "a", "choice": ["a"]})
    refused(completion, "structured_outputs", "multiple are specified: regex, json_object",
            structured_outputs={"regex": "a"}, response_format={"type": "json_object"})
    refused(completion, "structured_outputs", "none are specified", structured_outputs={"disable_any_whitespace": True})
    with pytest.raises(ApiError) as exc:  # a field vLLM's StructuredOutputsParams does not have
        completion(structured_outputs={"regexp": "a"})
    assert exc.value.param == "structured_outputs"
    for name in ("guided_json", "guided_regex"):
        with pytest.raises(ApiError, match="removed from vLLM's API; use `structured_outputs`"):
            completion(**{name: "a"}).unsupported()


def test_tool_choice_is_checked_as_vllm_checks_it():
    assert chat().tool_choice_of() == ToolChoice("none")
    assert chat(tools=TOOLS).tool_choice_of().kind == "auto"  # the default with tools
    assert chat(tools=TOOLS, tool_choice="none").structured() is None
    for extra, param, match in [
        ({"tools": []}, "tools", "must not be an empty array"),
        ({"tool_choice": "required"}, "tool_choice", "`tools` must be set"),
        ({"tools": TOOLS, "tool_choice": "always"}, "tool_choice", "Invalid value for `tool_choice`"),
        ({"tools": TOOLS, "tool_choice": {"type": "function"}}, "tool_choice.function", "Invalid value for `function`"),
        ({"tools": TOOLS, "tool_choice": {"function": {}}}, "tool_choice.function.name", "Expected field `name`"),
        ({"tools": TOOLS, "tool_choice": {"function": {"name": "nope"}}}, "tool_choice", "does not match any"),
        ({"tools": [{"type": "function"}], "tool_choice": "required"}, "tools", r"tools\[0\] must be"),
        ({"tools": TOOLS, "tool_choice": {"function": {"name": "now"}}, "structured_outputs": {"regex": "a"}},
         "structured_outputs", "either use constraints for structured outputs or tools"),
    ]:
        refused(chat, param, match, **extra)


def test_forced_tool_choice_constrains_to_the_tools_schema():
    named = chat(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_weather"}},
                 response_format={"type": "json_object"})  # the tool's schema wins, as in vLLM
    assert json.loads(named.structured().json) == TOOLS[0]["function"]["parameters"]
    empty = chat(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "now"}})
    assert json.loads(empty.structured().json) == {"type": "object", "properties": {}}
    required = json.loads(chat(tools=TOOLS, tool_choice="required").structured().json)
    assert required == required_schema(TOOLS, True)
    assert required["type"] == "array" and required["minItems"] == 1 and "maxItems" not in required
    names = [c["properties"]["name"]["enum"] for c in required["items"]["anyOf"]]
    assert names == [["get_weather"], ["now"]]
    one = json.loads(chat(tools=TOOLS, tool_choice="required", parallel_tool_calls=False).structured().json)
    assert one["maxItems"] == 1
    with_defs = [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"p": {"$ref": "#/$defs/P"}}, "$defs": {"P": {"type": "integer"}}}}}]
    schema = required_schema(with_defs, True)
    assert schema["$defs"] == {"P": {"type": "integer"}}
    assert "$defs" not in schema["items"]["anyOf"][0]["properties"]["parameters"]
    assert "$defs" in with_defs[0]["function"]["parameters"]  # the request's tools are left as they came


def test_tools_and_tool_messages_reach_the_chat_template(tmp_path):
    from daemons.proxy.api.tokenizer import HFTokenizer
    from tokenizers import Tokenizer, models

    Tokenizer(models.BPE()).save(str(tmp_path / "tokenizer.json"))
    template = ("{% for t in tools or [] %}[{{ t.function.name }}]{% endfor %}"
                "{% for m in messages %}{{ m.role }}:{{ m.content }}{% if m.tool_calls %}"
                "{{ m.tool_calls[0].function.name }}{% endif %}{{ m.tool_call_id or '' }};{% endfor %}")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": template}))
    tok = HFTokenizer(tmp_path)
    req = chat(messages=[{"role": "user", "content": "hi"},
                         {"role": "assistant", "content": None,
                          "tool_calls": [{"id": "c1", "type": "function",
                                          "function": {"name": "now", "arguments": "{}"}}]},
                         {"role": "tool", "content": "12:00", "tool_call_id": "c1"}], tools=TOOLS)
    text = tok.apply_chat_template(req.prompt_messages(), True, None, req.tools)
    assert text == "[get_weather][now]user:hi;assistant:now;tool:12:00c1;"


# ---------------------------------------------------------------- tool calls in the answer


def ids():
    n = iter(range(100))
    return lambda: f"call-{next(n)}"


def test_tool_calls_of_a_whole_output():
    named = ToolCalls(ToolChoice("named", "get_weather"), ids())
    assert named.message('{"city": "Paris"}') == {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call-0", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]}
    assert named.finish_reason("stop") == "stop" and named.calls("  ") == []
    req = ToolCalls(ToolChoice("required"), ids())
    text = '[{"name": "get_weather", "parameters": {"city":"Zürich"}}, {"name": "now", "parameters": {}}]'
    calls = req.calls(text)
    assert [c["function"] for c in calls] == [{"name": "get_weather", "arguments": '{"city": "Zürich"}'},
                                             {"name": "now", "arguments": "{}"}]
    assert [c["id"] for c in calls] == ["call-0", "call-1"]
    assert req.finish_reason("stop") == "tool_calls" and req.finish_reason("length") == "length"
    assert req.calls('[{"name": "now", "parameters": {') == [] and req.calls('{"name": "now"}') == []
    assert len(ToolCalls(ToolChoice("required", parallel=False)).calls(text)) == 1


def _job(choice: ToolChoice, stream_text: list[str], reason: str = "stop") -> tuple[list[dict], dict]:
    """The SSE chunks and the whole response of a chat job whose one choice outputs these pieces."""

    class Pieces:  # a detokenizer that gives each piece for its index
        def add(self, token_id):
            return stream_text[token_id]

        def flush(self):
            return ""

    def outs(rng):
        return [wire.TokenOut("r", i, i, reason if i == len(stream_text) - 1 else None) for i in rng]

    chunks = []
    for whole in (False, True):
        job = Job(True, "x", 0.0)
        job.setup("m", 3, False, None, 0)
        job.tools = ToolCalls(choice, ids())
        job.timer = type("T", (), {"delivered": lambda *a: None})()
        c = Choice(job, 0, [], Pieces(), False)
        job.choices = [c]
        if whole:
            c.texts += job.consume(c, outs(range(len(stream_text))))
            return chunks, job.full_response()
        for i in range(len(stream_text)):
            body = job.render(c, outs([i]))
            chunks += [json.loads(line[6:]) for line in body.decode().split("\n\n") if line.startswith("data: {")]
    raise AssertionError("unreachable")


def test_streamed_tool_calls_in_openai_shape():
    chunks, whole = _job(ToolChoice("named", "get_weather"), ['{"city"', ': "Oslo"', "}"])
    deltas = [c["choices"][0]["delta"] for c in chunks]
    assert deltas[0] == {"tool_calls": [{"index": 0, "id": "call-0", "type": "function",
                                         "function": {"name": "get_weather", "arguments": '{"city"'}}]}
    assert deltas[1:3] == [{"tool_calls": [{"index": 0, "function": {"arguments": a}}]} for a in (': "Oslo"', "}")]
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop" and deltas[-1] == {}
    msg = whole["choices"][0]["message"]
    assert msg["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": '{"city": "Oslo"}'}
    assert msg["content"] == "" and whole["choices"][0]["finish_reason"] == "stop"

    chunks, whole = _job(ToolChoice("required"), ['[{"name": "now", ', '"parameters": {}}', "]"])
    with_calls = [c["choices"][0]["delta"] for c in chunks if c["choices"][0]["delta"]]
    assert with_calls == [{"tool_calls": [{"index": 0, "id": "call-0", "type": "function",
                                           "function": {"name": "now", "arguments": "{}"}}]}]
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
    assert whole["choices"][0]["finish_reason"] == "tool_calls"
    assert whole["choices"][0]["message"]["tool_calls"][0]["function"]["name"] == "now"
    assert msgspec.json.decode(msgspec.json.encode(whole))  # plain JSON
