"""llumnix-proxy: OpenAI-compatible HTTP API over the cluster.

Tokenizes, asks the manager where the request goes, forwards it, and streams the tokens back in order.
Routes: /v1/completions, /v1/chat/completions (streamed or not, with usage), /v1/models, /health, /metrics.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import socket
import time
import uuid
from typing import Annotated, AsyncIterator, Optional

import msgspec
import typer
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, Counter, Gauge, Histogram, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from daemons import runtime, wire
from daemons.cli import load_or_exit
from daemons.config import Config
from daemons.proxy.cluster import ClusterClient, NoInstance, Stream
from daemons.proxy.protocol import (
    ApiError, ChatRequest, CompletionRequest, StopChecker, decode_body, parse_priority,
)
from daemons.proxy.tokenizer import Detokenizer, Tokenizer, TokenizerError, load_tokenizer

log = logging.getLogger("llumnix.proxy")

M_REQUESTS = Counter("llumnix_proxy_requests_total", "HTTP API requests, by route and status", ["route", "status"])
M_INFLIGHT = Gauge("llumnix_proxy_requests_in_flight", "Requests being served")
M_TOKENS = Counter("llumnix_proxy_tokens_total", "Output tokens sent to clients")
M_TTFT = Histogram("llumnix_proxy_time_to_first_token_seconds", "From request arrival to its first token",
                   buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30))
M_E2E = Histogram("llumnix_proxy_request_seconds", "From request arrival to its last token",
                  buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300))

_json = msgspec.json.encode


class Job:
    """One accepted API request: what it asked for and how its output is rendered."""

    def __init__(self, chat: bool, model: str, prompt_tokens: int, stops: list[str], include_usage: bool,
                 detok: Detokenizer, token_text=None):
        self.chat = chat
        self.detok = detok
        self.token_text = token_text  # set when logprobs were asked for
        self.lp: list[tuple[str, float | None]] = []  # (token text, logprob) not yet sent
        self.lp_offset = 0  # completions' text_offset of the next entry
        self.token_ids: list[int] | None = None  # collected when return_token_ids was asked for
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())
        self.model = model
        self.prompt_tokens = prompt_tokens
        self.completion_tokens = 0
        self.stop = StopChecker(stops)
        self.include_usage = include_usage
        self.arrival = time.perf_counter()
        head = (f'data: {{"id":"{self.id}","object":"{"chat.completion.chunk" if chat else "text_completion"}",'
                f'"created":{self.created},"model":{_json(model).decode()},"choices":[')
        self._head = head
        self._text_head = head + ('{"index":0,"delta":{"content":' if chat else '{"index":0,"text":')
        self._text_tail = ('},"logprobs":null,"finish_reason":null}]}\n\n' if chat else ',"logprobs":null,"finish_reason":null}]}\n\n')

    def usage(self) -> dict:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                "total_tokens": self.prompt_tokens + self.completion_tokens}

    def text_chunk(self, text: str) -> str:
        return self._text_head + _json(text).decode() + self._text_tail

    def first_chunk(self) -> str:
        return self._head + '{"index":0,"delta":{"role":"assistant","content":""},"logprobs":null,"finish_reason":null}]}\n\n'

    def final_chunk(self, reason: str) -> str:
        choice = {"index": 0, "logprobs": None, "finish_reason": reason}
        choice.update({"delta": {}} if self.chat else {"text": ""})
        out = self._head + _json(choice).decode() + "]}\n\n"
        if self.include_usage:
            out += self._head + '],"usage":' + _json(self.usage()).decode() + "}\n\n"
        return out

    def take_logprobs(self) -> dict | None:
        """The OpenAI logprobs object for the tokens consumed since the last call (sampled token only)."""
        if self.token_text is None:
            return None
        entries, self.lp = self.lp, []
        if self.chat:
            return {"content": [{"token": t, "logprob": lp, "bytes": list(t.encode()), "top_logprobs": []}
                                for t, lp in entries]}
        offsets = []
        for t, _ in entries:
            offsets.append(self.lp_offset)
            self.lp_offset += len(t)
        return {"tokens": [t for t, _ in entries], "token_logprobs": [lp for _, lp in entries],
                "top_logprobs": None, "text_offset": offsets}

    def rich_chunk(self, text: str) -> str:
        """A chunk with logprobs or token ids (the slower general path, used only when asked for)."""
        choice = {"index": 0, "logprobs": self.take_logprobs(), "finish_reason": None}
        choice.update({"delta": {"content": text}} if self.chat else {"text": text})
        if self.token_ids is not None:
            choice["token_ids"], self.token_ids = self.token_ids, []
        return self._head + _json(choice).decode() + "]}\n\n"

    def full_response(self, text: str, reason: str) -> dict:
        lp = self.take_logprobs()
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": lp, "finish_reason": reason}
        else:
            choice = {"index": 0, "text": text, "logprobs": lp, "finish_reason": reason}
        if self.token_ids is not None:
            choice["token_ids"] = self.token_ids
        return {"id": self.id, "object": "chat.completion" if self.chat else "text_completion",
                "created": self.created, "model": self.model, "choices": [choice], "usage": self.usage()}


class Proxy:
    def __init__(self, cfg: Config):
        self.cfg = cfg
        self.model = cfg.model.name
        self.max_model_len = cfg.model.max_model_len
        self.tokenizer: Tokenizer = load_tokenizer(cfg.model.path, cfg.sim.vocab_size, cfg.sim.eos_token_id)
        self.cluster = ClusterClient(cfg)

    # ------------------------------------------------------------------ request intake

    def _check_model(self, model: str) -> None:
        if model != self.model:
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

    def _limits(self, prompt_len: int, max_tokens: int | None, default: int | None, prompt_param: str) -> int:
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

    async def completions(self, request: Request) -> Response:
        req = decode_body(await request.body(), CompletionRequest)
        self._check_model(req.model)
        if req.echo:
            raise ApiError(400, "echo is not supported", "echo")
        ids = self._prompt_ids(req)
        max_tokens = self._limits(len(ids), req.max_tokens, 16, "prompt")
        sampling = req.sampling(max_tokens, req.logprobs)
        return await self._serve(request, req, ids, sampling, chat=False)

    async def chat(self, request: Request) -> Response:
        req = decode_body(await request.body(), ChatRequest)
        self._check_model(req.model)
        try:
            prompt = self.tokenizer.apply_chat_template([{"role": m.role, "content": m.text()} for m in req.messages])
        except TokenizerError as exc:
            raise ApiError(400, str(exc), "messages") from None
        ids = self.tokenizer.encode(prompt, add_special_tokens=False)
        max_tokens = self._limits(len(ids), req.max_completion_tokens or req.max_tokens, None, "messages")
        sampling = req.sampling(max_tokens, (req.top_logprobs or 0) if req.logprobs else None)
        return await self._serve(request, req, ids, sampling, chat=True)

    async def _serve(self, request: Request, req, ids: list[int], sampling: wire.SamplingParams, chat: bool) -> Response:
        priority = parse_priority(req.priority, request.headers.get("x-llumnix-priority"))
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        token_text = self.tokenizer.token_text if sampling.logprobs is not None else None
        job = Job(chat, self.model, len(ids), req.stop_strings(), include_usage, self.tokenizer.detokenizer(), token_text)
        if req.return_token_ids:
            job.token_ids = []
        submit = wire.Submit(job.id, ids, sampling, self.cluster.token_address, priority, time.time())
        try:
            stream = await self.cluster.submit(submit)
        except NoInstance as exc:
            raise ApiError(503, f"no instance can take the request: {exc}", type_="service_unavailable") from None
        try:
            first = await _unless_disconnected(request, stream.take())
        except BaseException:
            self.cluster.finish(stream)
            raise
        if first is None:  # the client went away before the first token: abort it on its instance
            self.cluster.finish(stream)
            return Response(status_code=499)
        if not first:
            self.cluster.finish(stream)
            raise ApiError(stream.status, stream.error or "request failed")
        M_TTFT.observe(time.perf_counter() - job.arrival)
        if req.stream:
            return StreamingResponse(self._sse(job, stream, first), media_type="text/event-stream",
                                     headers={"x-request-id": job.id})
        M_INFLIGHT.inc()
        try:
            collected = await _unless_disconnected(request, self._collect(job, stream, first))
        finally:
            M_INFLIGHT.dec()
            self.cluster.finish(stream)  # a client that went away: this aborts the request on its instance
        if collected is None:
            return Response(status_code=499)
        text, reason, error = collected
        if error:
            raise ApiError(stream.status, error)
        return JSONResponse(job.full_response(text, reason), headers={"x-request-id": job.id})

    # ------------------------------------------------------------------ output

    def _consume(self, job: Job, outs: list[wire.TokenOut]) -> tuple[list[str], str | None]:
        """Turn token outputs into text pieces; returns (pieces, finish reason or None)."""
        pieces, add, stop = [], job.detok.add, job.stop
        for out in outs:
            job.completion_tokens += 1
            if job.token_text is not None:
                job.lp.append((job.token_text(out.token_id), out.logprob))
            if job.token_ids is not None:
                job.token_ids.append(out.token_id)
            text, stopped = stop.feed(add(out.token_id))
            if not stopped and out.finish_reason is not None:
                more, stopped = stop.feed(job.detok.flush())
                text += more
            if text:
                pieces.append(text)
            if stopped:
                return pieces, "stop"
            if out.finish_reason is not None:
                tail = stop.flush()
                if tail:
                    pieces.append(tail)
                return pieces, out.finish_reason
        return pieces, None

    async def _collect(self, job: Job, stream: Stream, outs: list[wire.TokenOut]) -> tuple[str, str, str | None]:
        texts: list[str] = []
        while True:
            pieces, reason = self._consume(job, outs)
            texts += pieces
            if reason is not None:
                M_TOKENS.inc(job.completion_tokens)
                M_E2E.observe(time.perf_counter() - job.arrival)
                return "".join(texts), reason, None
            outs = await stream.take()
            if not outs:
                return "".join(texts), "error", stream.error

    async def _sse(self, job: Job, stream: Stream, outs: list[wire.TokenOut]) -> AsyncIterator[str]:
        M_INFLIGHT.inc()
        sent = 0
        try:
            head = job.first_chunk() if job.chat else ""
            while True:
                pieces, reason = self._consume(job, outs)
                if job.token_text is None and job.token_ids is None:
                    chunk = head + "".join(map(job.text_chunk, pieces))
                else:
                    chunk = head + job.rich_chunk("".join(pieces))
                head = ""
                if reason is not None:
                    yield chunk + job.final_chunk(reason) + "data: [DONE]\n\n"
                    M_E2E.observe(time.perf_counter() - job.arrival)
                    return
                if chunk:
                    yield chunk
                M_TOKENS.inc(job.completion_tokens - sent)
                sent = job.completion_tokens
                outs = await stream.take()
                if not outs:
                    err = ApiError(stream.status, stream.error or "request failed").body()
                    yield f"data: {_json(err).decode()}\n\ndata: [DONE]\n\n"
                    return
        finally:
            M_TOKENS.inc(job.completion_tokens - sent)
            M_INFLIGHT.dec()
            self.cluster.finish(stream)

    # ------------------------------------------------------------------ other routes

    def models(self) -> dict:
        return {"object": "list", "data": [{"id": self.model, "object": "model", "created": 0, "owned_by": "llumnix",
                                            "max_model_len": self.max_model_len}]}

    def health(self) -> Response:
        alive = len(self.cluster.alive())
        body = {"status": "ok" if alive else "unavailable", "instances_alive": alive,
                "manager": "ok" if self.cluster.manager_ok() else "unreachable"}
        return JSONResponse(body, status_code=200 if alive else 503)


def build_app(cfg: Config) -> FastAPI:
    """The HTTP app. Its cluster client is started and stopped by whoever serves it (see _serve)."""
    proxy = Proxy(cfg)
    app = FastAPI(title="llumnix-proxy")
    app.state.proxy = proxy

    @app.exception_handler(ApiError)
    async def api_error(request: Request, exc: ApiError):
        M_REQUESTS.labels(request.url.path, str(exc.status)).inc()
        if exc.status >= 500:
            log.warning("%s failed: %s", request.url.path, exc.message)
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception):
        log.exception("%s: internal error", request.url.path)
        M_REQUESTS.labels(request.url.path, "500").inc()
        return JSONResponse(ApiError(500, f"internal error: {type(exc).__name__}: {exc}").body(), status_code=500)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException):
        return JSONResponse(ApiError(exc.status_code, str(exc.detail)).body(), status_code=exc.status_code)

    def counted(route: str, handler):
        ok = M_REQUESTS.labels(route, "200")

        async def endpoint(request: Request) -> Response:
            response = await handler(request)
            (ok if response.status_code == 200 else M_REQUESTS.labels(route, str(response.status_code))).inc()
            return response

        return endpoint

    # The hot routes are plain Starlette routes: the body is decoded by msgspec, so FastAPI's per-request
    # dependency and validation machinery would only add latency.
    app.add_route("/v1/completions", counted("/v1/completions", proxy.completions), methods=["POST"])
    app.add_route("/v1/chat/completions", counted("/v1/chat/completions", proxy.chat), methods=["POST"])

    @app.get("/v1/models")
    async def models():
        return proxy.models()

    @app.get("/health")
    async def health():
        return proxy.health()

    @app.get("/metrics")
    async def metrics():
        return Response(generate_latest(), media_type=CONTENT_TYPE_LATEST)

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


async def _serve(cfg: Config) -> None:
    pc = cfg.proxy
    try:
        app = build_app(cfg)
    except TokenizerError as exc:
        raise runtime.StartupError(str(exc)) from None
    cluster: ClusterClient = app.state.proxy.cluster
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
