"""The soak's report (scripts/soak.py runs the soak): the witnesses' memory growth after the warm-up, every
aborted migration read back from the instances' logs with what explains it, the printed summary and the
RSS/descriptor plot. Reads what the soak sampled and logged; starts nothing."""

from __future__ import annotations

import json
import re
import sys
import time
from pathlib import Path

WITNESSES = ("proxy", "instance-i0", "manager")  # their memory is measured after the warm-up, one process each
# The proxy and instance i0 are never killed; the manager is killed and restarted only during the first half
# of the warm-up (--manager-chaos-s), then lives on, so that its growth over hours is measured too.

def growth(series: list[dict], warmup_s: float) -> dict[str, dict]:
    """Per witness (one process all along): RSS, descriptors and sockets just after the warm-up and at the
    end (the mean of the last samples against the first ones after the warm-up, up to 5 minutes of each,
    so that one allocation burst or a few client connections are no trend)."""
    out = {}
    for name in WITNESSES:
        rows = [r for r in series if r["name"] == name]
        after = [r for r in rows if r["t"] >= warmup_s]
        pids = {r["pid"] for r in after}
        if len(pids) != 1 or len(after) < 6:
            out[name] = {"pids": sorted(pids), "samples_after_warmup": len(after)}
            continue
        mean = lambda rs, k: sum(r[k] for r in rs) / len(rs)  # noqa: E731
        w = max(3, min(20, len(after) // 4))  # up to 5 minutes: descriptors come and go with client connections
        first, last = after[:w], after[-w:]
        out[name] = {"pid": after[0]["pid"], "samples_after_warmup": len(after)}
        for k in ("rss_mb", "fds", "sockets"):
            a, b = mean(first, k), mean(last, k)
            out[name][k] = {"after_warmup": round(a, 1), "end": round(b, 1), "max": max(r[k] for r in after),
                            "growth": round(b / a - 1, 4) if a else None}
    return out


ABORT_LINE = re.compile(r"^(\S+ \S+) \w+ llumnix-instance: migration of (\S+) to (\S+) (aborted-src|aborted-dst)"
                        r"(?: \((.*)\))?: \d+ stages,")
# How a reason explains itself: the request ended where it was (a race every live migration has), or the
# destination said no (its reason follows). A destination that failed is explained only by a kill of it.
REQUEST_ENDED = ("finished or was preempted", "not running here", "preempted on the source", "already migrating")
KILL_EXPLAINS_S = 60.0  # a destination killed this long before the abort explains it (leases are 10-15 s)


def aborted_migrations(run_dir: Path, kills: list[tuple[float, str]]) -> dict:
    """Every migration out that an instance of the run logged as aborted, from every instance's log (a killed
    instance's log stays: a restart appends), with its reason and what explains it: ``request_ended``,
    ``destination_refused``, ``destination_killed`` (``kills``: (wall time, instance id) of each kill -9) or
    ``unexplained``."""
    rows = []
    for log in sorted(run_dir.glob("instance-*.log")):
        for line in log.read_text(errors="replace").splitlines():
            m = ABORT_LINE.match(line)
            if m is None:
                continue
            at, rid, dst, ended, reason = m.groups()
            reason = reason or ""
            try:
                t = time.mktime(time.strptime(at.split(",")[0], "%Y-%m-%d %H:%M:%S")) + int(at.split(",")[1]) / 1000
            except (ValueError, IndexError):
                t = 0.0
            if any(k in reason for k in REQUEST_ENDED):
                why = "request_ended"
            elif reason.startswith("destination refused"):
                why = "destination_refused"
            elif ended == "aborted-dst" and any(iid == dst and 0 <= t - kt <= KILL_EXPLAINS_S for kt, iid in kills):
                why = "destination_killed"
            else:
                why = "unexplained"
            rows.append({"at": at, "source": log.stem.removeprefix("instance-"), "request": rid, "destination": dst,
                         "ended": ended, "reason": reason, "explained_by": why})
    by: dict[str, dict[str, int]] = {}
    for r in rows:
        key = re.sub(r"\b(cmpl|chatcmpl)-[0-9a-f]+\b", "ID", r["reason"]) or "(no reason)"
        by.setdefault(r["explained_by"], {}).setdefault(key, 0)
        by[r["explained_by"]][key] += 1
    return {"count": len(rows), "unexplained": sum(r["explained_by"] == "unexplained" for r in rows),
            "by_explanation": by, "all": rows}


def print_summary(r: dict) -> None:
    q = r["requests"]
    print("\n=== soak summary ===")
    print(f"duration {r['duration_s']:g}s (load {r['load_s']}s, settle {r['settle_s']}s), seed {r['seed']}")
    print(f"requests: sent {q['sent']}, completed {q['completed']}, lost {q['lost']}, "
          f"cut by a proxy kill and sent again {q.get('cut_by_proxy_kill', 0)} "
          f"(unfinished workers {q['unfinished_workers']}), {q['tokens']} tokens")
    for s in r["lost_samples"][:5]:
        print(f"  lost: {s}")
    print(f"leaked blocks after settling: {r['leaked_blocks']} over {len(r['instances_at_end'])} live instances")
    print(f"proxy: {r['proxy']}")
    print(f"migrations/scaling: {r['migrations']}")
    if r.get("sessions_seen"):
        print(f"sessions: {r['sessions']}; {r['sessions_seen']}")
    a = r.get("aborted_migrations") or {}
    print(f"aborted migrations in the instances' logs: {a.get('count', '?')}, unexplained {a.get('unexplained', '?')}")
    for why, reasons in (a.get("by_explanation") or {}).items():
        for reason, n in sorted(reasons.items(), key=lambda kv: -kv[1]):
            print(f"  {n:4d}  {why:20s} {reason[:150]}")
    print(f"chaos: {r['chaos']}")
    names = sorted(set(r["rss_mb"]["start"]) | set(r["rss_mb"]["end"]))
    print("RSS MB (start -> end):")
    for n in names:
        a, b = r["rss_mb"]["start"].get(n), r["rss_mb"]["end"].get(n)
        fmt = lambda x: "-" if x is None else f"{x['rss_mb']:.1f} (pid {x['pid']})"  # noqa: E731
        print(f"  {n:14s} {fmt(a)} -> {fmt(b)}")
    for name, g in r.get("witness_growth", {}).items():
        if "rss_mb" not in g:
            print(f"  witness {name}: not measurable ({g})")
            continue
        print(f"  witness {name} (pid {g['pid']}), after {r['warmup_s']:g}s of warm-up -> end: " + ", ".join(
            f"{k} {g[k]['after_warmup']:g} -> {g[k]['end']:g} ({100 * (g[k]['growth'] or 0):+.1f}%)"
            for k in ("rss_mb", "fds", "sockets")))
    print("RESULT:", "OK" if r["ok"] else "FAILED")


def plot(args) -> int:
    """RSS and open descriptors of every daemon over the soak (one line per process; witnesses bold)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    report = json.loads(Path(args.out).read_text())
    series = report.get("samples") or []
    if not series:
        print("soak: the report has no samples", file=sys.stderr)
        return 1
    fig, (ax_rss, ax_fd) = plt.subplots(2, 1, figsize=(11, 8), sharex=True)
    roles = {"manager": "tab:red", "proxy": "tab:blue", "instance": "tab:green"}
    by_proc: dict[tuple[str, int], list[dict]] = {}
    for r in series:
        by_proc.setdefault((r["name"], r["pid"]), []).append(r)
    labelled = set()
    for (name, _pid), rows in sorted(by_proc.items(), key=lambda kv: kv[1][0]["t"]):
        role = "manager" if name == "manager" else "proxy" if name.startswith("proxy") else "instance"
        witness = name in WITNESSES
        group = name if witness else role
        label = None if group in labelled else (f"{name} (witness: {'killed only in the warm-up' if name == 'manager' else 'never killed'})" if witness
                                                else f"{role}s (killed and restarted)")
        labelled.add(group)
        ts = [r["t"] / 60 for r in rows]
        kw = {"color": roles[role], "lw": 2.2 if witness else 0.8, "alpha": 1.0 if witness else 0.45, "label": label}
        if witness and role == "instance":
            kw["color"] = "tab:olive"
        ax_rss.plot(ts, [r["rss_mb"] for r in rows], **kw)
        ax_fd.plot(ts, [r["fds"] for r in rows], **{**kw, "label": None})
    warm = report.get("warmup_s", 0) / 60
    for ax in (ax_rss, ax_fd):
        ax.axvline(warm, color="grey", ls=":", lw=1)
        ax.grid(alpha=0.3)
    ax_rss.set_ylabel("RSS (MB)")
    ax_fd.set_ylabel("open file descriptors")
    ax_fd.set_xlabel("minutes into the soak")
    q = report["requests"]
    ax_rss.set_title(f"soak {report['duration_s'] / 3600:g} h: {q['sent']} requests, {q['lost']} lost, "
                     f"{report['leaked_blocks']} blocks leaked; chaos {report['chaos']}", fontsize=9)
    ax_rss.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    fig.savefig(args.png, dpi=110)
    print(f"soak: wrote {args.png}")
    return 0
