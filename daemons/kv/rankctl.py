"""The llumlet's line to each tensor-parallel rank's KV transfers, beside the engine's step.

A rank's transfers run on its Gloo pairs' threads (daemons/kv/ranks.py ``RankKv``); starting one, following it
and forgetting a pair are quick calls. Made through vLLM's ``collective_rpc`` they could only go between engine
steps (the executor's message queues are not thread-safe), so each call waited for the step in flight on its
instance: the last stage of a migration (the request's downtime) took several steps at each end, 60-360 ms at
TP 2 on a busy 2-core host against 2 ms at TP 1, whose transfers need no step at all.

Here every rank serves its own transfers on a thread of its own (``RankServer``), on a ZeroMQ ROUTER socket at an
``ipc://`` path in a directory only this user can enter, and the llumlet talks to each over a DEALER
(``RankLinks``): a start, a change of a paced send's share of time, and a ``wait`` that the rank answers when the
transfer ends (its pair's thread wakes the server through a pipe), so no one polls. Messages are msgpack lists;
a malformed one is logged and dropped.

``wait`` answers ``("done", bytes)`` or ``("error", why)``, as ``RankKv.poll`` reports a transfer.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import threading
from typing import Callable

import msgspec
import zmq
import zmq.asyncio

from daemons.ipcdirs import remove_endpoint_dir
from daemons.migration.transport import TransferError

log = logging.getLogger("llumnix.engine.vllm.tp")

_encode = msgspec.msgpack.Encoder().encode
_decode = msgspec.msgpack.Decoder().decode

METHODS = ("start", "wait", "duty", "forget")


# ==================================================================== each rank (in its worker process)


class RankServer:
    """One rank's control thread: answers the llumlet's calls on ``rank`` (a ``RankKv``, asked for at each call:
    the rank's KV is known only once the handshake asked its layout)."""

    def __init__(self, rank: Callable, directory: str, index: int):
        self.rank = rank
        self.endpoint = f"ipc://{directory}/rank{index}"
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.bind(self.endpoint)
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._waiters: dict[int, list[tuple[bytes, int]]] = {}  # op -> (peer identity, call id) waiting for its end
        self._closing = False
        self._thread = threading.Thread(target=self._serve, name="llumnix-kv-control", daemon=True)
        self._thread.start()

    def _woken(self, _fut=None) -> None:
        """(Any thread) A transfer ended: the server looks at its waiters."""
        try:
            os.write(self._wake_w, b"x")
        except BlockingIOError:  # the pipe is full: a wake-up is pending already
            pass

    def close(self) -> None:
        """Stop the thread; its socket closes (and its file goes) there. (A worker process just exits.)"""
        self._closing = True
        self._woken()
        self._thread.join(5)

    def _serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        poller.register(self._wake_r, zmq.POLLIN)
        while not self._closing:
            events = dict(poller.poll())
            if self._wake_r in events:
                try:
                    os.read(self._wake_r, 4096)
                except BlockingIOError:
                    pass
                self._answer_waiters()
            if self._sock in events:
                while True:
                    try:
                        frames = self._sock.recv_multipart(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    self._handle(frames)
        self._sock.close(0)
        self._ctx.term()
        os.close(self._wake_r)
        os.close(self._wake_w)

    def _reply(self, identity: bytes, call: int, ok: bool, result) -> None:
        self._sock.send_multipart([identity, _encode([call, ok, result])])

    def _handle(self, frames: list[bytes]) -> None:
        try:
            identity, payload = frames
            call, method, args = _decode(payload)
            if method not in METHODS or not isinstance(call, int) or not isinstance(args, list):
                raise ValueError(f"unknown call {method!r}")
        except (ValueError, TypeError, msgspec.DecodeError) as exc:
            log.warning("dropped a malformed KV control message: %s", exc)
            return
        try:
            rank = self.rank()
            if method == "start":
                op = args[0]
                rank.start(*args)
                rank.ops[op].add_done_callback(self._woken)
                result = None
            elif method == "wait":
                op = args[0]
                state = rank.poll([op])[op]
                if state[0] == "pending":
                    self._waiters.setdefault(op, []).append((identity, call))
                    return
                result = list(state)
            elif method == "duty":
                rank.poll([], {int(op): float(d) for op, d in args[0].items()})
                result = None
            else:  # forget
                rank.forget(args[0])
                result = None
        except Exception as exc:  # the llumlet's call fails; the rank goes on
            self._reply(identity, call, False, f"{type(exc).__name__}: {exc}")
            return
        self._reply(identity, call, True, result)

    def _answer_waiters(self) -> None:
        try:
            rank = self.rank()
        except Exception:  # no KV yet: nothing can have ended
            return
        for op in list(self._waiters):
            state = rank.poll([op])[op]
            if state[0] != "pending":
                for identity, call in self._waiters.pop(op):
                    self._reply(identity, call, True, list(state))


# ==================================================================== the llumlet's side


class RankTimeout(TransferError):
    """A rank did not answer a call in time (its process waits for a CPU, or died)."""


class RankLink:
    """The llumlet's DEALER to one rank. ``call`` resolves to the rank's answer, or raises TransferError."""

    _calls = itertools.count(1)

    def __init__(self, ctx: zmq.asyncio.Context, endpoint: str, index: int):
        self.index = index
        self.endpoint = endpoint
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(endpoint)
        self.pending: dict[int, asyncio.Future] = {}
        self.reader: asyncio.Task | None = None

    async def call(self, method: str, *args, timeout_s: float | None = None):
        if self.reader is None or self.reader.done():
            self.reader = asyncio.ensure_future(self._read())
        call = next(self._calls)
        fut = asyncio.get_running_loop().create_future()
        self.pending[call] = fut
        try:
            await self.sock.send(_encode([call, method, list(args)]))
            return await asyncio.wait_for(fut, timeout_s)
        except asyncio.TimeoutError:
            raise RankTimeout(f"tensor-parallel rank {self.index} did not answer {method} "
                                f"within {timeout_s:g}s") from None
        finally:
            self.pending.pop(call, None)

    async def _read(self) -> None:
        while True:
            payload = await self.sock.recv()
            try:
                call, ok, result = _decode(payload)
            except (ValueError, TypeError, msgspec.DecodeError) as exc:
                log.warning("dropped a malformed answer from tensor-parallel rank %d: %s", self.index, exc)
                continue
            fut = self.pending.get(call)
            if fut is None or fut.done():
                continue
            if ok:
                fut.set_result(result)
            else:
                fut.set_exception(TransferError(f"rank {self.index}: {result}"))

    def close(self) -> None:
        if self.reader is not None:
            self.reader.cancel()
        self.sock.close(0)


class RankLinks:
    """One link per rank, in rank order; ``everyone`` calls them all at once."""

    def __init__(self, endpoints: list[str], directory: str = "", ctx: zmq.asyncio.Context | None = None):
        self.ctx = ctx or zmq.asyncio.Context.instance()
        self.directory = directory
        self.links = [RankLink(self.ctx, e, i) for i, e in enumerate(endpoints)]

    def __len__(self) -> int:
        return len(self.links)

    async def everyone(self, method: str, *args, timeout_s: float | None = None) -> list:
        return list(await asyncio.gather(*(link.call(method, *args, timeout_s=timeout_s) for link in self.links)))

    def close(self) -> None:
        for link in self.links:
            link.close()
        remove_endpoint_dir(self.directory)
