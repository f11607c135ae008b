"""Live migration of running requests between instances: the llumlet's protocol, engine-agnostic.

Source, for one request (docs/architecture.md "Live migration"):

    stage 0     MigStage(request, KV layout, how to reach our KV store) -> destination reserves blocks,
                MigReady; the full blocks written so far go over Gloo while the request keeps decoding; MigDone
    stage k     the same for the blocks that filled up during stage k-1
    last stage  once at most ``last_stage_max_blocks`` remain (or after ``max_stages``): suspend the request
                at a step boundary, send the rest and the request's state (of the partial last block only
                its written token slots); the destination commits it (it is running there now) and answers
                MigDone: one round trip, the blocks right behind the message, no MigReady (a destination
                whose reservation the request outgrew grows it first; stage 0's headroom makes that rare)
    then        drop the request here; its tokens come from the destination, at the next index, to the same
                proxy (which is told the request moved)

Pre-copy is paced (daemons/pacing.py): with ``max_decode_slowdown`` set, the copy runs only so much of the
time that the engine's steps stay within that much of their time without a migration (``stepped``, which
the instance calls after every step), under ``bandwidth_limit_mbps`` as the hard cap; the last stage never.

Every step is acknowledged and has a timeout. The source aborts when the request finishes or is preempted
during pre-copy, or when the destination refuses, times out, dies or a transfer fails; it resumes the
request if it had suspended it, and tells the destination to release. A destination that hears nothing for
``dest_idle_timeout_s`` (a bounded lease) releases its reservation; one whose receive fails releases at once.
A peer the manager declares dead (``wire.PeerDead``, ``Migrator.peer_dead``) is waited for no longer: moves
out to it abort at once (a suspended request resumes here), reservations of moves in from it are released at
once, and the sockets and KV pairs to it close (counted: ``llumnix_instance_migration_released_total``). Blocks that a
transfer may still write are only released after the transfer has ended, so a late chunk never lands in a
block that another request got in the meantime.

Engine calls that change scheduler state run between steps (``boundary``); Gloo work runs on the pair's
thread (daemons/kv/transfer.py Pair) and only touches blocks no step writes. The KV moves through a transport the
instance hands over (``transport.py``'s ``KvTransport``: Gloo pairs, a tensor-parallel engine's ranks, or
in memory in the tests), which imports no engine module; the engines describe their KV in daemons/kv/layout.py.

Ownership (daemons/requests.py): the destination commits the request as the source's placement epoch + 1
and tells the proxy (``Moved``); so does the source once it hears of the commit. A source whose last stage
ends without an answer cannot know whether the destination committed: it resumes the request under the
next epoch too and tells the proxy, which keeps the first claim it hears of and aborts the other copy.
A destination that got ``MigAbort`` before committing never commits.

One object per concern, each owning its state: ``migrator.py`` (the Migrator, the facade the instance
holds: it builds the others and owns the pacing baseline), ``source.py`` (``Source``: the moves out, their
locks, pacers and counts), ``move.py`` (``Move``: one request's way out, stage by stage: plan → send →
account), ``destination.py`` (``Destination``: the moves in), ``peers.py`` (``Peers``: sockets between
instances, rendezvous relay, prefix queries), ``transport.py`` (what a KV transport is), ``records.py``
(outcomes, what the migrator needs of its instance, one move's state on each side), ``telemetry.py``
(metrics). The stage arithmetic is daemons/stages.py, shared with the simulator.
"""

from daemons.migration.migrator import Migrator
from daemons.migration.records import Aborted, DestinationFailed, Host, Refused
from daemons.migration.transport import KvPair, KvTransport, TransferError

__all__ = ["Aborted", "DestinationFailed", "Host", "KvPair", "KvTransport", "Migrator", "Refused", "TransferError"]
