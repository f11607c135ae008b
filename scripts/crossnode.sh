#!/usr/bin/env bash
# Live migration across "hosts" on a limited network: `llumnixctl bench migration --backend sim --netns`
# (each instance in its own network namespace, the sim engine moving real KV-shaped tensors of the
# kv-heavy shape, 64 KiB per token) at no limit, 25, 10 and 1 Gbit/s, and 10 Gbit/s with 0.5 ms added
# latency; plus the same-host (loopback) baseline. Needs root and iproute2; addresses are 198.18.0.0/24
# inside namespaces the benchmark creates and removes.
#
#   sudo bash scripts/crossnode.sh [OUT_DIR]   -> OUT_DIR/crossnode.json, OUT_DIR/crossnode.md (default: ./results)
#
# Environment: LENGTHS (default 256,1024,4096), REPEAT (live migrations per length, default 6),
# DECODE_TOKENS (default 1600: a request must outlive its migrations on the slowest link).
# TABLE_ONLY=1: only write OUT_DIR/crossnode.md again from OUT_DIR/crossnode.json.
set -euo pipefail
cd "$(dirname "$0")/.."
out="${1:-results}"
mkdir -p "$out"
venv="${LLUMNIX_VENV:-.venv}"
py="$venv/bin/python"
lengths="${LENGTHS:-256,1024,4096}"
common=(bench migration --backend sim --lengths "$lengths" --repeat "${REPEAT:-6}"
        --decode-tokens "${DECODE_TOKENS:-1600}" --json --budget-s 0)
runs=(
    "same host (loopback)|"
    "separate hosts, no limit|--netns"
    "25 Gbit/s|--netns --rate 25gbit"
    "10 Gbit/s|--netns --rate 10gbit"
    "1 Gbit/s|--netns --rate 1gbit"
    "10 Gbit/s + 0.5 ms|--netns --rate 10gbit --delay-ms 0.5"
)
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
i=0
[ -n "${TABLE_ONLY:-}" ] && runs=()
for run in "${runs[@]}"; do
    label="${run%%|*}"
    read -r -a extra <<< "${run#*|}"
    echo "== $label" >&2
    set +e
    COLUMNS=400 "$py" -m llumnixctl.main "${common[@]}" "${extra[@]}" 2>&1 > "$tmp/$i.json" | tee "$tmp/$i.err" >&2
    rc=${PIPESTATUS[0]}
    set -e
    printf '%s\n%s\n' "$label" "$rc" > "$tmp/$i.meta"
    i=$((i + 1))
done

"$py" - "$tmp" "$i" "$out" <<'EOF'
import json, pathlib, sys, time

tmp, n, out = pathlib.Path(sys.argv[1]), int(sys.argv[2]), pathlib.Path(sys.argv[3])
runs = []
if n == 0:  # TABLE_ONLY
    runs = json.loads((out / "crossnode.json").read_text())["runs"]
for k in range(n):
    label, rc = (tmp / f"{k}.meta").read_text().splitlines()[:2]
    err = (tmp / f"{k}.err").read_text(errors="replace").strip().splitlines()
    try:
        result = json.loads((tmp / f"{k}.json").read_text())
    except ValueError:
        result = None
    if rc != "0" or result is None:
        why = next((l.removeprefix("llumnixctl: ") for l in reversed(err) if l.startswith("llumnixctl:")),
                   err[-1] if err else f"exit status {rc}")
        runs.append({"label": label, "skipped": why})
    else:
        runs.append(dict(result, label=label))
if n:
    (out / "crossnode.json").write_text(json.dumps({"date": time.strftime("%Y-%m-%d"), "runs": runs}, indent=2) + "\n")

done = [r for r in runs if "results" in r]
lengths = sorted({x["tokens"] for r in done for x in r["results"]})
lines = [f"Live migration of one request of the kv-heavy shape (64 KiB of KV per token), sim backend, "
         f"{done[0]['cores'] if done else '?'} cores; medians of {done[0]['results'][0]['migrations'] if done else '?'} "
         "live migrations per length; MB = KV bytes the migration moved.", ""]
head = "| link | one TCP stream, Gbit/s | " + " | ".join(f"{t} tok: downtime / total ms (MB)" for t in lengths) + " |"
lines += [head, "|" + "---|" * (2 + len(lengths))]
for r in runs:
    if "skipped" in r:
        lines.append(f"| {r['label']} | skipped: {r['skipped']} |" + " |" * len(lengths))
        continue
    net = r["network"]
    gbps = f"{net['link_gbps_measured']:.1f}" if net.get("link_gbps_measured") else "-"
    by = {x["tokens"]: x for x in r["results"]}
    cells = [f"{by[t]['downtime_ms']:.1f} / {by[t]['migration_ms']:.0f} ({by[t]['bytes'] / 1e6:.0f})" if t in by else "-"
             for t in lengths]
    lines.append(f"| {r['label']} | {gbps} | " + " | ".join(cells) + " |")
from daemons.config import SimConfig

sim = SimConfig()
lines += ["", "The alternatives on the same runs (ms): blocking copy (stop-and-copy downtime), recomputation as "
          "measured (time to the first token of a prefill of the request's tokens on an instance) and the prefill "
          f"step the sim's latency model charges for it ({sim.prefill_ms_per_token:g} ms/token + {sim.prefill_ms:g} ms; "
          "the sim emits a step's tokens before it waits out the step's model time, so the measured figure leaves it out).", ""]
lines += ["| link | " + " | ".join(f"{t} tok: blocking / recompute / modelled prefill" for t in lengths) + " |",
          "|" + "---|" * (1 + len(lengths))]
for r in done:
    by = {x["tokens"]: x for x in r["results"]}
    cells = [f"{by[t]['blocking_copy_ms']:.0f} / {by[t]['recompute_ms']:.0f} / {sim.prefill_ms_per_token * t + sim.prefill_ms:.0f}"
             if t in by else "-" for t in lengths]
    lines.append(f"| {r['label']} | " + " | ".join(cells) + " |")
lines += ["", "What a live migration achieves end to end (Gbit/s: MB moved x 8 / total migration time; the copy "
          "stages, the handshakes and the gathering of blocks out of the KV tensors included).", ""]
lines += ["| link | " + " | ".join(f"{t} tok" for t in lengths) + " |", "|" + "---|" * (1 + len(lengths))]
for r in done:
    by = {x["tokens"]: x for x in r["results"]}
    cells = [f"{by[t]['bytes'] * 8 / by[t]['migration_ms'] / 1e6:.2f}" if t in by else "-" for t in lengths]
    lines.append(f"| {r['label']} | " + " | ".join(cells) + " |")
lines += ["", "Each instance runs in a network namespace of its own on a private bridge (198.18.0.0/24), the manager, "
          "the proxy and the client in a third; a rate is a tbf on both ends of each instance's veth (each direction). "
          "\"One TCP stream\" is what a plain socket got from i0 to i1 on that link just before the run. Runs on a "
          "shared 2-core machine differ by up to 2x in the fast rows; the 1 Gbit/s row is link-bound and steady. "
          "A skipped row says why (netem, for added latency, is missing from some kernels)."]
(out / "crossnode.md").write_text("\n".join(lines) + "\n")
print("\n".join(lines))
print(f"\nwrote {out}/crossnode.json and {out}/crossnode.md", file=sys.stderr)
EOF
