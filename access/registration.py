"""A relay's side of the relay registry (``shared.registry``): its record, kept fresh, and the
revoked certificates, read again and again.

Registration: the relay's ``RelayRecord`` (public URL, load, capacity, draining) is published
every ``register_interval`` seconds with a TTL of three intervals, so a relay that dies
disappears on its own. Revocation: ``registry.revoked()`` is read every
``revocation_poll_interval`` seconds and handed to the relay, which closes what it names. A
registry that fails is logged and retried; the last revoked list read is kept. Every call is
bounded by ``timeout``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable

from shared.cancelling import raise_if_cancelled
from shared.errors import GpumarketError
from shared.registry import Registry, RelayRecord

log = logging.getLogger(__name__)

# Registry records expire after this many missed refreshes.
REGISTRY_TTL_INTERVALS = 3


class RegistryLink:
    """Publishes ``record()`` and feeds ``on_revoked`` the revoked serials, from ``start`` to ``stop``."""

    def __init__(
        self,
        registry: Registry,
        *,
        relay_id: str,
        record: Callable[[], RelayRecord],
        on_revoked: Callable[[frozenset[str]], None],
        register_interval: float,
        revocation_poll_interval: float,
        timeout: float,
    ) -> None:
        self.registry = registry
        self.relay_id = relay_id
        self._record = record
        self._on_revoked = on_revoked
        self.register_interval = register_interval
        self.revocation_poll_interval = revocation_poll_interval
        self.timeout = timeout
        self.revoked: frozenset[str] = frozenset()  # the last list read
        self._registrar: asyncio.Task[None] | None = None
        self._poller: asyncio.Task[None] | None = None

    async def start(self) -> None:
        """Publish the record once (a failure is logged), then refresh it and poll revocations."""
        await self.publish()
        self._registrar = asyncio.create_task(self._register(), name=f"relay-{self.relay_id}-register")
        self._poller = asyncio.create_task(self._poll_revocations(), name=f"relay-{self.relay_id}-revocations")

    async def stop_refreshing(self) -> None:
        """No periodic refresh from now on (a draining record must not be overwritten)."""
        await stop_task(self._registrar)

    async def stop(self) -> None:
        """Stop both tasks, then remove the record (bounded; it expires on its own otherwise)."""
        await stop_task(self._registrar)
        await stop_task(self._poller)
        try:
            async with asyncio.timeout(self.timeout):
                await self.registry.remove_relay(self.relay_id)
        except (GpumarketError, OSError, TimeoutError) as exc:
            log.warning("relay %s: cannot remove its registry record (%s); it expires on its own", self.relay_id, exc)

    async def is_revoked(self, serial: str) -> bool:
        """Ask the registry, falling back on the last list read when it does not answer."""
        if serial in self.revoked:
            return True
        try:
            async with asyncio.timeout(self.timeout):
                return await self.registry.is_revoked(serial)
        except (GpumarketError, OSError, TimeoutError) as exc:
            log.warning("cannot ask the registry whether %s is revoked (%s); using the last list read", serial, exc)
            return False

    async def publish(self) -> None:
        """Publish the record once; a failure is logged (the record expires on its own)."""
        try:
            async with asyncio.timeout(self.timeout):
                await self.registry.put_relay(self._record(), ttl=REGISTRY_TTL_INTERVALS * self.register_interval)
        except (GpumarketError, OSError, TimeoutError) as exc:
            log.warning("relay %s: cannot publish its registry record (%s); retrying", self.relay_id, exc)
        except Exception:
            log.exception("relay %s: publishing its registry record failed unexpectedly; retrying", self.relay_id)

    async def _register(self) -> None:
        """Refresh the record every ``register_interval``, forever. Cancelling is safe."""
        while True:
            await asyncio.sleep(self.register_interval)
            await self.publish()
            raise_if_cancelled()  # redis-py writes with asyncio.wait_for, which can lose a cancel (shared.cancelling)

    async def _poll_revocations(self) -> None:
        """Read the revoked serials and hand them on, forever. Cancelling is safe."""
        while True:
            try:
                async with asyncio.timeout(self.timeout):
                    revoked = await self.registry.revoked()
            except (GpumarketError, OSError, TimeoutError) as exc:
                log.warning("cannot read revoked certificates (%s); keeping the last %d, retrying", exc, len(self.revoked))
            except Exception:
                log.exception("reading revoked certificates failed unexpectedly; retrying")
            else:
                self.revoked = revoked
                if revoked:
                    self._on_revoked(revoked)
            raise_if_cancelled()  # as in _register
            await asyncio.sleep(self.revocation_poll_interval)


async def stop_task(task: asyncio.Task[None] | None) -> None:
    """Cancel ``task`` (if any) and wait until it has stopped."""
    if task is None:
        return
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
