"""``llumnixctl check``: checks of a build on this machine that pass or fail (exit status 0 or 1).

``check migration``: on a throw-away local cluster of two instances (i0, i1), each request runs twice with
the same request id: once undisturbed (the reference), once live-migrated mid-decode from i0 to i1 (and back,
when there is room). Both runs must stream the same token ids and the same logprobs, the sampled token's and
its top alternatives'. Greedy requests check the KV cache that moved; seeded ones also the sampler's state
(the per-request generator continues on the destination). The same request id matters for the sim backend,
whose tokens are a function of (request id, index); vLLM's depend on the prompt and the seed only.

Requests go through the proxy's OpenAI API (streamed /v1/completions with token ids), one at a time, with
``manager.dispatch_policy=flood`` (so they start on i0) and paced steps (``instance.min_step_s``), so that a
request is still decoding when it is moved; pacing changes no output.

``--structured``: every request asks for JSON of a schema (``response_format`` json_schema, vLLM's grammar) and
moves once at a random point of its output (seeded): it must stream the unmigrated bytes, and they must be a
document of the schema (the destination's grammar matcher continued where the source's was).
"""

from __future__ import annotations

import json
import math
import random
import shutil
import signal
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Optional

import httpx
import typer
from rich.console import Console
from rich.table import Table

from daemons.config import ConfigError, load_config
from llumnixctl.admin import AdminClient
from llumnixctl.common import die, sse_chunks
from llumnixctl.experiments.bench.migration import wait_idle
from llumnixctl.lab import localcluster
from llumnixctl.lab.scratch import scratch_dir

app = typer.Typer(no_args_is_help=True, help="Checks that pass or fail: exit status 0 or 1.")

FIRST_MOVE_AT = 8  # tokens streamed before the first migration
GAP_TOKENS = 8  # tokens of steady decoding before moving back
VLLM_TOLERANCE = 1e-4  # absolute, on logprobs; the sim's are exact
# --structured: what every request's output must be (small: a random-weight model fills any string it may)
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 16}, "ok": {"type": "boolean"},
                                           "n": {"type": "integer", "minimum": 0, "maximum": 9999}},
          "required": ["name", "ok", "n"], "additionalProperties": False}


def of_schema(text: str) -> bool:
    """Whether ``text`` is a JSON document of SCHEMA."""
    try:
        doc = json.loads(text)
    except ValueError:
        return False
    return (isinstance(doc, dict) and set(doc) == {"name", "ok", "n"} and isinstance(doc["name"], str)
            and len(doc["name"]) <= 16 and isinstance(doc["ok"], bool) and isinstance(doc["n"], int)
            and not isinstance(doc["n"], bool) and 0 <= doc["n"] <= 9999)


@dataclass
class Sample:
    """What one streamed completion produced, token by token."""

    ids: list[int] = field(default_factory=list)
    logprobs: list[float | None] = field(default_factory=list)
    top: list[dict[str, float]] = field(default_factory=list)  # "token_id:<id>" -> logprob, per token
    text: str = ""


def first_mismatch(ref: Sample, got: Sample, tol: float) -> tuple[int, str] | None:
    """The first token index where ``got`` differs from ``ref`` and why; None when they agree. Token ids
    must be equal, logprobs (sampled and alternatives) within ``tol``; a shorter run differs where it ends."""
    n = max(len(ref.ids), len(got.ids))
    for i in range(n):
        if i >= len(ref.ids) or i >= len(got.ids):
            return i, f"{len(got.ids)} tokens, the unmigrated run made {len(ref.ids)}"
        if ref.ids[i] != got.ids[i]:
            return i, f"token {got.ids[i]}, the unmigrated run had {ref.ids[i]}"
        a, b = _at(ref.logprobs, i), _at(got.logprobs, i)
        if not _close(a, b, tol):
            return i, f"logprob {b}, the unmigrated run had {a}"
        ta, tb = _at(ref.top, i) or {}, _at(got.top, i) or {}
        if set(ta) != set(tb):
            return i, f"top logprobs name {sorted(tb)}, the unmigrated run's {sorted(ta)}"
        for k in ta:
            if not _close(ta[k], tb[k], tol):
                return i, f"top logprob of {k} {tb[k]}, the unmigrated run had {ta[k]}"
    return None


def _at(xs: list, i: int):
    return xs[i] if i < len(xs) else None


def _close(a: float | None, b: float | None, tol: float) -> bool:
    if a is None or b is None:
        return a is b
    return a == b or math.isclose(a, b, rel_tol=0.0, abs_tol=tol)


class _Stream(threading.Thread):
    """A streamed completion with a given request id, consumed on a thread: token ids and logprobs."""

    def __init__(self, url: str, body: dict, request_id: str):
        super().__init__(daemon=True)
        self.url, self.body, self.request_id = url, body, request_id
        self.rid = ""  # the id the cluster knows it by (the proxy's, from the stream)
        self.sample = Sample()
        self.finish: str | None = None
        self.error: str | None = None
        self.start()

    def run(self) -> None:
        try:
            for _ in range(100):  # the proxy may not have forgotten the reference run's id yet: 409, retry
                if self._once():
                    return
                time.sleep(0.05)
            self.error = f"the proxy kept refusing request id {self.request_id} as in flight"
        except (httpx.HTTPError, ValueError, KeyError) as exc:
            self.error = repr(exc)

    def _once(self) -> bool:
        headers = {"x-request-id": self.request_id}
        with httpx.stream("POST", self.url + "/v1/completions", json=self.body, headers=headers, timeout=600) as resp:
            if resp.status_code == 409:
                return False
            if resp.status_code != 200:
                self.error = f"HTTP {resp.status_code}: {resp.read()[:300]!r}"
                return True
            for chunk in sse_chunks(resp):
                if "error" in chunk:
                    self.error = str(chunk["error"])
                    return True
                self.rid = chunk["id"]
                for ch in chunk["choices"]:
                    lp = ch.get("logprobs") or {}
                    self.sample.logprobs += lp.get("token_logprobs", [])
                    self.sample.top += lp.get("top_logprobs") or []
                    self.sample.text += ch.get("text") or ""
                    self.sample.ids += ch.get("token_ids") or []  # last: wait() counts ids
                    self.finish = ch.get("finish_reason") or self.finish
        return True

    def wait(self, n: int, timeout: float) -> bool:
        """Until ``n`` tokens arrived (True) or the stream ended first (False)."""
        deadline = time.monotonic() + timeout
        while len(self.sample.ids) < n:
            if not self.is_alive():
                return False
            if time.monotonic() > deadline:
                raise RuntimeError(f"request {self.request_id} made {len(self.sample.ids)} tokens in {timeout:g}s")
            time.sleep(0.001)
        return True

    def result(self, timeout: float) -> Sample:
        self.join(timeout)
        if self.is_alive():
            raise RuntimeError(f"request {self.request_id} did not finish within {timeout:g}s")
        if self.error:
            raise RuntimeError(f"request {self.request_id} failed: {self.error}")
        return self.sample


def plan(n: int, max_tokens: int, logprobs: int, structured: bool = False) -> list[dict]:
    """The requests: the first half greedy, the rest seeded (distinct seeds); prompts of varied lengths.
    ``structured``: JSON of SCHEMA (until the document ends: EOS is not ignored), and a random point to move at
    (``move_at``: a fraction of the unmigrated run's tokens)."""
    rng = random.Random(0)
    out = []
    for i in range(n):
        greedy = i < (n + 1) // 2
        body = {"prompt": [rng.randrange(10, 1000) for _ in range(24 + 17 * i)], "max_tokens": max_tokens,
                "ignore_eos": not structured, "stream": True, "return_token_ids": True, "logprobs": logprobs,
                "return_tokens_as_token_ids": True}
        body.update({"temperature": 0} if greedy else {"temperature": 0.8, "top_p": 0.9, "seed": 1000 + i})
        kind = "greedy" if greedy else "seeded"
        if structured:
            body["response_format"] = {"type": "json_schema", "json_schema": {"name": "check", "schema": SCHEMA}}
            kind += "-json"
        out.append({"kind": kind, "seed": body.get("seed"), "body": body,
                    "move_at": rng.random() if structured else None})
    return out


def settings(backend: str, model: Path | None, tp: int, extra: list[str]) -> list[str]:
    """What every daemon of the cluster gets: ours, then --tp, then --set (later settings win)."""
    sets = ["manager.dispatch_policy=flood", "instance.min_step_s=0.02", "instance.log_level=warning",
            "proxy.log_level=warning", "migration.timeout_s=30"]
    if backend == "vllm":
        sets += [f"model.path={model}", "model.name=check", "vllm.block_size=32", "vllm.max_num_seqs=8"]
        if tp != 1:  # 1 is the default: a build without the setting still runs the check
            sets.append(f"vllm.tensor_parallel_size={tp}")
    return sets + extra


def _migrate(admin: AdminClient, s: _Stream, at: int, addresses: list[str]) -> dict | None:
    """Move the request to the other instance once it has ``at`` tokens; None if it finished first."""
    if not s.wait(at, timeout=600):
        return None
    deadline = time.monotonic() + 10
    while True:  # an instance reports the request once it has run a step there
        here = next((r.instance_id for r in admin.requests().requests if r.request_id == s.rid), None)
        if here is not None:
            break
        if not s.is_alive():
            return None
        if time.monotonic() > deadline:
            raise RuntimeError(f"request {s.rid} streams tokens but is on no instance")
        time.sleep(0.02)
    there = next(i for i in addresses if i != here)
    try:
        return {"outcome": admin.migrate(there, request_id=s.rid).outcomes[0], "to": there}
    except RuntimeError:  # the manager's refusal: unknown request, unless it has just finished
        s.join(5)
        if s.is_alive():
            raise
        return None


def check_one(url: str, admin: AdminClient, addresses: list[str], req: dict, request_id: str, tol: float) -> dict:
    """One request: the unmigrated reference, then the migrated run, compared token by token."""
    ref = _Stream(url, req["body"], request_id).result(600)
    max_tokens = req["body"]["max_tokens"]
    s = _Stream(url, req["body"], request_id)
    outcomes, reasons = [], []
    at, hops = FIRST_MOVE_AT, 2  # there, and back if there is room
    if req["move_at"] is not None:  # once, anywhere from the first token to the one before the last two
        at, hops = 1 + int(req["move_at"] * max(1, len(ref.ids) - 3)), 1
        max_tokens = len(ref.ids)
    for _ in range(hops):
        if at >= max_tokens - 2:
            break
        moved = _migrate(admin, s, at, addresses)
        if moved is None:
            break
        out = moved["outcome"]
        if out.outcome != "committed":
            reasons.append(f"migration to {moved['to']} aborted: {out.reason}")
            break
        outcomes.append(out)
        at = out.resumed_at + GAP_TOKENS
    got = s.result(600)
    wait_idle(admin)  # the next request starts on an idle pair
    mismatch = first_mismatch(ref, got, tol)
    if mismatch is not None:
        reasons.insert(0, f"token {mismatch[0]} differs: {mismatch[1]}")
    valid = None
    if req["move_at"] is not None:
        valid = of_schema(got.text)
        if not valid:  # the unmigrated run's too: the grammar let it through, the move did not make it
            also = "; so is the unmigrated run's" if not of_schema(ref.text) else ""
            reasons.append(f"its output is not JSON of the schema: {got.text[:80]!r}{also}")
    if not outcomes and not reasons:
        reasons.append(f"it finished before it could move (max_tokens {max_tokens})")
    return {"kind": req["kind"], "seed": req["seed"], "tokens": len(got.ids), "migrations": len(outcomes),
            "moved_at": [o.resumed_at for o in outcomes], "valid_json": valid,
            "downtime_ms": round(max(o.downtime_ms for o in outcomes), 3) if outcomes else None,
            "identical": mismatch is None and valid is not False,
            "first_mismatch": None if mismatch is None else mismatch[0],
            "reason": "; ".join(reasons) or None}


def run(backend: str, model: Path | None, tp: int, extra: list[str], requests: int, max_tokens: int,
        logprobs: int, log, structured: bool = False) -> dict:
    """The check; raises RuntimeError when the cluster does not start or a request fails."""
    t0 = time.monotonic()
    run_dir = scratch_dir("llumnix-check-mig-")
    state = None
    try:
        generated = backend == "vllm" and model is None
        if generated:
            from llumnixctl.lab.model import write_tiny_model

            log("writing the tiny test model ...")
            model = write_tiny_model(run_dir / "tiny")
        sets = settings(backend, model, tp, (["vllm.disable_any_whitespace=true"] if structured else []) + extra)
        log("starting two instances ...")
        try:
            state = localcluster.up(run_dir, 2, backend, 0, None, sets, timeout_s=600)
        except localcluster.ClusterError as exc:
            raise RuntimeError(str(exc)) from None
        name = load_config(None, sets).model.name  # what the instances serve, --set included
        admin = AdminClient(state.manager_address, timeout_s=600)
        try:
            addresses = sorted(v.instance_id for v in admin.status().instances)
            tol = 0.0 if backend == "sim" else VLLM_TOLERANCE
            batch = uuid.uuid4().hex[:8]
            results = []
            for i, req in enumerate(plan(requests, max_tokens, logprobs, structured)):
                log(f"request {i + 1}/{requests} ({req['kind']}) ...")
                req["body"]["model"] = name
                results.append(check_one(state.url, admin, addresses, req, f"check-{batch}-{i}", tol))
        finally:
            admin.close()
    finally:
        if state is not None:
            localcluster.stop(state)
        shutil.rmtree(run_dir, ignore_errors=True)
    label = "sim" if backend == "sim" else "tiny (generated)" if generated else str(model)
    return {"backend": backend, "model": label, "tp": tp, "settings": sets, "requests": results,
            "identical": all(r["identical"] for r in results), "elapsed_s": round(time.monotonic() - t0, 2),
            "structured": structured}


@app.command("migration")
def migration(
    backend: Annotated[str, typer.Option(metavar="vllm|sim", help="vllm (the tiny generated model, or --model) or sim; another value gives status 2")] = "vllm",
    model: Annotated[Optional[Path], typer.Option(metavar="DIR", help="vllm: checkpoint directory (default: generate the tiny model); with sim, or a directory without config.json, status 2")] = None,
    tp: Annotated[int, typer.Option("--tp", min=1, help="vllm only: tensor-parallel size of each instance (vllm.tensor_parallel_size; 1 sets nothing)")] = 1,
    set_: Annotated[Optional[list[str]], typer.Option("--set", help="setting for every daemon, after the check's own (so it wins over them): section.key=value, e.g. vllm.block_size=16, vllm.gpu_memory_utilization=0.4, vllm.dtype=bfloat16; a bad one gives status 2")] = None,
    requests: Annotated[int, typer.Option(min=1, help="requests to check: the first half greedy, the rest seeded (temperature 0.8, top_p 0.9)")] = 4,
    max_tokens: Annotated[int, typer.Option(min=FIRST_MOVE_AT + 4, help="tokens each request makes (--structured: at most; the document ends it)")] = 48,
    logprobs: Annotated[int, typer.Option(min=0, max=20, help="top alternatives compared per token, besides the sampled token's logprob")] = 2,
    structured: Annotated[bool, typer.Option("--structured", help="vllm only: every request asks for JSON of a schema (response_format json_schema) and moves once at a random point of its output; it must also be a document of the schema (sets vllm.disable_any_whitespace=true first)")] = False,
    json_: Annotated[bool, typer.Option("--json", help="print JSON")] = False,
) -> None:
    """Live-migrate greedy and seeded requests mid-decode between two instances and compare every token and logprob with an unmigrated run.

    Exit status 0 when every request migrated at least once and streamed what its unmigrated run did, 1
    otherwise (or when the cluster does not start), 2 for a bad command line or setting."""
    if backend not in ("vllm", "sim"):
        die(f"unknown --backend {backend!r}; choose vllm or sim", 2)
    if backend == "sim" and (model is not None or tp != 1):
        die("--model and --tp are for --backend vllm: the sim engine has no model", 2)
    if backend == "sim" and structured:
        die("--structured is for --backend vllm: the sim engine cannot constrain its output", 2)
    if model is not None and not (model / "config.json").exists():
        die(f"{model} is not a model checkpoint (no config.json)", 2)
    extra = list(set_ or [])
    try:  # a bad setting fails here, not in a daemon's log
        load_config(None, settings(backend, model.resolve() if model else Path("model"), tp, extra),
                    {"instance.backend": backend})
    except ConfigError as exc:
        die(str(exc), 2)
    err = Console(stderr=True)
    old = signal.signal(signal.SIGTERM, signal.default_int_handler)  # as Ctrl-C: the cluster is stopped
    try:
        result = run(backend, model.resolve() if model else None, tp, extra, requests, max_tokens, logprobs,
                     lambda m: err.print(m, markup=False), structured)
    except RuntimeError as exc:
        die(str(exc))  # a cluster that did not start: its log's last lines follow
    finally:
        signal.signal(signal.SIGTERM, old)
    if json_:
        sys.stdout.write(json.dumps(result, indent=2) + "\n")
    else:
        _print_table(result)
    failed = [(i, r) for i, r in enumerate(result["requests"]) if not r["identical"] or r["migrations"] < 1]
    if failed:
        i, r = failed[0]
        more = f" (and {len(failed) - 1} more request(s))" if len(failed) > 1 else ""
        die(f"request {i + 1} ({r['kind']}): {r['reason']}{more}")


def _print_table(result: dict) -> None:
    table = Table(title=f"live migration check · backend {result['backend']} · {result['model']} · tp {result['tp']}"
                        f" · {result['elapsed_s']:.1f} s")
    structured = result.get("structured")
    cols = ["#", "kind", "seed", "tokens", "migrations"] + (["moved at", "valid JSON"] if structured else [])
    for col in cols + ["downtime ms", "identical", "first mismatch"]:
        table.add_column(col, justify="left" if col in ("kind", "identical", "valid JSON") else "right")
    for i, r in enumerate(result["requests"]):
        extra = [",".join(map(str, r["moved_at"])) or "-", "yes" if r["valid_json"] else "[red]no[/red]"]
        table.add_row(str(i + 1), r["kind"], "-" if r["seed"] is None else str(r["seed"]), str(r["tokens"]),
                      str(r["migrations"]), *(extra if structured else []),
                      "-" if r["downtime_ms"] is None else f"{r['downtime_ms']:.2f}",
                      "yes" if r["identical"] else "[red]no[/red]",
                      "-" if r["first_mismatch"] is None else str(r["first_mismatch"]))
    Console(width=None if sys.stdout.isatty() else 160).print(table)
