"""A bounded load for end-to-end tests: streamed completions on a background thread, each one timed and
checked token by token against the sim's deterministic output."""

from __future__ import annotations

import asyncio
import json
import statistics
import threading
import time
from dataclasses import dataclass, field

import httpx

from daemons.engine.sim import sim_token_id

VOCAB = 32000


@dataclass
class Result:
    max_tokens: int
    priority: str = "normal"
    rid: str = ""
    sent: float = 0.0
    first: float | None = None
    done: float | None = None
    ids: list[int] = field(default_factory=list)
    error: str | None = None

    @property
    def ttft(self) -> float:
        return self.first - self.sent

    @property
    def tpot(self) -> float:
        return (self.done - self.first) / max(1, len(self.ids) - 1)

    def complete(self) -> bool:
        return (self.error is None and len(self.ids) == self.max_tokens
                and self.ids == [sim_token_id(self.rid, i, VOCAB) for i in range(self.max_tokens)])


@dataclass
class Spec:
    """One request of a load: when to send it (seconds after the start) and what to ask."""

    at: float
    max_tokens: int
    prompt_tokens: int = 32
    priority: str = "normal"


class Load(threading.Thread):
    """Sends ``specs`` at their times (open loop) and records each stream; ``join`` waits for all of them."""

    def __init__(self, url: str, specs: list[Spec], timeout: float = 120.0):
        super().__init__(daemon=True)
        self.url, self.specs, self.timeout = url, specs, timeout
        self.results = [Result(s.max_tokens, s.priority) for s in specs]
        self.start()

    def run(self) -> None:
        asyncio.run(self._all())

    async def _all(self) -> None:
        limits = httpx.Limits(max_connections=1000, max_keepalive_connections=1000)
        async with httpx.AsyncClient(timeout=self.timeout, limits=limits) as client:
            t0 = time.monotonic()
            await asyncio.gather(*(self._one(client, t0, s, r) for s, r in zip(self.specs, self.results)))

    async def _one(self, client: httpx.AsyncClient, t0: float, spec: Spec, res: Result) -> None:
        await asyncio.sleep(max(0.0, t0 + spec.at - time.monotonic()))
        body = {"model": "llumnix-sim", "prompt": [100 + i % 900 for i in range(spec.prompt_tokens)],
                "max_tokens": spec.max_tokens, "ignore_eos": True, "stream": True, "return_token_ids": True,
                "priority": spec.priority}
        res.sent = time.monotonic()
        try:
            async with client.stream("POST", self.url + "/v1/completions", json=body) as resp:
                if resp.status_code != 200:
                    res.error = f"HTTP {resp.status_code}: {(await resp.aread())[:300]!r}"
                    return
                async for line in resp.aiter_lines():
                    if not line.startswith("data: {"):
                        continue
                    chunk = json.loads(line[6:])
                    if "error" in chunk:
                        res.error = str(chunk["error"])
                        return
                    res.rid = chunk["id"]
                    got = [t for ch in chunk["choices"] for t in ch.get("token_ids", [])]
                    if got and res.first is None:
                        res.first = time.monotonic()
                    res.ids += got
            res.done = time.monotonic()
        except httpx.HTTPError as exc:
            res.error = repr(exc)

    def wait(self, timeout: float = 180.0) -> list[Result]:
        self.join(timeout)
        assert not self.is_alive(), "the load did not finish in time"
        return self.results

    def started(self) -> int:
        return sum(1 for r in self.results if r.first is not None)


def mean(xs) -> float:
    xs = list(xs)
    return statistics.fmean(xs) if xs else float("nan")


def failures(results: list[Result]) -> list[str]:
    return [f"{r.rid or '?'}: {r.error or f'{len(r.ids)}/{r.max_tokens} tokens'}" for r in results if not r.complete()]
