"""``llumnixctl bench overload --burst N``: a burst of N streams sent at once, after a short warm-up, to a cluster
that serves to a TTFT target: how many are admitted and how fast their first tokens come, how fast the refused
ones are told (at the client, and at the proxy by its ``llumnix_proxy_refusal_seconds`` histogram), and, with
``--retries``, whether the clients that wait the Retry-After they were given are admitted later and meet the
target. The streams are spread evenly over the cluster's proxies.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Callable

import httpx

from llumnixctl.experiments.bench.goodput import gave_up
from llumnixctl.experiments.bench.proxy_short import host_port, open_nodelay
from llumnixctl.experiments.bench.serve import stream_completion
from llumnixctl.stats import percentile


def _ms(xs: list[float], q: float) -> float | None:
    return round(percentile(xs, q) * 1000, 2) if xs else None


async def warm_up(url: str, body: Callable[[int, int], dict], n: int, output: int, timeout: float) -> int:
    """``n`` requests one at a time with short answers (a dozen, as a new user's first tries): the instances'
    step-time models and observed output lengths start from these. Returns how many succeeded."""
    ok = 0
    async with httpx.AsyncClient(timeout=timeout) as client:
        for k in range(n):
            r = await stream_completion(client, url, {**body(800_000 + k, output)}, None, timeout)
            ok += r["error"] is None
    return ok


async def _one_stream(host: str, port: int, request: bytes, conn=None) -> dict:
    """One streamed completion over a fresh connection (``conn``: already open), read raw: the status, the
    headers the refusal carries, and the time of every token event from the moment the request was written."""
    reader, writer = conn or await open_nodelay(host, port)
    sent = time.perf_counter()
    out = {"sent": sent, "status": None, "answered_s": None, "retry_after": None, "predicted_ttft_ms": None,
           "times": [], "error": None}
    try:
        writer.write(request)
        status = await reader.readline()
        out["answered_s"] = time.perf_counter() - sent
        out["status"] = int(status.split()[1]) if len(status.split()) > 1 else None
        while True:  # headers
            line = await reader.readline()
            if line in (b"\r\n", b"\n", b""):
                break
            name, _, value = line.decode("latin-1").partition(":")
            name = name.strip().lower()
            if name == "retry-after":
                out["retry_after"] = value.strip()
            elif name == "x-llumnix-predicted-ttft-ms":
                out["predicted_ttft_ms"] = value.strip()
        if out["status"] != 200:
            out["error"] = f"HTTP {out['status']}: {(await reader.read(4096))[:600]!r}"
            return out
        async for line in reader:  # Connection: close: the stream ends with the connection
            if line.startswith(b"data: {"):
                if line.startswith(b'data: {"error"'):
                    out["error"] = line[6:300].decode("utf-8", "replace")
                    break
                out["times"].append(time.perf_counter() - sent)
        if not out["times"] and out["error"] is None:
            out["error"] = "no token"
    except (ConnectionError, OSError, ValueError) as exc:
        out["error"] = f"{type(exc).__name__}: {exc}"
    finally:
        writer.close()
    return out


def _request(body: dict) -> bytes:
    data = json.dumps(body).encode()
    return (b"POST /v1/completions HTTP/1.1\r\nHost: bench\r\nContent-Type: application/json\r\n"
            b"Content-Length: " + str(len(data)).encode() + b"\r\nConnection: close\r\n\r\n" + data)


async def burst(urls: list[str], body: Callable[[int, int], dict], n: int, output: int, retries: int,
                timeout: float, deadline_s: float) -> list[dict]:
    """``n`` streams at once over ``urls`` (round robin): every connection is opened first, then every request
    written in one go (a raw client: an HTTP library's own cost on these two cores would be measured as the
    server's). A refused one (429 with Retry-After) waits what it was told and tries again on a new connection,
    up to ``retries`` times and not past ``deadline_s`` from the start. Each result: the attempts (status,
    seconds to the answer, Retry-After), and for the last one the stream's token times."""
    targets = [host_port(urls[k % len(urls)]) for k in range(n)]
    requests = [_request(body(k, output)) for k in range(n)]
    conns = await asyncio.gather(*(open_nodelay(h, p) for h, p in targets))
    start = time.perf_counter()

    async def one(k: int, conn) -> dict:
        attempts = []
        while True:
            r = await asyncio.wait_for(_one_stream(*targets[k], requests[k], conn), timeout)
            conn = None
            attempts.append({"status": r["status"], "answered_s": r["answered_s"], "retry_after": r["retry_after"],
                             "sent_s": r["sent"] - start, "gave_up": gave_up(r)})
            wait = _retry_after(r)
            if (r["status"] != 429 or wait is None or len(attempts) > retries
                    or time.perf_counter() + wait - start > deadline_s):
                r["attempts"] = attempts
                return r
            await asyncio.sleep(wait)

    return list(await asyncio.gather(*(one(k, c) for k, c in enumerate(conns))))


def _retry_after(r: dict) -> float | None:
    try:
        return float(r.get("retry_after")) if r.get("retry_after") else None
    except ValueError:
        return None


def analyse(results: list[dict], ttft_s: float, tpot_s: float) -> dict:
    """The burst's figures: first tries and retries apart."""
    first = [r["attempts"][0] for r in results]
    refusals = [a for r in results for a in r["attempts"] if a["status"] == 429]
    refusals = [a for a in refusals if not a.get("gave_up")]
    admitted = [r for r in results if r["error"] is None]
    at_once = [r for r in admitted if len(r["attempts"]) == 1]
    later = [r for r in admitted if len(r["attempts"]) > 1]
    ttft = [r["times"][0] for r in at_once]
    ttft_later = [r["times"][0] for r in later]

    def met(r: dict) -> bool:
        t = r["times"]
        tpot = (t[-1] - t[0]) / (len(t) - 1) if len(t) > 1 else 0.0
        return (not ttft_s or t[0] <= ttft_s) and (not tpot_s or tpot <= tpot_s)

    given_up = [r for r in results if gave_up(r)]
    other = [r for r in results if r["error"] is not None and r.get("status") != 429]
    return {
        "requests": len(results),
        "admitted_first_try": sum(1 for a in first if a["status"] == 200),
        "refused_first_try": sum(1 for a in first if a["status"] == 429),
        "refusals": len(refusals),
        "refusals_without_retry_after": sum(1 for a in refusals if not a["retry_after"]),
        "refusal_client_p50_ms": _ms([a["answered_s"] for a in refusals], 50),
        "refusal_client_p99_ms": _ms([a["answered_s"] for a in refusals], 99),
        "refusal_client_max_ms": _ms([a["answered_s"] for a in refusals], 100),
        "admitted_ttft_p50_ms": _ms(ttft, 50), "admitted_ttft_p99_ms": _ms(ttft, 99),
        "admitted_ttft_max_ms": _ms(ttft, 100),
        "admitted_met": sum(1 for r in at_once if met(r)),
        "retried_admitted": len(later), "retried_ttft_p99_ms": _ms(ttft_later, 99),
        "retried_met": sum(1 for r in later if met(r)),
        "still_refused": sum(1 for r in results if r.get("status") == 429) - len(given_up),
        "gave_up_after_admission": len(given_up),
        "other_errors": len(other), "first_other_error": other[0]["error"][:300] if other else "",
        "attainment_of_admitted": (sum(1 for r in admitted if met(r)) / len(admitted)) if admitted else None,
        **_prediction_error(admitted),
    }


def _prediction_error(admitted: list[dict]) -> dict:
    """|predicted - actual| / actual of the admitted requests' TTFT (the proxy's x-llumnix-predicted-ttft-ms
    against the client's; the client's includes the way to the proxy): median and 90th percentile."""
    errors = sorted(abs(float(r["predicted_ttft_ms"]) / 1000 - r["times"][0]) / r["times"][0]
                    for r in admitted if r.get("predicted_ttft_ms") and r["times"] and r["times"][0] > 0)
    if not errors:
        return {"ttft_error_p50": None, "ttft_error_p90": None}
    return {"ttft_error_p50": round(percentile(errors, 50), 3), "ttft_error_p90": round(percentile(errors, 90), 3)}


def proxy_refusals(urls: list[str]) -> dict:
    """The proxies' own refusal times: ``llumnix_proxy_refusal_seconds`` (histogram) summed over ``urls``, as
    P50/P99 upper bucket bounds in ms and a count."""
    buckets: dict[float, float] = {}
    count = 0.0
    for url in urls:
        try:
            text = httpx.get(url + "/metrics", timeout=10.0).text
        except httpx.HTTPError:
            continue
        for line in text.splitlines():
            if line.startswith("llumnix_proxy_refusal_seconds_bucket{"):
                le = line.split('le="', 1)[1].split('"', 1)[0]
                buckets[float("inf") if le == "+Inf" else float(le)] = (
                    buckets.get(float("inf") if le == "+Inf" else float(le), 0.0) + float(line.rsplit(" ", 1)[1]))
            elif line.startswith("llumnix_proxy_refusal_seconds_count"):
                count += float(line.rsplit(" ", 1)[1])

    def q(p: float) -> float | None:
        if not count:
            return None
        for le in sorted(buckets):
            if buckets[le] >= p * count:
                return le * 1000 if le != float("inf") else None
        return None

    return {"proxy_refusals": int(count), "refusal_proxy_p50_ms_le": q(0.5), "refusal_proxy_p99_ms_le": q(0.99)}
