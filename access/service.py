"""``gpumarket access``: one relay process against the Redis bus and the Redis relay registry."""

from __future__ import annotations

import asyncio
import logging

from access.relay import Relay
from shared.bus import Bus, open_bus
from shared.crypto import ca_public_key, server_ssl_context, web_ssl_context
from shared.errors import ConfigError
from shared.registry import Registry, open_registry
from shared.settings import AccessSettings

log = logging.getLogger(__name__)


def relay_from_settings(settings: AccessSettings, bus: Bus, registry: Registry | None = None) -> Relay:
    missing = [n for n in ("cert_file", "key_file", "ca_file") if getattr(settings, n) is None]
    if missing:
        names = ", ".join(f"GPUMARKET_{n.upper()}" for n in missing)
        raise ConfigError(f"the relay needs its TLS files: set {names} (issue them with `gpumarket admin issue-relay-cert`)")
    assert settings.cert_file and settings.key_file and settings.ca_file
    for path in (settings.cert_file, settings.key_file, settings.ca_file):
        if not path.exists():
            raise ConfigError(f"{path} does not exist; issue relay files with `gpumarket admin issue-relay-cert`")
    return Relay(
        relay_id=settings.relay_id,
        region=settings.region,
        bus=bus,
        registry=registry,
        # Agents must present a client certificate (checked per connection); renters connect without one.
        ssl_context=server_ssl_context(settings.cert_file, settings.key_file, settings.ca_file, require_client_cert=False),
        host=settings.host,
        port=settings.port,
        public_url=settings.public_url,
        public_host=settings.public_host,
        public_port=settings.public_port,
        heartbeat_interval=settings.heartbeat_interval,
        telemetry_interval=settings.telemetry_interval,
        open_timeout=settings.open_timeout,
        ping_interval=settings.ping_interval,
        ping_timeout=settings.ping_timeout,
        close_timeout=settings.close_timeout,
        drain_timeout=settings.drain_timeout,
        register_interval=settings.register_interval,
        revocation_poll_interval=settings.revocation_poll_interval,
        registry_timeout=settings.registry_timeout,
        link_event_timeout=settings.link_event_timeout,
        max_frame=settings.max_frame,
        max_outbound_queue=settings.max_outbound_queue,
        max_connections=settings.max_connections,
        max_messages_per_second=settings.max_messages_per_second,
        message_burst=settings.message_burst,
        max_connections_per_source_per_minute=settings.max_connections_per_source_per_minute,
        connection_burst_per_source=settings.connection_burst_per_source,
        max_tracked_sources=settings.max_tracked_sources,
        max_queue=settings.max_incoming_frames,
        write_limit=settings.write_limit_kib << 10,
        tls_read_limit=settings.tls_read_limit_kib << 10,
        token_key=ca_public_key(settings.ca_file),
        max_streams_per_agent=settings.max_streams_per_agent,
        max_streams_per_rental=settings.max_streams_per_rental,
        max_stream_buffer_per_agent=settings.max_stream_buffer_per_agent_mib << 20,
        stream_window=settings.stream_window_kib << 10,
        ports_domain=settings.ports_domain,
        ports_ssl_context=web_ssl_context(settings.cert_file, settings.key_file) if settings.ports_domain else None,
        ports_port=settings.ports_port,
        ports_public_port=settings.ports_public_port,
    )


def set_tls_read_buffer(kib: int) -> bool:
    """Size asyncio's TLS read buffer (the most one socket read takes) for this process; returns
    whether it could.

    CPython allocates ``SSLProtocol.max_size`` (256 KiB) per TLS connection up front; the relay
    shares one among its established connections (``access.tls``), so this now bounds what a
    handshake in progress holds and how much one read takes. It is an internal of asyncio, so it
    is set only where it exists, and process-wide.
    """
    import asyncio.sslproto

    if not isinstance(getattr(asyncio.sslproto.SSLProtocol, "max_size", None), int):
        log.warning("this Python's asyncio has no SSLProtocol.max_size; TLS read buffers keep their default size")
        return False
    asyncio.sslproto.SSLProtocol.max_size = kib * 1024
    return True


async def serve_access(settings: AccessSettings, *, stop: asyncio.Event) -> None:
    """Serve until ``stop`` is set (SIGTERM/SIGINT in the CLI), then drain: ``Relay.close`` takes at
    most about ``drain_timeout`` + 2 × ``registry_timeout`` seconds, however many agents are connected."""
    if settings.redis_url is None:
        raise ConfigError("a standalone relay needs the bus: set GPUMARKET_REDIS_URL")
    set_tls_read_buffer(settings.tls_read_buffer_kib)
    bus = await open_bus(settings.redis_url, prefix=settings.bus_prefix)
    try:
        registry = await open_registry(settings.redis_url, prefix=settings.bus_prefix)
        try:
            relay = relay_from_settings(settings, bus, registry)
            await relay.start()
            print(f"relay {settings.relay_id} listening on {relay.url} (published as {relay.public_url})", flush=True)
            try:
                await stop.wait()
            finally:
                await relay.close()
        finally:
            await registry.close()
    finally:
        await bus.close()
