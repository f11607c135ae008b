"""How one API request's token outputs become OpenAI text: its choices' text pieces, the SSE chunks of a
stream (bytes, ready to write), the body of a non-streamed response, and logprobs as vLLM renders them.

The common stream (no stop strings, logprobs or token ids) takes the short way per token: the detokenizer's
text, one chunk from a pre-rendered head and tail around the JSON string, and one write per batch of tokens
(daemons/proxy/service.py).
"""

from __future__ import annotations

import operator
import os

import msgspec

from daemons import metrics, wire
from daemons.proxy.cluster.stream import Stream
from daemons.proxy.api.protocol import StopChecker
from daemons.proxy.api.tokenizer import Detokenizer
from daemons.proxy.api.toolcalls import ToolCalls

_json = msgspec.json.encode
_token_id = operator.attrgetter("token_id")
_finish_reason = operator.attrgetter("finish_reason")


class Choice:
    """One sequence of a request: its stream, detokenizer, stop strings and what it has rendered."""

    __slots__ = ("index", "detok", "stop", "plain", "lp", "lp_offset", "token_ids", "completion_tokens", "stream",
                 "reason", "texts", "_text_head", "_text_tail", "_text_between")

    def __init__(self, job: "Job", index: int, stops: list[str], detok: Detokenizer, want_ids: bool):
        self.index = index
        self.detok = detok
        self.stop = StopChecker(stops)
        self.plain = not stops and not want_ids and job.token_text is None  # the short way (Job.consume)
        self.lp: list[tuple[int, float | None, list | None]] = []  # (token id, logprob, top) not yet sent
        self.lp_offset = 0  # completions' text_offset of the next entry
        self.token_ids: list[int] | None = [] if want_ids else None  # when return_token_ids was asked for
        self.completion_tokens = 0
        self.stream: Stream | None = None
        self.reason: str | None = None  # finish reason, once finished
        self.texts: list[str] = []  # a non-streamed response's text pieces
        self._text_head = job._head + (f'{{"index":{index},"delta":{{"content":' if job.chat
                                       else f'{{"index":{index},"text":').encode()
        self._text_tail = (b'},"logprobs":null,"finish_reason":null}]}\n\n' if job.chat
                           else b',"logprobs":null,"finish_reason":null}]}\n\n')
        self._text_between = self._text_tail + self._text_head

    def text_chunk(self, text: str) -> bytes:
        return self._text_head + _json(text) + self._text_tail

    def text_chunks(self, texts: list[str]) -> bytes:
        """One chunk per text, as ``text_chunk`` writes each, in one join."""
        if not texts:
            return b""
        return self._text_head + self._text_between.join(map(_json, texts)) + self._text_tail


class Job:
    """One accepted API request: what it asked for, how its output is rendered, and its access-log record."""

    def __init__(self, chat: bool, request_id: str | None, arrival: float, created: float = 0.0):
        """``arrival``: the proxy's Clock.monotonic() when it came (its latencies); ``created``: wall-clock
        seconds, its answer's ``created`` (the proxy's clock.time())."""
        self.chat = chat
        self.id = ("chatcmpl-" if chat else "cmpl-") + (request_id if request_id is not None else os.urandom(16).hex())
        self.created = int(created)
        self.arrival = arrival
        self.first_at: float | None = None  # the proxy's Clock.monotonic() at the first token of any choice
        self.timer: metrics.RequestTimer | None = None  # its latencies, once its choices are known
        self.model = ""
        self.prompt_tokens = 0
        self.include_usage = False
        self.token_text = None  # set when logprobs were asked for
        self.top_n = 0  # alternatives per token: completions' logprobs, chat's top_logprobs
        self.choices: list[Choice] = []
        self.status = 200
        self.key_name = "-"  # the name of its API key (proxy.api_keys_file), never the key
        self.principal = None  # that key (daemons/proxy/front/apikeys.py Principal), or None without keys
        self.ticket = None  # its place in the key's limits (daemons/proxy/front/tenants.py)
        self.logged = False
        self.ended = False
        self.trace = None  # its span (daemons/proxy/cluster/traces.py RequestTrace), with tracing on
        self.priority = 0
        self.slo = None  # its SLO class and targets (daemons/policy/slo.py RequestSlo), once admitted
        self.fits: tuple[str, ...] = ()  # (admission by SLO) the instances predicted to meet its TTFT target
        self.tools: ToolCalls | None = None  # a forced tool choice: the output is answered as tool calls
        self.adapter = ""  # the LoRA adapter its model names ("": the base model)
        self._head = b""

    def setup(self, model: str, prompt_tokens: int, include_usage: bool, token_text, top_n: int) -> None:
        self.model, self.prompt_tokens, self.include_usage = model, prompt_tokens, include_usage
        self.token_text, self.top_n = token_text, top_n
        self._head = (f'data: {{"id":{_json(self.id).decode()},"object":"{"chat.completion.chunk" if self.chat else "text_completion"}",'
                      f'"created":{self.created},"model":{_json(model).decode()},"choices":[').encode()

    @property
    def completion_tokens(self) -> int:
        return sum(c.completion_tokens for c in self.choices)

    def usage(self) -> dict:
        done = self.completion_tokens
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": done, "total_tokens": self.prompt_tokens + done}

    # ------------------------------------------------------------------ tokens to text

    def consume(self, c: Choice, outs: list[wire.TokenOut]) -> list[str]:
        """Turn token outputs into text pieces; sets c.reason once the choice finished."""
        self.timer.delivered(c.index, len(outs))
        if c.plain:
            return self._consume_plain(c, outs)
        pieces, add, stop = [], c.detok.add, c.stop
        for out in outs:
            c.completion_tokens += 1
            if self.token_text is not None:
                c.lp.append((out.token_id, out.logprob, out.top))
            if c.token_ids is not None:
                c.token_ids.append(out.token_id)
            text, stopped = stop.feed(add(out.token_id))
            if not stopped and out.finish_reason is not None:
                more, stopped = stop.feed(c.detok.flush())
                text += more
            if text:
                pieces.append(text)
            if stopped:
                c.reason = "stop"
                return pieces
            if out.finish_reason is not None:
                tail = stop.flush()
                if tail:
                    pieces.append(tail)
                c.reason = out.finish_reason
                return pieces
        return pieces

    @staticmethod
    def _consume_plain(c: Choice, outs: list[wire.TokenOut]) -> list[str]:
        """consume() without stop strings, logprobs or token ids: each token's text as it comes."""
        reasons = list(map(_finish_reason, outs))
        ended = len(outs) - reasons.count(None)
        if not ended or (ended == 1 and reasons[-1] is not None):  # none finished, or the last only: per batch
            texts = list(map(c.detok.add, map(_token_id, outs)))
            c.completion_tokens += len(outs)
            if ended:
                texts[-1] += c.detok.flush()
                c.reason = reasons[-1]
            return list(filter(None, texts))
        pieces, add = [], c.detok.add
        for out in outs:
            c.completion_tokens += 1
            text = add(out.token_id)
            if out.finish_reason is not None:
                text += c.detok.flush()
                if text:
                    pieces.append(text)
                c.reason = out.finish_reason
                return pieces
            if text:
                pieces.append(text)
        return pieces

    def render(self, c: Choice, outs: list[wire.TokenOut]) -> bytes:
        """The SSE chunks of a batch of one choice's outputs (its final chunk too, once it finished)."""
        pieces = self.consume(c, outs)
        if self.tools is not None:
            chunk = self.tools.chunk(self._head, c.index, "".join(pieces), c.reason is not None,
                                     self.take_logprobs(c))
        elif c.plain:
            chunk = c.text_chunks(pieces)
        else:
            chunk = self.rich_chunk(c, "".join(pieces))
        if c.reason is not None:
            chunk += self.final_chunk(c)
        return chunk

    # ------------------------------------------------------------------ chunks and bodies

    def first_chunks(self) -> bytes:
        return b"".join(self._head + f'{{"index":{c.index},"delta":{{"role":"assistant","content":""}},"logprobs":null,'
                        '"finish_reason":null}]}\n\n'.encode() for c in self.choices)

    def final_chunk(self, c: Choice) -> bytes:
        reason = c.reason if self.tools is None else self.tools.finish_reason(c.reason)
        choice = {"index": c.index, "logprobs": None, "finish_reason": reason}
        choice.update({"delta": {}} if self.chat else {"text": ""})
        return self._head + _json(choice) + b"]}\n\n"

    def end_chunks(self) -> bytes:
        out = self._head + b'],"usage":' + _json(self.usage()) + b"}\n\n" if self.include_usage else b""
        return out + b"data: [DONE]\n\n"

    def take_logprobs(self, c: Choice) -> dict | None:
        """The OpenAI logprobs object for the tokens consumed since the last call, as vLLM renders it:
        completions' top_logprobs holds the sampled token and the top ``logprobs`` alternatives (one dict per
        token), chat's the first ``top_logprobs`` of those (sampled token first, duplicates once)."""
        if self.token_text is None:
            return None
        entries, c.lp = c.lp, []
        text, k = self.token_text, self.top_n
        if self.chat:
            content = []
            for tid, lp, top in entries:
                t = text(tid)
                alts = []
                if k:
                    ranked = {tid: lp}
                    for alt, alt_lp in top or ():
                        ranked[alt] = alt_lp
                    for alt, alt_lp in list(ranked.items())[:k]:
                        at = text(alt)
                        alts.append({"token": at, "logprob": _clamp(alt_lp), "bytes": list(at.encode("utf-8", "replace"))})
                content.append({"token": t, "logprob": _clamp(lp), "bytes": list(t.encode("utf-8", "replace")),
                                "top_logprobs": alts})
            return {"content": content}
        tokens, offsets, top_logprobs = [], [], []
        for tid, lp, top in entries:
            t = text(tid)
            tokens.append(t)
            offsets.append(c.lp_offset)
            c.lp_offset += len(t)
            ranked = {tid: lp}
            for alt, alt_lp in top or ():
                ranked[alt] = alt_lp
            top_logprobs.append({text(alt): _clamp(alt_lp) for alt, alt_lp in list(ranked.items())[:k + 1]})
        return {"tokens": tokens, "token_logprobs": [_clamp(lp) for _, lp, _ in entries],
                "top_logprobs": top_logprobs, "text_offset": offsets}

    def rich_chunk(self, c: Choice, text: str) -> bytes:
        """A chunk with logprobs or token ids (the slower general path, used only when asked for)."""
        choice = {"index": c.index, "logprobs": self.take_logprobs(c), "finish_reason": None}
        choice.update({"delta": {"content": text}} if self.chat else {"text": text})
        if c.token_ids is not None:
            choice["token_ids"], c.token_ids = c.token_ids, []
        return self._head + _json(choice) + b"]}\n\n"

    def full_response(self) -> dict:
        choices = []
        for c in self.choices:
            text, lp = "".join(c.texts), self.take_logprobs(c)
            if self.tools is not None:
                choice = {"index": c.index, "message": self.tools.message(text), "logprobs": lp,
                          "finish_reason": self.tools.finish_reason(c.reason)}
            elif self.chat:
                choice = {"index": c.index, "message": {"role": "assistant", "content": text}, "logprobs": lp,
                          "finish_reason": c.reason}
            else:
                choice = {"index": c.index, "text": text, "logprobs": lp, "finish_reason": c.reason}
            if c.token_ids is not None:
                choice["token_ids"] = c.token_ids
            choices.append(choice)
        return {"id": self.id, "object": "chat.completion" if self.chat else "text_completion",
                "created": self.created, "model": self.model, "choices": choices, "usage": self.usage()}

    def streams(self) -> list[Stream]:
        return [c.stream for c in self.choices if c.stream is not None]


def token_id_text(token_id: int) -> str:
    return f"token_id:{token_id}"


def _clamp(lp: float | None) -> float | None:
    return None if lp is None else max(lp, -9999.0)  # -inf is not JSON; OpenAI's and vLLM's floor
