"""The proxy's request logic, whichever HTTP path calls it (daemons/proxy/front/fastpath.py, or FastAPI's routes in
daemons/proxy/app.py): a completion or chat request is checked, tokenized, dispatched over the cluster
(daemons/proxy/cluster/client.py) and its tokens rendered (daemons/proxy/api/render.py), with the access log.

``Proxy`` is a facade over the objects that decide: ``Checks`` (front/checks.py: what a request must be),
``TenantLimits`` (front/tenants.py: each API key's limits), ``AccessLog`` (front/access.py), ``Guard``
(front/guard.py: API keys, body limits and request counts, for both HTTP paths), ``Routes`` (front/routes.py:
models, tokenize, detokenize, health) and the ``ClusterClient``; how an answer goes out is api/output.py's
functions."""

from __future__ import annotations

import asyncio
import math
import weakref

import msgspec

from daemons import metrics, wire
from daemons.clock import Clock
from daemons.config import Config, body_limit
from daemons.proxy.front.access import AccessLog
from daemons.proxy.front.apikeys import ApiKeys
from daemons.proxy.front.call import Call, Reply
from daemons.proxy.front.checks import Checks
from daemons.proxy.cluster.client import M_REFUSAL, M_REJECTED, ClusterClient, NoInstance, Overloaded, Stream
from daemons.proxy.cluster.goodput import Goodput
from daemons.proxy.front.guard import Guard
from daemons.proxy.api.output import collect, sse
from daemons.proxy.api.protocol import ApiError, ChatRequest, CompletionRequest, decode_body, derive_seed, parse_priority
from daemons.proxy.api.render import Choice, Job, token_id_text
from daemons.proxy.api.sessions import NONE, Session, session_of
from daemons.proxy.front.routes import Routes
from daemons.proxy.front.tenants import TenantLimits, Tenants
from daemons.proxy.api.tokenizer import Tokenizer, load_tokenizer
from daemons.proxy.api.toolcalls import ToolCalls
from daemons.proxy.cluster.traces import RequestTrace
from daemons.tracing import Tracer

# Defined in daemons/metrics.py, with the latencies of each request (Job.timer).
M_INFLIGHT = metrics.P_IN_FLIGHT
CHARS_PER_TOKEN = 4  # admission's estimate of a prompt's tokens from its request body, before tokenizing


# A body larger than this is not read before admission has checked that even its best case (one prompt token,
# one output token, the highest priority its caller may send) would be admitted: a refusal does not wait for it.
PRE_ADMIT_BYTES = 16384


def prompt_estimate(body, body_bytes: int) -> int:
    """Admission's estimate of a request's prompt tokens before tokenizing: a completion's token ids as they are,
    else the body's size at CHARS_PER_TOKEN."""
    prompt = body.prompt if isinstance(body, CompletionRequest) else None
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        return len(prompt)
    return body_bytes // CHARS_PER_TOKEN

_json = msgspec.json.encode


def max_retain_s(cfg: Config) -> float:
    """The most a request may ask its session's prefix kept (kv_tier.max_retain_s)."""
    return cfg.kv_tier.max_retain_s


class Proxy:
    """The request path: admit, dispatch, serve and log each request, through the objects named in the
    module's text. Owns the ids of the requests in flight here."""

    def __init__(self, cfg: Config, clock: Clock | None = None):
        """``clock``: the time the cluster client, the keys' limits, the writes' timeout and every latency of a
        request (its TTFT and TPOT as goodput judges them, the histograms, the access log) read (default: the
        monotonic clock)."""
        self.cfg = cfg
        self.clock = clock = clock or Clock()
        self.model = cfg.model.name
        self.max_model_len = cfg.model.max_model_len
        self.tokenizer: Tokenizer = load_tokenizer(cfg.model.path, cfg.sim.vocab_size, cfg.sim.eos_token_id)
        self.keys: ApiKeys | None = (ApiKeys.load(cfg.proxy.api_keys_file, clock.monotonic)
                                     if cfg.proxy.api_keys_file else None)
        self.tracer = Tracer.create(cfg.tracing, "llumnix-proxy")  # None: tracing off
        self.cluster = ClusterClient(cfg, clock=clock, tracer=self.tracer)
        self.goodput = Goodput(cfg.slo)  # SLO outcomes per class (daemons/proxy/cluster/goodput.py)
        self.active: set[str] = set()  # ids of the requests this proxy is serving
        self.checks = Checks(self.tokenizer, self.model, self.max_model_len, cfg.proxy.max_prompt_tokens, cfg.proxy,
                             self.cluster.adapters)
        self.tenants = Tenants(clock.monotonic)  # per-key limits (daemons/proxy/front/tenants.py)
        self.limits = TenantLimits(self.tenants)
        self.access = AccessLog(cfg.proxy.access_log, clock.monotonic)
        self.guard = Guard(self.keys, body_limit(cfg), self.access)
        self.session_header = cfg.sessions.header.lower()
        self.max_retain_s = max_retain_s(cfg)
        self.routes = Routes(self.checks, self.cluster.alive, self.cluster.manager_ok,
                             self.cluster.lora if cfg.lora.api_updates else None)

    async def handle(self, call: Call, chat: bool) -> Reply:
        """One completion or chat request; logs it once it is answered (a stream: once it ends). Raises
        ApiError for an answer that is an error."""
        arrival = self.clock.monotonic()
        job = None
        principal = call.principal
        key_name = principal.name if principal is not None else "-"
        try:
            job = Job(chat, self.checks.request_id(call), arrival, self.clock.time())
            job.key_name = key_name
            if self.tracer is not None:
                job.trace = RequestTrace(self.tracer, call.headers.get("traceparent", ""), job.id, chat, key_name)
            if principal is not None:
                job.principal = principal
                job.ticket = self.limits.enter(principal)
            reply = await self._accept(call, job)
        except ApiError as exc:
            self.limits.release(job)
            if job is None:
                self.access.write(None, chat, arrival, exc.status, key_name)
            else:
                job.status = exc.status
                self.access.write(job, chat, arrival, exc.status)
            raise
        except BaseException:
            self.limits.release(job)
            self.access.write(job, chat, arrival, 500)
            raise
        if reply.stream is None:  # a stream logs itself when it ends
            self.access.write(job, chat, arrival, reply.status)
        return reply

    def _admit(self, priority: int, job: Job, prompt_tokens: int = 0, max_tokens: int = 0, final: bool = False,
               session: str = "") -> None:
        """Admission control (daemons/proxy/cluster/admission.py ``admit``): 429 with Retry-After, before any tokenizing
        (``prompt_tokens``: an estimate from the body, for the SLO's prediction; ``max_tokens``: the most it may
        generate, 0: not known yet; ``final``: the check with the body read, whose admission counts at once against
        the next ones'; ``session``: its session, whose prompt's cached part is not counted as work). How long the refusal took, from the request's arrival, goes to
        llumnix_proxy_refusal_seconds."""
        principal = job.principal
        # The request's SLO class and targets, computed here once (its key's where tighter): admission, dispatch,
        # the instance's attainment and goodput read them.
        job.priority, job.slo = priority, self.cluster.classes.of(priority, Goodput.key_targets(principal))
        try:
            verdict = self.cluster.admit(job.slo, principal.name if principal is not None else "", prompt_tokens,
                                         max_tokens, job.id if final else "", session)
            job.fits = verdict.fits if verdict is not None else ()
        except Overloaded as exc:
            M_REFUSAL.observe(self.clock.monotonic() - job.arrival)
            M_REJECTED.labels(exc.reason).inc()
            self.goodput.refused(job.slo, exc.reason)
            raise self._retry_later(429, str(exc), "rate_limit_exceeded", exc.retry_after_s) from None

    def _retry_later(self, status: int, message: str, code: str, retry_after_s: float = 0.0) -> ApiError:
        err = ApiError(status, message, type_="rate_limit_exceeded" if status == 429 else "service_unavailable",
                       code=code)
        after = math.ceil(retry_after_s) if retry_after_s > 0 else self.cfg.admission.retry_after_s
        err.headers = {"Retry-After": str(after)}
        return err

    async def _accept(self, call: Call, job: Job) -> Reply:
        header_priority = call.headers.get("x-llumnix-priority")
        if header_priority is not None:  # refused before the body is read, however large
            self._admit(parse_priority(None, header_priority), job)
        elif self._large(call):  # refused before a large body is read, when even the best case would be
            self._admit(self._best_priority(call), job, 1, 1)
        raw = await call.read()
        body = decode_body(raw, ChatRequest if job.chat else CompletionRequest)
        job.model = body.model
        job.adapter = self.checks.check_model(body.model)
        body.unsupported()
        self.checks.check_stops(body)
        session = session_of(body, call.headers, self.session_header, self.max_retain_s)
        prompt_tokens = prompt_estimate(body, len(raw))
        self._admit(parse_priority(body.priority, header_priority), job, prompt_tokens,
                    self._max_tokens_estimate(body, prompt_tokens), final=True, session=session.name)
        structured = body.structured()
        if job.chat:
            tools = self.checks.tool_choice(body)
            if tools.kind in ("required", "named"):
                job.tools = ToolCalls(tools)
            prompt = self.checks.chat_prompt(body, body.add_generation_prompt)
            ids = self.tokenizer.encode(prompt, add_special_tokens=False)
            max_tokens = self.checks.max_tokens(len(ids), body.max_completion_tokens or body.max_tokens, None, "messages")
            self.limits.charge(job, len(ids) + body.n * max_tokens)
            top_n = body.top_logprobs or 0
            sampling = body.sampling(max_tokens, top_n if body.logprobs else None, structured)
        else:
            ids = self.checks.prompt_ids(body)
            max_tokens = self.checks.max_tokens(len(ids), body.max_tokens, 16, "prompt")
            self.limits.charge(job, len(ids) + body.n * max_tokens)
            top_n = body.logprobs or 0
            sampling = body.sampling(max_tokens, body.logprobs, structured)
        return await self._serve(call, job, body, ids, sampling, top_n, session)

    def _large(self, call: Call) -> bool:
        """A body that may take a while to arrive (over PRE_ADMIT_BYTES, or of unknown length)."""
        length = call.headers.get("content-length")
        return length is None or not length.isdigit() or int(length) > PRE_ADMIT_BYTES

    @staticmethod
    def _best_priority(call: Call) -> int:
        """The highest priority this caller may send (its body may ask for it): high unless its API key may not."""
        principal = call.principal
        return 1 if principal is None or principal.high_priority else 0

    def _max_tokens_estimate(self, body, prompt_tokens: int) -> int:
        """The most tokens a request may generate, as admission sees it before the checks: what it asks for (a
        chat request's max_completion_tokens first), else the default (completions: 16; chat: up to the context
        limit); never past the context limit."""
        room = max(self.max_model_len - prompt_tokens, 1)  # (more is a 400 from the checks, not a refusal)
        asked = (body.max_completion_tokens if isinstance(body, ChatRequest) else None) or body.max_tokens
        if asked:
            return min(asked, room)
        return min(16, room) if not isinstance(body, ChatRequest) else room

    def _in_flight(self, job: Job, sub_ids: list[str]) -> bool:
        return job.id in self.active or any(rid in self.cluster.streams for rid in sub_ids)

    async def _serve(self, call: Call, job: Job, req, ids: list[int], sampling: wire.SamplingParams,
                     top_n: int, session: Session = NONE) -> Reply:
        priority = parse_priority(req.priority, call.headers.get("x-llumnix-priority"))
        principal = call.principal
        if job.slo.high and principal is not None and not principal.high_priority:
            raise ApiError(403, f"The API key '{principal.name}' may not send priority high: it lacks the "
                                f"high_priority permission (high_priority = true in proxy.api_keys_file).",
                           "priority", type_="invalid_request_error", code="permission_denied")
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        token_text = None
        if sampling.logprobs is not None:
            token_text = token_id_text if req.return_tokens_as_token_ids else self.tokenizer.token_text
        job.setup(job.adapter or self.model, len(ids), include_usage, token_text, top_n)
        stops = req.stop_strings()
        n = req.n
        job.choices = [Choice(job, k, stops, self.tokenizer.detokenizer(), req.return_token_ids) for k in range(n)]
        job.timer = metrics.RequestTimer(job.arrival, len(ids), n, self.clock.monotonic)
        sub_ids = [job.id] if n == 1 else [f"{job.id}-{k}" for k in range(n)]
        if self._in_flight(job, sub_ids):
            raise ApiError(409, f"a request with id {job.id!r} is in flight on this proxy; ids must be unique",
                           "x-request-id", code="request_id_in_use")
        now = self.clock.time()
        traceparent = job.trace.traceparent if job.trace is not None else ""
        targets = job.slo.own  # the instance where it finishes judges it against these (its attainment)
        ttft_ms, tpot_ms = targets.ttft_s * 1000.0, targets.tpot_s * 1000.0
        submits = [wire.Submit(rid, ids, sampling if n == 1 else msgspec.structs.replace(
            sampling, seed=derive_seed(sampling.seed, k)), self.cluster.token_address, priority, now,
            traceparent=traceparent, slo_ttft_ms=ttft_ms, slo_tpot_ms=tpot_ms, adapter=job.adapter,
            adapter_path=self.cluster.adapters().get(job.adapter, ""), session=session.name,
            retain_s=session.retain_s) for k, rid in enumerate(sub_ids)]
        self.active.add(job.id)
        handed_over = False  # to the streaming reply, which cleans up when it ends
        try:
            await self._submit(job, submits)
            firsts = await call.unless_disconnected(self._firsts(job))
            if firsts is None:  # the client went away before the first token: abort it on its instance
                return Reply(499)
            for c, first in zip(job.choices, firsts):
                if not first:
                    if c.stream.status == 429:  # it gave up waiting for its first token (slo.give_up_factor)
                        self.goodput.gave_up(job.slo)
                        raise self._retry_later(429, c.stream.error or "overloaded", "rate_limit_exceeded",
                                                job.slo.own.ttft_s)
                    raise ApiError(c.stream.status, c.stream.error or "request failed")
            job.timer.first_token(job.first_at)
            headers = {"x-request-id": call.echo_id or job.id}
            predicted = job.choices[0].stream.predicted
            if predicted is not None:  # what it was placed by (daemons/policy/slo.py): clients and benchmarks compare
                headers["x-llumnix-predicted-ttft-ms"] = f"{predicted[0] * 1000:.1f}"
                headers["x-llumnix-predicted-tpot-ms"] = f"{predicted[1] * 1000:.2f}"
            if req.stream:
                body = sse(job, firsts, self._ended)
                # A client gone before the body starts means the generator never runs (nor its finally).
                weakref.finalize(body, self._abandoned, job).atexit = False  # not at exit: the cluster is gone
                handed_over = True
                return Reply(200, headers=headers, stream=body, job=job)
            M_INFLIGHT.inc()
            try:
                failed = await call.unless_disconnected(collect(job, firsts))
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
        give_up_s = self.goodput.give_up_s(job.slo.own)
        if len(submits) == 1:
            try:
                job.choices[0].stream = await self.cluster.submit(submits[0], tenant, weight, give_up_s, slo_=job.slo,
                                                                  fits=job.fits)
            except NoInstance as exc:
                raise self._no_instance(exc) from None
            return
        results = await asyncio.gather(*(self.cluster.submit(s, tenant, weight, give_up_s, slo_=job.slo, fits=job.fits)
                                         for s in submits),
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
            job.first_at = self.clock.monotonic()
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
            self._outcome(job)
        for stream in job.streams():
            self.cluster.finish(stream)
        self.active.discard(job.id)
        self.limits.release(job)

    def _outcome(self, job: Job) -> None:
        """A request that got its answer (its first choice finished): its SLO outcome and prediction errors."""
        c = job.choices[0] if job.choices else None
        if c is None or c.stream is None or not c.reason or job.first_at is None or job.slo is None:
            return
        timer = job.timer
        tpot = ((timer.last[0] - timer.first[0]) / (timer.tokens[0] - 1)) if timer.tokens[0] > 1 else None
        self.goodput.finished(job.slo, job.first_at - job.arrival, tpot, c.stream.predicted)

    def _abandoned(self, job: Job) -> None:
        self._end(job)
        self.access.write(job, job.chat, job.arrival, 499)

    def _ended(self, job: Job) -> None:
        """A streamed answer ended (daemons/proxy/api/output.py ``sse``): let the request go and log it."""
        self._end(job)
        self.access.write(job, job.chat, job.arrival, job.status)
