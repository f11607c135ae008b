"""Conversations and agent loops whose KV should follow the session (``bench sessions``, ``simulate --sessions``).

A session opens with one of ``agents`` shared agent system prompts (``system_tokens`` long, popularity
``(k + 1) ** -skew``) and runs ``turns`` turns (uniform in the bounds): turn k's prompt is turn k-1's prompt,
its answer and a new message (a user's reply or a tool's output), so prompts grow; its output is its answer.
The loop is closed: turn k is sent ``think_s`` (exponential, mean ``think``) after turn k-1's answer ended
(``TraceRequest.session``/``turn``/``think_s``, the replay's and the simulator's rule). Sessions start as a
Poisson (or Gamma) process of ``session_rate`` per second; a session ends early where its context would pass
``max_context``. The turns are built by ``traces/cache.py``'s ``conversation`` (the multi-turn trace's), so a
segment name is the same tokens wherever it appears (``cache.prompt_ids``).

The working set is what a cache must hold to serve every reuse: the distinct tokens of every prompt plus each
session's last answer (``working_set``). ``sessions`` sizes a trace against a cluster's KV either by a number
of sessions or by ``working_set_tokens`` (as many sessions as it takes to reach it: the issue's check wants a
working set of at least 4x the engines' KV). ``describe`` prints the ratio.

Pure and seeded: the same arguments give the same trace; the first k sessions of a longer trace are the
trace of k sessions (each session's draws come after the ones before it, from the same streams).
"""

from __future__ import annotations

import heapq

from llumnixctl.experiments.traces.cache import check_bounds, conversation, popularity, sharing, streams
from llumnixctl.experiments.traces.gen import TraceRequest, gaps

MAX_SESSIONS = 1_000_000  # sizing by working set stops here whatever it reached


def sessions(n: int = 0, *, session_rate: float, arrival: str = "poisson", cv: float = 1.0,
             turns: tuple[int, int] = (4, 8), agents: int = 4, system_tokens: int = 1024, skew: float = 1.0,
             message: tuple[int, int] = (16, 256), reply: tuple[int, int] = (16, 128), think: float = 1.0,
             max_context: int = 4096, alpha: float = 1.0, working_set_tokens: int = 0,
             seed: int = 0) -> list[TraceRequest]:
    """The turns of ``n`` sessions (``n`` = 0: of as many as make the working set reach ``working_set_tokens``),
    in order of their nominal arrival (see the module's doc)."""
    check_bounds(*turns, "turns")
    check_bounds(*message, "message")
    check_bounds(*reply, "reply")
    if n < 0 or (n == 0 and working_set_tokens <= 0):
        raise ValueError("give a number of sessions (>= 1) or a working set to reach (tokens >= 1)")
    if system_tokens < 0 or think < 0:
        raise ValueError("system_tokens and think must be >= 0")
    if session_rate <= 0:
        raise ValueError(f"the session rate must be positive; got {session_rate}")
    system_len = system_tokens if agents else 0
    if system_len + message[0] + reply[0] > max_context:
        raise ValueError(f"no turn fits in max_context {max_context}: a system prompt of {system_tokens} tokens, a "
                         f"message of at least {message[0]} and a reply of at least {reply[0]}")
    weights = popularity(max(agents, 1), skew, 0.0)
    r = streams(seed)
    rows: list[tuple] = []
    used_agents: set[int] = set()
    start, session, ws = 0.0, 0, 0
    while (session < n) if n else (ws < working_set_tokens and session < MAX_SESSIONS):
        start += gaps(r["arrival"], 1, session_rate, arrival, cv)[0]
        system, k = (), -1
        if agents and system_tokens:
            k = r["prefix"].choices(range(len(weights)), weights)[0]
            system = ((f"s{seed}-sys{k}", system_tokens),)
        turns_of = conversation(r, seed, session, start, system, r["turns"].randint(*turns), message, reply, think,
                                max_context, alpha)
        rows.extend(turns_of)
        if turns_of:
            _, _, _, segs, out, _ = turns_of[-1]
            ws += sum(x for _, x in segs) - system_len + out
            if k >= 0 and k not in used_agents:
                used_agents.add(k)
                ws += system_tokens
        session += 1
    rows.sort(key=lambda x: (x[0], x[1], x[2]))
    return [TraceRequest(i, t, sum(x for _, x in segs), o, "normal", segments=segs, session=s, turn=k, think_s=th)
            for i, (t, s, k, segs, o, th) in enumerate(rows)]


def session_key(seed: int, session: int) -> str:
    """The session's name on the wire (OpenAI's ``prompt_cache_key``, the session header)."""
    return f"bench-{seed}-s{session}"


def working_set(reqs: list[TraceRequest]) -> int:
    """Tokens a cache must hold to serve every reuse of the trace: its prompts' distinct segments and each
    session's last answer (its KV is made, and a next turn would reuse it)."""
    seen: dict[str, int] = {}
    last: dict[int, TraceRequest] = {}
    for r in reqs:
        for name, length in r.segments:
            seen[name] = length
        if r.session >= 0 and (r.session not in last or last[r.session].turn < r.turn):
            last[r.session] = r
    return sum(seen.values()) + sum(r.output_tokens for r in last.values())


def nominal_live_peak(reqs: list[TraceRequest]) -> int:
    """The most context tokens held at once by sessions under way, on the trace's nominal timeline (answers in
    no time): a session is under way from its first turn to its last, and holds its latest turn's prompt.
    A lower bound of what a run holds (service time only makes sessions overlap more)."""
    events: list[tuple[float, int, int, int]] = []  # (time, order, session, tokens): order 0 = end before a start
    span: dict[int, tuple[float, float]] = {}
    for r in reqs:
        if r.session < 0:
            continue
        a, b = span.get(r.session, (r.arrival_s, r.arrival_s))
        span[r.session] = (min(a, r.arrival_s), max(b, r.arrival_s))
        events.append((r.arrival_s, 1, r.session, r.prompt_tokens))
    for s, (_, end) in span.items():
        events.append((end, 2, s, 0))
    heapq.heapify(events)
    held: dict[int, int] = {}
    total = peak = 0
    while events:
        _, order, s, tokens = heapq.heappop(events)
        total -= held.pop(s, 0)
        if order == 1:
            held[s] = tokens
            total += tokens
        peak = max(peak, total)
    return peak


def describe(reqs: list[TraceRequest], kv_tokens: int = 0, block_size: int = 16, lead: int = 0) -> dict:
    """What a reader wants to know of a session trace: its size, its working set against ``kv_tokens`` (the
    cluster's KV, all engines together; 0: unknown) and what a perfect cache would serve (``cache.sharing``,
    with ``lead`` tokens before every prompt: a BOS)."""
    by: dict[int, int] = {}
    for r in reqs:
        by[r.session] = by.get(r.session, 0) + 1
    prompts = sorted(r.prompt_tokens for r in reqs) or [0]
    ws = working_set(reqs)
    out = {"sessions": len(by), "turns": len(reqs), "mean_turns": round(len(reqs) / len(by), 2) if by else 0.0,
           "most_turns": max(by.values(), default=0), "prompt_tokens_mean": round(sum(prompts) / len(prompts), 1),
           "prompt_tokens_max": prompts[-1], "working_set_tokens": ws,
           "nominal_live_peak_tokens": nominal_live_peak(reqs), "kv_tokens": kv_tokens,
           "working_set_over_kv": round(ws / kv_tokens, 2) if kv_tokens else None,
           **sharing(reqs, block_size, lead)}
    return out
