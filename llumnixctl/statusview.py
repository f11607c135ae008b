"""`llumnixctl status`: its JSON (a contract for scripts: keys are added, never renamed) and its table.

The SLO columns: per instance, the TTFT and TPOT predicted for a new request of a 512-token prompt
(daemons/policy/slo.py ``reference_prediction``, from the step-time model each instance reports), and the
attainment over the last slo.window_s: of the requests with an SLO that finished on it, the share that met both
targets (daemons/instance/attainment.py); the cluster's line sums them; and the error of the TTFT the proxies
predicted for the requests placed there (same file), so an operator sees when the model is wrong.
"""

from __future__ import annotations

from rich.console import Group
from rich.table import Table

from daemons import wire
from daemons.policy.registry import SCALING
from daemons.policy.slo import REFERENCE_PROMPT_TOKENS
from llumnixctl.common import instance_json


def status_json(snap: wire.Snapshot, address: str) -> dict:
    rows = [instance_json(v) for v in snap.instances]
    alive = [r for r in rows if r["state"] == "alive"]
    serving = [r for r in alive if not r["draining"] and not r["cordoned"]]
    totals = {
        "instances": len(rows), "alive": len(alive), "serving": len(serving),
        "draining": sum(1 for r in rows if r["draining"]), "cordoned": sum(1 for r in rows if r["cordoned"]),
        "blocks_total": sum(r["blocks_total"] for r in alive), "blocks_used": sum(r["blocks_used"] for r in alive),
        "running": sum(r["running"] for r in alive), "waiting": sum(r["waiting"] for r in alive),
        "preemptions": sum(r["preemptions"] for r in rows),
        "prefix_query_tokens": sum(r["prefix_query_tokens"] for r in rows),
        "prefix_hit_tokens": sum(r["prefix_hit_tokens"] for r in rows),
        "mean_freeness": round(sum(r["freeness"] for r in serving) / len(serving), 4) if serving else None,
        "migrations_in_flight": sum(r["migrating_out"] for r in rows),
        "migrations_committed": sum(r["migrations_committed"] for r in rows),
        "migrations_aborted": sum(r["migrations_aborted"] for r in rows),
        "ordered_migrations": dict(snap.ordered_migrations),
        "scale_outs": snap.scale_outs, "scale_ins": snap.scale_ins, "launching": snap.launching,
        "slo_met": sum(r["slo_met"] for r in rows), "slo_judged": sum(r["slo_judged"] for r in rows),
        "slo_reference_prompt_tokens": REFERENCE_PROMPT_TOKENS,
        "tier_blocks": sum(r["tier_blocks"] for r in alive), "tier_capacity": sum(r["tier_capacity"] for r in alive),
        "retained_blocks": sum(r["retained_blocks"] for r in alive),
    }
    roles: dict[str, int] = {}
    for r in alive:
        roles[r["role"]] = roles.get(r["role"], 0) + 1
    totals["roles"] = roles
    totals["handovers"] = {k.split("/", 1)[1]: v for k, v in snap.ordered_migrations.items() if k.startswith("handover/")}
    totals["slo_attainment"] = round(totals["slo_met"] / totals["slo_judged"], 4) if totals["slo_judged"] else None
    return {"instances": rows, "totals": totals,
            "manager": {"address": address, "uptime_s": snap.uptime_s, "dispatch_policy": snap.dispatch_policy,
                        "dispatched_total": snap.dispatched_total, "pairing_policy": snap.pairing_policy,
                        "request_selection": snap.request_selection, "scaling_policy": snap.scaling_policy,
                        "migrating": snap.migrating, "proxies": snap.proxies}}


def flags_text(r: dict) -> str:
    flags = []
    if r["draining"]:
        flags.append(f"draining: {r['drain_reason']}" if r["drain_reason"] else "draining")
    if r["cordoned"]:
        flags.append("cordoned")
    if r.get("scale_in_protected"):
        flags.append("protected")
    return r["state"] + (f" ({', '.join(flags)})" if flags else "")


def number_text(x: float | None, inf: str) -> str:
    return inf if x is None else f"{x:.2f}" if abs(x) < 1e6 else f"{x:.3g}"


def _ms(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    return f"{seconds * 1000:.0f}ms" if seconds < 10 else f"{seconds:.0f}s"


def _attained(r: dict) -> str:
    """Met of judged over the window, and the share ("-": none judged)."""
    if not r["slo_judged"]:
        return "-"
    return f"{r['slo_met']}/{r['slo_judged']} {100 * r['slo_attainment']:.0f}%"


def _error(r: dict) -> str:
    """The TTFT predictions' error over the window, median / 90th percentile ("-": none judged)."""
    if not r.get("ttft_error_judged"):
        return "-"
    return f"{100 * r['ttft_error_p50']:.0f}%/{100 * r['ttft_error_p90']:.0f}%"


def _tier(r: dict) -> tuple[str, str]:
    """The host tier's columns: blocks held / its size ("-": no tier), blocks retained for sessions."""
    return (f"{r.get('tier_blocks', 0)}/{r['tier_capacity']}" if r.get("tier_capacity") else "-",
            str(r.get("retained_blocks", 0)))


def render_status(data: dict) -> Group:
    """The status table and its summary lines, from status_json's data (what `status` prints)."""
    m = data["manager"]
    table = Table(title=f"manager {m['address']} · dispatch {m['dispatch_policy']} · migration "
                        f"{m['pairing_policy'] if m['migrating'] else 'drains only'} · selection {m['request_selection']} "
                        f"· scaling {m['scaling_policy']}", title_justify="left")
    right = ("PID", "RUNNING", "WAITING", "VIRTUAL USAGE", "FREENESS", "TTFT*", "TPOT*", "SLO MET", "TTFT ERR", "RETAINED")
    roles = any(r.get("role", "mixed") != "mixed" for r in data["instances"])  # the ROLE column, when disaggregated
    # The host tier's columns, when an instance has a tier or retains sessions' blocks (kv_tier)
    tiers = any(r.get("tier_capacity") or r.get("retained_blocks") for r in data["instances"])
    for col in ("ID", "HOST", "PID", "STATE", *(("ROLE",) if roles else ()), "BLOCKS USED/TOTAL", "RUNNING", "WAITING",
                "VIRTUAL USAGE", "FREENESS", "MIGRATING OUT/IN", "TTFT*", "TPOT*", "SLO MET", "TTFT ERR",
                *(("HOST TIER USED/TOTAL", "RETAINED") if tiers else ()), "LAST REPORT"):
        table.add_column(col, justify="right" if col in right else "left")
    for r in data["instances"]:
        style = "red" if r["state"] != "alive" else "yellow" if r["draining"] or r["cordoned"] else None
        role = (r.get("role", "mixed"),) if roles else ()
        table.add_row(r["id"], r["host"], str(r["pid"]), flags_text(r), *role, f"{r['blocks_used']}/{r['blocks_total']}",
                      str(r["running"]), str(r["waiting"]), number_text(r["virtual_usage"], "inf"), number_text(r["freeness"], "-inf"),
                      f"{r['migrating_out']}/{r['migrating_in']}", _ms(r["predicted_ttft_s"]),
                      _ms(r["predicted_tpot_s"]), _attained(r), _error(r), *(_tier(r) if tiers else ()),
                      f"{r['last_report_age_s']:.1f}s ago", style=style)
    t = data["totals"]
    table.add_section()
    table.add_row("total", "", "", f"{t['alive']}/{t['instances']} alive", *(("",) if roles else ()),
                  f"{t['blocks_used']}/{t['blocks_total']}",
                  str(t["running"]), str(t["waiting"]), "",
                  "" if t["mean_freeness"] is None else f"{t['mean_freeness']:.2f} avg",
                  f"{t['migrations_in_flight']} in flight", "", "", _attained(t), "", *(_tier(t) if tiers else ()), "")
    parts: list = [table, f"* predicted for a new request of a {t['slo_reference_prompt_tokens']}-token prompt (its "
                          "instance's step-time model); SLO MET: requests that met both targets of those that finished "
                          "in the last slo.window_s; TTFT ERR: the proxies' TTFT predictions for the requests placed "
                          "there against the actual, |predicted - actual| / actual, median / 90th percentile over the "
                          "same window (the model is wrong when these are large)"]
    if t["prefix_query_tokens"]:
        each = ", ".join(f"{r['id']} {100 * r['prefix_hit_rate']:.0f}%" for r in data["instances"] if r["prefix_hit_rate"] is not None)
        parts.append(f"prefix cache: {100 * t['prefix_hit_tokens'] / t['prefix_query_tokens']:.1f}% of "
                     f"{t['prefix_query_tokens']} prompt tokens hit ({each})")
    if tiers:
        each = ", ".join(f"{r['id']} {r['restore_ms_per_block']:.3g}" for r in data["instances"] if r.get("tier_capacity"))
        parts.append(f"host KV tier: blocks held / its size per instance; RETAINED: blocks kept for sessions within their "
                     f"TTL (free, reclaimable); restore ms per block: {each or '-'}")
    held = [r for r in data["instances"] if r.get("adapters") or r.get("adapter_slots")]
    if held:  # LoRA: each instance's adapters, most recently used first, and its open slots (free, or idle)
        parts.append("adapters: " + "; ".join(f"{r['id']} {', '.join(r.get('adapters', [])) or '-'} "
                                              f"({r.get('adapter_slots', 0)} open)" for r in held))
    ordered = ", ".join(f"{k} {v}" for k, v in sorted(t["ordered_migrations"].items())) or "none"
    parts.append(f"migrations: {t['migrations_committed']} committed, {t['migrations_aborted']} aborted, "
                 f"{t['migrations_in_flight']} in flight; ordered by the manager: {ordered}")
    if roles:
        handovers = t.get("handovers", {})
        parts.append("roles: " + ", ".join(f"{n} {k}" for k, n in sorted(t.get("roles", {}).items())) +
                     f"; handovers: {handovers.get('committed', 0)} committed, {handovers.get('aborted', 0)} aborted, "
                     f"{handovers.get('lost', 0)} lost")
    if t["scale_outs"] or t["scale_ins"] or t["launching"] or (m["scaling_policy"] not in SCALING or SCALING.get(m["scaling_policy"]).scales):
        parts.append(f"scaling: {t['scale_outs']} out, {t['scale_ins']} in, {t['launching']} launching")
    return Group(*parts)
