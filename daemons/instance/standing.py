"""Who the instance is (known once its request socket is bound) and where it stands with the manager
(accepting, draining, cordoned, its role): each has one owner that changes it, and the other parts read it."""

from __future__ import annotations

from dataclasses import dataclass

from daemons import wire


@dataclass
class Identity:
    """Its id and addresses: set by the Instance when it binds (``Instance.run``), read by every part that
    names the instance in a message."""

    instance_id: str = ""
    request_address: str = ""
    metrics_address: str = ""


class Standing:
    """Whether it takes requests: changed by the manager's SetDraining (``drain``, through control.py) and by
    shutting down (``stop_accepting``); read by intake, reports and the migrator."""

    def __init__(self, role: str = "mixed") -> None:
        self.role = role  # "mixed" | "prefill" | "decode": set by the manager's SetRole (``set_role``)
        self._role_watchers: list = []  # called with (old, new) on a change
        self._accepting = True
        self._draining = ""  # the reason while the manager has us draining
        self._elsewhere = True  # (while draining) another instance takes requests
        self._cordoned = False

    @property
    def accepting(self) -> bool:
        return self._accepting

    @property
    def draining(self) -> str:
        return self._draining

    @property
    def elsewhere(self) -> bool:
        return self._elsewhere

    @property
    def cordoned(self) -> bool:
        return self._cordoned

    @property
    def open(self) -> bool:
        """Proxies may dispatch to us (what our heartbeats say)."""
        return self._accepting and not self._draining and not self._cordoned

    def give_back_reason(self) -> str:
        """Why a Submit that comes now goes back to its proxy ("": it is taken in)."""
        if not self._accepting:
            return "shutting down"
        return "draining" if self._draining and self._elsewhere else ""

    def register_reason(self) -> str:
        """The drain reason a registration carries."""
        return "stopping" if not self._accepting else self._draining

    def drain(self, msg: wire.SetDraining) -> str:
        """Apply the manager's SetDraining; returns the drain reason it replaced."""
        was = self._draining
        self._draining = (msg.reason or "operator") if msg.draining else ""
        self._cordoned = msg.cordoned
        self._elsewhere = msg.elsewhere
        return was

    def set_role(self, msg: wire.SetRole) -> str:
        """Apply the manager's SetRole; returns the role it replaced."""
        was, self.role = self.role, msg.role
        if was != msg.role:
            for fn in self._role_watchers:
                fn(was, msg.role)
        return was

    def watch_role(self, fn) -> None:
        """Call ``fn(old, new)`` when the role changes."""
        self._role_watchers.append(fn)

    def stop_accepting(self) -> None:
        self._accepting = False
