"""``shared.cancelling``: a stop that ``asyncio.wait_for`` lost (Python 3.11) is raised again.

The first test pins the loss itself where this Python has it, so the guard's reason stays true; the others show the
guard: the task ends cancelled however ``wait_for`` behaves.
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
import sys
from collections.abc import Callable, Coroutine

import dns.message
import dns.rcode
import pytest

from access.geodns.server import GeoDnsServer
from access.registration import RegistryLink
from access.relay import Relay
from agent.discovery import resolve_relays
from shared.bus import BusMessage, InProcessBus
from shared.cancelling import raise_if_cancelled
from shared.registry import MemoryRegistry, RelayRecord


async def _cancel_as_it_completes(body: Callable[[asyncio.Queue[int]], Coroutine[None, None, str]]) -> asyncio.Task[str]:
    """Run ``body(queue)``; put an item in its queue and, in the same loop pass that releases its ``wait_for``, cancel it."""
    queue: asyncio.Queue[int] = asyncio.Queue()
    task = asyncio.create_task(body(queue))
    await asyncio.sleep(0.01)  # waiting in wait_for
    queue.put_nowait(1)  # the inner get finishes...
    await asyncio.sleep(0)  # ...its task runs; wait_for's waiter is released, the outer task not yet woken
    task.cancel()  # the stop lands in that same pass
    return task


@pytest.mark.skipif(sys.version_info >= (3, 12), reason="Python 3.12's wait_for no longer loses a cancel")
async def test_python_3_11_wait_for_loses_a_cancel_that_lands_as_it_completes() -> None:
    async def unguarded(queue: asyncio.Queue[int]) -> str:
        await asyncio.wait_for(queue.get(), 5)
        assert asyncio.current_task().cancelling() == 1  # type: ignore[union-attr]  # asked, and never told
        return "ran on"

    task = await _cancel_as_it_completes(unguarded)
    assert await task == "ran on"


async def test_the_guard_raises_the_lost_cancel_again() -> None:
    async def guarded(queue: asyncio.Queue[int]) -> str:
        await asyncio.wait_for(queue.get(), 5)
        raise_if_cancelled()
        return "ran on"

    task = await _cancel_as_it_completes(guarded)
    with pytest.raises(asyncio.CancelledError):
        await task
    assert task.cancelled()


async def test_the_guard_says_nothing_when_no_cancel_is_pending() -> None:
    raise_if_cancelled()

    async def handled() -> str:
        try:
            await asyncio.sleep(10)
        except asyncio.CancelledError:
            asyncio.current_task().uncancel()  # type: ignore[union-attr]  # handled on purpose, and said so
        raise_if_cancelled()
        return "handled"

    task = asyncio.create_task(handled())
    await asyncio.sleep(0)
    task.cancel()
    assert await task == "handled"


@pytest.mark.parametrize("passes", range(8))
async def test_a_relay_lookup_that_answers_as_the_agent_stops_still_stops_it(passes: int) -> None:
    """The agent's DNS lookup of its relays (dnspython, over ``wait_for``) with a cancel that lands ``passes`` loop
    passes after its answer was sent: ``resolve_relays`` ends cancelled whichever pass it is. One of them is the pass
    in which dnspython's inner wait has finished and ``wait_for`` not yet returned: without the guard, the lookup
    there goes on to its next query. The answers come from a UDP server of the test's own."""
    loop = asyncio.get_running_loop()
    queries: asyncio.Queue[tuple[bytes, tuple[str, int]]] = asyncio.Queue()

    class Server(asyncio.DatagramProtocol):
        def datagram_received(self, data: bytes, addr: tuple[str, int]) -> None:
            queries.put_nowait((data, addr))

    transport, _ = await loop.create_datagram_endpoint(Server, local_addr=("127.0.0.1", 0))
    port = transport.get_extra_info("sockname")[1]
    try:
        lookup = asyncio.create_task(resolve_relays("relays.example", resolver="127.0.0.1", resolver_port=port, timeout=5.0))
        data, addr = await queries.get()
        reply = dns.message.make_response(dns.message.from_wire(data))
        reply.set_rcode(dns.rcode.NXDOMAIN)  # no SRV: the lookup would go on to ask for A and AAAA
        transport.sendto(reply.to_wire(), addr)
        for _ in range(passes):
            await asyncio.sleep(0)
        lookup.cancel()
        with pytest.raises(asyncio.CancelledError):
            await lookup
    finally:
        transport.close()


class _WaitForBus(InProcessBus):
    """A bus whose reads wait as redis-py's writes do (``asyncio.wait_for``), on a queue the test fills."""

    def __init__(self) -> None:
        super().__init__()
        self.answers: asyncio.Queue[int] = asyncio.Queue()

    async def claim_stale(self, stream: str, group: str, consumer: str, *, min_idle: float, count: int = 100) -> list[BusMessage]:
        return []

    async def read(self, stream: str, group: str, consumer: str, *, count: int = 100, block: float | None = 1.0) -> list[BusMessage]:
        await asyncio.wait_for(self.answers.get(), 60)
        return []


async def _cancelled_as_answered(task: asyncio.Task[None], answers: asyncio.Queue[int]) -> bool:
    """Whether ``task``, waiting on ``answers`` under ``wait_for``, ends cancelled when a cancel lands in the same loop
    pass as its answer."""
    await asyncio.sleep(0.05)  # waiting in its call
    answers.put_nowait(1)
    await asyncio.sleep(0)
    task.cancel()
    try:
        return await _stopped(task) and task.cancelled()
    finally:
        task.cancel()


async def _stopped(task: asyncio.Task[None]) -> bool:
    """Whether ``task`` ends within 5 s of a cancel landing as its ``wait_for`` completes (``_cancel_as_it_completes``)."""
    with contextlib.suppress(TimeoutError, asyncio.CancelledError):
        async with asyncio.timeout(5):
            await asyncio.shield(task)
    return task.done()


async def test_a_relays_command_consumer_stops_when_its_read_answers_as_the_relay_closes() -> None:
    """A relay's close stops its command consumer; a cancel that redis-py's ``wait_for`` lost made the consumer read on
    and the close wait until SIGKILL (tests/test_cluster.py, once under load)."""
    bus = _WaitForBus()
    relay = Relay(relay_id="relay-t", bus=bus, ssl_context=ssl.create_default_context(ssl.Purpose.CLIENT_AUTH))
    consumer = asyncio.create_task(relay._consume_commands())
    assert await _cancelled_as_answered(consumer, bus.answers)


class _WaitForRegistry(MemoryRegistry):
    """A registry whose every call waits as redis-py's writes do, on a queue the test fills."""

    def __init__(self) -> None:
        super().__init__()
        self.answers: asyncio.Queue[int] = asyncio.Queue()

    async def put_relay(self, record: RelayRecord, *, ttl: float) -> None:
        await asyncio.wait_for(self.answers.get(), 60)

    async def revoked(self) -> frozenset[str]:
        await asyncio.wait_for(self.answers.get(), 60)
        return frozenset()

    async def relays(self) -> list[RelayRecord]:
        await asyncio.wait_for(self.answers.get(), 60)
        return []


@pytest.mark.parametrize("loop", ["_register", "_poll_revocations"])
async def test_a_relays_registry_loops_stop_when_a_call_answers_as_they_are_cancelled(loop: str) -> None:
    registry = _WaitForRegistry()
    link = RegistryLink(registry, relay_id="relay-t", record=lambda: RelayRecord("relay-t", "r", "wss://x", "x", 1, 0, 1, False, 0.0),
                        on_revoked=lambda _: None, register_interval=0.001, revocation_poll_interval=0.001, timeout=60)  # fmt: skip
    task = asyncio.create_task(getattr(link, loop)())
    assert await _cancelled_as_answered(task, registry.answers)


async def test_the_geo_dns_refresh_loop_stops_when_its_read_answers_as_it_is_cancelled() -> None:
    """The geo DNS's close stops its refresh loop; a cancel that redis-py's ``wait_for`` lost made the loop sleep and read
    on, so ``close`` (and ``gpumarket dns`` on SIGTERM) waited forever (tests/test_cluster.py, under load)."""
    registry = _WaitForRegistry()
    server = GeoDnsServer(registry, zone="relays.test", refresh_interval=0.001)
    task = asyncio.create_task(server._refresh_forever())
    assert await _cancelled_as_answered(task, registry.answers)
