"""Saying something about a key (a client key, an instance id, a verb) at most once in a while, and
remembering at most so many keys: keys a peer makes up (a random CURVE key per connection attempt) must
not grow a daemon's memory, however many it tries."""

from __future__ import annotations

from typing import Hashable


class Throttle:
    def __init__(self, every_s: float = 60.0, cap: int = 1024):
        self.every_s = every_s
        self.cap = cap
        self._last: dict[Hashable, float] = {}  # oldest said first: the one forgotten when full

    def due(self, key: Hashable, now: float) -> bool:
        """True (and remembered) if nothing was said about ``key`` in the last ``every_s`` seconds."""
        last = self._last.get(key)
        if last is not None and now - last < self.every_s:
            return False
        self._last.pop(key, None)
        self._last[key] = now
        if len(self._last) > self.cap:
            self._last.pop(next(iter(self._last)))
        return True

    def __len__(self) -> int:
        return len(self._last)
