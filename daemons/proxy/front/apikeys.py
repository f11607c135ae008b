"""API keys of the proxy's HTTP API (``proxy.api_keys_file``): load the file, check a request's key, reload.

The file is TOML, one table per key; the table's name is the key's name, which the access log shows
(never the key):

    [keys.alice]
    key = "sk-..."              # the key itself, or instead
    sha256 = "<64 hex digits>"  # the SHA-256 of the key: printf %s "$KEY" | sha256sum
    high_priority = true        # may send priority high (default false)
    enabled = false             # revoked: the key is refused (default true)
    requests_per_minute = 600   # limits of this key, each 0 (the default) for none; past one: 429 + Retry-After
    tokens_per_minute = 200000  #   prompt tokens plus max_tokens, counted when a request is admitted (what it
                                #   did not generate is given back when it ends)
    max_concurrent_requests = 8 #   requests of this key in flight at once, on this proxy
    weight = 2.0                # its share of a saturated cluster against the other keys' (default 1)
    slo_ttft_ms = 500           # a tighter SLO for this key's requests than their priority class's [slo] targets
    slo_tpot_ms = 50            #   (each 0, the default, for the class's own); admission and goodput use it

Limits are per proxy: behind P proxies a key may get up to P times them (divide them by P for a cluster-wide
figure). See daemons/proxy/front/tenants.py for the limits and daemons/proxy/cluster/fairness.py for the shares.

A request presents ``Authorization: Bearer KEY``. The presented key is hashed with SHA-256 and its digest
looked up among the keys' digests, then compared with hmac.compare_digest: the time taken does not depend
on how much of a real key the presented one matches. The file is read again when it changes (its mtime,
size or inode; looked at no more than once a second, on the next request), and at once on ``reload()``
(the proxy calls it on SIGHUP). A file that is no longer valid is logged as an error and the keys last
loaded stay in force until it is fixed (an edit half done must not lock every client out). A file that is
gone revokes every key (deleting it must not leave the old keys working) until it is back.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import re
import sys
from dataclasses import dataclass
from typing import Callable

from daemons.clock import Clock
from daemons.proxy.api.protocol import ApiError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - 3.10
    import tomli as tomllib

log = logging.getLogger("llumnix.proxy")

_NAME = re.compile(r"[A-Za-z0-9_.@-]{1,64}")  # a name is safe in a log line
_KEY = re.compile(r"[!-~]+")  # what a Bearer token can carry: visible ASCII, no spaces
_HEX = re.compile(r"[0-9a-fA-F]{64}")
_FIELDS = {"key", "sha256", "high_priority", "enabled", "requests_per_minute", "tokens_per_minute",
           "max_concurrent_requests", "weight", "slo_ttft_ms", "slo_tpot_ms"}
_LIMITS = ("requests_per_minute", "tokens_per_minute", "max_concurrent_requests")

MISSING = ("You didn't provide an API key. You need to provide your API key in an Authorization header using "
           "Bearer auth (i.e. Authorization: Bearer YOUR_KEY).")
MALFORMED = "Malformed Authorization header: expected Authorization: Bearer YOUR_KEY."
INCORRECT = "Incorrect API key provided."


class ApiKeysError(Exception):
    """The keys file cannot be used; the message names the file and the key."""


class Unauthorized(ApiError):
    """401: no key, a malformed header, or a key that is unknown or revoked."""

    def __init__(self, message: str, presented: bool = True):
        super().__init__(401, message, type_="invalid_request_error", code="invalid_api_key")
        # RFC 6750: say what went wrong only when credentials were sent
        self.headers = {"WWW-Authenticate": 'Bearer error="invalid_token"' if presented else "Bearer"}


@dataclass(frozen=True)
class Principal:
    """Who sent a request: the key's name and what it may do."""

    name: str
    high_priority: bool = False
    requests_per_minute: int = 0  # 0: no limit
    tokens_per_minute: int = 0
    max_concurrent_requests: int = 0
    weight: float = 1.0  # share in the fair queue between keys
    slo_ttft_ms: float = 0.0  # a tighter SLO than its class's (0: the class's)
    slo_tpot_ms: float = 0.0


@dataclass(frozen=True)
class _Entry:
    digest: bytes
    principal: Principal
    enabled: bool


def digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8", "surrogateescape")).digest()


def bearer(authorization: str | None) -> str:
    """The token of an ``Authorization: Bearer TOKEN`` header; raises Unauthorized."""
    if not authorization or not authorization.strip():
        raise Unauthorized(MISSING, presented=False)
    scheme, _, token = authorization.strip().partition(" ")
    token = token.strip()
    if scheme.lower() != "bearer" or not token or not _KEY.fullmatch(token):
        raise Unauthorized(MALFORMED)
    return token


def check_token(authorization: str | None, token: str) -> None:
    """A bearer token that must equal ``token`` (the metrics token); raises Unauthorized."""
    if not hmac.compare_digest(digest(bearer(authorization)), digest(token)):
        raise Unauthorized("Incorrect token provided.")


def parse(path: str, text: str) -> dict[bytes, _Entry]:
    """The entries of a keys file's text, by the digest of their key; raises ApiKeysError."""
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ApiKeysError(f"{path}: not valid TOML: {exc}") from None
    other = sorted(set(data) - {"keys"})
    if other:
        raise ApiKeysError(f"{path}: unknown entry {other[0]!r}; the file holds only [keys.NAME] tables")
    keys = data.get("keys", {})
    if not isinstance(keys, dict):
        raise ApiKeysError(f"{path}: keys must be [keys.NAME] tables, got {type(keys).__name__}")
    entries: dict[bytes, _Entry] = {}
    for name, table in keys.items():
        where = f"{path}: [keys.{name}]"
        if not _NAME.fullmatch(name):
            raise ApiKeysError(f"{where}: a key's name is 1 to 64 letters, digits, '_', '-', '.' or '@'")
        if not isinstance(table, dict):
            raise ApiKeysError(f"{path}: keys.{name} must be a [keys.{name}] table, got {type(table).__name__}")
        unknown = sorted(set(table) - _FIELDS)
        if unknown:
            raise ApiKeysError(f"{where}: unknown field {unknown[0]!r} (known: {', '.join(sorted(_FIELDS))})")
        if ("key" in table) == ("sha256" in table):
            raise ApiKeysError(f'{where}: give exactly one of key = "..." or sha256 = "<hex>"')
        if "key" in table:
            key = table["key"]
            if not isinstance(key, str) or not _KEY.fullmatch(key):
                raise ApiKeysError(f"{where}: key must be a non-empty string of visible ASCII characters, no spaces")
            value = digest(key)
        else:
            hexed = table["sha256"]
            if not isinstance(hexed, str) or not _HEX.fullmatch(hexed):
                raise ApiKeysError(f"{where}: sha256 must be the 64 hex digits of the key's SHA-256")
            value = bytes.fromhex(hexed)
        flags = {}
        for flag, default in (("high_priority", False), ("enabled", True)):
            flags[flag] = table.get(flag, default)
            if not isinstance(flags[flag], bool):
                raise ApiKeysError(f"{where}: {flag} must be true or false, got {flags[flag]!r}")
        limits = {}
        for limit in _LIMITS:
            limits[limit] = table.get(limit, 0)
            if isinstance(limits[limit], bool) or not isinstance(limits[limit], int) or limits[limit] < 0:
                raise ApiKeysError(f"{where}: {limit} must be a whole number >= 0 (0: no limit), got {limits[limit]!r}")
        weight = table.get("weight", 1.0)
        if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not 0 < weight <= 1e6:
            raise ApiKeysError(f"{where}: weight must be a number > 0 (its share against the other keys'), "
                               f"got {weight!r}")
        targets = {}
        for target in ("slo_ttft_ms", "slo_tpot_ms"):
            targets[target] = table.get(target, 0.0)
            if isinstance(targets[target], bool) or not isinstance(targets[target], (int, float)) or targets[target] < 0:
                raise ApiKeysError(f"{where}: {target} must be a number of milliseconds >= 0 (0: its priority "
                                   f"class's [slo] target), got {targets[target]!r}")
            targets[target] = float(targets[target])
        if value in entries:
            raise ApiKeysError(f"{where}: the same key as [keys.{entries[value].principal.name}]")
        entries[value] = _Entry(value, Principal(name, flags["high_priority"], weight=float(weight), **limits,
                                                 **targets), flags["enabled"])
    return entries


def _stamp(path: str) -> tuple[int, int, int]:
    st = os.stat(path)
    return st.st_mtime_ns, st.st_size, st.st_ino


class ApiKeys:
    """The keys of ``proxy.api_keys_file``. ``check`` also picks up changes to the file."""

    CHECK_INTERVAL_S = 1.0

    def __init__(self, path: str, entries: dict[bytes, _Entry], stamp: tuple[int, int, int] | None,
                 now: Callable[[], float] | None = None):
        """``now``: the clock the file's re-reads are timed by (default: daemons.clock.Clock's monotonic)."""
        self.now = now or Clock().monotonic
        self.path = path
        self._entries = entries
        self._stamp = stamp  # of the file last loaded
        self._bad: tuple | None = None  # the stamp (or error) last logged as unusable, to log it once
        self._next_look = self.now() + self.CHECK_INTERVAL_S

    @classmethod
    def load(cls, path: str, now: Callable[[], float] | None = None) -> "ApiKeys":
        """Read the file; raises ApiKeysError (the proxy then does not start)."""
        stamp, entries = cls._read(path)
        keys = cls(path, entries, stamp, now)
        log.info("API keys: %s", keys.summary())
        return keys

    @staticmethod
    def _read(path: str) -> tuple[tuple[int, int, int], dict[bytes, _Entry]]:
        try:
            stamp = _stamp(path)
            with open(path, encoding="utf-8") as f:
                text = f.read()
        except OSError as exc:
            raise ApiKeysError(f"cannot read the API keys file {path}: {exc.strerror}") from None
        except UnicodeDecodeError:
            raise ApiKeysError(f"{path}: not UTF-8 text") from None
        return stamp, parse(path, text)

    def summary(self) -> str:
        on = [e.principal.name for e in self._entries.values() if e.enabled]
        return (f"{len(on)} enabled of {len(self._entries)} in {self.path}"
                + (f" ({', '.join(sorted(on))})" if on else ""))

    def names(self) -> list[str]:
        """The names of the enabled keys."""
        return sorted(e.principal.name for e in self._entries.values() if e.enabled)

    def reload(self, force: bool = True) -> bool:
        """Read the file again if it changed (or ``force``); True when new keys were loaded. A file that
        cannot be used is logged once and the keys loaded before stay in force."""
        try:
            stamp = _stamp(self.path)
        except FileNotFoundError:
            if self._entries or self._bad != ("gone",):
                self._entries, self._stamp, self._bad = {}, None, ("gone",)
                log.error("the API keys file %s is gone: every key is refused until it is back", self.path)
            return False
        except OSError as exc:
            self._unusable(("missing", exc.errno), f"cannot read the API keys file {self.path}: {exc.strerror}")
            return False
        if stamp == self._stamp and not force:
            return False
        try:
            stamp, entries = self._read(self.path)
        except ApiKeysError as exc:
            self._unusable(stamp, str(exc))
            return False
        self._entries, self._stamp, self._bad = entries, stamp, None
        log.info("API keys reloaded: %s", self.summary())
        return True

    def _unusable(self, what, why: str) -> None:
        if what != self._bad:
            self._bad = what
            log.error("%s; the API keys loaded before stay in force until the file is fixed", why)

    def check(self, authorization: str | None) -> Principal:
        """Who presents this ``Authorization`` header value; raises Unauthorized."""
        now = self.now()
        if now >= self._next_look:
            self._next_look = now + self.CHECK_INTERVAL_S
            self.reload(force=False)
        presented = digest(bearer(authorization))
        entry = self._entries.get(presented)
        if entry is None or not hmac.compare_digest(entry.digest, presented) or not entry.enabled:
            raise Unauthorized(INCORRECT)
        return entry.principal
