"""The proxy's request logic, whichever HTTP path calls it (daemons/proxy/fastpath.py, or FastAPI's routes in
daemons/proxy/app.py): a completion or chat request is checked, tokenized, dispatched over the cluster
(daemons/proxy/cluster.py) and its tokens rendered (daemons/proxy/render.py), with the access log. What a
request must be is in checks.py, how its answer goes out in output.py, the other routes (models, tokenize,
detokenize, health) in routes.py."""

from __future__ import annotations

import asyncio
import logging
import time
import weakref

import msgspec

from daemons import metrics, wire
from daemons.config import Config
from daemons.proxy.apikeys import ApiKeys
from daemons.proxy.checks import ChecksMixin
from daemons.proxy.cluster import M_REJECTED, ClusterClient, NoInstance, Overloaded, Stream
from daemons.proxy.fastpath import Call, Reply
from daemons.proxy.output import OutputMixin
from daemons.proxy.protocol import ApiError, ChatRequest, CompletionRequest, decode_body, derive_seed, parse_priority
from daemons.proxy.render import Choice, Job, token_id_text
from daemons.proxy.routes import RoutesMixin
from daemons.proxy.tenants import TenantLimitsMixin, Tenants
from daemons.proxy.tokenizer import Tokenizer, load_tokenizer
from daemons.proxy.traces import RequestTrace
from daemons.tracing import Tracer

access_log = logging.getLogger("llumnix.access")

# Defined in daemons/metrics.py, with the latencies of each request (Job.timer).
M_INFLIGHT = metrics.P_IN_FLIGHT

_json = msgspec.json.encode


class Proxy(ChecksMixin, OutputMixin, RoutesMixin, TenantLimitsMixin):
    """The request path: admit, dispatch, serve and log each request; the checks, the output and the other
    routes are in the files named for them."""

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
        self.pc = cfg.proxy
        self.tenants = Tenants()  # per-key limits (daemons/proxy/tenants.py)
        self.tracer = self.cluster.tracer = Tracer.create(cfg.tracing, "llumnix-proxy")  # None: tracing off
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
            if self.tracer is not None:
                job.trace = RequestTrace(self.tracer, call.headers.get("traceparent", ""), job.id, chat, key_name)
            if principal is not None:
                job.principal = principal
                job.ticket = self._enter(principal)
            reply = await self._accept(call, job)
        except ApiError as exc:
            self._release(job)
            if job is None:
                self._access(None, chat, arrival, exc.status, key_name)
            else:
                job.status = exc.status
                self._access(job, chat, arrival, exc.status)
            raise
        except BaseException:
            self._release(job)
            self._access(job, chat, arrival, 500)
            raise
        if reply.stream is None:  # a stream logs itself when it ends
            self._access(job, chat, arrival, reply.status)
        return reply

    def _admit(self, priority: int, job: Job) -> None:
        """Admission control (daemons/proxy/admission.py ``admit``): 429 with Retry-After, before any tokenizing."""
        try:
            self.cluster.admit(priority, job.principal.name if job.principal is not None else "")
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
            self._admit(parse_priority(None, header_priority), job)
        body = decode_body(await call.read(), ChatRequest if job.chat else CompletionRequest)
        job.model = body.model
        self._check_model(body.model)
        body.unsupported()
        self._check_stops(body)
        self._admit(parse_priority(body.priority, header_priority), job)
        if job.chat:
            prompt = self._chat_prompt(body, body.add_generation_prompt)
            ids = self.tokenizer.encode(prompt, add_special_tokens=False)
            max_tokens = self._limits(len(ids), body.max_completion_tokens or body.max_tokens, None, "messages")
            self._charge(job, len(ids) + body.n * max_tokens)
            top_n = body.top_logprobs or 0
            sampling = body.sampling(max_tokens, top_n if body.logprobs else None)
        else:
            ids = self._prompt_ids(body)
            max_tokens = self._limits(len(ids), body.max_tokens, 16, "prompt")
            self._charge(job, len(ids) + body.n * max_tokens)
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
        traceparent = job.trace.traceparent if job.trace is not None else ""
        submits = [wire.Submit(rid, ids, sampling if n == 1 else msgspec.structs.replace(
            sampling, seed=derive_seed(sampling.seed, k)), self.cluster.token_address, priority, now,
            traceparent=traceparent) for k, rid in enumerate(sub_ids)]
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
        p = job.principal
        tenant, weight = (p.name, p.weight) if p is not None else ("", 1.0)
        if len(submits) == 1:
            try:
                job.choices[0].stream = await self.cluster.submit(submits[0], tenant, weight)
            except NoInstance as exc:
                raise self._no_instance(exc) from None
            return
        results = await asyncio.gather(*(self.cluster.submit(s, tenant, weight) for s in submits),
                                       return_exceptions=True)
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
        self._release(job)

    def _abandoned(self, job: Job) -> None:
        self._end(job)
        self._access(job, job.chat, job.arrival, 499)

    def _access(self, job: Job | None, chat: bool, arrival: float, status: int, key_name: str = "-") -> None:
        if job is not None:
            if job.logged:
                return
            job.logged = True
            if job.trace is not None:
                job.trace.end(status, {"llumnix.model": job.model or None, "llumnix.prompt_tokens": job.prompt_tokens,
                                       "llumnix.completion_tokens": job.completion_tokens,
                                       "llumnix.instances": ",".join(dict.fromkeys(
                                           i for s in job.streams() for i in s.tried)) or None})
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
