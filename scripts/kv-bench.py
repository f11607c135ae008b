#!/usr/bin/env python3
"""How fast our KV path moves one request's blocks, on the device the KV lives on, without an engine.

A real Gloo pair over 127.0.0.1 (both ends in this process, each on its own thread, as two instances' pairs
on one node are), per request length:

- ``whole``: all of a request's blocks in chunks of ``--chunk-bytes``, double-buffered (a blocking copy, or
  a first pre-copy stage): ms and GB/s;
- ``last``: what a migration's last stage moves while the request is suspended after pre-copy (one full block
  and the written slots of the partial one, as one message): ms, the copy part of the downtime;
- ``load`` / ``store``: one chunk from the KV into the host buffer (on a GPU: gather on the device, copy to
  pinned memory on the transfer's stream) and back: GB/s, the device's share of the copy.

Shapes default to one rank of Llama-3-8B (32 layers, 8 KV heads of 128, bfloat16: 128 KiB a token), blocks
of 16 tokens, in the layout vLLM allocates on the device (``--layout`` takes any of its six, or all).

    .venv/bin/python scripts/kv-bench.py [--device cuda] [--layout all] [--tokens 1024,8192] [--json]

Prints a table (or one JSON document with ``--json``); medians of ``--repeat`` runs after one warm-up.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from daemons.kv.layout import KvBlocks, Staging  # noqa: E402
from daemons.kv.transfer import Pair  # noqa: E402
from tests.support.gloo import loopback_pair  # noqa: E402
from tests.support.kvviews import ORDERS, layout_views  # noqa: E402


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def timed(fn, repeat: int, device: str) -> list[float]:
    fn()  # warm-up: buffers, the pair's first messages
    out = []
    for _ in range(repeat):
        sync(device)
        began = time.perf_counter()
        fn()
        sync(device)
        out.append(time.perf_counter() - began)
    return out


def move(src: Pair, dst: Pair, ka: KvBlocks, kb: KvBlocks, send_ids, recv_ids, chunk: int, tail: int = 0,
         one_message: bool = False) -> int:
    got = dst.recv(kb, recv_ids, chunk, tail_tokens=tail, one_message=one_message)
    sent = src.send(ka, send_ids, chunk, tail_tokens=tail, one_message=one_message).result(120)
    if got.result(120) != sent:
        raise RuntimeError(f"sent {sent} bytes, received {got.result()}")
    return sent


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cpu", "cuda"])
    ap.add_argument("--tokens", default="1024,8192", help="request lengths, comma-separated")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-size", type=int, default=128)
    ap.add_argument("--block", type=int, default=16, help="tokens per KV block")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--layout", default="",
                    help="vLLM KV layouts, comma-separated, or all (default: LBNHC on a GPU, what vLLM allocates "
                         "there unless a backend asks otherwise; LBHNC on the CPU, what its CPU backend takes)")
    ap.add_argument("--chunk-bytes", type=int, default=8 << 20, help="migration.chunk_bytes")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        print("kv-bench: --device cuda, but torch sees no CUDA device", file=sys.stderr)
        return 2
    layouts = (list(ORDERS) if args.layout == "all" else [x.strip() for x in args.layout.split(",") if x.strip()]
               or ["LBNHC" if args.device == "cuda" else "LBHNC"])
    unknown = [x for x in layouts if x not in ORDERS]
    if unknown:
        print(f"kv-bench: unknown layout {', '.join(unknown)} (one of {', '.join(ORDERS)}, or all)", file=sys.stderr)
        return 2
    lengths = [int(x) for x in args.tokens.split(",") if x.strip()]
    src, dst = loopback_pair("kv-bench", 60)
    try:
        measured = [measure(args, layout, lengths, src, dst) for layout in layouts]
    finally:
        src.close()
        dst.close()
    doc = {"device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu", "torch": torch.__version__,
           "shape": {"layers": args.layers, "kv_heads": args.kv_heads, "head_size": args.head_size,
                     "block_tokens": args.block, "dtype": args.dtype},
           "repeat": args.repeat, "layouts": measured}
    if args.json:
        print(json.dumps(doc, indent=2))
        return 0
    print(f"{doc['device']}, torch {doc['torch']}: {args.layers} layers x {args.kv_heads} KV heads x {args.head_size}, "
          f"{args.dtype}, {args.block}-token blocks of {measured[0]['block_nbytes'] / 1024:.0f} KiB; "
          f"medians of {args.repeat}")
    for m in measured:
        print(f"layout {m['layout']} ({m['copy_path']} copies), chunks of {m['chunk_blocks']} blocks: one chunk into "
              f"the host buffer {m['load_gb_s']:.2f} GB/s, back {m['store_gb_s']:.2f} GB/s")
        print(f"{'tokens':>7} {'MiB':>8} {'whole ms':>9} {'GB/s':>6} {'last stage ms':>14}")
        for r in m["results"]:
            print(f"{r['tokens']:>7} {r['bytes'] / 2**20:>8.1f} {r['whole_ms']:>9.1f} {r['whole_gb_s']:>6.2f} "
                  f"{r['last_ms']:>14.2f}")
    return 0


def measure(args, layout: str, lengths: list[int], src: Pair, dst: Pair) -> dict:
    """One layout's figures: every length's whole request and last stage, and one chunk's staging."""
    blocks = max(-(-n // args.block) for n in lengths) + 2
    views = dict(layers=args.layers, blocks=blocks, heads=args.kv_heads, tokens=args.block,
                 channels=2 * args.head_size, dtype=getattr(torch, args.dtype), device=args.device)
    ka = KvBlocks(layout_views(layout, seed=1, **views), "kv-bench", layout, token_slots=True)
    kb = KvBlocks(layout_views(layout, seed=2, **views), "kv-bench", layout, token_slots=True)
    chunk = max(1, args.chunk_bytes // ka.block_nbytes)
    rng = random.Random(0)
    results = []
    for n in lengths:
        count = -(-n // args.block)
        send_ids, recv_ids = rng.sample(range(blocks), count), rng.sample(range(blocks), count)
        nbytes = count * ka.block_nbytes
        whole = timed(lambda: move(src, dst, ka, kb, send_ids, recv_ids, chunk), args.repeat, args.device)
        tail = n % args.block or args.block
        last_ids, last_into = send_ids[-2:], recv_ids[-2:]
        last = timed(lambda: move(src, dst, ka, kb, last_ids, last_into, chunk, tail=tail, one_message=True),
                     args.repeat, args.device)
        results.append({"tokens": n, "blocks": count, "bytes": nbytes,
                        "whole_ms": statistics.median(whole) * 1e3,
                        "whole_gb_s": nbytes / statistics.median(whole) / 1e9,
                        "last_ms": statistics.median(last) * 1e3,
                        "last_bytes": ka.block_nbytes + ka.tail_nbytes(tail)})
    st_a, st_b = Staging(ka, chunk * ka.block_nbytes), Staging(kb, chunk * kb.block_nbytes)
    ids = rng.sample(range(blocks), min(chunk, blocks))
    load = timed(lambda: st_a.load(0, ids), args.repeat, args.device)
    store = timed(lambda: st_b.store(0, ids), args.repeat, args.device)
    chunk_bytes = len(ids) * ka.block_nbytes
    return {"layout": layout, "block_nbytes": ka.block_nbytes, "copy_path": ka.path, "chunk_blocks": chunk,
            "load_gb_s": chunk_bytes / statistics.median(load) / 1e9,
            "store_gb_s": chunk_bytes / statistics.median(store) / 1e9, "results": results}


if __name__ == "__main__":
    sys.exit(main())
