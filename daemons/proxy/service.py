"""The proxy's request logic, whichever HTTP path calls it (daemons/proxy/fastpath.py, or FastAPI's routes in
daemons/proxy/app.py): a completion or chat request is checked, tokenized, dispatched over the cluster
(daemons/proxy/cluster.py) and its tokens rendered (daemons/proxy/render.py); also the other routes' answers
(models, tokenize, detokenize, health) and the access log."""

from __future__ import annotations

import asyncio
import logging
import re
import time
import weakref
from typing import AsyncIterator

import msgspec
from fastapi import Request
from fastapi.responses import JSONResponse, Response

from daemons import metrics, wire
from daemons.config import Config
from daemons.proxy.apikeys import ApiKeys
from daemons.proxy.cluster import M_REJECTED, ClusterClient, NoInstance, Overloaded, Stream
from daemons.proxy.fastpath import Call, Reply
from daemons.proxy.protocol import (
    ApiError, ChatRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest, decode_body, derive_seed,
    parse_priority,
)
from daemons.proxy.render import Choice, Job, token_id_text
from daemons.proxy.tokenizer import Tokenizer, TokenizerError, load_tokenizer

access_log = logging.getLogger("llumnix.access")

# Defined in daemons/metrics.py, with the latencies of each request (Job.timer).
M_INFLIGHT = metrics.P_IN_FLIGHT
M_TOKENS = metrics.P_GENERATION_TOKENS

_json = msgspec.json.encode
_REQUEST_ID = re.compile(r"[!-~]{1,128}")  # visible ASCII: safe in logs, tables and headers


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

    def _admit(self, priority: int) -> None:
        """Admission control (daemons/proxy/admission.py ``admit``): 429 with Retry-After, before any tokenizing."""
        try:
            self.cluster.admit(priority)
        except Overloaded as exc:
            M_REJECTED.labels(exc.reason).inc()
            raise self._retry_later(429, str(exc), "rate_limit_exceeded") from None

    def _retry_later(self, status: int, message: str, code: str) -> ApiError:
        err = ApiError(status, message, type_="rate_limit_exceeded" if status == 429 else "service_unavailable",
                       code=code)
        err.headers = {"Retry-After": str(self.cfg.admission.retry_after_s)}
        return err

    async def _accept(self, call: Call, job: Job) -> Reply:
        header_priority = call.headers.get("x-llumnix-priority")
        if header_priority is not None:  # refused before the body is read, however large
            self._admit(parse_priority(None, header_priority))
        body = decode_body(await call.read(), ChatRequest if job.chat else CompletionRequest)
        job.model = body.model
        self._check_model(body.model)
        body.unsupported()
        self._admit(parse_priority(body.priority, header_priority))
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
                raise self._no_instance(exc) from None
            return
        results = await asyncio.gather(*(self.cluster.submit(s) for s in submits), return_exceptions=True)
        for c, res in zip(job.choices, results):
            if isinstance(res, Stream):
                c.stream = res
        for res in results:
            if isinstance(res, NoInstance):
                raise self._no_instance(res)
            if isinstance(res, BaseException):
                raise res

    def _no_instance(self, exc: NoInstance) -> ApiError:
        M_REJECTED.labels(exc.reason).inc()
        return self._retry_later(503, f"no instance can take the request: {exc}", exc.reason)

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
