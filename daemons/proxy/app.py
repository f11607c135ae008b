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
import gc
import logging
import re
import signal
import socket
import time
import weakref
from typing import Annotated, AsyncIterator, Optional

import msgspec
import typer
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from daemons import metrics, runtime, security, wire
from daemons.cli import load_or_exit, package_version
from daemons.config import Config
from daemons.proxy.apikeys import ApiKeys, ApiKeysError, Principal, check_token
from daemons.proxy.cluster import ClusterClient, NoInstance, Stream
from daemons.proxy.fastpath import Call, FastPath, Reply, too_large
from daemons.proxy.openapi import needs_key, openapi_document
from daemons.proxy.protocol import (
    ApiError, ChatRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest, decode_body, derive_seed,
    parse_priority,
)
from daemons.proxy.render import Choice, Job, token_id_text
from daemons.proxy.tokenizer import Tokenizer, TokenizerError, load_tokenizer

log = logging.getLogger("llumnix.proxy")
access_log = logging.getLogger("llumnix.access")

# Defined in daemons/metrics.py, with the latencies of each request (Job.timer).
M_REQUESTS = metrics.P_REQUESTS
M_INFLIGHT = metrics.P_IN_FLIGHT
M_TOKENS = metrics.P_GENERATION_TOKENS

_json = msgspec.json.encode
_REQUEST_ID = re.compile(r"[!-~]{1,128}")  # visible ASCII: safe in logs, tables and headers
GC_THRESHOLD = 10_000  # the collector's first generation (Python's default: 700); see _serve


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

    def _request_id(self, call: Call) -> str | None:
        """The client's x-request-id, validated (None when there is none)."""
        value = call.headers.get("x-request-id")
        if value is None:
            return None
        if not _REQUEST_ID.fullmatch(value):
            raise ApiError(400, "x-request-id must be 1 to 128 visible ASCII characters (no spaces)", "x-request-id",
                           code="invalid_request_id")
        call.echo_id = value
        return value

    async def handle(self, call: Call, chat: bool) -> Reply:
        """One completion or chat request; logs it once it is answered (a stream: once it ends). Raises
        ApiError for an answer that is an error."""
        arrival = time.perf_counter()
        job = None
        principal = call.principal
        key_name = principal.name if principal is not None else "-"
        try:
            job = Job(chat, self._request_id(call), arrival)
            job.key_name = key_name
            reply = await self._accept(call, job)
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
        if reply.stream is None:  # a stream logs itself when it ends
            self._access(job, chat, arrival, reply.status)
        return reply

    async def _accept(self, call: Call, job: Job) -> Reply:
        body = decode_body(await call.read(), ChatRequest if job.chat else CompletionRequest)
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
        return await self._serve(call, job, body, ids, sampling, top_n)

    def _in_flight(self, job: Job, sub_ids: list[str]) -> bool:
        return job.id in self.active or any(rid in self.cluster.streams for rid in sub_ids)

    async def _serve(self, call: Call, job: Job, req, ids: list[int], sampling: wire.SamplingParams,
                     top_n: int) -> Reply:
        priority = parse_priority(req.priority, call.headers.get("x-llumnix-priority"))
        principal = call.principal
        if priority > 0 and principal is not None and not principal.high_priority:
            raise ApiError(403, f"The API key '{principal.name}' may not send priority high: it lacks the "
                                f"high_priority permission (high_priority = true in proxy.api_keys_file).",
                           "priority", type_="invalid_request_error", code="permission_denied")
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        token_text = None
        if sampling.logprobs is not None:
            token_text = token_id_text if req.return_tokens_as_token_ids else self.tokenizer.token_text
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
        handed_over = False  # to the streaming reply, which cleans up when it ends
        try:
            await self._submit(job, submits)
            firsts = await call.unless_disconnected(self._firsts(job))
            if firsts is None:  # the client went away before the first token: abort it on its instance
                return Reply(499)
            for c, first in zip(job.choices, firsts):
                if not first:
                    raise ApiError(c.stream.status, c.stream.error or "request failed")
            job.timer.first_token(job.first_at)
            headers = {"x-request-id": call.echo_id or job.id}
            if req.stream:
                body = self._sse(job, firsts)
                # A client gone before the body starts means the generator never runs (nor its finally).
                weakref.finalize(body, self._abandoned, job).atexit = False  # not at exit: the cluster is gone
                handed_over = True
                return Reply(200, headers=headers, stream=body, job=job)
            M_INFLIGHT.inc()
            try:
                failed = await call.unless_disconnected(self._collect(job, firsts))
            finally:
                M_INFLIGHT.dec()
            if failed is None:
                return Reply(499)
            if failed is not True:
                raise ApiError(failed.stream.status, failed.stream.error or "request failed")
            return Reply(200, _json(job.full_response()), headers)
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

    async def _firsts(self, job: Job) -> list[list[wire.TokenOut]]:
        """Every choice's first outputs ([] for one that failed)."""
        if len(job.choices) == 1:
            return [await self._first(job, job.choices[0])]
        return await asyncio.gather(*(self._first(job, c) for c in job.choices))

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

    async def _collect(self, job: Job, firsts: list[list[wire.TokenOut]]) -> Choice | bool:
        """Collect every choice's text; True when all finished, else the choice whose stream failed."""
        for c, outs in zip(job.choices, firsts):
            c.texts += job.consume(c, outs)
        if len(job.choices) == 1:
            c = job.choices[0]
            while c.reason is None:
                outs = await c.stream.take()
                if not outs:
                    return c
                c.texts += job.consume(c, outs)
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
                        c.texts += job.consume(c, outs)
                        if c.reason is None:
                            pending[asyncio.ensure_future(c.stream.take())] = c
            finally:
                for fut in pending:
                    fut.cancel()
        M_TOKENS.inc(job.completion_tokens)
        return True

    def _stream_error(self, c: Choice) -> bytes:
        err = ApiError(c.stream.status, c.stream.error or "request failed").body()
        return b"data: " + _json(err) + b"\n\ndata: [DONE]\n\n"

    async def _sse(self, job: Job, firsts: list[list[wire.TokenOut]]) -> AsyncIterator[bytes]:
        M_INFLIGHT.inc()
        sent = 0
        pending: dict = {}
        try:
            head = job.first_chunks() if job.chat else b""
            if len(job.choices) == 1:
                c, outs = job.choices[0], firsts[0]
                while True:
                    chunk = head + job.render(c, outs)
                    head = b""
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
                head += job.render(c, outs)
                if c.reason is None:
                    pending[asyncio.ensure_future(c.stream.take())] = c
            if head:
                yield head
            while pending:
                done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                chunk = b""
                for fut in done:
                    c = pending.pop(fut)
                    outs = fut.result()
                    if not outs:
                        job.status = c.stream.status
                        yield chunk + self._stream_error(c)
                        return
                    chunk += job.render(c, outs)
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

class _Guard:
    """ASGI middleware, before any route: the API key of the routes that need one (proxy.api_keys_file), and
    the body size of every request (proxy.max_body_bytes), by its Content-Length or counted as it arrives,
    so that no body larger than the limit is ever held in memory."""

    def __init__(self, app, proxy: "Proxy", max_body_bytes: int):
        self.app = app
        self.proxy = proxy
        self.limit = max_body_bytes

    def too_large(self) -> ApiError:
        return too_large(self.limit)

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

    def completion(chat: bool):
        async def endpoint(request: Request) -> Response:
            call = Call(request.headers, getattr(request.state, "principal", None), request.receive, request.body)
            try:
                reply = await proxy.handle(call, chat)
            finally:
                if call.echo_id:
                    request.state.echo_id = call.echo_id
            if reply.stream is not None:
                return StreamingResponse(reply.stream, media_type="text/event-stream", headers=reply.headers)
            return Response(reply.body, status_code=reply.status, headers=reply.headers,
                            media_type="application/json" if reply.body else None)

        return endpoint

    # The body routes are plain Starlette routes: the body is decoded by msgspec, so FastAPI's per-request
    # dependency and validation machinery would only add latency. openapi_document describes them. With
    # proxy.fast_path (the default), the completion routes are answered before FastAPI (daemons/proxy/fastpath.py).
    app.add_route("/v1/completions", counted("/v1/completions", completion(False)), methods=["POST"])
    app.add_route("/v1/chat/completions", counted("/v1/chat/completions", completion(True)), methods=["POST"])
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


def serving_app(cfg: Config, app: FastAPI):
    """What the server runs: the completion routes' fast path in front of ``app`` (proxy.fast_path), or ``app``."""
    if not cfg.proxy.fast_path:
        return app
    return FastPath(app, app.state.proxy, cfg.proxy.max_body_bytes)


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
    # The collector has next to nothing to find here: the request path leaves no reference cycles
    # (tests/test_proxy_fastpath.py), so what it did was rescan live objects, about a tenth of a short
    # request's CPU. What startup built (FastAPI, the tokenizer) is set aside, and it runs 14x less often.
    gc.freeze()
    gc.set_threshold(GC_THRESHOLD, 10, 10)
    server = uvicorn.Server(uvicorn.Config(serving_app(cfg, app), log_config=None, access_log=False, lifespan="off",
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
