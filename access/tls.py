"""What TLS costs a relay per connection, what it cuts, and the relay's connection class
(``tracking_connection_class``) that applies it to every connection once its handshake is done.

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
import ssl
import weakref

from websockets.asyncio.server import ServerConnection

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


def no_session_tickets(context: ssl.SSLContext) -> None:
    """Stop a server context from sending TLS 1.3 session tickets."""
    context.num_tickets = 0


def tracking_connection_class(tracked: set[ServerConnection], tls_read_limit: int) -> type[ServerConnection]:
    """A ``ServerConnection`` that is in ``tracked`` from the moment its TLS handshake completes
    until it is lost, so a drain can drop one stuck before or after its websocket handshake
    (websockets' own ``all_connections`` only holds those past it). It reads through its loop's
    shared TLS read buffer and holds at most ``tls_read_limit`` received bytes not yet decrypted."""

    class TrackedConnection(ServerConnection):
        def connection_made(self, transport: asyncio.BaseTransport) -> None:
            super().connection_made(transport)
            share_read_buffer(transport)  # called once the TLS handshake is done
            limit_tls_reads(transport, tls_read_limit)
            tracked.add(self)

        def connection_lost(self, exc: Exception | None) -> None:
            tracked.discard(self)
            super().connection_lost(exc)

    return TrackedConnection
