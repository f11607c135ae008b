"""LinkWatch on real ZeroMQ sockets (no daemon): a dropped connection that reconnects is still UP, one whose
reconnection is refused is DOWN at once, and a frozen one (its kernel accepts, nothing answers) is DOWN after the
timeout. Each test waits on the watch's own state changes, never on a sleep."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys

import zmq
import zmq.asyncio

from daemons.links import DOWN, UP, LinkWatch


PEER = """
import zmq
sock = zmq.Context().socket(zmq.ROUTER)
port = sock.bind_to_random_port("tcp://127.0.0.1")
print(port, flush=True)
import sys; sys.stdin.read()
"""


class Rig:
    """A watched DEALER connected to ``address``, or to a ROUTER 'peer' of its own."""

    def __init__(self, timeout_s: float, address: str = ""):
        self.ctx = zmq.asyncio.Context()
        self.peer = None
        if not address:
            self.peer = self.ctx.socket(zmq.ROUTER)
            self.peer.setsockopt(zmq.LINGER, 0)
            address = f"tcp://127.0.0.1:{self.peer.bind_to_random_port('tcp://127.0.0.1')}"
        self.address = address
        self.changes: list[str] = []
        self.changed = asyncio.Event()
        self.watch = LinkWatch(timeout_s, self._changed)
        self.client = self.watch.prepare(self.ctx.socket(zmq.DEALER))
        self.client.setsockopt(zmq.LINGER, 0)
        self.watch.watch("peer", self.client)
        self.client.connect(self.address)

    def _changed(self, key: str, state: str) -> None:
        self.changes.append(state)
        self.changed.set()

    async def until(self, state: str, timeout_s: float = 10.0) -> None:
        async def wait():
            while self.watch.state("peer") != state:
                self.changed.clear()
                await self.changed.wait()
        await asyncio.wait_for(wait(), timeout_s)

    def close(self) -> None:
        if self.peer is not None:
            self.peer.close(linger=0)
        self.watch.close()
        self.ctx.destroy(linger=0)


class Relay:
    """A TCP relay to the peer whose live connections the test can cut while it goes on listening: the
    client's reconnection reaches the same peer."""

    def __init__(self, target_port: int):
        self.target_port = target_port
        self.writers: list[asyncio.StreamWriter] = []

    async def start(self) -> int:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return self.server.sockets[0].getsockname()[1]

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target_port)
        self.writers += [writer, up_writer]

        async def pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
            try:
                while data := await src.read(65536):
                    dst.write(data)
                    await dst.drain()
            except (ConnectionError, OSError):
                pass
            finally:
                dst.close()

        await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer))

    def cut(self) -> None:
        for w in self.writers:
            w.transport.abort()
        self.writers.clear()

    def close(self) -> None:
        self.cut()
        self.server.close()


def test_a_drop_that_reconnects_stays_up():
    """The connection is cut (as a machine that stalled for seconds cuts it: its keepalive timer expires the
    moment it runs again) while the peer is there: ZeroMQ's reconnection reaches it, and the link never reads
    DOWN; the drop is counted as healed."""

    async def go():
        peer = zmq.asyncio.Context.instance().socket(zmq.ROUTER)
        peer.setsockopt(zmq.LINGER, 0)
        relay = Relay(peer.bind_to_random_port("tcp://127.0.0.1"))
        port = await relay.start()
        rig = Rig(timeout_s=5.0, address=f"tcp://127.0.0.1:{port}")
        try:
            await rig.until(UP)
            relay.cut()
            while rig.watch.came_back == 0:  # (a healed drop changes no state: polled)
                await asyncio.sleep(0.005)
            return rig.changes, rig.watch.state("peer")
        finally:
            rig.close()
            relay.close()
            peer.close(linger=0)

    changes, state = asyncio.run(asyncio.wait_for(go(), 30))
    assert changes == [UP] and state == UP


def test_a_refused_reconnection_is_down_before_the_timeout():
    """The peer's process is gone (nothing listens on its port): the first refused reconnection makes the link
    DOWN, long before the (here 60 s) timeout would."""

    async def go():
        rig = Rig(timeout_s=60.0)
        try:
            await rig.until(UP)
            loop = asyncio.get_running_loop()
            start = loop.time()
            rig.peer.close(linger=0)
            await rig.until(DOWN, timeout_s=30.0)
            return rig.changes, loop.time() - start
        finally:
            rig.close()

    changes, took = asyncio.run(go())
    assert changes == [UP, DOWN] and took < 30.0


def test_a_frozen_peer_is_down_after_the_timeout():
    """The peer's process is frozen (SIGSTOP): its kernel still accepts TCP connections, but nothing answers a
    keepalive or completes a handshake. The drop is followed by a reconnection that never completes: DOWN once
    the timeout has passed again, not before."""
    peer = subprocess.Popen([sys.executable, "-c", PEER], stdin=subprocess.PIPE, stdout=subprocess.PIPE)

    async def go():
        port = int(peer.stdout.readline())
        rig = Rig(timeout_s=0.5, address=f"tcp://127.0.0.1:{port}")
        try:
            await rig.until(UP)
            os.kill(peer.pid, signal.SIGSTOP)
            await rig.until(DOWN, timeout_s=30.0)
            return rig.changes, rig.watch.came_back
        finally:
            rig.close()

    try:
        assert asyncio.run(go()) == ([UP, DOWN], 0)
    finally:
        os.kill(peer.pid, signal.SIGCONT)
        peer.kill()
        peer.wait(10)
