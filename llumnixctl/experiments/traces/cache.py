"""Traces whose requests share prompt content, for prefix-cache experiments: shared system prompts with a
popularity skew (one of them hot, if asked) and multi-turn conversations.

A request's prompt is a list of named segments (``TraceRequest.segments``): the same name is the same
tokens wherever it appears, so two requests share exactly their common leading segments. ``segment_ids``
turns a segment into token ids (seeded by its name: the same on any machine); ``prompt_ids`` a whole
request (a request without segments gets tokens of its own, unique in the trace).

- ``shared_prefix``: each request is one of ``prefixes`` system prompts (``prefix_tokens`` long) and a
  suffix of its own. Prompt ``k`` (0-based) is chosen with probability proportional to ``(k + 1) **
  -skew`` (zipf; 0 = uniform); with ``hot`` > 0, prompt 0 is chosen with probability ``hot`` and the
  others share the rest by the same law (the hotspot case).
- ``multi_turn``: sessions of ``turns`` turns (uniform in the bounds). A session opens with one of
  ``system_prompts`` system prompts (same law) and each turn adds a message; the turn's prompt is the
  system prompt and every earlier message and reply, then its message (what a chat client resends), and
  its output is its reply. Sessions start at ``rate / mean turns`` per second, so requests arrive at about
  ``rate``; a turn is sent ``think_s`` (exponential, mean ``think``) after the previous one ended.
  A session ends early where its context would pass ``max_context``.
"""

from __future__ import annotations

import random
from functools import lru_cache

from llumnixctl.experiments.traces.gen import TraceRequest, gaps, power_law


def popularity(n: int, skew: float, hot: float) -> list[float]:
    if n < 1:
        raise ValueError(f"the number of shared prompts must be >= 1; got {n}")
    if not 0.0 <= hot < 1.0:
        raise ValueError(f"the hot prompt's share must be in [0, 1); got {hot}")
    w = [(k + 1) ** -skew for k in range(n)]
    if hot > 0 and n > 1:
        rest = sum(w[1:])
        return [hot] + [(1.0 - hot) * x / rest for x in w[1:]]
    total = sum(w)
    return [x / total for x in w]


def check_bounds(lo: int, hi: int, what: str) -> None:
    if lo < 1 or hi < lo:
        raise ValueError(f"{what} bounds must satisfy 1 <= min <= max; got [{lo}, {hi}]")


def shared_prefix(n: int, *, rate: float, arrival: str = "poisson", cv: float = 1.0, prefixes: int = 24,
                  prefix_tokens: int = 384, skew: float = 1.0, hot: float = 0.0, suffix: tuple[int, int] = (16, 128),
                  output: tuple[int, int] = (16, 256), alpha: float = 1.0, seed: int = 0) -> list[TraceRequest]:
    """``n`` requests, each a shared system prompt and a suffix of its own (see the module's doc)."""
    check_bounds(*suffix, "suffix")
    check_bounds(*output, "output")
    if prefix_tokens < 1:
        raise ValueError(f"the shared prompts' length must be >= 1; got {prefix_tokens}")
    weights = popularity(prefixes, skew, hot)
    r = {k: random.Random(f"llumnix-trace:{seed}:{k}") for k in ("arrival", "prefix", "prompt", "output")}
    t, out = 0.0, []
    for i, gap in enumerate(gaps(r["arrival"], n, rate, arrival, cv)):
        t += gap
        k = r["prefix"].choices(range(prefixes), weights)[0]
        own = power_law(r["prompt"], suffix[0], suffix[1], alpha)
        segments = ((f"s{seed}-p{k}", prefix_tokens), (f"s{seed}-r{i}", own))
        out.append(TraceRequest(i, t, prefix_tokens + own, power_law(r["output"], output[0], output[1], alpha),
                                "normal", segments=segments))
    return out


def multi_turn(n: int, *, rate: float, arrival: str = "poisson", cv: float = 1.0, turns: tuple[int, int] = (2, 8),
               system_prompts: int = 8, system_tokens: int = 256, skew: float = 1.0,
               message: tuple[int, int] = (16, 128), reply: tuple[int, int] = (16, 256), think: float = 5.0,
               max_context: int = 4096, alpha: float = 1.0, seed: int = 0) -> list[TraceRequest]:
    """``n`` requests (turns of sessions, in order of their nominal arrival; see the module's doc)."""
    check_bounds(*turns, "turns")
    check_bounds(*message, "message")
    check_bounds(*reply, "reply")
    if system_tokens < 0 or think < 0:
        raise ValueError("system_tokens and think must be >= 0")
    if rate <= 0:
        raise ValueError(f"the arrival rate must be positive; got {rate}")
    if (system_tokens if system_prompts else 0) + message[0] + reply[0] > max_context:
        raise ValueError(f"no turn fits in max_context {max_context}: a system prompt of {system_tokens} tokens, a "
                         f"message of at least {message[0]} and a reply of at least {reply[0]}")
    weights = popularity(max(system_prompts, 1), skew, 0.0)
    r = streams(seed)
    session_rate = rate / ((turns[0] + turns[1]) / 2)
    rows: list[tuple[float, int, int, tuple, int, float]] = []
    start, session = 0.0, 0
    while len(rows) < n:
        start += gaps(r["arrival"], 1, session_rate, arrival, cv)[0]
        system = ()
        if system_prompts and system_tokens:
            k = r["prefix"].choices(range(len(weights)), weights)[0]
            system = ((f"s{seed}-sys{k}", system_tokens),)
        rows.extend(conversation(r, seed, session, start, system, r["turns"].randint(*turns), message, reply, think,
                                 max_context, alpha))
        session += 1
    rows.sort(key=lambda x: (x[0], x[1], x[2]))
    return [TraceRequest(i, t, sum(x for _, x in segs), o, "normal", segments=segs, session=s, turn=k, think_s=th)
            for i, (t, s, k, segs, o, th) in enumerate(rows[:n])]


def streams(seed: int) -> dict[str, random.Random]:
    """The generators' random streams, one per kind of draw (a change to one kind leaves the others' draws)."""
    return {k: random.Random(f"llumnix-trace:{seed}:{k}")
            for k in ("arrival", "prefix", "prompt", "output", "turns", "think")}


def conversation(r: dict[str, random.Random], seed: int, session: int, start: float, system: tuple, turns: int,
                 message: tuple[int, int], reply: tuple[int, int], think: float, max_context: int,
                 alpha: float) -> list[tuple[float, int, int, tuple, int, float]]:
    """One session's turns as rows (nominal arrival, session, turn, segments, output tokens, think time): it opens
    with ``system`` (segments) at ``start``; turn k's prompt is every earlier message and reply, then its own
    message; a turn after the first comes ``think_s`` (exponential, mean ``think``) after the one before it
    (nominally at once: the replay waits for its end). It ends early where its context would pass
    ``max_context``."""
    history, rows, t = list(system), [], start
    for turn in range(turns):
        m = power_law(r["prompt"], message[0], message[1], alpha)
        o = power_law(r["output"], reply[0], reply[1], alpha)
        history.append((f"s{seed}-c{session}m{turn}", m))
        if sum(x for _, x in history) + o > max_context:
            break
        think_s = r["think"].expovariate(1.0 / think) if think > 0 and turn else 0.0
        t += think_s
        rows.append((t, session, turn, tuple(history), o, think_s))
        history.append((f"s{seed}-c{session}a{turn}", o))
    return rows


@lru_cache(maxsize=4096)
def segment_ids(name: str, length: int, vocab: int, lo: int = 0) -> tuple[int, ...]:
    """The tokens of a segment: ``length`` ids in ``[lo, vocab)``, seeded by the name."""
    rng = random.Random(f"llumnix-segment:{name}")
    return tuple(rng.randrange(lo, vocab) for _ in range(length))


def prompt_ids(req: TraceRequest, vocab: int, lo: int = 0) -> list[int]:
    """The request's prompt as token ids in ``[lo, vocab)``: its segments', or its own unique ones."""
    segments = req.segments or ((f"own-{req.index}", req.prompt_tokens),)
    ids: list[int] = []
    for name, length in segments:
        ids.extend(segment_ids(name, length, vocab, lo))
    return ids


def previous_turns(reqs: list[TraceRequest]) -> dict[int, int]:
    """For each request that is a later turn of a session in ``reqs``: the index of the turn before it."""
    at = {(r.session, r.turn): r.index for r in reqs if r.session >= 0}
    return {r.index: at[(r.session, r.turn - 1)] for r in reqs if r.session >= 0 and (r.session, r.turn - 1) in at}


def sharing(reqs: list[TraceRequest], block_size: int = 16, lead: int = 0) -> dict:
    """What a perfect cache could save: the prompt tokens in leading full blocks some earlier request
    already had (an infinite cache, one instance), as a share of all prompt tokens. ``lead``: tokens an engine
    puts before every prompt (a BOS), which shift the blocks' bounds."""
    seen: set = set()
    saved = total = 0
    for r in reqs:
        ids = [-1] * lead + prompt_ids(r, 1 << 30)
        total += len(ids)
        parent: object = None
        hit = True
        for b in range(len(ids) // block_size):
            parent = hash((parent, tuple(ids[b * block_size:(b + 1) * block_size])))
            if hit and parent in seen and (b + 1) * block_size < len(ids):
                saved += block_size
            else:
                hit = False
            seen.add(parent)
    return {"prompt_tokens": total, "shareable_tokens": saved, "shareable_fraction": saved / total if total else 0.0}
