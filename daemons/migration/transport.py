"""What the migration protocol needs of a KV transport: pairs that move a stage's blocks between two instances.

Implementations: Gloo pairs (daemons/kv/transfer.py ``KvTransfer``), a tensor-parallel engine's ranks each over
its own Gloo pair (daemons/kv/ranks.py ``TpTransfer``), and blocks copied in memory between instances of one
process (tests/support/kv.py ``MemoryKv``). The instance picks one and hands it to the Migrator
(daemons/kv/ranks.py ``gloo_transport`` in the daemon). The blocks are described by the engine
(daemons/kv/layout.py); a transport imports no engine module and the engines import no transport.

A pair matches its sends and receives in the order they were posted at its two ends (both ends post in the
order of the control messages, which travel in order on one ZeroMQ connection), so no tags are needed. A
pair whose peer never posts its half never completes: the migration's own timeouts end it.
"""

from __future__ import annotations

from typing import Awaitable, Callable, Protocol

from daemons.kv.layout import KvBlocks


class TransferError(Exception):
    """A pair could not form or a send/receive failed (peer gone, timeout)."""


class Relay(Protocol):
    """A pair's rendezvous store whose writes must reach the peer (daemons/kv/transfer.py RelayStore)."""

    def attach(self, send: Callable[[str, bytes], None]) -> None: ...


class KvPair(Protocol):
    """One instance's end of a pair with one peer."""

    key: str  # names the pair at both ends (the source picks it; stage 0 tells the destination)
    broken: bool
    relay: Relay | None  # None: the pair needs no rendezvous over the instances' channel

    def send(self, kv: KvBlocks, block_ids: list[int], chunk_blocks: int, limit_bytes_s: float = 0.0,
             tail_tokens: int = 0, duty: Callable[[], float] | None = None,
             one_message: bool = False) -> Awaitable[int]:
        """Send ``block_ids`` in chunks of ``chunk_blocks``; resolves to the bytes sent (a concurrent or an
        asyncio future). ``tail_tokens``: of the last block only its first this many token slots.
        ``duty``: read before each chunk, the share of time the copy may run. ``one_message``: each chunk as
        one message (the receiver says the same)."""
        ...

    def recv(self, kv: KvBlocks, block_ids: list[int], chunk_blocks: int, tail_tokens: int = 0,
             one_message: bool = False) -> Awaitable[int]:
        """Receive into ``block_ids`` what the peer sends with the same arguments; resolves to the bytes."""
        ...


class KvTransport(Protocol):
    """This instance's end of KV transfer: the pairs it starts as a source and joins as a destination."""

    address: str  # where a destination's pairs meet this source's ("": over the instances' channel)

    def source_pair(self, me: str, peer: str, peer_address: str = "") -> KvPair:
        """The pair to send to ``peer`` (made on first use, and anew when ``peer_address`` changed)."""
        ...

    def dest_pair(self, key: str, store_address: str) -> KvPair:
        """The pair a source named ``key`` (its ``address`` is ``store_address``), joined on first use."""
        ...

    def relayed(self, pair_key: str, key: str, value: bytes) -> None:
        """A rendezvous value the peer of pair ``pair_key`` wrote (wire.KvRendezvous)."""
        ...

    def forget(self, name: str) -> None:
        """Close a pair (by peer for a source's, by key for a destination's); the next use makes a new one."""
        ...

    def close(self) -> None: ...
