"""An agent's network under fault, on the link between it and its relay (a proxy; ``tc netem`` is not
available here): lost for a while within the rental grace period, lost past it, and slow and lossy.

The network is cut at the proxy (a black hole: nothing goes through, the sockets stay open), not by
stopping the agent (SIGSTOP): a host that loses its network keeps running its workload, sampling and
spooling, and its spool is replayed when the network comes back; a stopped agent would do none of that.

**Timing.** Production: heartbeats every 10 s, a host offline after 3 missed (30 s); a link the relay's
keepalive gives up on (a ping every 10 s, 10 s for its pong) is closed, and the rentals of a host whose link
stays closed fail over after ``failover_after_s`` 20 s; the heartbeat backstop fails those of a host silent
but still linked after ``rental_grace_period`` 120 s more. Here: heartbeats every 1 s (offline after 3 s), the
link's defaults unchanged, a backstop grace of 60 s. The short outage is 5 s: no pong waits long enough
for the keepalive to give up, but it is longer than the offline threshold, so the host does go offline and
comes back (the harder case: production's heartbeats would not even notice). The long one is 50 s: the
keepalive closes the link within 22 s, the rental fails over 20 s later; it ends by resetting the
connections, as a 5-minute outage ends once pings have given up on both sides.
"""

from __future__ import annotations

import asyncio
import time
from datetime import datetime, timedelta
from typing import Any

import pytest
from sqlalchemy import select, text

from billing.rating import offline_intervals, served_seconds
from master.models import Command, Rental
from tests.faults.harness import GRACE_S, OFFLINE_AFTER_S, Scenario, agent_log

pytestmark = [pytest.mark.slow, pytest.mark.postgres, pytest.mark.redis]

SHORT_OUTAGE_S = 5.0
LONG_OUTAGE_S = 50.0
SLOP_S = 2.0  # the relay stamps what it receives; a frame already past the proxy when it closed is heard a moment later


async def rental_row(scenario: Scenario, rental_id: str) -> Rental:
    async with scenario.cluster.database() as db, db.session() as session:
        rental = await session.get(Rental, rental_id)
        assert rental is not None
        return rental


async def host_changes(scenario: Scenario, host_id: str, since: datetime) -> list[tuple[datetime, str]]:
    async with scenario.cluster.database() as db, db.session() as session:
        rows = (await session.execute(
            text("SELECT at, to_state FROM host_events WHERE host_id = :h AND at >= :since ORDER BY at, id"),
            {"h": host_id, "since": since},
        )).all()  # fmt: skip
    return [(at, state) for at, state in rows]


async def billed_as_rated(scenario: Scenario, rental: Rental) -> int:
    """The seconds rating owes for ``rental`` up to its ``rated_until``: served time less the host's offline intervals."""
    assert rental.started_at is not None and rental.rated_until is not None and rental.host_id is not None
    async with scenario.cluster.database() as db, db.session() as session:
        offline = await offline_intervals(session, rental.host_id, rental.started_at, rental.rated_until)
    return served_seconds(rental.started_at, rental.rated_until, offline)


class TestAgentNetwork:
    @pytest.mark.scenario("agent_outage_within_grace", "an agent loses its network for 5 s, within the link's fail-over time")
    @pytest.mark.timeout(120, func_only=True)
    async def test_a_rental_survives_an_outage_within_the_grace_period_and_is_billed_once(self, scenario: Scenario) -> None:
        """The link of the host running a rental is black-holed for 5 s: the host goes offline (1 s heartbeats) and comes
        back, its link never declared closed, the rental never stops running, the offline seconds are not billed, nothing is billed
        twice, and the telemetry spooled during the outage is stored exactly once with no gap."""
        bench, report = scenario.bench, scenario.report
        assert bench.agent_link is not None
        host_id = bench.host_of(bench.link_agent)
        status, rental = await scenario.rent(offer_id=await scenario.offer(host_id))
        assert status == 201, rental
        await scenario.wait_rental(rental["id"], "running")
        await scenario.wait_charged(rental["id"])

        bench.agent_link.black_hole()
        cut = report.inject(f"black hole on {bench.link_agent}'s link to its relay", seconds=SHORT_OUTAGE_S,
                            grace_period_s=GRACE_S, offline_after_s=OFFLINE_AFTER_S, rental=rental["id"])  # fmt: skip
        await asyncio.sleep(SHORT_OUTAGE_S)
        bench.agent_link.heal()
        healed = report.inject("network back (held frames delivered, connection kept)")

        async def rented_again() -> bool:
            return bool((await scenario.host(host_id))["state"] == "rented")

        await scenario.until(rented_again, "the host rented again", timeout=30)
        await scenario.wait_charged(rental["id"], after=healed + timedelta(seconds=1))
        changes = await host_changes(scenario, host_id, cut - timedelta(seconds=1))
        view = await scenario.rental(rental["id"])
        assert view["state"] == "running", view
        row = await rental_row(scenario, rental["id"])
        expected = await billed_as_rated(scenario, row)
        assert row.billed_seconds == expected, (row.billed_seconds, expected)
        offline_s = sum(((b - a).total_seconds() for a, b in _offline_spans(changes)), 0.0)
        report.verify("rental", {"state": view["state"], "host_state_changes": [s for _, s in changes],
                                 "host_went_offline": any(s == "offline" for _, s in changes),
                                 "offline_s_not_billed": round(offline_s, 2), "billed_seconds": row.billed_seconds,
                                 "billed_seconds_expected": expected})  # fmt: skip
        if not any(s == "offline" for _, s in changes):
            report.note("the host was not marked offline during the outage (the monitor did not see 3 s of silence)")
        await scenario.invariants(covered_after=healed, hosts=[host_id])
        await scenario.stop_all_rentals()

    @pytest.mark.scenario("agent_outage_past_grace", "an agent loses its network for 50 s (scaled 5 minutes), past the link's fail-over")
    @pytest.mark.timeout(200, func_only=True)
    async def test_past_the_grace_period_the_rental_fails_over_and_billing_stops_when_the_host_was_lost(self, scenario: Scenario) -> None:
        """The link of the host running a rental (restart_on_failure) is black-holed for 50 s: the relay's keepalive
        closes the link, and failover_after_s later the rental fails as host lost with host_lost_at = the last time
        the host was heard (before the cut), billing ends exactly there
        (the rental's billed seconds and usage postings stop at host_lost_at, later passes add nothing), the rental is
        placed again on another host, and when the network returns the agent is told to stop the stray workload."""
        bench, report = scenario.bench, scenario.report
        assert bench.agent_link is not None
        host_id = bench.host_of(bench.link_agent)
        running = await scenario.rent_running_on(host_id, rated_after_s=3)
        rental_id = running["id"]

        bench.agent_link.black_hole()
        cut = report.inject(f"black hole on {bench.link_agent}'s link to its relay", seconds=LONG_OUTAGE_S,
                            grace_period_s=GRACE_S, offline_after_s=OFFLINE_AFTER_S, failover_after_s=20.0, rental=rental_id)  # fmt: skip
        began = time.monotonic()
        failed = await scenario.wait_rental(rental_id, "failed", timeout=60)
        failed_after = round(time.monotonic() - began, 1)
        await asyncio.sleep(max(0.0, LONG_OUTAGE_S - (time.monotonic() - began)))
        reset = bench.agent_link.cut()
        bench.agent_link.heal()
        healed = report.inject("network back; the connections of the outage reset", connections_reset=reset)

        lost_at = datetime.fromisoformat(failed["host_lost_at"])
        assert lost_at <= cut + timedelta(seconds=SLOP_S), (lost_at, cut)
        assert failed["stopped_at"] == failed["host_lost_at"], failed
        assert "agent link closed" in (failed["failure_reason"] or ""), failed  # the link failed it over, not the backstop
        report.verify("failed_as_host_lost", {"failed_after_s": failed_after, "host_lost_at": failed["host_lost_at"],
                                              "network_cut_at": cut.isoformat(timespec="milliseconds"),
                                              "last_heard_before_cut_s": round((cut - lost_at).total_seconds(), 2),
                                              "reason": failed["failure_reason"]})  # fmt: skip

        async def rated_to_the_end() -> Rental | None:
            row = await rental_row(scenario, rental_id)
            return row if row.rated_until == row.host_lost_at else None

        row = await scenario.until(rated_to_the_end, "the rental rated up to host_lost_at", timeout=30)
        postings_then = await _postings(scenario, rental_id)
        await asyncio.sleep(3 * scenario.cluster.billing_interval)  # later passes must add nothing
        postings_after = await _postings(scenario, rental_id)
        assert postings_after == postings_then, (postings_then, postings_after)
        assert row.started_at is not None and row.host_lost_at is not None
        served = int((row.host_lost_at - row.started_at).total_seconds())
        assert row.billed_seconds == await billed_as_rated(scenario, row) <= served, (row.billed_seconds, served)
        # A pass while the host was silent but not yet lost rated past host_lost_at; the end gives that back.
        rated_past = max((p["period_end"] for p in postings_after if p["kind"] == "usage"), default=None)
        kinds = [p["kind"] for p in postings_after]
        if rated_past is not None and rated_past > row.host_lost_at:
            assert "correction" in kinds, postings_after
        report.verify("billing_stopped_at_host_lost", {
            "billed_seconds": row.billed_seconds, "started_to_host_lost_s": served,
            "rated_past_host_lost_s": round(max(0.0, (rated_past - row.host_lost_at).total_seconds()), 2) if rated_past else 0,
            "postings": kinds, "postings_after_3_more_passes": len(postings_after) - len(postings_then),
        })  # fmt: skip

        async def replacement() -> dict[str, Any] | None:
            status, body = await scenario.call("GET", "/rentals?limit=500", "renter")
            new = [r for r in body["items"] if r.get("replaces") == rental_id] if status == 200 else []
            return new[0] if new and new[0]["state"] == "running" else None

        new = await scenario.until(replacement, "the replacement rental running", timeout=60)
        assert new["host_id"] != host_id, new
        report.verify("failed_over", {"replacement": new["id"], "on_host": new["host_id"], "state": new["state"]})

        async def stray_stopped() -> Command | None:
            async with scenario.cluster.database() as db, db.session() as session:
                rows = (await session.scalars(select(Command).where(Command.rental_id == rental_id,
                                                                    Command.kind == "stop_workload"))).all()  # fmt: skip
            return next((c for c in rows if c.state == "succeeded"), None)

        stop = await scenario.until(stray_stopped, "the stray workload stopped on the host that came back", timeout=60)
        report.verify("stray_workload", {"stop_command": stop.id, "state": stop.state})
        view = await scenario.rental(rental_id)
        assert view["state"] == "failed", view
        await scenario.invariants(covered_after=healed, hosts=[host_id])
        await scenario.stop_all_rentals()

    @pytest.mark.scenario("agent_link_latency_loss", "latency, stalls (loss) and dropped connections on an agent's link")
    @pytest.mark.timeout(120, func_only=True)
    async def test_a_slow_lossy_link_delays_but_loses_and_duplicates_nothing(self, scenario: Scenario) -> None:
        """For 12 s the agent's link adds 100 ms to every chunk each way, holds 10 % of chunks 0.5 s more (a lost
        segment waiting for its retransmission) and is reset every 4 s: a rental is started and stopped through it,
        the agent reconnects after each reset and replays, and its telemetry is stored exactly once with no gap."""
        bench, report = scenario.bench, scenario.report
        assert bench.agent_link is not None
        host_id = bench.host_of(bench.link_agent)
        connects_before = agent_log(bench, bench.link_agent).count("connected to relay")
        offer = await scenario.offer(host_id)
        bench.agent_link.shape(latency=0.1, stall_probability=0.1, stall_s=0.5)
        began = report.inject(f"latency 100 ms each way, 10 % of chunks held 0.5 s more on {bench.link_agent}'s link")
        status, rental = await scenario.rent(offer_id=offer)
        assert status == 201, rental
        resets = 0
        for _ in range(3):
            await asyncio.sleep(4)
            resets += bench.agent_link.cut()
            report.inject("connections reset")
        running = await scenario.wait_rental(rental["id"], "running", timeout=60)
        status, _ = await scenario.call("DELETE", f"/rentals/{rental['id']}", "renter")
        assert status == 202
        stopped = await scenario.wait_rental(rental["id"], "stopped", timeout=60)
        stats = bench.agent_link.stats
        bench.agent_link.heal()
        healed = report.inject("link healed", stalls=stats.stalls, resets=resets)

        async def online() -> bool:
            return bool((await scenario.host(host_id))["state"] == "online")

        await scenario.until(online, "the host online", timeout=30)
        connects = agent_log(bench, bench.link_agent).count("connected to relay") - connects_before
        report.verify("through_the_bad_link", {"rental": [running["state"], stopped["state"]], "agent_reconnects": connects,
                                               "shaped_s": round((healed - began).total_seconds(), 1)})  # fmt: skip
        assert connects >= 1
        await scenario.invariants(covered_after=healed, hosts=[host_id])


def _offline_spans(changes: list[tuple[datetime, str]]) -> list[tuple[datetime, datetime]]:
    spans, went = [], None
    for at, state in changes:
        if state == "offline":
            went = went or at
        elif went is not None:
            spans.append((went, at))
            went = None
    return spans


async def _postings(scenario: Scenario, rental_id: str) -> list[dict[str, Any]]:
    async with scenario.cluster.database() as db, db.session() as session:
        rows = (await session.execute(
            text("SELECT key, kind, period_start, period_end FROM ledger_transactions WHERE rental_id = :r ORDER BY id"),
            {"r": rental_id},
        )).all()  # fmt: skip
    return [{"key": k, "kind": kind, "period_start": a, "period_end": b} for k, kind, a, b in rows]
