"""``llumnixctl bench serve``: replay a trace open loop against any OpenAI-compatible endpoint.

The target may be our proxy, vLLM's own server (``vllm serve``) or another router: every request is a
streamed ``/v1/completions`` with its prompt as a list of token ids of exactly the trace's length and
``max_tokens`` = its output length (with ``ignore_eos`` unless --no-ignore-eos), sent at its arrival time
whatever happened to the ones before it (open loop; --max-concurrency caps the requests in flight).

The figures are those of vLLM's ``vllm bench serve`` (vllm/benchmarks/serve.py), with its definitions,
its result block and its JSON keys, so that they compare with what people run today:

- TTFT: from sending the request to the first streamed chunk with a choice;
- E2EL: from sending to the last chunk with a choice;
- TPOT: (E2EL - TTFT) / (output tokens - 1), for requests of more than one output token;
- ITL: every gap between consecutive chunks with a choice (all requests' gaps pooled);
- output tokens and input lengths: the usage chunk's ``completion_tokens`` and ``prompt_tokens``;
- mean, median, std and P99 as numpy computes them, in ms; aggregates over the successful requests.

The replay core here (:func:`stream_completion`, :func:`replay`) is also what ``bench policies`` uses.
"""

from __future__ import annotations

import asyncio
import json
import random
import sys
import time
from datetime import datetime
from pathlib import Path
from typing import Annotated, Callable, Iterator, Optional

import httpx
import typer
from rich.console import Console

from llumnixctl.experiments.traces import gen as trace_mod
from llumnixctl.experiments.bench.goodput import slo_figures
from llumnixctl.experiments.bench.serve_figures import metrics, plot_cdfs, result_block

# A neutral text to tokenize once: prompts are its token ids, rotated per request and repeated to length.
BASE_TEXT = (
    "The quick brown fox jumps over the lazy dog while the old river keeps running toward the sea. "
    "Every morning the baker opens the shop, the children walk to school, and the city slowly wakes up. "
    "Numbers such as 17, 42 and 1984 appear in books, on maps, in songs and in the news of the day. "
)


# ---------------------------------------------------------------------- the replay core (shared)


async def stream_completion(client: httpx.AsyncClient, url: str, body: dict, headers: dict | None,
                            timeout_s: float, texts: bool = False) -> dict:
    """POST one streamed completion and follow it. Times are seconds from sending: ``times`` has one
    entry per chunk with a choice (the first is the TTFT, the last the end-to-end latency)."""
    out = {"id": None, "error": None, "times": [], "prompt_tokens": None, "completion_tokens": None, "text": ""}
    sent = time.perf_counter()
    out["sent"] = sent

    async def follow() -> None:
        async with client.stream("POST", url + "/v1/completions", json=body, headers=headers) as resp:
            out["status"], out["answered_s"] = resp.status_code, time.perf_counter() - sent
            out["retry_after"] = resp.headers.get("retry-after")
            out["predicted_ttft_ms"] = resp.headers.get("x-llumnix-predicted-ttft-ms")  # (the proxy's SLO prediction)
            out["predicted_tpot_ms"] = resp.headers.get("x-llumnix-predicted-tpot-ms")
            if resp.status_code != 200:
                out["error"] = f"HTTP {resp.status_code}: {(await resp.aread())[:200]!r}"
                return
            # Raw bytes, split into SSE events here: a client that shares the cores with the server pays
            # about twice as much CPU per token to decode every line (the JSON is parsed only when needed).
            pending = b""
            async for data in resp.aiter_raw():
                now = time.perf_counter() - sent
                *events, pending = (pending + data).replace(b"\r\n", b"\n").split(b"\n\n")
                for ev in events:
                    ev = ev.strip()
                    if not ev.startswith(b"data: {") and not ev.startswith(b"data:{"):
                        continue
                    payload = ev[5:].lstrip()
                    if payload.startswith(b'{"error"'):
                        err = json.loads(payload)["error"]
                        out["error"] = err.get("message", "error event") if isinstance(err, dict) else str(err)
                        return
                    has_usage = b'"usage":{' in payload
                    if not (has_usage or texts or out["id"] is None):
                        out["times"].append(now)  # the common case: a token chunk, not parsed
                        continue
                    doc = json.loads(payload)
                    out["id"] = out["id"] or doc.get("id")
                    if has_usage and isinstance(doc.get("usage"), dict):
                        out["prompt_tokens"] = doc["usage"].get("prompt_tokens")
                        out["completion_tokens"] = doc["usage"].get("completion_tokens")
                    if doc.get("choices"):
                        out["text"] += (doc["choices"][0].get("text") or "") if texts else ""
                        out["times"].append(now)

    try:
        await asyncio.wait_for(follow(), timeout_s)
    except asyncio.TimeoutError:
        out["error"] = f"timeout after {timeout_s:g}s"
    except httpx.HTTPError as exc:
        out["error"] = repr(exc)
    if out["error"] is None and not out["times"]:
        out["error"] = "no chunk with a choice in the stream"
    return out


def poisson_arrivals(rng: random.Random, rate: float, seconds: float, mark: Callable[[], object] | None = None) -> list:
    """The arrival times of a Poisson process of ``rate`` per second within ``seconds``; with ``mark``, each as
    (time, ``mark()``), its mark drawn right after its gap (an open-loop load)."""
    arrivals, t = [], 0.0
    while True:
        t += rng.expovariate(rate)
        if t > seconds:
            return arrivals
        arrivals.append(t if mark is None else (t, mark()))


async def closed_loop_rate(url: str, concurrency: int, seconds: float, timeout: float,
                           bodies: Callable[[int], Iterator[dict]]) -> float:
    """Completed requests per second over ``seconds`` with ``concurrency`` streamed requests always in flight:
    worker ``w`` sends the bodies of ``bodies(w)``, one after the other (a capacity measurement)."""
    done = 0
    stop = time.perf_counter() + seconds

    async def worker(w: int, client: httpx.AsyncClient) -> None:
        nonlocal done
        next_body = bodies(w)
        while time.perf_counter() < stop:
            r = await stream_completion(client, url, next(next_body), None, timeout)
            if r["error"] is None and time.perf_counter() <= stop:
                done += 1

    t0 = time.perf_counter()
    async with httpx.AsyncClient(limits=httpx.Limits(max_connections=None), timeout=timeout) as client:
        await asyncio.gather(*(worker(w, client) for w in range(concurrency)))
    return done / (time.perf_counter() - t0)


async def replay(url: str, reqs: list[trace_mod.TraceRequest], body: Callable[[trace_mod.TraceRequest], dict], *,
                 timeout_s: float, headers: dict | None = None, max_concurrency: int | None = None,
                 rate_scale: float = 1.0, texts: bool = False,
                 on_done: Callable[[dict], None] | None = None,
                 headers_of: Callable[[trace_mod.TraceRequest], dict] | None = None) -> tuple[list[dict], float]:
    """Send every request at ``arrival_s / rate_scale`` after the start (open loop), at most
    ``max_concurrency`` in flight; a later turn of a session (``TraceRequest.session``) instead its
    ``think_s`` after the turn before it ended (a closed loop, as a chat user). Returns the results in trace
    order (each ``stream_completion``'s dict plus ``index``, ``lag_s``: how late it was sent, and
    ``start_s``: when, from the start) and the benchmark's duration (the start to the end of the last
    request). ``headers_of(req)``: headers of that request's own, over ``headers`` (a session header)."""
    from llumnixctl.experiments.traces.cache import previous_turns

    limits = httpx.Limits(max_connections=None, max_keepalive_connections=256)
    gate = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    after = previous_turns(reqs)
    ended = {p: asyncio.Event() for p in after.values()}
    async with httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(timeout_s, connect=10.0)) as client:
        t0 = time.perf_counter() + 0.2  # every task is created before the first send

        async def one(req: trace_mod.TraceRequest) -> dict:
            try:
                return await send(req)
            finally:
                if req.index in ended:
                    ended[req.index].set()

        async def send(req: trace_mod.TraceRequest) -> dict:
            due = t0 + req.arrival_s / rate_scale
            if req.index in after:
                await ended[after[req.index]].wait()
                due = time.perf_counter() + req.think_s / rate_scale
            await asyncio.sleep(max(0.0, due - time.perf_counter()))
            if gate is not None:
                await gate.acquire()
            try:
                own = {**(headers or {}), **headers_of(req)} if headers_of is not None else headers
                r = await stream_completion(client, url, body(req), own, timeout_s, texts)
            finally:
                if gate is not None:
                    gate.release()
            r.update(index=req.index, lag_s=r["sent"] - due, start_s=r["sent"] - t0)
            if on_done is not None:
                on_done(r)
            return r

        results = await asyncio.gather(*(one(r) for r in reqs))
        return list(results), time.perf_counter() - t0


# ---------------------------------------------------------------------- the target


def load_trace(path: Path, fmt: str | None, tokenizer: str | None = None, rate: float = 4.0,
               seed: int = 0) -> list[trace_mod.TraceRequest]:
    """llumnixctl.experiments.traces.files.load (any of its formats; ShareGPT's text is counted with ``tokenizer`` and given
    Poisson arrivals at ``rate``); without that module, our JSONL (arrival_s, prompt_tokens, output_tokens)."""
    try:
        from llumnixctl.experiments.traces import files as traces
    except ImportError:
        traces = None
    if traces is None:
        reqs = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        return [trace_mod.TraceRequest(i, float(d["arrival_s"]), int(d["prompt_tokens"]), int(d["output_tokens"]),
                                       d.get("priority", "normal")) for i, d in enumerate(reqs)]
    options: dict = {}
    if (fmt or traces.sniff(path)) == "sharegpt":
        if not tokenizer:
            raise ValueError("a ShareGPT trace has text, not token counts: give --tokenizer PATH to count them")
        options = {"model_path": tokenizer, "rate": rate, "seed": seed}
    return traces.load(path, fmt, **options)


def token_pool(client: httpx.Client, url: str, model: str, tokenizer: str | None) -> list[int]:
    """Token ids of BASE_TEXT for the served model: from --tokenizer, else the server's /tokenize."""
    if tokenizer:
        from transformers import AutoTokenizer

        ids = AutoTokenizer.from_pretrained(tokenizer).encode(BASE_TEXT, add_special_tokens=False)
    else:
        resp = client.post(url + "/tokenize", json={"model": model, "prompt": BASE_TEXT, "add_special_tokens": False})
        if resp.status_code != 200:
            raise RuntimeError(f"{url}/tokenize answered HTTP {resp.status_code}; name the model's tokenizer "
                               "with --tokenizer PATH")
        ids = resp.json()["tokens"]
    if not ids:
        raise RuntimeError("the tokenizer gave no tokens for the base text")
    return list(ids)


def prompt_ids(pool: list[int], req: trace_mod.TraceRequest) -> list[int]:
    """Exactly ``req.prompt_tokens`` ids: the pool rotated by the request's index, repeated and trimmed; a
    request with shared content (``segments``) gets the same ids for the same segment (traces/cache.py)."""
    if req.segments:
        from llumnixctl.experiments.traces.cache import prompt_ids as shared_ids

        return [pool[i] for i in shared_ids(req, len(pool))]
    k = (req.index * 7) % len(pool)
    rot = pool[k:] + pool[:k]
    reps = -(-req.prompt_tokens // len(rot))
    return (rot * reps)[:req.prompt_tokens]


def _cluster_counters(client) -> dict | None:
    from llumnixctl.admin import ManagerUnreachable

    try:
        snap = client.status()
    except (ManagerUnreachable, RuntimeError):
        return None
    loads = [v.load for v in snap.instances]
    return {"preemptions": sum(ld.preemptions for ld in loads),
            "committed": sum(ld.migrations_committed for ld in loads),
            "aborted": sum(ld.migrations_aborted for ld in loads),
            "busy": sum(ld.running + ld.waiting for ld in loads),
            "dead": sorted(v.instance_id for v in snap.instances if v.state == "dead"),
            "metrics": {v.instance_id: v.metrics_address for v in snap.instances if v.metrics_address}}


STEADY_HISTOGRAMS = {"heartbeat_lateness": "llumnix_instance_heartbeat_lateness_seconds",
                     "query": "llumnix_instance_query_seconds"}
PROXY_COUNTERS = {"failovers": "llumnix_proxy_failovers_total", "rejected": "llumnix_proxy_admission_rejections_total",
                  "waited": "llumnix_proxy_dispatch_waits_total"}


def fetch_metrics(address: str, parse: Callable[[str], dict[str, float]]) -> dict[str, float]:
    """A /metrics page (``host:port`` or a URL), ``parse``d; {} if it cannot be read."""
    url = address if address.startswith("http") else f"http://{address}"
    if not url.rstrip("/").endswith("/metrics"):
        url = url.rstrip("/") + "/metrics"
    try:
        resp = httpx.get(url, timeout=10)
        return parse(resp.text) if resp.status_code == 200 else {}
    except (httpx.HTTPError, ValueError):  # unreachable, or not a Prometheus page
        return {}


def _by_name_and_bucket(text: str) -> dict[str, float]:
    """Every sample of a Prometheus page by name (and a histogram bucket's ``le``), summed over other labels."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        for smp in fam.samples:
            key = smp.name + "".join(f"|{k}={v}" for k, v in sorted(smp.labels.items()) if k == "le")
            out[key] = out.get(key, 0.0) + smp.value
    return out


def _scrape(address: str) -> dict[str, float]:
    """Every sample of a /metrics page (``host:port`` or a URL), by name and labels; {} if it cannot be read."""
    return fetch_metrics(address, _by_name_and_bucket)


def _quantile(before: dict[str, float], after: dict[str, float], name: str, q: float) -> float | None:
    """The ``q`` quantile of a histogram's observations between two scrapes: the upper bound of the bucket it
    falls in (None with no observation)."""
    prefix = name + "_bucket|le="
    buckets = sorted((float(k[len(prefix):]), after[k] - before.get(k, 0.0)) for k in after if k.startswith(prefix))
    total = buckets[-1][1] if buckets else 0.0
    if total <= 0:
        return None
    return next(bound for bound, n in buckets if n >= q * total)


def steadiness(before: dict, after: dict, proxy_before: dict, proxy_after: dict) -> dict:
    """What the run cost the llumlets' liveness and query paths (per instance: p99 and the largest bucket
    reached, ms), instances marked dead meanwhile, and the proxy's failovers, refusals and waits."""
    out: dict = {"instances_dead": sorted(set(after["dead"]) - set(before["dead"]))}
    for key, name in STEADY_HISTOGRAMS.items():
        per = {}
        for iid, address in after["metrics"].items():
            b, a = before.get("scrapes", {}).get(iid, {}), after.get("scrapes", {}).get(iid, {})
            p99, top = _quantile(b, a, name, 0.99), _quantile(b, a, name, 1.0)
            if p99 is not None:
                per[iid] = {"p99_ms": p99 * 1000, "max_ms": top * 1000}
        out[f"{key}_ms"] = per
    for key, name in PROXY_COUNTERS.items():
        out[f"proxy_{key}"] = proxy_after.get(name, 0.0) - proxy_before.get(name, 0.0)
    return out


# ---------------------------------------------------------------------- the command


def command(
    url: Annotated[str, typer.Option(metavar="URL", help="the endpoint's base URL, e.g. http://127.0.0.1:8000")],
    trace: Annotated[Optional[Path], typer.Option("--trace", metavar="FILE", help="trace file to replay (see --trace-format)")] = None,
    trace_format: Annotated[Optional[str], typer.Option(metavar="jsonl|sharegpt|burstgpt|azure", help="the trace's format (default: from the file)")] = None,
    requests: Annotated[Optional[int], typer.Option(help="without --trace: generate a trace of this many requests", min=1)] = None,
    rate: Annotated[float, typer.Option(help="with --requests or a ShareGPT trace: mean Poisson arrival rate, requests/s", min=0.001)] = 4.0,
    prompt_min: Annotated[int, typer.Option(help="with --requests: shortest prompt, tokens", min=1)] = 16,
    prompt_max: Annotated[int, typer.Option(help="with --requests: longest prompt, tokens", min=1)] = 512,
    output_min: Annotated[int, typer.Option(help="with --requests: shortest output, tokens", min=1)] = 16,
    output_max: Annotated[int, typer.Option(help="with --requests: longest output, tokens", min=1)] = 512,
    seed: Annotated[int, typer.Option(help="with --requests: trace seed")] = 0,
    model: Annotated[Optional[str], typer.Option(metavar="NAME", help="model name to send (default: the first of GET /v1/models)")] = None,
    tokenizer: Annotated[Optional[str], typer.Option(metavar="PATH", help="tokenizer path or name for the prompts (default: the server's /tokenize)")] = None,
    text_prompts: Annotated[bool, typer.Option("--text-prompts", help="send each prompt as text of single-token words (of the --tokenizer, a local checkpoint directory) instead of token ids: for a router that takes only text (smg)")] = False,
    api_key: Annotated[Optional[str], typer.Option(envvar="LLUMNIX_API_KEY", metavar="KEY", help="sent as Authorization: Bearer KEY")] = None,
    max_concurrency: Annotated[Optional[int], typer.Option(help="at most this many requests in flight", min=1)] = None,
    rate_scale: Annotated[float, typer.Option(help="arrivals this many times faster than the trace's", min=0.001)] = 1.0,
    ignore_eos: Annotated[bool, typer.Option(help="send ignore_eos so outputs are of the trace's length")] = True,
    request_timeout: Annotated[float, typer.Option(help="seconds a request may take before it counts as failed", min=1.0)] = 600.0,
    slo_ttft_ms: Annotated[float, typer.Option(help="TTFT target, ms: report goodput (requests per second that met every target) and attainment (met / completed) against it (0: none)", min=0.0)] = 0.0,
    slo_tpot_ms: Annotated[float, typer.Option(help="TPOT target, ms, for goodput and attainment (0: none)", min=0.0)] = 0.0,
    run_dir: Annotated[Optional[Path], typer.Option("--run-dir", help="our local cluster: report its preemptions and migrations")] = None,
    manager: Annotated[Optional[str], typer.Option("--manager", help="our cluster's manager: report its preemptions and migrations")] = None,
    save: Annotated[Optional[Path], typer.Option(metavar="FILE", help="write the result JSON to this file")] = None,
    plot: Annotated[Optional[Path], typer.Option(metavar="DIR", help="write TTFT/TPOT/E2EL CDF PNGs into this directory (needs matplotlib)")] = None,
    json_: Annotated[bool, typer.Option("--json", help="print the result JSON instead of the result block")] = False,
) -> None:
    """Replay a trace open loop against any OpenAI-compatible endpoint; vLLM's `bench serve` figures.

    Each request is a streamed /v1/completions whose prompt is a list of
    token ids of exactly the trace's length (--text-prompts: text of as many
    single-token words, less the tokenizer's BOS), with max_tokens its output
    length and ignore_eos. Prints vLLM's Serving Benchmark Result block;
    --json prints (and --save writes) the JSON vLLM saves: completed, failed,
    duration, total_input_tokens, total_output_tokens, request_throughput,
    output_throughput, total_token_throughput, mean/median/std/p99 of
    ttft, tpot, itl and e2el (_ms), the per-request input_lens,
    output_lens, ttfts, itls, latencies, start_times, generated_texts,
    errors; plus ours: prompt_token_mismatches, short_outputs,
    expected_input_lens, expected_output_lens, and with --run-dir or
    --manager preemptions and migrations {committed, aborted} during the run;
    with --slo-ttft-ms/--slo-tpot-ms, slo {goodput_rps, attainment, classes}.
    """
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from llumnixctl import common

    err = Console(stderr=True)
    url = url.rstrip("/")
    if (trace is None) == (requests is None):
        common.die("give either --trace FILE or --requests N (with --rate)", 2)
    if prompt_min > prompt_max or output_min > output_max:
        common.die("--prompt-min/--output-min must not exceed --prompt-max/--output-max", 2)
    try:
        if trace is not None:
            reqs = load_trace(trace, trace_format, tokenizer, rate, seed)
        else:
            reqs = trace_mod.generate(requests, rate=rate, prompt=(prompt_min, prompt_max),
                                      output=(output_min, output_max), seed=seed)
    except (OSError, ValueError, KeyError) as exc:
        common.die(f"cannot read the trace {trace}: {exc}", 2)
    if not reqs:
        common.die("the trace has no requests", 2)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        with httpx.Client(timeout=30.0, headers=headers) as c:
            if model is None:
                resp = c.get(url + "/v1/models")
                if resp.status_code != 200 or not resp.json().get("data"):
                    common.die(f"{url}/v1/models answered HTTP {resp.status_code}; name the model with --model")
                model = resp.json()["data"][0]["id"]
            pool = [] if text_prompts else token_pool(c, url, model, tokenizer)
    except httpx.HTTPError as exc:
        common.die(f"cannot reach {url}: {exc!r}")
    except RuntimeError as exc:
        common.die(str(exc))

    words, lead = None, 0
    if text_prompts:
        if tokenizer is None or not Path(tokenizer).is_dir():
            common.die("--text-prompts needs --tokenizer DIR, a local checkpoint directory", 2)
        from llumnixctl.experiments.traces.words import Words
        from llumnixctl.experiments.traces.files import special_lead

        try:
            words, lead = Words(Path(tokenizer)), special_lead(tokenizer)
        except (OSError, ValueError, RuntimeError) as exc:
            common.die(f"--text-prompts: {exc}", 2)

    admin = common.admin(manager, run_dir, None, 5.0) if (run_dir is not None or manager) else None
    before = _cluster_counters(admin) if admin is not None else None
    if before is not None:
        before["scrapes"] = {iid: _scrape(a) for iid, a in before["metrics"].items()}
        proxy_before = _scrape(url)

    def body(req: trace_mod.TraceRequest) -> dict:
        prompt = words.text(req, drop=lead) if words is not None else prompt_ids(pool, req)
        b = {"model": model, "prompt": prompt, "max_tokens": req.output_tokens, "stream": True,
             "stream_options": {"include_usage": True}}
        if ignore_eos:
            b["ignore_eos"] = True
        return b

    progress = Progress(TextColumn("bench serve"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                        console=err, transient=True)
    with progress:
        task = progress.add_task("requests", total=len(reqs))
        results, duration = asyncio.run(replay(url, reqs, body, timeout_s=request_timeout, headers=headers,
                                               max_concurrency=max_concurrency, rate_scale=rate_scale, texts=True,
                                               on_done=lambda r: progress.advance(task)))
    res = {"date": datetime.now().strftime("%Y%m%d-%H%M%S"), "backend": "openai", "endpoint": url + "/v1/completions",
           "model_id": model, "tokenizer_id": tokenizer or f"{url}/tokenize", "num_prompts": len(reqs),
           "request_rate": rate * rate_scale if trace is None else None, "rate_scale": rate_scale,
           "max_concurrency": max_concurrency, "trace": str(trace) if trace else None,
           **metrics(reqs, results, duration)}
    if slo_ttft_ms or slo_tpot_ms:  # the targets are the client's: set [slo] on the cluster for it to serve to them
        res["slo"] = slo_figures(results, slo_ttft_ms / 1000, slo_tpot_ms / 1000, duration)
    if admin is not None:
        after = None
        deadline = time.monotonic() + 5.0  # the instances' last load reports reach the manager
        while time.monotonic() < deadline:
            after = _cluster_counters(admin)
            if after is None or after["busy"] == 0:
                break
            time.sleep(0.2)
        admin.close()
        if before is not None and after is not None:
            res["preemptions"] = after["preemptions"] - before["preemptions"]
            res["migrations"] = {"committed": after["committed"] - before["committed"],
                                 "aborted": after["aborted"] - before["aborted"]}
            after["scrapes"] = {iid: _scrape(a) for iid, a in after["metrics"].items()}
            res["steadiness"] = steadiness(before, after, proxy_before, _scrape(url))
        else:
            err.print("bench serve: the manager did not answer; no preemptions or migrations", markup=False)
    if res["prompt_token_mismatches"]:
        err.print(f"bench serve: {res['prompt_token_mismatches']} requests' usage.prompt_tokens differ from the "
                  "trace's prompt length", markup=False)
    firsts = sorted({e for e in res["errors"] if e})
    if firsts:
        err.print(f"bench serve: {res['failed']} requests failed; first error: {firsts[0][:300]}", markup=False)
    if save is not None:
        save.write_text(json.dumps(res, indent=2) + "\n")
    if plot is not None:
        import importlib.util

        if importlib.util.find_spec("matplotlib") is None:
            err.print("bench serve: matplotlib is not installed (pip install 'llumnix-toolkit[plot]'); no plots", markup=False)
        else:
            for p in plot_cdfs(res, plot):
                err.print(f"bench serve: wrote {p}", markup=False)
    if json_:
        sys.stdout.write(json.dumps(res, indent=2) + "\n")
    else:
        sys.stdout.write(result_block(res) + "\n")
    if res["completed"] == 0:
        raise typer.Exit(1)
