"""Fail-over on a closed agent link (issue 43): the master's view of each host's link from the relays' link events,
and the sweep that fails a rental over ``failover_after_s`` after its host's link closed and stayed closed, on a
controlled clock. The relay's side is ``tests/test_relay.py::TestLinkEvents``, the whole path ``tests/faults``."""

from __future__ import annotations

from collections.abc import AsyncIterator
from datetime import datetime, timedelta
from pathlib import Path
from typing import Literal

import pytest
from sqlalchemy import select

from billing.rating import RatingPolicy, rate_open_rentals
from master.app import close_master, open_master
from master.background.heartbeats import sweep
from master.background.links import apply_link_events
from master.context import Master
from master.models import Host, HostEvent, Rental
from master.services.accounts.core import Principal
from master.services.rentals import core as rentals
from master.services.rentals import request as rental_request
from master.telemetry.links import apply_link_event
from shared import protocol
from shared.bus import InProcessBus
from shared.errors import ValidationFailed
from tests.factories import create_principal, gpu_info, master_settings, online_host
from tests.helpers import ManualClock
from tests.test_host_liveness import T0, WallClock, heard_at, running_rental, state

World = tuple[Master, ManualClock, WallClock]
DEFAULT_S = 20.0  # MasterSettings.failover_after_s


@pytest.fixture
async def world(tmp_path: Path, database_url: str) -> AsyncIterator[World]:
    """A master on production timing (heartbeats every 10 s, offline after 3 missed, a 120 s grace, failover 20 s)."""
    clock, wall = ManualClock(T0), WallClock(T0)
    master = await open_master(
        master_settings(tmp_path, database_url=database_url, heartbeat_interval=10.0, missed_heartbeats_offline=3,
                        rental_grace_period=120.0, failover_after_s=DEFAULT_S),
        bus=InProcessBus(wall_clock=wall), clock=clock,
    )  # fmt: skip
    try:
        yield master, clock, wall
    finally:
        await close_master(master)


def link(event: Literal["open", "closed"], host_id: str, connection_id: str, at: datetime, *, relay: str = "relay-a",
         draining: bool = False) -> protocol.LinkEvent:  # fmt: skip
    return protocol.LinkEvent(event=event, relay_id=relay, host_id=host_id, connection_id=connection_id, at=at,
                              draining=draining, code=1006 if event == "closed" else None)


async def apply(master: Master, *events: protocol.LinkEvent) -> list[str | None]:
    changes = []
    for event in events:
        async with master.db.session() as session:
            changes.append(await apply_link_event(session, event, failover_after_s=DEFAULT_S))
    return changes


async def host_row(master: Master, host_id: str) -> Host:
    async with master.db.session() as session:
        host = await session.get(Host, host_id)
    assert host is not None
    return host


async def rental_row(master: Master, rental_id: str) -> Rental:
    async with master.db.session() as session:
        rental = await session.get(Rental, rental_id)
    assert rental is not None
    return rental


async def causes(master: Master, rental_id: str) -> list[str]:
    async with master.db.session() as session:
        return [e.cause for e in await rentals.rental_events(session, rental_id)]


async def rent(master: Master, renter: Principal, **fields: object) -> Rental:
    request = rental_request.RentalRequest(gpu_count=1, workload={"kind": "hold"}, **fields)  # type: ignore[arg-type]
    rental, _ = await rentals.create_rental(master, renter, request, idempotency_key=None)
    return rental


class TestLinkState:
    async def test_the_close_of_the_current_link_marks_the_host_down_and_tells_its_renters(self, world: World) -> None:
        master, clock, _ = world
        provider, _ = await create_principal(master, "p", "provider")
        host_id, rental = await running_rental(master, provider, clock)
        opened = clock.now()
        assert await apply(master, link("open", host_id, "c1", opened)) == [None]  # up, as it was
        clock.advance(5)
        assert await apply(master, link("closed", host_id, "c1", clock.now())) == ["down"]
        host = await host_row(master, host_id)
        assert (host.link_connection_id, host.link_opened_at, host.link_down_since) == ("c1", opened, clock.now())
        told = [c for c in await causes(master, rental.id) if c.startswith("host's agent link closed")]
        assert len(told) == 1 and "relay-a" in told[0] and "fails as host lost" in told[0], told

    async def test_the_late_close_of_an_old_link_after_a_reconnect_elsewhere_changes_nothing(self, world: World) -> None:
        """Relay B's open arrives before relay A's close of the link the agent left: the host's link stays up."""
        master, clock, _ = world
        provider, _ = await create_principal(master, "p", "provider")
        host_id, rental = await running_rental(master, provider, clock)
        t = clock.now()
        changes = await apply(master, link("open", host_id, "a1", t), link("open", host_id, "b1", t + timedelta(seconds=2), relay="relay-b"),
                              link("closed", host_id, "a1", t + timedelta(seconds=3)))  # fmt: skip
        assert changes == [None, None, None]
        host = await host_row(master, host_id)
        assert (host.link_connection_id, host.link_down_since) == ("b1", None)
        assert not [c for c in await causes(master, rental.id) if "agent link" in c]

    async def test_a_close_then_a_reconnect_elsewhere_brings_the_link_back(self, world: World) -> None:
        master, clock, _ = world
        provider, _ = await create_principal(master, "p", "provider")
        host_id, rental = await running_rental(master, provider, clock)
        t = clock.now()
        changes = await apply(master, link("open", host_id, "a1", t), link("closed", host_id, "a1", t + timedelta(seconds=1)),
                              link("open", host_id, "b1", t + timedelta(seconds=4), relay="relay-b"))  # fmt: skip
        assert changes == [None, "down", "up"]
        host = await host_row(master, host_id)
        assert (host.link_connection_id, host.link_down_since) == ("b1", None)
        back = [c for c in await causes(master, rental.id) if c.startswith("host's agent link back")]
        assert len(back) == 1 and "relay-b after 3.0s" in back[0], back

    async def test_redelivered_and_stale_events_change_nothing(self, world: World) -> None:
        """At-least-once delivery: a repeated open or close, or an open older than the current link's, is a no-op."""
        master, clock, _ = world
        provider, _ = await create_principal(master, "p", "provider")
        host_id = await online_host(master, provider, [gpu_info(0)])
        t = clock.now()
        opened, closed = link("open", host_id, "a1", t), link("closed", host_id, "a1", t + timedelta(seconds=1))
        assert await apply(master, opened, closed, opened, closed) == [None, "down", None, None]
        assert await apply(master, link("open", host_id, "z0", t - timedelta(seconds=30), relay="relay-z")) == [None]
        host = await host_row(master, host_id)
        assert (host.link_connection_id, host.link_down_since) == ("a1", t + timedelta(seconds=1))

    async def test_a_close_with_no_open_seen_counts_for_the_relay_the_host_was_last_heard_through(self, world: World) -> None:
        """Links opened before the relays reported them: the close from the host's relay counts, another relay's not."""
        master, clock, _ = world
        provider, _ = await create_principal(master, "p", "provider")
        host_id = await online_host(master, provider, [gpu_info(0)])  # its hello came via relay-t
        assert await apply(master, link("closed", host_id, "x1", clock.now(), relay="relay-other")) == [None]
        assert await apply(master, link("closed", host_id, "t1", clock.now(), relay="relay-t")) == ["down"]


class TestFailover:
    async def test_a_rental_fails_over_failover_after_s_after_the_link_closed_and_is_placed_again(self, world: World) -> None:
        """Default settings: at 19.9 s nothing; at 20 s the rental fails as host lost (billing stops at the last time the
        host was heard), its host goes offline, and the rental that asked for it runs again on another host."""
        master, clock, _ = world
        provider, _ = await create_principal(master, "p", "provider")
        host_id = await online_host(master, provider, [gpu_info(0)])
        spare = await online_host(master, provider, [gpu_info(0)])
        renter, _ = await create_principal(master, "renter", "renter")
        await heard_at(master, spare, 1, clock.now())
        rental = await rent(master, renter, offer_id=f"{host_id}:NVIDIA GeForce RTX 4090", restart_on_failure=True)
        assert rental.host_id == host_id
        await apply(master, link("open", host_id, "c1", clock.now()))
        await heard_at(master, host_id, 1, clock.now())
        last_heard = clock.now()
        clock.advance(2)
        closed_at = clock.now()
        await apply(master, link("closed", host_id, "c1", closed_at))
        clock.advance(DEFAULT_S - 0.1)
        await heard_at(master, spare, 2, clock.now())
        assert await sweep(master) == ([], [])
        clock.advance(0.1)
        gone, lost = await sweep(master)
        assert (gone, lost) == ([host_id], [rental.id])
        failed = await rental_row(master, rental.id)
        assert failed.state == "failed" and failed.failure_code == "host_lost" and failed.failure_owner == "provider"
        assert failed.host_lost_at == failed.stopped_at == last_heard
        assert failed.failure_reason is not None and "agent link closed" in failed.failure_reason
        assert await state(master, host_id) == "offline"
        async with master.db.session() as session:
            again = (await session.scalars(select(Rental).where(Rental.replaces_id == rental.id))).all()
        assert len(again) == 1 and again[0].host_id == spare and again[0].state == "starting"
        assert any(c.startswith(f"placed again as rental {again[0].id}") for c in await causes(master, rental.id))
        assert await sweep(master) == ([], [])  # once

    async def test_a_link_back_within_the_failover_time_changes_nothing_and_leaves_no_charge_gap(self, world: World) -> None:
        """The agent reconnects through another relay 8 s after its link closed: nothing fails, the host never goes
        offline, and every second is charged."""
        master, clock, _ = world
        provider, _ = await create_principal(master, "p", "provider")
        host_id, rental = await running_rental(master, provider, clock)
        await apply(master, link("open", host_id, "a1", clock.now()))
        clock.advance(3)
        await apply(master, link("closed", host_id, "a1", clock.now(), draining=True))
        clock.advance(8)
        await apply(master, link("open", host_id, "b1", clock.now(), relay="relay-b"))
        seq = 3
        for _ in range(6):
            await heard_at(master, host_id, seq, clock.now(), running=[rental.id])
            assert await sweep(master) == ([], [])
            clock.advance(10)
            seq += 1
        assert (await rental_row(master, rental.id)).state == "running"
        async with master.db.session() as session:
            offline = (await session.scalars(select(HostEvent).where(HostEvent.host_id == host_id, HostEvent.to_state == "offline"))).all()
        assert offline == []
        await rate_open_rentals(master.db, now=clock.now(), policy=RatingPolicy(min_period_s=0))
        row = await rental_row(master, rental.id)
        assert row.started_at is not None and row.rated_until is not None
        assert row.billed_seconds == int((row.rated_until - row.started_at).total_seconds())

    async def test_a_rental_that_asked_for_longer_waits_longer(self, world: World) -> None:
        """On one host, a rental with the default fails at 20 s; one with failover_after_s 90 runs on (its host offline,
        its meter paused) and fails at 90 s, before the heartbeat backstop's grace would have ended it."""
        master, clock, _ = world
        provider, _ = await create_principal(master, "p", "provider")
        host_id = await online_host(master, provider, [gpu_info(0), gpu_info(1)])
        renter, _ = await create_principal(master, "renter", "renter")
        short = await rent(master, renter)
        long = await rent(master, renter, failover_after_s=90)
        assert short.host_id == long.host_id == host_id
        await heard_at(master, host_id, 1, clock.now())
        await apply(master, link("closed", host_id, "t1", clock.now(), relay="relay-t"))
        clock.advance(DEFAULT_S)
        assert (await sweep(master))[1] == [short.id]
        clock.advance(89 - DEFAULT_S)
        assert (await sweep(master))[1] == []
        assert (await rental_row(master, long.id)).state in ("starting", "pending", "running")
        clock.advance(1)
        assert (await sweep(master))[1] == [long.id]

    async def test_a_link_closed_before_the_monitor_started_counts_from_its_start(self, world: World) -> None:
        """Regression: after `gpumarket up` was stopped for a while (its relay's closes applied), a restarted master
        failed every rental at its first sweep, before the agents could reconnect."""
        master, clock, _ = world
        provider, _ = await create_principal(master, "p", "provider")
        host_id, rental = await running_rental(master, provider, clock)
        await apply(master, link("closed", host_id, "t1", clock.now(), relay="relay-t", draining=True))
        clock.advance(3600)
        started = clock.now()
        assert (await sweep(master, watching_since=started))[1] == []
        clock.advance(DEFAULT_S - 1)
        assert (await sweep(master, watching_since=started))[1] == []
        clock.advance(1)
        assert (await sweep(master, watching_since=started))[1] == [rental.id]

    async def test_a_host_heard_after_its_link_closed_is_not_failed_over(self, world: World) -> None:
        """A message from the host after the close (its reconnect's open still on the way) says it is not lost."""
        master, clock, _ = world
        provider, _ = await create_principal(master, "p", "provider")
        host_id, rental = await running_rental(master, provider, clock)
        await apply(master, link("open", host_id, "a1", clock.now()))
        clock.advance(1)
        await apply(master, link("closed", host_id, "a1", clock.now()))
        clock.advance(5)
        await heard_at(master, host_id, 3, clock.now(), running=[rental.id])
        clock.advance(DEFAULT_S)
        await heard_at(master, host_id, 4, clock.now(), running=[rental.id])
        assert await sweep(master) == ([], [])
        assert (await rental_row(master, rental.id)).state == "running"

    async def test_link_events_are_judged_as_of_what_has_been_applied(self, world: World) -> None:
        """An open on the bus that no master has applied yet holds the fail-over back (as ingestion lag does silence)."""
        master, clock, wall = world
        provider, _ = await create_principal(master, "p", "provider")
        host_id, rental = await running_rental(master, provider, clock)
        await master.bus.ensure_group(protocol.AGENT_LINKS_STREAM, protocol.INGEST_GROUP)
        await apply(master, link("closed", host_id, "t1", clock.now(), relay="relay-t"))
        clock.advance(8)
        wall.at = clock.now().timestamp()
        await master.bus.publish(protocol.AGENT_LINKS_STREAM,
                                 protocol.encode_link_event(link("open", host_id, "b1", clock.now(), relay="relay-b")))
        clock.advance(DEFAULT_S)
        assert await sweep(master) == ([], [])
        batch = await master.bus.read(protocol.AGENT_LINKS_STREAM, protocol.INGEST_GROUP, "t", block=None)
        await apply_link_events(master, batch)
        assert (await host_row(master, host_id)).link_down_since is None
        await heard_at(master, host_id, 3, clock.now(), running=[rental.id])
        assert await sweep(master) == ([], [])
        assert (await rental_row(master, rental.id)).state == "running"


class TestRequest:
    @pytest.mark.parametrize("seconds", [9, 0, -1, 86401])
    def test_a_failover_time_outside_10_s_to_a_day_is_refused(self, seconds: int) -> None:
        with pytest.raises(ValidationFailed) as refused:
            rental_request.RentalRequest(failover_after_s=seconds).check(max_queue_timeout_s=600)
        assert refused.value.code == "invalid_failover_after"

    def test_the_failover_time_is_part_of_the_request(self) -> None:
        """Two requests differing only in failover_after_s are not the same request (an Idempotency-Key reuse is caught)."""
        plain = rental_request.RentalRequest()
        assert plain.fingerprint() != rental_request.RentalRequest(failover_after_s=60).fingerprint()
        assert rental_request.RentalRequest(failover_after_s=10).check(max_queue_timeout_s=600).failover_after_s == 10
