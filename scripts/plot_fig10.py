"""Draw Fig 10 from `llumnixctl bench migration --json` output: downtime per sequence length, log scale.

    python scripts/plot_fig10.py fig10.json fig10.png
"""

from __future__ import annotations

import json
import sys

import matplotlib

matplotlib.use("Agg")  # no display on servers
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.ticker import NullLocator  # noqa: E402


def main(src: str, dst: str) -> None:
    data = json.load(open(src))
    rows = data["results"]
    x = [r["tokens"] for r in rows]
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    for key, label, marker in (("downtime_ms", "live migration (downtime)", "o"),
                               ("blocking_copy_ms", "blocking copy", "s"),
                               ("recompute_ms", "recomputation", "^")):
        left.plot(x, [r[key] for r in rows], marker=marker, label=label)
    left.set(yscale="log", xlabel="sequence length (tokens)", ylabel="request downtime (ms)", title="Downtime")
    left.set_xscale("log", base=2)
    left.xaxis.set_minor_locator(NullLocator())  # only the measured lengths are labelled
    left.set_xticks(x, [str(v) for v in x])
    left.legend()
    left.grid(True, which="both", alpha=0.3)
    base = [r["decode_step_ms"] or 0 for r in rows]
    during = [r["decode_step_migrating_ms"] or 0 for r in rows]
    width = 0.38
    pos = range(len(x))
    right.bar([p - width / 2 for p in pos], base, width, label="decode step")
    right.bar([p + width / 2 for p in pos], during, width, label="while migrating")
    right.set_xticks(list(pos), [str(v) for v in x])
    right.set(xlabel="sequence length (tokens)", ylabel="ms", title="Decode step time of the migrating request")
    right.legend()
    fig.suptitle(f"Live migration, {data['backend']} ({data['model']}, {data['cores']} cores)")
    fig.tight_layout()
    fig.savefig(dst, dpi=120)


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit("usage: plot_fig10.py FIG10.json OUT.png")
    main(sys.argv[1], sys.argv[2])
