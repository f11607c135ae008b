"""llumnix-proxy: OpenAI-compatible HTTP API over the cluster.

Tokenizes, asks the manager where the request goes, forwards it, and streams the tokens back in order.
Routes: /v1/completions, /v1/chat/completions (streamed or not, with usage), /v1/models, /v1/models/{id},
/tokenize, /detokenize, /version, /health, /metrics, /openapi.json (and /docs).

- ``n > 1``: the proxy fans out n requests of its own, ``<id>-0`` .. ``<id>-<n-1>``, each dispatched like any
  other (so the n sequences may run on different instances and migrate independently), with the same
  sampling; a seeded request gives the k-th one seed + k (as vLLM does). Their outputs merge into one
  response: n choices (index 0..n-1), usage counting the prompt once and every completion token; a stream
  interleaves the choices' chunks, each with its index, a finish chunk per choice, then one usage chunk.
  If one of them fails, the whole response fails (the others are aborted).
- Request ids: ``cmpl-<hex>`` / ``chatcmpl-<hex>``, or with an ``x-request-id`` header ``cmpl-<header>`` /
  ``chatcmpl-<header>`` (vLLM's form). The header must be 1..128 visible ASCII characters (else 400), and a
  request whose id is in flight on this proxy is refused with 409 (``code: request_id_in_use``). The id is
  the response ``id`` and the id ``llumnixctl requests`` shows; the response's ``x-request-id`` header is
  the client's value (or the generated id).
- Access log: one info line per completion or chat request on logger ``llumnix.access`` (id, model,
  instance, status, prompt and completion tokens, TTFT, total time, finish reason; the same as ``extra``
  fields for a JSON formatter), and the name of the request's API key; ``proxy.access_log = false`` turns it
  off.
- API keys: with ``proxy.api_keys_file`` (see daemons/proxy/apikeys.py), every /v1 route and /tokenize,
  /detokenize need ``Authorization: Bearer KEY`` (else 401), and priority high needs a key with
  ``high_priority = true`` (else 403). ``/metrics`` needs the token of ``security.metrics_token_file`` when
  that is set. ``/health``, ``/version``, ``/openapi.json`` and ``/docs`` stay open.
- Limits: a body larger than ``proxy.max_body_bytes`` is refused with 413 (by its Content-Length, or as it
  arrives), a prompt longer than ``proxy.max_prompt_tokens`` with 400.
"""

from __future__ import annotations

import asyncio
import logging
import re
import signal
import socket
import time
import uuid
import weakref
from typing import Annotated, AsyncIterator, Optional

import msgspec
import typer
import uvicorn
from fastapi import FastAPI, Request
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from daemons import metrics, runtime, security, wire
from daemons.cli import load_or_exit, package_version
from daemons.config import Config
from daemons.proxy.apikeys import ApiKeys, ApiKeysError, Principal, check_token
from daemons.proxy.cluster import ClusterClient, NoInstance, Stream
from daemons.proxy.protocol import (
    ApiError, ChatRequest, CompletionRequest, DetokenizeRequest, ErrorResponse, StopChecker, TokenizeRequest,
    decode_body, derive_seed, document_schemas, openapi_components, parse_priority,
)
from daemons.proxy.tokenizer import Detokenizer, Tokenizer, TokenizerError, load_tokenizer

log = logging.getLogger("llumnix.proxy")
access_log = logging.getLogger("llumnix.access")

# Defined in daemons/metrics.py, with the latencies of each request (Job.timer).
M_REQUESTS = metrics.P_REQUESTS
M_INFLIGHT = metrics.P_IN_FLIGHT
M_TOKENS = metrics.P_GENERATION_TOKENS

_json = msgspec.json.encode
_REQUEST_ID = re.compile(r"[!-~]{1,128}")  # visible ASCII: safe in logs, tables and headers


class Choice:
    """One sequence of a request: its stream, detokenizer, stop strings and what it has rendered."""

    __slots__ = ("index", "detok", "stop", "lp", "lp_offset", "token_ids", "completion_tokens", "stream", "reason",
                 "texts", "_text_head", "_text_tail")

    def __init__(self, job: "Job", index: int, stops: list[str], detok: Detokenizer, want_ids: bool):
        self.index = index
        self.detok = detok
        self.stop = StopChecker(stops)
        self.lp: list[tuple[int, float | None, list | None]] = []  # (token id, logprob, top) not yet sent
        self.lp_offset = 0  # completions' text_offset of the next entry
        self.token_ids: list[int] | None = [] if want_ids else None  # when return_token_ids was asked for
        self.completion_tokens = 0
        self.stream: Stream | None = None
        self.reason: str | None = None  # finish reason, once finished
        self.texts: list[str] = []  # a non-streamed response's text pieces
        self._text_head = job._head + (f'{{"index":{index},"delta":{{"content":' if job.chat else f'{{"index":{index},"text":')
        self._text_tail = ('},"logprobs":null,"finish_reason":null}]}\n\n' if job.chat
                           else ',"logprobs":null,"finish_reason":null}]}\n\n')

    def text_chunk(self, text: str) -> str:
        return self._text_head + _json(text).decode() + self._text_tail


class Job:
    """One accepted API request: what it asked for, how its output is rendered, and its access-log record."""

    def __init__(self, chat: bool, request_id: str | None, arrival: float):
        self.chat = chat
        self.id = ("chatcmpl-" if chat else "cmpl-") + (request_id if request_id is not None else uuid.uuid4().hex)
        self.created = int(time.time())
        self.arrival = arrival
        self.first_at: float | None = None  # perf_counter of the first token of any choice
        self.timer: metrics.RequestTimer | None = None  # its latencies, once its choices are known
        self.model = ""
        self.prompt_tokens = 0
        self.include_usage = False
        self.token_text = None  # set when logprobs were asked for
        self.top_n = 0  # alternatives per token: completions' logprobs, chat's top_logprobs
        self.choices: list[Choice] = []
        self.status = 200
        self.key_name = "-"  # the name of its API key (proxy.api_keys_file), never the key
        self.logged = False
        self.ended = False
        self._head = ""

    def setup(self, model: str, prompt_tokens: int, include_usage: bool, token_text, top_n: int) -> None:
        self.model, self.prompt_tokens, self.include_usage = model, prompt_tokens, include_usage
        self.token_text, self.top_n = token_text, top_n
        self._head = (f'data: {{"id":{_json(self.id).decode()},"object":"{"chat.completion.chunk" if self.chat else "text_completion"}",'
                      f'"created":{self.created},"model":{_json(model).decode()},"choices":[')

    @property
    def completion_tokens(self) -> int:
        return sum(c.completion_tokens for c in self.choices)

    def usage(self) -> dict:
        done = self.completion_tokens
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": done, "total_tokens": self.prompt_tokens + done}

    def first_chunks(self) -> str:
        return "".join(self._head + f'{{"index":{c.index},"delta":{{"role":"assistant","content":""}},"logprobs":null,'
                       '"finish_reason":null}]}\n\n' for c in self.choices)

    def final_chunk(self, c: Choice) -> str:
        choice = {"index": c.index, "logprobs": None, "finish_reason": c.reason}
        choice.update({"delta": {}} if self.chat else {"text": ""})
        return self._head + _json(choice).decode() + "]}\n\n"

    def end_chunks(self) -> str:
        out = self._head + '],"usage":' + _json(self.usage()).decode() + "}\n\n" if self.include_usage else ""
        return out + "data: [DONE]\n\n"

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

    def rich_chunk(self, c: Choice, text: str) -> str:
        """A chunk with logprobs or token ids (the slower general path, used only when asked for)."""
        choice = {"index": c.index, "logprobs": self.take_logprobs(c), "finish_reason": None}
        choice.update({"delta": {"content": text}} if self.chat else {"text": text})
        if c.token_ids is not None:
            choice["token_ids"], c.token_ids = c.token_ids, []
        return self._head + _json(choice).decode() + "]}\n\n"

    def full_response(self) -> dict:
        choices = []
        for c in self.choices:
            text, lp = "".join(c.texts), self.take_logprobs(c)
            if self.chat:
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


def _token_id_text(token_id: int) -> str:
    return f"token_id:{token_id}"


def _clamp(lp: float | None) -> float | None:
    return None if lp is None else max(lp, -9999.0)  # -inf is not JSON; OpenAI's and vLLM's floor


class Proxy:
    def __init__(self, cfg: Config):
        self.cfg = cfg
        self.model = cfg.model.name
        self.max_model_len = cfg.model.max_model_len
        self.tokenizer: Tokenizer = load_tokenizer(cfg.model.path, cfg.sim.vocab_size, cfg.sim.eos_token_id)
        self.keys: ApiKeys | None = ApiKeys.load(cfg.proxy.api_keys_file) if cfg.proxy.api_keys_file else None
        self.cluster = ClusterClient(cfg)
        self.access_log = cfg.proxy.access_log
        self.active: set[str] = set()  # ids of the requests this proxy is serving
        self.max_prompt_tokens = cfg.proxy.max_prompt_tokens  # 0: only the context limit

    # ------------------------------------------------------------------ request intake

    def _check_model(self, model: str | None) -> None:
        if model is not None and model != self.model:
            raise ApiError(404, f"The model `{model}` does not exist. This proxy serves `{self.model}`.", "model",
                           code="model_not_found")

    def _prompt_ids(self, req: CompletionRequest) -> list[int]:
        prompt = req.prompt
        if isinstance(prompt, list) and any(isinstance(p, str) for p in prompt):
            if len(prompt) != 1:
                raise ApiError(400, "prompt must be a string, a list of one string, or a list of token ids; "
                                    "send one request per prompt", "prompt")
            prompt = prompt[0]
        if isinstance(prompt, str):
            ids = self.tokenizer.encode(prompt)
        else:
            ids = list(prompt)
            if any(t < 0 for t in ids):
                raise ApiError(400, "token ids in prompt must be >= 0", "prompt")
        if not ids:
            raise ApiError(400, "prompt is empty", "prompt")
        return ids

    def _chat_prompt(self, req: ChatRequest | TokenizeRequest, add_generation_prompt: bool) -> str:
        try:
            return self.tokenizer.apply_chat_template(req.prompt_messages(), add_generation_prompt,
                                                      req.chat_template_kwargs)
        except TokenizerError as exc:
            raise ApiError(400, str(exc), "messages") from None

    def _limits(self, prompt_len: int, max_tokens: int | None, default: int | None, prompt_param: str) -> int:
        if self.max_prompt_tokens and prompt_len > self.max_prompt_tokens:
            raise ApiError(400, f"This proxy accepts prompts of at most {self.max_prompt_tokens} tokens "
                                f"(proxy.max_prompt_tokens). However, your prompt has {prompt_len} tokens.",
                           prompt_param, code="prompt_too_long")
        room = self.max_model_len - prompt_len
        if room < 1:
            raise ApiError(400, f"This model's maximum context length is {self.max_model_len} tokens. However, your "
                                f"prompt has {prompt_len} tokens, leaving no room for output.", prompt_param)
        if max_tokens is None:
            max_tokens = room if default is None else min(default, room)
        if prompt_len + max_tokens > self.max_model_len:
            raise ApiError(400, f"This model's maximum context length is {self.max_model_len} tokens. However, you "
                                f"requested {prompt_len + max_tokens} tokens ({prompt_len} in the prompt, {max_tokens} "
                                f"for the completion). Please reduce the prompt or max_tokens.", "max_tokens")
        return max_tokens

    def _request_id(self, request: Request) -> str | None:
        """The client's x-request-id, validated (None when there is none)."""
        value = request.headers.get("x-request-id")
        if value is None:
            return None
        if not _REQUEST_ID.fullmatch(value):
            raise ApiError(400, "x-request-id must be 1 to 128 visible ASCII characters (no spaces)", "x-request-id",
                           code="invalid_request_id")
        request.state.echo_id = value
        return value

    async def completions(self, request: Request) -> Response:
        return await self._handle(request, chat=False)

    async def chat(self, request: Request) -> Response:
        return await self._handle(request, chat=True)

    async def _handle(self, request: Request, chat: bool) -> Response:
        """One completion or chat request; logs it once it is answered (a stream: once it ends)."""
        arrival = time.perf_counter()
        job = None
        principal: Principal | None = getattr(request.state, "principal", None)
        key_name = principal.name if principal is not None else "-"
        try:
            job = Job(chat, self._request_id(request), arrival)
            job.key_name = key_name
            response = await self._accept(request, job)
        except ApiError as exc:
            if job is None:
                self._access(None, chat, arrival, exc.status, key_name)
            else:
                job.status = exc.status
                self._access(job, chat, arrival, exc.status)
            raise
        except BaseException:
            self._access(job, chat, arrival, 500)
            raise
        if not isinstance(response, StreamingResponse):  # a stream logs itself when it ends
            self._access(job, chat, arrival, response.status_code)
        return response

    async def _accept(self, request: Request, job: Job) -> Response:
        body = decode_body(await request.body(), ChatRequest if job.chat else CompletionRequest)
        job.model = body.model
        self._check_model(body.model)
        body.unsupported()
        if job.chat:
            prompt = self._chat_prompt(body, body.add_generation_prompt)
            ids = self.tokenizer.encode(prompt, add_special_tokens=False)
            max_tokens = self._limits(len(ids), body.max_completion_tokens or body.max_tokens, None, "messages")
            top_n = body.top_logprobs or 0
            sampling = body.sampling(max_tokens, top_n if body.logprobs else None)
        else:
            ids = self._prompt_ids(body)
            max_tokens = self._limits(len(ids), body.max_tokens, 16, "prompt")
            top_n = body.logprobs or 0
            sampling = body.sampling(max_tokens, body.logprobs)
        return await self._serve(request, job, body, ids, sampling, top_n)

    def _in_flight(self, job: Job, sub_ids: list[str]) -> bool:
        return job.id in self.active or any(rid in self.cluster.streams for rid in sub_ids)

    async def _serve(self, request: Request, job: Job, req, ids: list[int], sampling: wire.SamplingParams,
                     top_n: int) -> Response:
        priority = parse_priority(req.priority, request.headers.get("x-llumnix-priority"))
        principal: Principal | None = getattr(request.state, "principal", None)
        if priority > 0 and principal is not None and not principal.high_priority:
            raise ApiError(403, f"The API key '{principal.name}' may not send priority high: it lacks the "
                                f"high_priority permission (high_priority = true in proxy.api_keys_file).",
                           "priority", type_="invalid_request_error", code="permission_denied")
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        token_text = None
        if sampling.logprobs is not None:
            token_text = _token_id_text if req.return_tokens_as_token_ids else self.tokenizer.token_text
        job.setup(self.model, len(ids), include_usage, token_text, top_n)
        stops = req.stop_strings()
        n = req.n
        job.choices = [Choice(job, k, stops, self.tokenizer.detokenizer(), req.return_token_ids) for k in range(n)]
        job.timer = metrics.RequestTimer(job.arrival, len(ids), n)
        sub_ids = [job.id] if n == 1 else [f"{job.id}-{k}" for k in range(n)]
        if self._in_flight(job, sub_ids):
            raise ApiError(409, f"a request with id {job.id!r} is in flight on this proxy; ids must be unique",
                           "x-request-id", code="request_id_in_use")
        now = time.time()
        submits = [wire.Submit(rid, ids, sampling if n == 1 else msgspec.structs.replace(
            sampling, seed=derive_seed(sampling.seed, k)), self.cluster.token_address, priority, now)
            for k, rid in enumerate(sub_ids)]
        self.active.add(job.id)
        handed_over = False  # to the streaming response, which cleans up when it ends
        try:
            await self._submit(job, submits)
            firsts = await _unless_disconnected(request, asyncio.gather(*(self._first(job, c) for c in job.choices)))
            if firsts is None:  # the client went away before the first token: abort it on its instance
                return Response(status_code=499)
            for c, first in zip(job.choices, firsts):
                if not first:
                    raise ApiError(c.stream.status, c.stream.error or "request failed")
            job.timer.first_token(job.first_at)
            headers = {"x-request-id": getattr(request.state, "echo_id", job.id)}
            if req.stream:
                body = self._sse(job, firsts)
                # A client gone before the body starts means the generator never runs (nor its finally).
                weakref.finalize(body, self._abandoned, job).atexit = False  # not at exit: the cluster is gone
                response = StreamingResponse(body, media_type="text/event-stream", headers=headers)
                handed_over = True
                return response
            M_INFLIGHT.inc()
            try:
                failed = await _unless_disconnected(request, self._collect(job, firsts))
            finally:
                M_INFLIGHT.dec()
            if failed is None:
                return Response(status_code=499)
            if failed is not True:
                raise ApiError(failed.stream.status, failed.stream.error or "request failed")
            return JSONResponse(job.full_response(), headers=headers)
        finally:
            if not handed_over:
                self._end(job)  # a client that went away: this aborts the request on its instances

    async def _submit(self, job: Job, submits: list[wire.Submit]) -> None:
        if len(submits) == 1:
            try:
                job.choices[0].stream = await self.cluster.submit(submits[0])
            except NoInstance as exc:
                raise ApiError(503, f"no instance can take the request: {exc}", type_="service_unavailable") from None
            return
        results = await asyncio.gather(*(self.cluster.submit(s) for s in submits), return_exceptions=True)
        for c, res in zip(job.choices, results):
            if isinstance(res, Stream):
                c.stream = res
        for res in results:
            if isinstance(res, NoInstance):
                raise ApiError(503, f"no instance can take the request: {res}", type_="service_unavailable")
            if isinstance(res, BaseException):
                raise res

    async def _first(self, job: Job, c: Choice) -> list[wire.TokenOut]:
        outs = await c.stream.take()
        if outs and job.first_at is None:
            job.first_at = time.perf_counter()
        return outs

    def _end(self, job: Job) -> None:
        """Forget the request's streams (aborting what still runs) and its id; once (a later request may
        reuse the id)."""
        if job.ended:
            return
        job.ended = True
        if job.timer is not None:  # each placed choice: its finish reason, or why it ended without one
            job.timer.finished([None if c.stream is None else c.reason or ("error" if c.stream.error else "abort")
                                for c in job.choices])
        for stream in job.streams():
            self.cluster.finish(stream)
        self.active.discard(job.id)

    def _abandoned(self, job: Job) -> None:
        self._end(job)
        self._access(job, job.chat, job.arrival, 499)

    def _access(self, job: Job | None, chat: bool, arrival: float, status: int, key_name: str = "-") -> None:
        if job is not None:
            if job.logged:
                return
            job.logged = True
        if not self.access_log or not access_log.isEnabledFor(logging.INFO):
            return
        now = time.perf_counter()
        streams = job.streams() if job is not None else []
        reasons = [c.reason for c in job.choices if c.reason] if job is not None else []
        rec = {
            "request_id": job.id if job is not None else "-",
            "route": "/v1/chat/completions" if chat else "/v1/completions",
            "model": (job.model if job is not None else "") or "-",
            "instance": ",".join(dict.fromkeys(s.instance_id for s in streams if s.instance_id)) or "-",
            "status": status,
            "n": len(job.choices) if job is not None and job.choices else 1,
            "prompt_tokens": job.prompt_tokens if job is not None else 0,
            "completion_tokens": job.completion_tokens if job is not None else 0,
            "ttft_ms": round((job.first_at - arrival) * 1000, 1) if job is not None and job.first_at else None,
            "total_ms": round((now - arrival) * 1000, 1),
            "finish_reason": ",".join(dict.fromkeys(reasons)) or None,
            "key_name": job.key_name if job is not None else key_name,
        }
        access_log.info("access %s %s model=%s instance=%s status=%d prompt_tokens=%d completion_tokens=%d ttft_ms=%s "
                        "total_ms=%.1f finish_reason=%s key_name=%s", rec["request_id"], rec["route"], rec["model"],
                        rec["instance"], status, rec["prompt_tokens"], rec["completion_tokens"],
                        "-" if rec["ttft_ms"] is None else rec["ttft_ms"], rec["total_ms"], rec["finish_reason"] or "-",
                        rec["key_name"], extra=rec)

    # ------------------------------------------------------------------ output

    def _consume(self, job: Job, c: Choice, outs: list[wire.TokenOut]) -> list[str]:
        """Turn token outputs into text pieces; sets c.reason once the choice finished."""
        job.timer.delivered(c.index, len(outs))
        pieces, add, stop = [], c.detok.add, c.stop
        for out in outs:
            c.completion_tokens += 1
            if job.token_text is not None:
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

    async def _collect(self, job: Job, firsts: list[list[wire.TokenOut]]) -> Choice | bool:
        """Collect every choice's text; True when all finished, else the choice whose stream failed."""
        for c, outs in zip(job.choices, firsts):
            c.texts += self._consume(job, c, outs)
        if len(job.choices) == 1:
            c = job.choices[0]
            while c.reason is None:
                outs = await c.stream.take()
                if not outs:
                    return c
                c.texts += self._consume(job, c, outs)
        else:
            pending = {asyncio.ensure_future(c.stream.take()): c for c in job.choices if c.reason is None}
            try:
                while pending:
                    done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                    for fut in done:
                        c = pending.pop(fut)
                        outs = fut.result()
                        if not outs:
                            return c
                        c.texts += self._consume(job, c, outs)
                        if c.reason is None:
                            pending[asyncio.ensure_future(c.stream.take())] = c
            finally:
                for fut in pending:
                    fut.cancel()
        M_TOKENS.inc(job.completion_tokens)
        return True

    def _render(self, job: Job, c: Choice, outs: list[wire.TokenOut]) -> str:
        pieces = self._consume(job, c, outs)
        if job.token_text is None and c.token_ids is None:
            chunk = "".join(map(c.text_chunk, pieces))
        else:
            chunk = job.rich_chunk(c, "".join(pieces))
        if c.reason is not None:
            chunk += job.final_chunk(c)
        return chunk

    def _stream_error(self, c: Choice) -> str:
        err = ApiError(c.stream.status, c.stream.error or "request failed").body()
        return f"data: {_json(err).decode()}\n\ndata: [DONE]\n\n"

    async def _sse(self, job: Job, firsts: list[list[wire.TokenOut]]) -> AsyncIterator[str]:
        M_INFLIGHT.inc()
        sent = 0
        pending: dict = {}
        try:
            head = job.first_chunks() if job.chat else ""
            if len(job.choices) == 1:
                c, outs = job.choices[0], firsts[0]
                while True:
                    chunk = head + self._render(job, c, outs)
                    head = ""
                    if c.reason is not None:
                        yield chunk + job.end_chunks()
                        return
                    if chunk:
                        yield chunk
                    M_TOKENS.inc(c.completion_tokens - sent)
                    sent = c.completion_tokens
                    outs = await c.stream.take()
                    if not outs:
                        job.status = c.stream.status
                        yield self._stream_error(c)
                        return
            for c, outs in zip(job.choices, firsts):
                head += self._render(job, c, outs)
                if c.reason is None:
                    pending[asyncio.ensure_future(c.stream.take())] = c
            if head:
                yield head
            while pending:
                done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                chunk = ""
                for fut in done:
                    c = pending.pop(fut)
                    outs = fut.result()
                    if not outs:
                        job.status = c.stream.status
                        yield chunk + self._stream_error(c)
                        return
                    chunk += self._render(job, c, outs)
                    if c.reason is None:
                        pending[asyncio.ensure_future(c.stream.take())] = c
                if chunk:
                    yield chunk
                done_tokens = job.completion_tokens
                M_TOKENS.inc(done_tokens - sent)
                sent = done_tokens
            yield job.end_chunks()
        except BaseException:
            if job.status == 200:
                job.status = 499  # the client went away mid-stream (or the server is stopping)
            raise
        finally:
            for fut in pending:
                fut.cancel()
            M_TOKENS.inc(job.completion_tokens - sent)
            M_INFLIGHT.dec()
            self._end(job)
            self._access(job, job.chat, job.arrival, job.status)

    # ------------------------------------------------------------------ other routes

    def model_card(self) -> dict:
        return {"id": self.model, "object": "model", "created": 0, "owned_by": "llumnix", "root": self.model,
                "max_model_len": self.max_model_len}

    def models(self) -> dict:
        return {"object": "list", "data": [self.model_card()]}

    def model_info(self, model_id: str) -> dict:
        if model_id != self.model:
            raise ApiError(404, f"The model `{model_id}` does not exist. This proxy serves `{self.model}`.", "model",
                           code="model_not_found")
        return self.model_card()

    async def tokenize(self, request: Request) -> Response:
        req = decode_body(await request.body(), TokenizeRequest)
        self._check_model(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise ApiError(400, "give either `prompt` or `messages`", "prompt" if req.prompt is None else "messages")
        if req.messages is not None:
            text = self._chat_prompt(req, req.add_generation_prompt)
            ids = self.tokenizer.encode(text, add_special_tokens=bool(req.add_special_tokens))
        else:
            ids = self.tokenizer.encode(req.prompt, add_special_tokens=req.add_special_tokens is not False)
        body = {"count": len(ids), "max_model_len": self.max_model_len, "tokens": ids,
                "token_strs": [self.tokenizer.token_str(t) for t in ids] if req.return_token_strs else None}
        return JSONResponse(body)

    async def detokenize(self, request: Request) -> Response:
        req = decode_body(await request.body(), DetokenizeRequest)
        self._check_model(req.model)
        vocab = self.tokenizer.vocab_size
        bad = next((t for t in req.tokens if not 0 <= t < vocab), None)
        if bad is not None:
            raise ApiError(400, f"token id {bad} is out of range for this model's vocabulary (0..{vocab - 1})", "tokens")
        return JSONResponse({"prompt": self.tokenizer.decode_all(req.tokens)})

    def health(self) -> Response:
        alive = len(self.cluster.alive())
        body = {"status": "ok" if alive else "unavailable", "instances_alive": alive,
                "manager": "ok" if self.cluster.manager_ok() else "unreachable"}
        return JSONResponse(body, status_code=200 if alive else 503)


# ---------------------------------------------------------------------- the OpenAPI document

_BODY_ROUTES = [  # (path, struct, summary, streams)
    ("/v1/completions", CompletionRequest, "Create a completion", True),
    ("/v1/chat/completions", ChatRequest, "Create a chat completion", True),
    ("/tokenize", TokenizeRequest, "Tokenize a prompt or chat messages (vLLM's route)", False),
    ("/detokenize", DetokenizeRequest, "Turn token ids into text (vLLM's route)", False),
]
_ERRORS = {"400": "Bad request (the body names the parameter)", "404": "Unknown model", "409": "Request id in flight",
           "413": "Request body larger than proxy.max_body_bytes", "499": "The client went away",
           "503": "No instance can take the request", "504": "Request timed out"}


def needs_key(path: str) -> bool:
    """The routes that need an API key when proxy.api_keys_file is set."""
    return path.startswith("/v1/") or path in ("/v1", "/tokenize", "/detokenize")


def openapi_document(app: FastAPI, model: str, max_model_len: int, api_keys: bool = False,
                     metrics_token: bool = False) -> dict:
    """FastAPI's document of the decorated routes, plus the msgspec-decoded POST routes with their request
    schemas (from the same structs that decode them, narrowed to what this proxy serves) and the OpenAI
    error body; with ``api_keys`` (``metrics_token``), the bearer scheme on the routes that need it."""
    doc = get_openapi(title="llumnix-proxy", version=package_version(), routes=app.routes,
                      description="OpenAI-compatible API of a Llumnix cluster")
    refs, components = openapi_components([kind for _, kind, _, _ in _BODY_ROUTES] + [ErrorResponse])
    document_schemas(components, model, max_model_len)
    schemas = doc.setdefault("components", {}).setdefault("schemas", {})
    schemas.pop("HTTPValidationError", None)  # FastAPI's 422 body: never sent here
    schemas.pop("ValidationError", None)
    schemas.update(components)
    error = {"content": {"application/json": {"schema": refs[-1]}}}
    header = {"name": "x-request-id", "in": "header", "required": False,
              "description": "the request id (echoed back); 1 to 128 visible ASCII characters",
              "schema": {"type": "string", "pattern": "^[!-~]{1,128}$"}}
    priority = {"name": "x-llumnix-priority", "in": "header", "required": False,
                "schema": {"type": "string", "enum": ["normal", "high"]}}
    examples = {
        "/v1/completions": {"model": model, "prompt": "Hello", "max_tokens": 8},
        "/v1/chat/completions": {"model": model, "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 8},
        "/tokenize": {"model": model, "prompt": "Hello"},
        "/detokenize": {"model": model, "tokens": [5, 6, 7]},
    }
    for (path, _, summary, streams), ref in zip(_BODY_ROUTES, refs):
        ok = {"application/json": {"schema": {"type": "object"}}}
        if streams:
            ok["text/event-stream"] = {"schema": {"type": "string"}}
        op = {"summary": summary, "operationId": path.strip("/").replace("/", "_"),
              "requestBody": {"required": True,
                              "content": {"application/json": {"schema": ref, "example": examples[path]}}},
              "responses": {"200": {"description": "OK", "content": ok},
                            **{code: {"description": text, **error} for code, text in _ERRORS.items()
                               if streams or code in ("400", "404", "413")}}}
        if streams:
            op["parameters"] = [header, priority]
        doc["paths"][path] = {"post": op}
    for path, item in doc["paths"].items():  # the decorated routes answer errors with the same body
        for op in item.values():
            op.setdefault("responses", {}).pop("422", None)
            if path == "/v1/models/{model_id}":
                op["responses"]["404"] = {"description": "Unknown model", **error}
                for param in op.get("parameters", []):
                    param["example"] = model
            if (api_keys and needs_key(path)) or (metrics_token and path == "/metrics"):
                op["security"] = [{"bearer": []}]
                op["responses"]["401"] = {"description": "No API key, or an unknown or revoked one"
                                          if path != "/metrics" else "No token, or the wrong one", **error}
                if api_keys and path in ("/v1/completions", "/v1/chat/completions"):
                    op["responses"]["403"] = {"description": "Priority high from a key without high_priority", **error}
    if api_keys or metrics_token:
        doc["components"]["securitySchemes"] = {"bearer": {
            "type": "http", "scheme": "bearer",
            "description": "an API key of proxy.api_keys_file" if api_keys else "the metrics token"}}
    return doc


class _Guard:
    """ASGI middleware, before any route: the API key of the routes that need one (proxy.api_keys_file), and
    the body size of every request (proxy.max_body_bytes), by its Content-Length or counted as it arrives,
    so that no body larger than the limit is ever held in memory."""

    def __init__(self, app, proxy: "Proxy", max_body_bytes: int):
        self.app = app
        self.proxy = proxy
        self.limit = max_body_bytes

    def too_large(self) -> ApiError:
        return ApiError(413, f"Request body too large: this proxy accepts at most {self.limit} bytes "
                             "(proxy.max_body_bytes).", type_="invalid_request_error", code="request_too_large")

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        keys = self.proxy.keys
        if keys is not None and needs_key(scope["path"]):
            try:
                principal = keys.check(_header(scope, b"authorization"))
            except ApiError as exc:
                return await self.refuse(scope, receive, send, exc)
            scope.setdefault("state", {})["principal"] = principal  # request.state.principal
        length = _header(scope, b"content-length")
        if length is not None and length.strip().isdigit() and int(length) > self.limit:
            return await self.refuse(scope, receive, send, self.too_large())
        received = 0

        async def limited():
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.limit:  # a chunked body (or one longer than it said) grew past the limit
                    raise self.too_large()  # to the route, whose error handler answers 413
            return message

        await self.app(scope, limited, send)

    async def refuse(self, scope, receive, send, exc: ApiError) -> None:
        """Answer before the route runs (its body unread: the server discards it); completion and chat
        requests get their access line and count, as when a route refuses them."""
        path = scope["path"]
        if path in ("/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"):
            M_REQUESTS.labels(path, str(exc.status)).inc()
        if path in ("/v1/completions", "/v1/chat/completions"):
            self.proxy._access(None, path == "/v1/chat/completions", time.perf_counter(), exc.status)
        response = JSONResponse(exc.body(), status_code=exc.status, headers=getattr(exc, "headers", None))
        await response(scope, receive, send)


def _header(scope, name: bytes) -> str | None:
    for key, value in scope["headers"]:
        if key == name:
            return value.decode("latin-1")
    return None


def build_app(cfg: Config) -> FastAPI:
    """The HTTP app. Its cluster client is started and stopped by whoever serves it (see _serve)."""
    try:
        metrics_token = security.read_token(cfg.security.metrics_token_file)
    except ValueError as exc:
        raise runtime.StartupError(f"security.metrics_token_file: {exc}") from None
    proxy = Proxy(cfg)
    app = FastAPI(title="llumnix-proxy", version=package_version())
    app.state.proxy = proxy
    app.add_middleware(_Guard, proxy=proxy, max_body_bytes=cfg.proxy.max_body_bytes)

    def with_echo(request: Request, body: dict, status: int, headers: dict | None = None) -> JSONResponse:
        echo = getattr(request.state, "echo_id", None)
        if echo:
            headers = {**(headers or {}), "x-request-id": echo}
        return JSONResponse(body, status_code=status, headers=headers)

    @app.exception_handler(ApiError)
    async def api_error(request: Request, exc: ApiError):
        M_REQUESTS.labels(request.url.path, str(exc.status)).inc()
        if exc.status >= 500:
            log.warning("%s failed: %s", request.url.path, exc.message)
        return with_echo(request, exc.body(), exc.status, getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception):
        log.exception("%s: internal error", request.url.path)
        M_REQUESTS.labels(request.url.path, "500").inc()
        return with_echo(request, ApiError(500, f"internal error: {type(exc).__name__}: {exc}").body(), 500)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException):
        return JSONResponse(ApiError(exc.status_code, str(exc.detail)).body(), status_code=exc.status_code,
                            headers=getattr(exc, "headers", None))

    def counted(route: str, handler):
        ok = M_REQUESTS.labels(route, "200")

        async def endpoint(request: Request) -> Response:
            response = await handler(request)
            (ok if response.status_code == 200 else M_REQUESTS.labels(route, str(response.status_code))).inc()
            return response

        return endpoint

    # The hot routes are plain Starlette routes: the body is decoded by msgspec, so FastAPI's per-request
    # dependency and validation machinery would only add latency. openapi_document describes them.
    app.add_route("/v1/completions", counted("/v1/completions", proxy.completions), methods=["POST"])
    app.add_route("/v1/chat/completions", counted("/v1/chat/completions", proxy.chat), methods=["POST"])
    app.add_route("/tokenize", counted("/tokenize", proxy.tokenize), methods=["POST"])
    app.add_route("/detokenize", counted("/detokenize", proxy.detokenize), methods=["POST"])

    @app.get("/v1/models", summary="List the served model")
    async def models():
        return proxy.models()

    @app.get("/v1/models/{model_id:path}", summary="The served model's card (404 for any other id)")
    async def model(model_id: str):
        return proxy.model_info(model_id)

    @app.get("/version", summary="The llumnix-toolkit version")
    async def version():
        return {"version": package_version()}

    @app.get("/health", summary="200 while an instance takes requests, else 503")
    async def health():
        return proxy.health()

    @app.get("/metrics", summary="Prometheus metrics")
    async def metrics(request: Request):
        if metrics_token:
            check_token(request.headers.get("authorization"), metrics_token)
        return Response(generate_latest(), media_type=CONTENT_TYPE_LATEST)

    def openapi() -> dict:
        if app.openapi_schema is None:
            app.openapi_schema = openapi_document(app, proxy.model, proxy.max_model_len, proxy.keys is not None,
                                                  bool(metrics_token))
        return app.openapi_schema

    app.openapi = openapi
    return app


class _Stopped(Exception):
    """SIGTERM or SIGINT, re-raised by uvicorn after its graceful shutdown."""


def _stopped(*_) -> None:
    raise _Stopped


def _listen(host: str, port: int) -> socket.socket:
    """Bind the HTTP socket ourselves, so a port in use is one clear line, not uvicorn's exit 3."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        family, kind, proto, _, address = infos[0]
        sock = socket.socket(family, kind, proto)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
    except OSError as exc:
        raise runtime.StartupError(f"cannot serve HTTP on {host}:{port}: {exc.strerror or exc}") from None
    sock.listen(2048)
    sock.setblocking(False)
    return sock


async def _unless_disconnected(request: Request, coro):
    """``await coro``, or None as soon as the client disconnects (a non-streaming request's handler is not
    cancelled by the server when its client leaves, so without this it would wait out the whole request)."""
    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    work = asyncio.ensure_future(coro)
    gone = asyncio.ensure_future(disconnected())
    try:
        done, _ = await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
    if work in done:
        return work.result()
    work.cancel()
    return None


def _check_exposure(cfg: Config) -> None:
    """An API without keys listens only on loopback, unless the network is declared trusted."""
    pc = cfg.proxy
    host = f"[{pc.host}]" if ":" in pc.host and not pc.host.startswith("[") else pc.host  # a bare IPv6 address
    if not pc.api_keys_file and not cfg.security.trusted_network and not security.is_loopback(host):
        raise runtime.StartupError(
            f"proxy.host = {pc.host} listens beyond loopback without proxy.api_keys_file; set it "
            "(see llumnix-proxy(8)) or set security.trusted_network = true")


async def _serve(cfg: Config) -> None:
    pc = cfg.proxy
    _check_exposure(cfg)
    try:
        app = build_app(cfg)
    except (TokenizerError, ApiKeysError) as exc:
        raise runtime.StartupError(str(exc)) from None
    cluster: ClusterClient = app.state.proxy.cluster
    keys: ApiKeys | None = app.state.proxy.keys
    # SIGHUP (systemctl reload): read the keys file again now; without one there is nothing to reload,
    # and a reload must not stop the proxy.
    asyncio.get_running_loop().add_signal_handler(
        signal.SIGHUP, keys.reload if keys is not None else lambda: log.info("SIGHUP: no proxy.api_keys_file to read again"))
    listener = _listen(pc.host, pc.port)
    await cluster.start()
    server = uvicorn.Server(uvicorn.Config(app, log_config=None, access_log=False, lifespan="off",
                                           timeout_graceful_shutdown=pc.shutdown_grace_s))

    async def notify_when_started() -> None:
        while not server.started:
            await asyncio.sleep(0.05)
        log.info("serving the OpenAI API on http://%s:%d (model %s)", pc.host, listener.getsockname()[1], cfg.model.name)
        runtime.sd_notify("READY=1")

    # uvicorn restores the handlers it found and re-raises the signal that stopped it once it is done:
    # ours turns that into a normal return, so a clean stop exits 0 as systemd expects.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, _stopped)
    failed: list[BaseException] = []

    async def exit_on_failure() -> None:  # a proxy whose token or manager path died must not stay up deaf
        failure = await runtime.first_failure(asyncio.Event(), cluster.essential)
        log.error("an essential task failed: %r; exiting so that the service manager restarts us", failure)
        failed.append(failure)
        server.should_exit = True

    watcher = asyncio.create_task(notify_when_started())
    guard = asyncio.create_task(exit_on_failure())
    try:
        await server.serve(sockets=[listener])
    except _Stopped:
        pass
    finally:
        watcher.cancel()
        guard.cancel()
        runtime.sd_notify("STOPPING=1")
        await cluster.stop()
    log.info("stopped")
    if failed:
        raise SystemExit(1)


app = typer.Typer(add_completion=False, help="llumnix-proxy: OpenAI-compatible HTTP front end of a Llumnix cluster.")


@app.command()
def main(
    config: Annotated[Optional[str], typer.Option("--config", "-c", help="llumnix.toml (default: $LLUMNIX_CONFIG)")] = None,
    host: Annotated[Optional[str], typer.Option(help="HTTP listen address (proxy.host)")] = None,
    port: Annotated[Optional[int], typer.Option(help="HTTP listen port (proxy.port)")] = None,
    manager: Annotated[Optional[str], typer.Option(help="manager address (manager.address)")] = None,
    log_level: Annotated[Optional[str], typer.Option(help="debug, info, warning, error (proxy.log_level)")] = None,
    set_: Annotated[Optional[list[str]], typer.Option("--set", help="override any setting: section.key=value")] = None,
) -> None:
    """Serve the OpenAI API until SIGTERM."""
    cfg = load_or_exit("llumnix-proxy", config, set_, {
        "proxy.host": host, "proxy.port": port, "manager.address": manager, "proxy.log_level": log_level,
    })
    runtime.setup_logging(cfg.proxy.log_level, "llumnix-proxy")
    runtime.exit_on_startup_error("llumnix-proxy", _serve(cfg))


def entry() -> None:
    app()


if __name__ == "__main__":
    entry()
