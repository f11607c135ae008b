"""What ``llumnixctl bench migration`` measures a request by: a streamed completion whose token arrival times are
kept (``TimedStream``), and the time a destination takes to prefill the same prompt from scratch
(``recompute_ms``: what the paper's Fig 10 sets the migration against)."""

from __future__ import annotations

import threading
import time
import uuid

import httpx
import zmq

from daemons import runtime, wire
from llumnixctl.common import sse_chunks


class TimedStream(threading.Thread):
    """A streamed completion whose token arrival times are kept."""

    def __init__(self, url: str, model: str, prompt: list[int], max_tokens: int):
        super().__init__(daemon=True)
        self.url, self.model, self.prompt, self.max_tokens = url, model, prompt, max_tokens
        self.times: list[float] = []
        self.ids: list[int] = []
        self.rid = ""
        self.error: str | None = None
        self.stop = threading.Event()
        self.start()

    def run(self) -> None:
        body = {"model": self.model, "prompt": self.prompt, "max_tokens": self.max_tokens, "ignore_eos": True,
                "temperature": 0, "stream": True, "return_token_ids": True}
        try:
            with httpx.stream("POST", self.url + "/v1/completions", json=body, timeout=600) as resp:
                if resp.status_code != 200:
                    self.error = f"HTTP {resp.status_code}: {resp.read()[:300]!r}"
                    return
                for chunk in sse_chunks(resp):
                    if "error" in chunk:
                        self.error = str(chunk["error"])
                        return
                    now = time.perf_counter()
                    self.rid = chunk["id"]
                    for ch in chunk["choices"]:
                        for t in ch.get("token_ids", []):
                            self.ids.append(t)
                            self.times.append(now)
                    if self.stop.is_set():
                        return  # closing the stream aborts the request
        except httpx.HTTPError as exc:
            self.error = repr(exc)

    def wait(self, n: int, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while len(self.ids) < n:
            if self.error or not self.is_alive():
                raise RuntimeError(f"the benchmark request failed: {self.error or 'stream ended'}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"the benchmark request made {len(self.ids)} tokens in {timeout:g}s")
            time.sleep(0.001)

    def end(self) -> None:
        self.stop.set()
        self.join(60)


def recompute_ms(request_address: str, prompt: list[int], timeout_s: float, reply_host: str = "127.0.0.1") -> float:
    """Prefill ``prompt`` on one instance from scratch: time to its first token, over ZeroMQ."""
    ctx = zmq.Context.instance()
    pull = runtime.tune(ctx.socket(zmq.PULL))
    dealer = runtime.tune(ctx.socket(zmq.DEALER))
    try:
        reply_to = runtime.bind(pull, f"tcp://{reply_host}:0")
        dealer.connect(request_address)
        sub = wire.Submit(f"recompute-{uuid.uuid4().hex}", prompt, wire.SamplingParams(max_tokens=1, ignore_eos=True,
                                                                                       temperature=0), reply_to)
        t0 = time.perf_counter()
        dealer.send(wire.encode(sub))
        while True:
            if not pull.poll(int(timeout_s * 1000)):
                raise RuntimeError(f"recomputation on the destination did not finish within {timeout_s:g}s")
            msg = wire.decode(pull.recv())
            if isinstance(msg, wire.RequestFailed):
                raise RuntimeError(f"recomputation refused: {msg.message}")
            if isinstance(msg, wire.TokenBatch) and msg.outputs:
                return (time.perf_counter() - t0) * 1e3
    finally:
        dealer.close(0)
        pull.close(0)
