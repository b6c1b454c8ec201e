"""What TLS costs a relay per connection, what it cuts, and the relay's connection class
(``tracking_connection_class``) that applies it to every connection once its handshake is done; and
``peer_identity``, the host a connection's client certificate names.

* **One read buffer per event loop.** CPython's asyncio gives every TLS connection its own read
  buffer of ``SSLProtocol.max_size`` bytes (256 KiB by default, zero-filled, so resident) that
  only ever holds the bytes of one ``recv_into`` until ``buffer_updated`` copies them into the
  connection's ``MemoryBIO``, synchronously, in the same callback. So connections of one loop can
  share one buffer: ``share_read_buffer`` points an established connection's protocol at its
  loop's. A connection still has its own during its handshake. Where asyncio is not CPython's
  (uvloop) it changes nothing and says so.
* **A bound on what waits to be decrypted.** While websockets holds ``max_queue`` frames the
  relay has not read yet, it pauses the TLS transport, which then keeps reading the socket into
  the connection's ``MemoryBIO`` up to 256 KiB (``FLOW_CONTROL_HIGH_WATER_SSL_READ``), whose
  memory OpenSSL never gives back while the connection lasts. ``limit_tls_reads`` lowers that
  mark, so an agent that sends faster than the relay forwards is held back by TCP sooner.
* **No copy of the peer certificate as a dict.** asyncio decodes the client certificate into a
  dict (``getpeercert()``, some 1.7 KiB) kept in the transport's extra info for the connection's
  life; the relay reads the DER from the ``ssl_object`` instead, so ``forget_peercert_dict``
  drops it: ``get_extra_info("peercert")`` is ``None`` on a relay connection.
* **No last frame held by the parser.** websockets' frame parser (``Protocol.parse``) keeps the
  last frame it received in a local variable until the next one arrives, payload included (a
  telemetry frame is ~7 KB): an idle agent would cost the relay its last frame.
  ``ReleasingServerProtocol`` hands the rest of websockets a new ``Frame`` sharing the payload
  and empties the parser's own once it is passed on.
* **No empty deques.** An empty ``collections.deque`` keeps a 64-slot block (760 bytes with its
  header), and a connection has three that are nearly always empty: websockets' ``drain_waiters``
  and its received frames' queue, asyncio's TLS ``_write_backlog``. ``use_small_queues`` swaps them
  for lists (``SmallQueue``, a list with ``popleft``/``extendleft``: 56 bytes empty), which do what
  their users ask of them (append, iterate, remove, index, delete the first) for the few items they
  hold; ``tests/test_relay_memory.py`` checks they are in place and the connection still works.
* **No session tickets.** A TLS 1.3 server sends two tickets after each handshake (each an
  encryption of the session, client certificate included) so clients can resume; agents never
  resume (they hold one long connection, and a new one is a full handshake with the client
  certificate), so ``no_session_tickets`` turns them off.

``SSLProtocol._ssl_buffer`` is an internal of asyncio; ``tests/test_relay_memory.py`` checks it
still behaves as this module expects. The read size (``SSLProtocol.max_size``) is set by
``access.service.set_tls_read_buffer``.
"""

from __future__ import annotations

import asyncio
import collections
import ssl
import weakref
from collections.abc import Iterable
from typing import Any

from websockets.asyncio.server import Server, ServerConnection
from websockets.frames import Frame
from websockets.server import ServerProtocol

from access.keepalive import Keepalive
from shared.crypto import host_id_from_der, serial_hex_from_der

# Each loop's buffer, as the memoryview asyncio reads into (it keeps the bytearray alive).
_read_buffers: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, memoryview] = weakref.WeakKeyDictionary()


def share_read_buffer(transport: asyncio.BaseTransport) -> bool:
    """Make an established TLS connection read through its event loop's shared buffer; ``False``
    when the transport is not asyncio's own TLS transport (plain TCP, uvloop). Call it on the loop."""
    protocol = getattr(transport, "_ssl_protocol", None)
    own = getattr(protocol, "_ssl_buffer", None)
    if not isinstance(own, bytearray) or not isinstance(getattr(protocol, "_ssl_buffer_view", None), memoryview):
        return False
    loop = asyncio.get_running_loop()
    shared = _read_buffers.get(loop)
    if shared is None or len(shared) < len(own):  # get_buffer would otherwise allocate a private one
        shared = _read_buffers[loop] = memoryview(bytearray(len(own)))
    protocol._ssl_buffer = shared.obj  # type: ignore[union-attr]
    protocol._ssl_buffer_view = shared  # type: ignore[union-attr]
    return True


def limit_tls_reads(transport: asyncio.BaseTransport, limit: int) -> bool:
    """Pause reading a TLS connection's socket once ``limit`` bytes wait to be decrypted; ``False``
    when the transport has no such limit (plain TCP)."""
    set_limits = getattr(transport, "set_read_buffer_limits", None)  # asyncio's TLS transport only
    if set_limits is None or transport.get_extra_info("ssl_object") is None:
        return False
    set_limits(high=limit)
    return True


def forget_peercert_dict(transport: asyncio.BaseTransport) -> bool:
    """Drop the decoded peer certificate asyncio keeps in a TLS transport's extra info (the DER
    stays readable through ``ssl_object``); ``False`` when there is none to drop."""
    extra = getattr(getattr(transport, "_ssl_protocol", None), "_extra", None)
    return isinstance(extra, dict) and extra.pop("peercert", None) is not None


class SmallQueue(list[Any]):
    """A list with the two ``deque`` methods websockets' ``SimpleQueue`` uses, for queues of a few items."""

    __slots__ = ()

    def popleft(self) -> Any:
        return self.pop(0)

    def extendleft(self, items: Iterable[Any]) -> None:
        self[:0] = list(items)[::-1]  # as deque.extendleft: each item in turn to the left


def use_small_queues(connection: ServerConnection) -> bool:
    """Swap a connection's empty deques for ``SmallQueue``s (see the module docstring); ``False`` where one
    is not an empty deque where expected (another websockets or asyncio), and left as it is."""
    swapped = True
    holders = ((connection, "drain_waiters"), (getattr(connection.recv_messages, "frames", None), "queue"),
               (getattr(connection.transport, "_ssl_protocol", None), "_write_backlog"))
    for holder, name in holders:
        current = getattr(holder, name, None)
        if isinstance(current, collections.deque) and not current:
            setattr(holder, name, SmallQueue())
        else:
            swapped = False
    return swapped


class ReleasingServerProtocol(ServerProtocol):
    """websockets' server protocol, except that the frame its parser keeps until the next one
    arrives no longer holds its payload once passed on (see the module docstring).

    ``Protocol.parse`` calls ``recv_frame(frame)`` and reads nothing of the frame afterwards;
    everything downstream (the events, the ``Assembler``) gets the copy."""

    def recv_frame(self, frame: Frame) -> None:
        passed = Frame(frame.opcode, frame.data, frame.fin, frame.rsv1, frame.rsv2, frame.rsv3)
        frame.data = b""
        super().recv_frame(passed)


def no_session_tickets(context: ssl.SSLContext) -> None:
    """Stop a server context from sending TLS 1.3 session tickets."""
    context.num_tickets = 0


def tracking_connection_class(tracked: set[ServerConnection], tls_read_limit: int,
                              keepalive: Keepalive | None = None) -> type[ServerConnection]:
    """A ``ServerConnection`` that is in ``tracked`` from the moment its TLS handshake completes
    until it is lost, so a drain can drop one stuck before or after its websocket handshake
    (websockets' own ``all_connections`` only holds those past it). It reads through its loop's
    shared TLS read buffer, holds at most ``tls_read_limit`` received bytes not yet decrypted, keeps
    no decoded peer certificate and parses with ``ReleasingServerProtocol``. With a ``keepalive``,
    that is what pings it once its opening handshake is done (serve it with ``ping_interval=None``)."""

    class TrackedConnection(ServerConnection):
        def __init__(self, protocol: ServerProtocol, server: Server, **kwargs: Any) -> None:
            if type(protocol) is ServerProtocol:  # serve() makes a plain one; same layout, one method more
                protocol.__class__ = ReleasingServerProtocol
            super().__init__(protocol, server, **kwargs)

        def connection_made(self, transport: asyncio.BaseTransport) -> None:
            super().connection_made(transport)
            share_read_buffer(transport)  # called once the TLS handshake is done
            limit_tls_reads(transport, tls_read_limit)
            forget_peercert_dict(transport)
            use_small_queues(self)
            tracked.add(self)

        def start_keepalive(self) -> None:  # websockets calls it once the opening handshake is done
            if keepalive is not None:
                keepalive.add(self)
            else:
                super().start_keepalive()

        def connection_lost(self, exc: Exception | None) -> None:
            tracked.discard(self)
            if keepalive is not None:
                keepalive.discard(self)
            super().connection_lost(exc)

    return TrackedConnection


def peer_identity(connection: ServerConnection) -> tuple[str, str]:
    """The host id and certificate serial (hex) of the connection's client certificate (read here,
    so that the handler does not hold the certificate's DER for the connection's life). Raises
    ``GpumarketError`` when there is no usable certificate."""
    ssl_object = connection.transport.get_extra_info("ssl_object")
    der = ssl_object.getpeercert(binary_form=True) if ssl_object else None
    return host_id_from_der(der), serial_hex_from_der(der)
