"""A request's session and its retention, as OpenAI's API names them.

A session (a conversation, an agent's loop) is named by the body's ``prompt_cache_key`` (OpenAI's prompt
caching field, a string), else by the header sessions.header (default ``x-session-id``), else not at all. Its
turns are then placed where its KV is (daemons/policy/sessions.py). ``prompt_cache_retention`` asks how long
the session's cached prefix is kept after the turn: "in_memory" (also "in-memory") is the instance's default
(kv_tier.retain_s), "24h" is as long as the cluster allows (kv_tier.max_retain_s). Anything else is a 400
naming the field, as OpenAI answers."""

from __future__ import annotations

from dataclasses import dataclass

from daemons.proxy.api.errors import ApiError
from daemons.proxy.api.protocol import MAX_SESSION_CHARS

DAY_S = 86400.0
IN_MEMORY = ("in_memory", "in-memory")
LONG = ("24h",)


@dataclass(frozen=True)
class Session:
    """What a request says of its session: its name ("": none) and the retention it asks (0: the default)."""

    name: str = ""
    retain_s: float = 0.0


NONE = Session()


def session_of(body, headers, header: str, max_retain_s: float) -> Session:
    """The request's session: ``body``'s prompt_cache_key, else the ``header`` (a lowercase name; "": none), with
    its ``prompt_cache_retention`` mapped to seconds (``max_retain_s``: the cluster's bound, 0: a day)."""
    name = body.prompt_cache_key or ""
    if not name and header:
        name = headers.get(header) or ""
        if len(name) > MAX_SESSION_CHARS:
            raise ApiError(400, f"the {header} header is longer than {MAX_SESSION_CHARS} characters", header,
                           code="invalid_value")
    return Session(name, retention_s(body.prompt_cache_retention, max_retain_s))


def retention_s(value: str | None, max_retain_s: float) -> float:
    """Seconds a request's cached prefix is to be kept (0: the instance's default)."""
    if value is None or value in IN_MEMORY:
        return 0.0
    if value in LONG:
        return min(DAY_S, max_retain_s) if max_retain_s > 0 else DAY_S
    raise ApiError(400, f"Invalid value for prompt_cache_retention: {value!r}; supported values are 'in_memory' "
                        f"and '24h'", "prompt_cache_retention", code="invalid_value")
