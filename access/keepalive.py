"""One keepalive for all of a relay's websockets: ``Keepalive``, a single task that pings every
connection in turn, instead of websockets' task per connection.

It keeps websockets' behaviour (``Connection.keepalive``): a connection is pinged ``ping_interval``
seconds after its opening handshake and after each ping, never while its last ping waits for a pong;
without a pong ``ping_timeout`` seconds after the ping, it is failed with 1011 ("keepalive ping
timeout"): the close frame is sent and the TLS connection closed, and aborted ``close_timeout``
seconds later if it is still open. A pong is websockets' to match (``Connection.pending_pings``), so
``Connection.ping`` and ``latency`` work as before.

Per connection it holds one entry of an ordered dict (the connections in the order of their next ping:
the interval is the same for all, so a pinged connection goes to the end) and, while a ping waits, a
future and one entry of a deque (in the order of their deadlines). The task sleeps until the first
deadline or ping falls due (or a connection is added that is due sooner), no sooner than ``resolution`` seconds
after it last woke, so that a relay
of thousands of agents pings them in batches; a ping or a failure may then be up to ``resolution`` late.

Pings are written without waiting (``Connection.ping`` awaits the write buffer's drain, which would
hold every other connection's ping behind one agent that does not read): a ping goes behind whatever
the connection has buffered, as it does with websockets' own keepalive.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import math
import random
import struct

from websockets.asyncio.connection import Connection
from websockets.frames import CloseCode
from websockets.protocol import State

log = logging.getLogger(__name__)

TIMEOUT_REASON = "keepalive ping timeout"  # websockets' own


class Keepalive:
    """Pings every connection ``add``-ed to it (see the module docstring); ``run`` is its one task."""

    def __init__(self, *, ping_interval: float, ping_timeout: float, close_timeout: float,
                 resolution: float | None = None) -> None:
        if min(ping_interval, ping_timeout, close_timeout) <= 0 or (resolution is not None and resolution <= 0):
            raise ValueError("keepalive intervals and timeouts must be positive")
        self.ping_interval = ping_interval
        self.ping_timeout = ping_timeout
        self.close_timeout = close_timeout
        self.resolution = resolution if resolution is not None else min(ping_interval, ping_timeout) / 20
        self._due: collections.OrderedDict[Connection, float] = collections.OrderedDict()  # next ping, in order
        self._waiting: collections.deque[tuple[float, Connection, asyncio.Future[float]]] = collections.deque()
        self._pending: dict[Connection, asyncio.Future[float]] = {}  # the ping each connection waits on
        self._wake = asyncio.Event()
        self._next_wake = math.inf  # when the task wakes next, unless ``add`` wakes it sooner
        self.timeouts = 0  # connections failed for want of a pong

    def __len__(self) -> int:
        return len(self._due)

    def add(self, connection: Connection, *, now: float | None = None) -> None:
        """Ping ``connection`` from ``ping_interval`` seconds after ``now`` (default: the loop's time; its opening
        handshake just completed)."""
        at = (asyncio.get_running_loop().time() if now is None else now) + self.ping_interval
        self._due[connection] = at
        if at < self._next_wake:
            self._wake.set()

    def discard(self, connection: Connection) -> None:
        """Stop pinging ``connection`` (it is lost); its pending ping, if any, is websockets' to end."""
        self._due.pop(connection, None)
        self._pending.pop(connection, None)

    async def run(self) -> None:
        """Ping and time out connections until cancelled."""
        loop = asyncio.get_running_loop()
        while True:
            self._wake.clear()
            self._next_wake = self.tick(loop.time())
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout_at(None if math.isinf(self._next_wake) else self._next_wake):
                    await self._wake.wait()  # or until a connection is added that is due sooner

    def tick(self, now: float) -> float:
        """Fail the connections whose ping went unanswered until ``now``, ping those due; return when to
        tick next (``math.inf``: when a connection is added). ``run`` calls it; tests, with their own clock."""
        self._expire(now)
        self._ping(now, asyncio.get_running_loop())
        following = [self._waiting[0][0]] if self._waiting else []
        if self._due:
            following.append(next(iter(self._due.values())))
        return max(min(following), now + self.resolution) if following else math.inf

    def _ping(self, now: float, loop: asyncio.AbstractEventLoop) -> None:
        due = self._due
        while due:
            connection, at = next(iter(due.items()))
            if at > now:
                return
            last = self._pending.get(connection)
            if last is not None and not last.done():  # its last ping waits (ping_timeout > ping_interval): as
                due[connection] = now + self.resolution  # websockets, the next one only once the pong is in
                due.move_to_end(connection)  # (at most ``resolution`` late, for it and those behind it)
                continue
            due[connection] = now + self.ping_interval
            due.move_to_end(connection)
            if connection.protocol.state is not State.OPEN:
                continue  # closing: websockets' ping would not send either; discarded once lost
            pong = self._send_ping(connection, loop)
            self._pending[connection] = pong
            self._waiting.append((now + self.ping_timeout, connection, pong))

    def _expire(self, now: float) -> None:
        waiting = self._waiting
        while waiting and waiting[0][0] <= now:
            _, connection, pong = waiting.popleft()
            if self._pending.get(connection) is pong:
                del self._pending[connection]
            if not pong.done() and connection.protocol.state is State.OPEN:
                self.timeouts += 1
                log.info("no pong from %s within %.1f s: closing the connection", connection.remote_address, self.ping_timeout)
                self._fail(connection)

    @staticmethod
    def _send_ping(connection: Connection, loop: asyncio.AbstractEventLoop) -> asyncio.Future[float]:
        """``Connection.ping`` without waiting for the write buffer to drain."""
        data = struct.pack("!I", random.getrandbits(32))
        while data in connection.pending_pings:
            data = struct.pack("!I", random.getrandbits(32))
        pong: asyncio.Future[float] = loop.create_future()
        connection.pending_pings[data] = (pong, loop.time())
        connection.protocol.send_ping(data)
        connection.send_data()
        return pong

    def _fail(self, connection: Connection) -> None:
        """What websockets does on a keepalive timeout: fail with 1011, then abort after ``close_timeout``."""
        connection.protocol.fail(CloseCode.INTERNAL_ERROR, TIMEOUT_REASON)
        connection.send_data()
        waiter = connection.connection_lost_waiter
        if not waiter.done():
            handle = asyncio.get_running_loop().call_later(self.close_timeout, _abort, connection)
            waiter.add_done_callback(lambda _: handle.cancel())


def _abort(connection: Connection) -> None:
    with contextlib.suppress(Exception):  # already lost: nothing to do
        connection.transport.abort()
