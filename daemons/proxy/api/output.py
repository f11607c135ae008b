"""A request's answer (functions of the Job, daemons/proxy/api/render.py): collected whole, or streamed as server-sent events with the error or usage at the end."""

from __future__ import annotations

import asyncio
from typing import AsyncIterator, Callable

import msgspec

from daemons import metrics, wire
from daemons.proxy.api.protocol import ApiError
from daemons.proxy.api.render import Choice, Job

# Defined in daemons/metrics.py, with the latencies of each request (Job.timer).
M_INFLIGHT = metrics.P_IN_FLIGHT
M_TOKENS = metrics.P_GENERATION_TOKENS

_json = msgspec.json.encode


async def collect(job: Job, firsts: list[list[wire.TokenOut]]) -> Choice | bool:
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

def _stream_error(c: Choice) -> bytes:
    err = ApiError(c.stream.status, c.stream.error or "request failed").body()
    return b"data: " + _json(err) + b"\n\ndata: [DONE]\n\n"

async def sse(job: Job, firsts: list[list[wire.TokenOut]], ended: Callable[[Job], None]) -> AsyncIterator[bytes]:
    """The server-sent events of every choice as its tokens come; ``ended(job)`` once the stream ends
    (the request let go and logged), however it ends."""
    M_INFLIGHT.inc()
    count = M_TOKENS.labels().inc  # its one series, once: each chunk adds to it without the wrapper's calls
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
                count(c.completion_tokens - sent)
                sent = c.completion_tokens
                outs = await c.stream.take()
                if not outs:
                    job.status = c.stream.status
                    yield _stream_error(c)
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
                    yield chunk + _stream_error(c)
                    return
                chunk += job.render(c, outs)
                if c.reason is None:
                    pending[asyncio.ensure_future(c.stream.take())] = c
            if chunk:
                yield chunk
            done_tokens = job.completion_tokens
            count(done_tokens - sent)
            sent = done_tokens
        yield job.end_chunks()
    except BaseException:
        if job.status == 200:
            job.status = 499  # the client went away mid-stream (or the server is stopping)
        raise
    finally:
        for fut in pending:
            fut.cancel()
        count(job.completion_tokens - sent)
        M_INFLIGHT.dec()
        ended(job)
