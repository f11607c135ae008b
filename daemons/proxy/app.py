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
- API keys: with ``proxy.api_keys_file`` (see daemons/proxy/front/apikeys.py), every /v1 route and /tokenize,
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
import signal
import socket
from typing import Annotated, Optional

import typer
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from daemons import metrics, runtime, security
from daemons.cli import ConfigFile, LogLevel, Overrides, daemon_main, package_version
from daemons.config import Config
from daemons.proxy.front.apikeys import ApiKeys, ApiKeysError, check_token
from daemons.proxy.front.call import Call, Headers
from daemons.proxy.cluster.client import ClusterClient
from daemons.proxy.front.fastpath import FastPath
from daemons.proxy.front.guard import Guard
from daemons.proxy.api.openapi import openapi_document
from daemons.proxy.api.protocol import ApiError
from daemons.proxy.api.render import Job  # noqa: F401  (tests build Jobs from here)
from daemons.proxy.service import Proxy
from daemons.proxy.api.tokenizer import TokenizerError

log = logging.getLogger("llumnix.proxy")

M_REQUESTS = metrics.P_REQUESTS  # defined in daemons/metrics.py
GC_THRESHOLD = 10_000  # the collector's first generation (Python's default: 700); see _serve


class _Guard:
    """ASGI middleware, before any route: the proxy's guard (daemons/proxy/front/guard.py) checks the API key of the
    routes that need one and the body size of every request, by its Content-Length or counted as it
    arrives (the route's error handler answers a 413 raised while it reads)."""

    def __init__(self, app, guard: Guard):
        self.app = app
        self.guard = guard

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = Headers(scope["headers"])
        try:
            principal = self.guard.check(scope["path"], headers.get("authorization"), headers.get("content-length"))
        except ApiError as exc:
            # Answered before the route runs (its body unread: the server discards it).
            self.guard.refused(scope["path"], exc.status)
            response = JSONResponse(exc.body(), status_code=exc.status, headers=getattr(exc, "headers", None))
            return await response(scope, receive, send)
        if principal is not None:
            scope.setdefault("state", {})["principal"] = principal  # request.state.principal
        await self.app(scope, self.guard.limited(receive), send)


def route_label(request: Request) -> str:
    """The metric label of a request's path: the route it matched (``/v1/models/{model_id}``), never the raw
    path, whose every variant would add a series for good; "unmatched" for none."""
    route = request.scope.get("route")
    return getattr(route, "path", None) or "unmatched"


def build_app(cfg: Config) -> FastAPI:
    """The HTTP app. Its cluster client is started and stopped by whoever serves it (see _serve)."""
    try:
        metrics_token = security.read_token(cfg.security.metrics_token_file)
    except ValueError as exc:
        raise runtime.StartupError(f"security.metrics_token_file: {exc}") from None
    proxy = Proxy(cfg)
    app = FastAPI(title="llumnix-proxy", version=package_version())
    app.state.proxy = proxy
    guard = proxy.guard
    app.add_middleware(_Guard, guard=guard)

    def with_echo(request: Request, body: dict, status: int, headers: dict | None = None) -> JSONResponse:
        echo = getattr(request.state, "echo_id", None)
        if echo:
            headers = {**(headers or {}), "x-request-id": echo}
        return JSONResponse(body, status_code=status, headers=headers)

    @app.exception_handler(ApiError)
    async def api_error(request: Request, exc: ApiError):
        guard.count(route_label(request), exc.status)
        if exc.status >= 500:
            log.warning("%s failed: %s", request.url.path, exc.message)
        return with_echo(request, exc.body(), exc.status, getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception):
        log.exception("%s: internal error", request.url.path)
        guard.count(route_label(request), 500)
        return with_echo(request, ApiError(500, f"internal error: {type(exc).__name__}: {exc}").body(), 500)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException):
        return JSONResponse(ApiError(exc.status_code, str(exc.detail)).body(), status_code=exc.status_code,
                            headers=getattr(exc, "headers", None))

    def counted(route: str, handler):
        async def endpoint(request: Request) -> Response:
            response = await handler(request)
            guard.count(route, response.status_code)
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
    # proxy.fast_path (the default), the completion routes are answered before FastAPI (daemons/proxy/front/fastpath.py).
    app.add_route("/v1/completions", counted("/v1/completions", completion(False)), methods=["POST"])
    app.add_route("/v1/chat/completions", counted("/v1/chat/completions", completion(True)), methods=["POST"])
    app.add_route("/tokenize", counted("/tokenize", proxy.routes.tokenize), methods=["POST"])
    app.add_route("/detokenize", counted("/detokenize", proxy.routes.detokenize), methods=["POST"])
    app.add_route("/v1/load_lora_adapter", counted("/v1/load_lora_adapter", proxy.routes.load_lora_adapter),
                  methods=["POST"])
    app.add_route("/v1/unload_lora_adapter", counted("/v1/unload_lora_adapter", proxy.routes.unload_lora_adapter),
                  methods=["POST"])

    @app.get("/v1/models", summary="List the served model and its LoRA adapters (each with its base as parent)")
    async def models():
        return proxy.routes.models()

    @app.get("/v1/models/{model_id:path}", summary="The served model's or an adapter's card (404 for any other id)")
    async def model(model_id: str):
        return proxy.routes.model_info(model_id)

    @app.get("/version", summary="The llumnix-toolkit version")
    async def version():
        return {"version": package_version()}

    @app.get("/health", summary="200 while an instance takes requests, else 503")
    async def health():
        return proxy.routes.health()

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
    return FastPath(app, app.state.proxy, write_timeout_s=cfg.proxy.write_timeout_s)


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
    # (tests/unit/test_proxy_fastpath.py), so what it did was rescan live objects, about a tenth of a short
    # request's CPU. What startup built (FastAPI, the tokenizer) is set aside, and it runs 14x less often.
    gc.freeze()
    gc.set_threshold(GC_THRESHOLD, 10, 10)
    server = uvicorn.Server(uvicorn.Config(serving_app(cfg, app), log_config=None, access_log=False, lifespan="off",
                                           timeout_graceful_shutdown=pc.shutdown_grace_s,
                                           timeout_keep_alive=pc.keep_alive_s,
                                           limit_concurrency=pc.max_connections or None))

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
        if app.state.proxy.tracer is not None:
            app.state.proxy.tracer.shutdown()  # the last requests' spans
    log.info("stopped")
    if failed:
        raise SystemExit(1)


app = typer.Typer(add_completion=False, help="llumnix-proxy: OpenAI-compatible HTTP front end of a Llumnix cluster.")


@app.command()
def main(
    config: ConfigFile = None,
    host: Annotated[Optional[str], typer.Option(help="HTTP listen address (proxy.host)")] = None,
    port: Annotated[Optional[int], typer.Option(help="HTTP listen port; 0 lets the system choose one, which the proxy logs (proxy.port)")] = None,
    manager: Annotated[Optional[str], typer.Option(help="address of the manager (manager.address)")] = None,
    log_level: LogLevel("proxy") = None,
    set_: Overrides("; model.path and model.name have no flag of their own and are set this way or in the file") = None,
) -> None:
    """Serve the OpenAI API until SIGTERM."""
    daemon_main("llumnix-proxy", config, set_, {
        "proxy.host": host, "proxy.port": port, "manager.address": manager, "proxy.log_level": log_level,
    }, _serve)


def entry() -> None:
    app()


if __name__ == "__main__":
    entry()
