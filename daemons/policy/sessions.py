"""Sessions and KV tiers in dispatch: what a request's cached leading blocks are worth on each instance, priced by
predicted time, and a session's turn placed where its KV is, with bounded load. Pure functions over plain values
(daemons/policy/dispatch.py ``place`` calls them, for the proxies, the manager and the simulator alike).

Pricing. A request of P prompt tokens on an instance whose engine holds E of its leading blocks and whose host tier
holds H more (daemons/prefix.py ``match_tiers``) costs, before its first token:
- nothing for the E engine blocks;
- H x the instance's ``restore_ms_per_block`` (from its load report: measured; until it has measured, block bytes
  over sessions.restore_gbps) to bring the H blocks back from its tier;
- for blocks another instance holds beyond E + H (the holder with the most), a pull while the request queues, at
  the copy cost: block bytes over sessions.kv_link_gbps; taken only where it is shorter than prefilling those
  tokens (``pull_blocks``) and kv_tier.pull is on; the copy overlaps the request's wait in the queue, so only
  what it takes past that wait counts;
- the instance's predicted TTFT of the rest (daemons/policy/slo.py ``predict_ttft``: its queue, then the prefill of
  what is not cached); an instance with no step-time model yet prefills at REFERENCE_PREFILL_MS_PER_TOKEN.
Block bytes are what the instance reports (wire.InstanceLoad ``block_nbytes``, from its host tier), else block_size x
sessions.kv_bytes_per_token.

Sessions. A request naming a session goes to the instance that holds most of its prompt (engine and host tier
together; the session's last instance wins a tie) unless that instance is past ``bound`` x the mean load (its
requests, running, queued and dispatched, with this one counted: consistent hashing with bounded loads, Mirrokni
et al.), or it is predicted past the request's TTFT target while another instance is predicted to serve it
sooner (with a recompute or a pull); then to the cheapest other instance by the policy in force, with a pull
from the holder where that pays. No instance then takes more than ``bound`` x its share because of its
sessions' popularity."""

from __future__ import annotations

import math
from dataclasses import dataclass

from daemons.policy import slo
from daemons.policy.usage import InstanceState

REFERENCE_PREFILL_MS_PER_TOKEN = 0.1  # an instance with no step-time model yet (scheduling.cross_node_recompute_ms_per_token's default)
REFERENCE_KV_BYTES_PER_TOKEN = 131072  # 2 x 32 layers x 8 KV heads x 128 x 2 bytes: an 8B model, GQA, 16-bit
HOW = ("affinity", "spilled", "new", "pull")  # how a session's turn was placed (llumnix_proxy_session_dispatches_total)


@dataclass(frozen=True)
class Pricing:
    """What session dispatch and tier pricing read of the settings ([sessions], kv_tier.pull)."""

    affinity: bool = True
    bound: float = 1.25
    pull: bool = True
    kv_bytes_per_token: int = REFERENCE_KV_BYTES_PER_TOKEN
    link_gbps: float = 10.0
    restore_gbps: float = 40.0

    def block_bytes(self, block_size: int, reported: int = 0) -> int:
        """A block's KV bytes: as its instance reported them (wire.InstanceLoad ``block_nbytes``), else block_size x
        kv_bytes_per_token."""
        return reported if reported > 0 else block_size * self.kv_bytes_per_token

    def copy_ms(self, blocks: int, block_size: int, reported: int = 0) -> float:
        """A pull of ``blocks`` between instances (``reported``: the destination's block bytes, 0: unknown)."""
        return blocks * self.block_bytes(block_size, reported) * 8 / (self.link_gbps * 1e9) * 1000.0

    def restore_ms_per_block(self, s: InstanceState) -> float:
        """One block from ``s``'s host tier into its engine: as ``s`` measured it, else the default rate."""
        if s.restore_ms_per_block > 0:
            return s.restore_ms_per_block
        return self.block_bytes(s.block_size, s.block_nbytes) * 8 / (self.restore_gbps * 1e9) * 1000.0


def pricing_of(cfg) -> Pricing:
    """Pricing from the settings (daemons/config.py Config)."""
    ss = cfg.sessions
    per_token = ss.kv_bytes_per_token or cfg.scheduling.cross_node_kv_bytes_per_token or REFERENCE_KV_BYTES_PER_TOKEN
    return Pricing(ss.affinity, ss.bound, cfg.kv_tier.pull, per_token, ss.kv_link_gbps, ss.restore_gbps)


Tiers = dict[str, tuple[int, int]]  # instance -> (engine leading blocks, engine-or-host leading blocks)


def prefill_ms_per_token(s: InstanceState) -> float:
    fit = s.latency
    if slo.fitted(fit) and fit.prefill_ms_per_token > 0:
        return fit.prefill_ms_per_token
    return REFERENCE_PREFILL_MS_PER_TOKEN


def holder(tiers: Tiers | None, ids, home: str = "") -> tuple[str, int]:
    """Among ``ids``, the instance that holds most of the request's leading blocks in some tier (``home``, the
    session's last instance, wins a tie, then more of them in the engine): (its id, those blocks); ("", 0) if none."""
    best, key = "", None
    for iid in ids:
        engine, both = (tiers or {}).get(iid, (0, 0))
        if both <= 0:
            continue
        k = (both, iid == home, engine, iid)
        if key is None or k > key:
            best, key = iid, k
    return best, (key[0] if key else 0)


def pull_blocks(s: InstanceState, tiers: Tiers | None, prompt_tokens: int, src: str, src_blocks: int,
                p: Pricing) -> int:
    """Blocks worth pulling to ``s`` from ``src`` (which holds ``src_blocks`` leading blocks): those beyond what
    ``s`` holds, when copying them is predicted shorter than prefilling them on ``s``; 0 otherwise."""
    if not p.pull or not src or src == s.instance_id:
        return 0
    _, both = (tiers or {}).get(s.instance_id, (0, 0))
    n = min(src_blocks, prompt_tokens // max(s.block_size, 1)) - both
    if n <= 0:
        return 0
    prefill_ms = n * s.block_size * prefill_ms_per_token(s)
    return n if p.copy_ms(n, s.block_size, s.block_nbytes) < prefill_ms else 0


def pull_for(dst: InstanceState, sources, tiers: Tiers | None, prompt_tokens: int, p: Pricing) -> tuple[str, int]:
    """A pull to ``dst`` of the request's leading blocks from the one of ``sources`` (live instances) holding most of
    them, where that is predicted shorter than their prefill (``pull_blocks``): (source, blocks), or ("", 0)."""
    if not tiers or not p.pull:
        return "", 0
    src, blocks = holder(tiers, [i for i in sources if i != dst.instance_id])
    n = pull_blocks(dst, tiers, prompt_tokens, src, blocks, p) if src else 0
    return (src, n) if n else ("", 0)


@dataclass(frozen=True)
class Priced:
    """One instance's price for a request: its predicted TTFT with its tiers (and pull) counted."""

    instance_id: str
    ttft_s: float
    engine: int = 0  # leading blocks its engine holds
    host: int = 0  # more leading blocks its host tier holds
    pulled: int = 0  # leading blocks pulled from ``pull_from`` (0: no pull)
    pull_from: str = ""


def price(s: InstanceState, prompt_tokens: int, tiers: Tiers | None, p: Pricing, high: bool = False,
          src: str = "", src_blocks: int = 0, max_tokens: int = 0) -> Priced:
    """``s``'s predicted TTFT for the request (module text), with a pull from ``src`` (holding ``src_blocks``) where
    that pays. ``s`` as the SLO predicts it (slo.pooled: completed by the cluster's fits)."""
    bs = max(s.block_size, 1)
    engine, both = (tiers or {}).get(s.instance_id, (0, 0))
    pulled = pull_blocks(s, tiers, prompt_tokens, src, src_blocks, p)
    uncached = max(prompt_tokens - (both + pulled) * bs, 0)
    restore_s = (both - engine) * p.restore_ms_per_block(s) / 1000.0
    if slo.fitted(s.latency):
        ttft = slo.predict_ttft(s, uncached, high, max_tokens)
        wait = slo.predict_ttft(s, 0, high, max_tokens) if pulled else 0.0
    else:
        ttft, wait = uncached * REFERENCE_PREFILL_MS_PER_TOKEN / 1000.0, 0.0
    copy_s = p.copy_ms(pulled, bs, s.block_nbytes) / 1000.0 if pulled else 0.0
    return Priced(s.instance_id, ttft + restore_s + max(copy_s - wait, 0.0), engine, both - engine, pulled,
                  src if pulled else "")


def saved_s(s: InstanceState, tiers: Tiers, p: Pricing) -> float:
    """Prefill time the request's cached blocks on ``s`` save there: each engine block its prefill, each host
    block its prefill less its restore (the slo policy's cache credit)."""
    engine, both = tiers.get(s.instance_id, (0, 0))
    per_block = s.block_size * prefill_ms_per_token(s)
    return (engine * per_block + (both - engine) * max(per_block - p.restore_ms_per_block(s), 0.0)) / 1000.0


# ------------------------------------------------------------------ a session's turn


@dataclass(frozen=True)
class Follow:
    """Where a session's turn goes by its KV: ``instance_id`` (""; then the policy decides, away from ``avoid``
    when set) and ``how``: "affinity" (to its holder), "spilled" (its holder is past the bound or its target),
    "new" (no instance holds any of it)."""

    instance_id: str
    how: str
    avoid: str = ""
    holder_blocks: int = 0


def within_bound(states: list[InstanceState], iid: str, bound: float) -> bool:
    """Whether ``iid`` may take one more request for its cache: its requests (running, queued, dispatched) with
    this one stay within ``bound`` x the mean over ``states``, this one counted (ceil: on an idle cluster an
    instance may always take one)."""
    n = len(states)
    if n <= 1:
        return True
    total = sum(s.batch for s in states) + 1
    cap = math.ceil(bound * total / n)
    mine = next((s.batch for s in states if s.instance_id == iid), 0)
    return mine + 1 <= cap


def follow(states: list[InstanceState], prompt_tokens: int, tiers: Tiers | None, home: str, p: Pricing,
           ttft_target_s: float = 0.0, high: bool = False) -> Follow:
    """A session's turn over the instances that take requests (``states``, as the SLO predicts them): see the
    module's text."""
    eligible = [s for s in states if s.dispatchable]
    iid, blocks = holder(tiers, [s.instance_id for s in eligible], home)
    if not iid:
        return Follow("", "new")
    if not within_bound(eligible, iid, p.bound):
        return Follow("", "spilled", iid, blocks)
    if ttft_target_s > 0:
        s = next(s for s in eligible if s.instance_id == iid)
        mine = price(s, prompt_tokens, tiers, p, high).ttft_s
        if mine > ttft_target_s and _cheaper_elsewhere(eligible, iid, blocks, mine, prompt_tokens, tiers, p, high):
            return Follow("", "spilled", iid, blocks)
    return Follow(iid, "affinity", "", blocks)


def _cheaper_elsewhere(eligible: list[InstanceState], iid: str, blocks: int, mine: float, prompt_tokens: int,
                       tiers: Tiers | None, p: Pricing, high: bool) -> bool:
    """Whether some instance other than the holder ``iid`` (holding ``blocks``) is predicted to give the turn its
    first token sooner than the holder's ``mine``: with what it caches, a pull from the holder where that pays,
    and the prefill of the rest. When every instance is past the target, the turn stays where it is served
    soonest: spilling it where it would wait as long only adds a recompute to a loaded cluster."""
    return any(price(o, prompt_tokens, tiers, p, high, iid, blocks).ttft_s < mine
               for o in eligible if o.instance_id != iid)
