"""Helpers of the failure tests: streamed requests checked token by token, waits, metrics."""

from __future__ import annotations

import json
import threading
import time

import httpx

from daemons.engine.sim import sim_token_id

VOCAB = 32000


def wait_for(what, timeout: float, message="", every: float = 0.05):
    """Poll ``what()`` until it is truthy (returned), failing after ``timeout`` seconds with ``message`` (a
    string, or a callable read at the failure: a view of what the test waited on). The tests' one wait for a
    condition of processes they do not drive (daemons, logs, metrics); in-process code on virtual time waits
    with its harness's ``until`` instead."""
    deadline = time.monotonic() + timeout
    while True:
        got = what()
        if got:
            return got
        if time.monotonic() >= deadline:
            said = message() if callable(message) else message
            raise AssertionError(f"{said or 'the condition'}: not within {timeout:g}s")
        time.sleep(every)


def samples(text: str) -> dict[str, float]:
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def _labels(key: str) -> dict[str, str]:
    """The labels of a sample key ``name{a="x",b="y"}`` (label values here never hold '",')."""
    if "{" not in key:
        return {}
    body = key[key.index("{") + 1: key.rindex("}")]
    return dict((k, v.strip('"')) for k, v in (p.split("=", 1) for p in body.split('",') if p))


def metric(samples_: dict[str, float], name: str, default=None, **labels: str):
    """The sum of ``name``'s samples whose labels include ``labels`` (every metric also carries model_name,
    an instance's instance_id); ``default`` when there is none."""
    got = [v for k, v in samples_.items() if k.split("{", 1)[0] == name
           and all(_labels(k).get(a) == b for a, b in labels.items())]
    return sum(got) if got else default


def proxy_metric(url: str, name: str) -> float:
    """The sum of a proxy metric over its labels."""
    return metric(samples(httpx.get(url + "/metrics", timeout=10).text), name, default=0.0)


class Stream(threading.Thread):
    """One streamed completion on a thread: every token id, the request id, usage, the error if any."""

    def __init__(self, url: str, max_tokens: int, prompt="x", model: str = "llumnix-sim", start: bool = True,
                 headers: dict | None = None, **extra):
        super().__init__(daemon=True)
        self.url = url
        self.headers = headers or {}
        # The sim ends a request at EOS with chance eos_rate per token; a check of exactly max_tokens tokens must
        # not lose that draw now and then, so EOS is off unless a test asks for it.
        extra.setdefault("ignore_eos", True)
        self.body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "stream": True,
                     "return_token_ids": True, "stream_options": {"include_usage": True}, **extra}
        self.ids: list[int] = []
        self.rid = ""
        self.usage: dict | None = None
        self.finish: str | None = None
        self.error = None
        self.started = threading.Event()  # set at the first chunk (or the end)
        self.stop_after: int | None = None  # close the connection after this many tokens (the client leaves)
        if start:
            self.start()

    def run(self) -> None:
        try:
            with httpx.stream("POST", self.url + "/v1/completions", json=self.body, headers=self.headers,
                              timeout=120) as resp:
                if resp.status_code != 200:
                    self.error = f"HTTP {resp.status_code}: {resp.read()[:300]!r}"
                    return
                for line in resp.iter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line[6:])
                    if "error" in chunk:
                        self.error = chunk["error"]
                        return
                    self.rid = chunk["id"]
                    self.started.set()
                    self.usage = chunk.get("usage") or self.usage
                    for ch in chunk["choices"]:
                        self.ids += ch.get("token_ids") or []
                        self.finish = ch.get("finish_reason") or self.finish
                    if self.stop_after is not None and len(self.ids) >= self.stop_after:
                        break
        except httpx.HTTPError as exc:
            self.error = repr(exc)
        finally:
            self.started.set()

    def wait_tokens(self, n: int, timeout: float = 30) -> None:
        wait_for(lambda: len(self.ids) >= n or not self.is_alive(), timeout, f"only {len(self.ids)} tokens")
        assert len(self.ids) >= n, f"stream ended early: {self.error}"

    def result(self, timeout: float = 120) -> "Stream":
        self.join(timeout)
        assert not self.is_alive(), "the stream did not end"
        return self

    def check_sim(self, n: int, prompt_tokens: int | None = None) -> None:
        """Complete and exact: the sim's n tokens for this request id, each once, in order; usage agrees."""
        self.result()
        assert self.error is None, self.error
        want = [sim_token_id(self.rid, i, VOCAB) for i in range(n)]
        assert self.ids == want, f"{self.rid}: wrong tokens: got {self.ids}, want {want} (finish {self.finish})"
        assert self.usage is not None and self.usage["completion_tokens"] == n, self.usage
        if prompt_tokens is not None:
            assert self.usage["prompt_tokens"] == prompt_tokens, self.usage
