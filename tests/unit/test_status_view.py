"""`llumnixctl status`'s SLO columns and keys (llumnixctl/statusview.py), from a manager snapshot built here."""

from __future__ import annotations

import json

import pytest
from rich.console import Console

from daemons import wire
from daemons.policy import slo
from daemons.policy.usage import state_of
from llumnixctl.statusview import render_status, status_json

FIT = wire.LatencyFit(steps=100, prefill_ms=5.0, prefill_ms_per_token=0.1, decode_ms=10.0, decode_ms_per_seq=1.0,
                      decode_ms_per_token=0.001, extra_ms=2.0, chunk_tokens=2048, finish_rate=4.0)


def view(iid: str, load: wire.InstanceLoad) -> wire.InstanceView:
    return wire.InstanceView(iid, "h", 1, "alive", "tcp://127.0.0.1:1", "sim", "m", load, 100.0, 0.2)


def snapshot() -> wire.Snapshot:
    busy = wire.InstanceLoad(1000, 400, running=6, waiting=2, batch_size=8, block_size=16, waiting_tokens=1024,
                             context_tokens=3000, latency=FIT, slo_judged=40, slo_met=36)
    fresh = wire.InstanceLoad(1000, 0, running=0, waiting=0, batch_size=8, block_size=16)  # no model, nothing judged
    return wire.Snapshot(0, [view("i0", busy), view("i1", fresh)], dispatch_policy="slo")


def test_status_json_adds_predictions_and_attainment_per_instance_and_in_all():
    data = status_json(snapshot(), "tcp://127.0.0.1:7100")
    json.dumps(data)  # JSON as printed: no inf or nan
    i0, i1 = data["instances"]
    s = state_of("i0", snapshot().instances[0].load)
    assert i0["predicted_ttft_s"] == pytest.approx(slo.predict_ttft(s, 512), rel=1e-5)
    assert i0["predicted_tpot_s"] == pytest.approx(slo.predict_tpot(s, 512, joining=1), rel=1e-5)
    # 6 running, then the batch fills to 8 with one of the 2 queued ahead (half their 1024 tokens) and the 512-token
    # newcomer: decode 10 + 8 + 0.001 x (3000 + 512 + 512) ms plus 2 ms of others' prefills
    assert i0["predicted_tpot_s"] == pytest.approx((10 + 8 + 0.001 * (3000 + 512 + 512) + 2) / 1000, rel=1e-5)
    assert i0["predicted_ttft_s"] > 0.1  # the 1024 queued tokens and its own, in one chunk, with the decodes
    assert (i0["slo_met"], i0["slo_judged"], i0["slo_attainment"]) == (36, 40, 0.9)
    assert i1["predicted_ttft_s"] is None and i1["predicted_tpot_s"] is None and i1["slo_attainment"] is None
    t = data["totals"]
    assert (t["slo_met"], t["slo_judged"], t["slo_attainment"], t["slo_reference_prompt_tokens"]) == (36, 40, 0.9, 512)
    for key in ("instances", "alive", "running", "waiting", "mean_freeness"):  # the old keys stay
        assert key in t


def test_status_table_shows_the_slo_columns_and_the_cluster_line():
    data = status_json(snapshot(), "tcp://127.0.0.1:7100")
    console = Console(width=250, record=True)
    console.print(render_status(data))
    text = console.export_text()
    rows = {cells[0]: cells for cells in ([c.strip() for c in line.split("│")[1:-1]] for line in text.splitlines())
            if cells}
    header = next(line for line in text.splitlines() if "FREENESS" in line)
    names = [c.strip() for c in header.split("┃")[1:-1]]
    col = {name: names.index(name) for name in ("TTFT*", "TPOT*", "SLO MET")}
    i0, i1, total = rows["i0"], rows["i1"], rows["total"]
    assert i0[col["TPOT*"]] == f"{data['instances'][0]['predicted_tpot_s'] * 1000:.0f}ms"
    assert i0[col["TTFT*"]] == f"{data['instances'][0]['predicted_ttft_s'] * 1000:.0f}ms"
    assert i0[col["SLO MET"]] == "36/40 90%" and total[col["SLO MET"]] == "36/40 90%"
    assert [i1[c] for c in col.values()] == ["-", "-", "-"]  # no model yet, nothing judged
    assert "512-token prompt" in text


def test_status_shows_each_instances_adapters_and_free_slots():
    held = wire.InstanceLoad(1000, 0, 0, 0, 8, 16, adapters=["sql", "chat"], adapter_slots=1)
    off = wire.InstanceLoad(1000, 0, 0, 0, 8, 16)  # LoRA off: not in the adapters line
    data = status_json(wire.Snapshot(0, [view("i0", held), view("i1", off)]), "tcp://127.0.0.1:7100")
    assert (data["instances"][0]["adapters"], data["instances"][0]["adapter_slots"]) == (["sql", "chat"], 1)
    assert (data["instances"][1]["adapters"], data["instances"][1]["adapter_slots"]) == ([], 0)
    console = Console(width=250, record=True)
    console.print(render_status(data))
    assert "adapters: i0 sql, chat (1 open)" in console.export_text()


def test_status_shows_the_host_tier_and_retained_blocks_when_an_instance_has_them():
    tiered = wire.InstanceLoad(1000, 0, 0, 0, 8, 16, tier_blocks=300, tier_capacity=4000, restore_ms_per_block=0.17,
                               retained_blocks=42)
    off = wire.InstanceLoad(1000, 0, 0, 0, 8, 16)
    data = status_json(wire.Snapshot(0, [view("i0", tiered), view("i1", off)]), "tcp://127.0.0.1:7100")
    i0, i1 = data["instances"]
    assert (i0["tier_blocks"], i0["tier_capacity"], i0["restore_ms_per_block"], i0["retained_blocks"]) == (300, 4000, 0.17, 42)
    assert (i1["tier_blocks"], i1["tier_capacity"], i1["retained_blocks"]) == (0, 0, 0)
    t = data["totals"]
    assert (t["tier_blocks"], t["tier_capacity"], t["retained_blocks"]) == (300, 4000, 42)
    console = Console(width=300, record=True)
    console.print(render_status(data))
    text = console.export_text()
    header = next(line for line in text.splitlines() if "FREENESS" in line)
    names = [c.strip() for c in header.split("┃")[1:-1]]
    rows = {cells[0]: cells for cells in ([c.strip() for c in line.split("│")[1:-1]] for line in text.splitlines())
            if cells}
    tier, kept = names.index("HOST TIER USED/TOTAL"), names.index("RETAINED")
    assert (rows["i0"][tier], rows["i0"][kept]) == ("300/4000", "42")
    assert (rows["i1"][tier], rows["i1"][kept]) == ("-", "0")
    assert (rows["total"][tier], rows["total"][kept]) == ("300/4000", "42")
    assert "restore ms per block: i0 0.17" in text
    console = Console(width=300, record=True)  # no tier anywhere: no tier columns
    console.print(render_status(status_json(wire.Snapshot(0, [view("i1", off)]), "tcp://127.0.0.1:7100")))
    assert "HOST TIER" not in console.export_text()
