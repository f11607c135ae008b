"""The answer to a chat request whose tool choice forced a call ("required" or a named function): its output,
constrained by the tools' JSON schemas (daemons/proxy/api/structured.py), becomes ``tool_calls`` in the OpenAI
shape, as vLLM 0.32's server shapes it.

- named: one call of that function, its arguments the output text as generated; finish_reason as the engine's.
- required: the output is a JSON array of ``{"name": ..., "parameters": {...}}``; each element is a call with
  ``arguments`` = the parameters as JSON; finish_reason "tool_calls" where the engine's was "stop".

The message's content is "" (vLLM's). Streamed, a named call goes out as it is generated (its id, name and the
first text in the first delta, then argument pieces); "required" calls go out whole in the last delta, once
the array is complete.
"""

from __future__ import annotations

import json
import os
from typing import Callable

import msgspec

from daemons.proxy.api.structured import ToolChoice

_json = msgspec.json.encode


def new_call_id() -> str:
    return f"chatcmpl-tool-{os.urandom(16).hex()}"  # vLLM's form (make_tool_call_id)


class ToolCalls:
    """Shapes every choice's output of one request as tool calls; knows what each streamed choice sent."""

    def __init__(self, choice: ToolChoice, new_id: Callable[[], str] = new_call_id):
        self.choice = choice
        self._new_id = new_id
        self._started: set[int] = set()  # named: choices whose call's first delta (id, name) went out
        self._texts: dict[int, list[str]] = {}  # required: each streamed choice's text so far

    def calls(self, text: str) -> list[dict]:
        """The calls a whole output makes (none when it is not a complete array of calls)."""
        if self.choice.kind == "named":
            if not text.strip():
                return []
            return [self._call(self.choice.name, text)]
        try:
            parsed = json.loads(text)
        except ValueError:
            return []
        if not isinstance(parsed, list) or not all(isinstance(p, dict) and isinstance(p.get("name"), str)
                                                   for p in parsed):
            return []
        calls = [self._call(p["name"], json.dumps(p.get("parameters"), ensure_ascii=False)) for p in parsed]
        return calls[:1] if not self.choice.parallel else calls

    def _call(self, name: str, arguments: str) -> dict:
        return {"id": self._new_id(), "type": "function", "function": {"name": name, "arguments": arguments}}

    def finish_reason(self, reason: str | None) -> str | None:
        return "tool_calls" if self.choice.kind == "required" and reason == "stop" else reason

    def message(self, text: str) -> dict:
        """A non-streamed choice's message."""
        return {"role": "assistant", "content": "", "tool_calls": self.calls(text)}

    def delta(self, index: int, text: str, finished: bool) -> dict | None:
        """A streamed choice's delta for a new piece of its output (None: nothing to send yet)."""
        if self.choice.kind == "named":
            if not text:
                return None
            if index in self._started:
                return {"tool_calls": [{"index": 0, "function": {"arguments": text}}]}
            self._started.add(index)
            return {"tool_calls": [{"index": 0, **self._call(self.choice.name, text)}]}
        parts = self._texts.setdefault(index, [])
        parts.append(text)
        if not finished:
            return None
        calls = self.calls("".join(self._texts.pop(index)))
        return {"tool_calls": [{"index": i, **call} for i, call in enumerate(calls)]} if calls else None

    def chunk(self, head: bytes, index: int, text: str, finished: bool, logprobs: dict | None) -> bytes:
        """The SSE chunk of a piece of a choice's output (b"" when there is nothing to send)."""
        delta = self.delta(index, text, finished)
        if delta is None and logprobs is None:
            return b""
        choice = {"index": index, "delta": delta or {}, "logprobs": logprobs, "finish_reason": None}
        return head + _json(choice) + b"]}\n\n"
