"""The sessions a proxy or the manager knows: a bounded table (least recently seen forgotten first, past
sessions.max_sessions) of each session's last instance, the block keys of its last prompt (daemons/prefix.py), its
turns and when it was first and last seen. Where its KV is *now* is not kept here: the prefix index says
(``rows`` and the proxy's dispatch look its keys up with ``Follower.match_tiers``), since instances evict and move
blocks without telling anyone but the index.

A proxy fills its table as it places each turn (daemons/proxy/cluster/dispatch.py); the manager fills its own from
the proxies' Dispatched notices and the dispatches it answers (daemons/manager/dispatch.py), and answers
``llumnixctl sessions`` from it (wire.SessionsQuery)."""

from __future__ import annotations

from collections import OrderedDict
from typing import Callable

from daemons import wire


class _Session:
    __slots__ = ("instance_id", "keys", "turns", "tokens", "first", "last")

    def __init__(self, now: float):
        self.instance_id = ""
        self.keys: list[int] = []
        self.turns = 0
        self.tokens = 0
        self.first = self.last = now


class SessionTable:
    """Sessions by name, least recently seen first. Receives its bound and the clock it reads."""

    def __init__(self, max_sessions: int, now: Callable[[], float]):
        self.max_sessions = max(max_sessions, 1)
        self.now = now
        self._by_name: OrderedDict[str, _Session] = OrderedDict()
        self.forgotten = 0  # sessions dropped for the bound

    def __len__(self) -> int:
        return len(self._by_name)

    def __contains__(self, name: object) -> bool:
        return name in self._by_name

    def home(self, name: str) -> str:
        """The instance the session's last turn went to ("": unknown)."""
        s = self._by_name.get(name)
        return s.instance_id if s is not None else ""

    def keys(self, name: str) -> list[int]:
        """The block keys of the session's last prompt ([]: unknown): the leading blocks of its next one."""
        s = self._by_name.get(name)
        return s.keys if s is not None else []

    def placed(self, name: str, instance_id: str, keys: list[int], tokens: int) -> None:
        """A turn of session ``name`` (``tokens`` prompt tokens, ``keys`` its block keys) went to ``instance_id``."""
        if not name:
            return
        now = self.now()
        s = self._by_name.get(name)
        if s is None:
            s = self._by_name[name] = _Session(now)
            while len(self._by_name) > self.max_sessions:
                self._by_name.popitem(last=False)
                self.forgotten += 1
        else:
            self._by_name.move_to_end(name)
        s.instance_id, s.tokens, s.last = instance_id, tokens, now
        if keys:
            s.keys = list(keys)
        s.turns += 1

    def rows(self, match_tiers, limit: int = 0) -> list[wire.SessionRow]:
        """The sessions, most recently seen first (at most ``limit``; 0: all), with where their last prompt's blocks
        are now (``match_tiers``: prefix.Follower.match_tiers)."""
        now = self.now()
        out = []
        for name in reversed(self._by_name):
            if limit and len(out) >= limit:
                break
            s = self._by_name[name]
            held = match_tiers(s.keys) if s.keys else {}
            out.append(wire.SessionRow(name, s.instance_id, s.turns, s.tokens, len(s.keys), now - s.first, now - s.last,
                                       {i: e for i, (e, _) in held.items() if e},
                                       {i: b - e for i, (e, b) in held.items() if b > e}))
        return out
