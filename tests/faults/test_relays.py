"""Relays under fault: one killed with kill -9 under load, one cut off from the masters (a partition on its
bus link, black-holed by a proxy; ``tc netem`` is not available here)."""

from __future__ import annotations

import asyncio
import time
from datetime import UTC, datetime

import pytest

from gpumarket.cluster import REGIONS
from tests.faults.checks import check_logs
from tests.faults.harness import Scenario

pytestmark = [pytest.mark.slow, pytest.mark.postgres, pytest.mark.redis]

# 10 KiB of output every 0.1 s. A shell loop, not this interpreter: an agent running as root gives the
# rental a uid of its own, which cannot reach an interpreter under /root.
CHATTY = {"kind": "process", "argv": ["/bin/sh", "-c", 'x=$(printf "%1023s" "" | tr " " x); '
                                      'while :; do for i in 1 2 3 4 5 6 7 8 9 10; do echo "$x"; done; sleep 0.1; done']}
LOG_SHIP_S = 2.0  # the agent's log_ship_interval
PARTITION_S = 8.0  # longer than the relay's bus timeout (5 s), so it gives up on the bus and sends its agents away


async def relays_of(scenario: Scenario, host_ids: list[str]) -> dict[str, str | None]:
    hosts = await scenario.hosts()
    return {h: hosts[h]["relay_id"] if hosts[h]["state"] in ("online", "rented") else None for h in host_ids}


async def registered(scenario: Scenario) -> set[str]:
    status, body = await scenario.call("GET", "/relays")
    return {r["relay_id"] for r in body["items"]} if status == 200 else set()


class TestRelayFaults:
    @pytest.mark.scenario("relay_kill", "kill -9 a relay under load: its agents move to the other relay, telemetry stored exactly once")
    @pytest.mark.timeout(120, func_only=True)
    async def test_agents_of_a_killed_relay_reconnect_elsewhere_and_lose_nothing(self, scenario: Scenario) -> None:
        """SIGKILL of the relay most DNS-discovered agents are on, while a rental is being started behind it: each of
        its agents reconnects to the other relay and replays its spool; every telemetry report is stored exactly once
        with no gap; the rental starts; the relay restarts and registers again."""
        bench, cluster, report = scenario.bench, scenario.cluster, scenario.report
        dns_hosts = [bench.host_of(a) for a in bench.dns_agents]
        hosts = await scenario.hosts()
        where = await relays_of(scenario, dns_hosts)
        victim = max((r.relay_id for r in REGIONS), key=lambda r: (sum(v == r for v in where.values()), r == REGIONS[0].relay_id))
        survivor = next(r.relay_id for r in REGIONS if r.relay_id != victim)
        moving = [h for h, relay in where.items() if relay == victim]
        assert moving, f"no DNS agent on {victim}: {where}"
        biggest = max(moving, key=lambda h: len(hosts[h]["gpus"]))  # room for the rental started at the kill
        # Load: on the victim's hosts, a workload writing 100 KiB/s each, shipped as 16 KiB log messages.
        chatty = []
        for host_id in [h for h in moving if h != biggest or len(hosts[h]["gpus"]) > 1]:
            status, body = await scenario.rent(offer_id=await scenario.offer(host_id), workload=CHATTY)
            assert status == 201, body
            chatty.append(body["id"])
        for rental_id in chatty:
            await scenario.wait_rental(rental_id, "running")
        offer = await scenario.offer(biggest)
        await bench.wire.refresh()
        rate_from, t_from = bench.wire.entries, time.monotonic()
        await asyncio.sleep(2)
        await bench.wire.refresh()
        load = round((bench.wire.entries - rate_from) / (time.monotonic() - t_from), 1)
        status, rental = await scenario.rent(offer_id=offer)  # its start command goes out through the victim
        assert status == 201, rental
        cluster.expected_down.add(victim)
        cluster.processes.kill(victim)
        killed = report.inject(f"SIGKILL {victim} (process group)", agents_connected=len(moving) + (victim == REGIONS[0].relay_id),
                               bus_messages_per_s=load, log_writing_workloads=len(chatty), rental_starting=rental["id"])  # fmt: skip
        began = time.monotonic()

        async def moved() -> dict[str, str | None] | None:
            now = await relays_of(scenario, moving)
            return now if all(relay == survivor for relay in now.values()) else None

        await scenario.until(moved, f"every agent of {victim} online on {survivor}", timeout=60)
        report.verify("reconnected", {"agents": len(moving), "to": survivor, "within_s": round(time.monotonic() - began, 1)})
        running = await scenario.wait_rental(rental["id"], "running", timeout=60)
        report.verify("rental_started_behind_the_dead_relay", {"rental": rental["id"], "state": running["state"]})

        cluster.processes.restart(victim)
        cluster.expected_down.discard(victim)
        await scenario.until(lambda: _has(scenario, victim), f"{victim} registered again", timeout=60)
        report.inject(f"restarted {victim}")
        report.verify("relay_back", {"relay": victim, "registered": True, "down_s": round(time.monotonic() - began, 1)})
        if victim == REGIONS[0].relay_id:
            report.note(f"{bench.link_agent} is pinned to {victim} through its proxy (no other relay to go to); "
                        "it reconnected when the relay was back")  # fmt: skip
        await cluster.wait_healthy()
        await scenario.stop_all_rentals()  # a stopped workload's last output is shipped, then its log is complete
        await asyncio.sleep(2 * LOG_SHIP_S)
        async with cluster.database() as db:
            report.verify("workload_logs", await check_logs(db, chatty))
        await scenario.invariants(covered_after=killed)

    @pytest.mark.scenario("relay_partition", "a partition between a relay and the masters (its bus link black-holed), then healed")
    @pytest.mark.timeout(120, func_only=True)
    async def test_a_relay_cut_off_from_the_masters_sends_its_agents_away_and_comes_back(self, scenario: Scenario) -> None:
        """The proxy between relay-us-east and Redis forwards nothing for 8 s (sockets stay open, as in a
        partition): the relay's publishes time out, it closes its agents with "bus unavailable" and its registry
        record expires; the agents move to relay-eu-west and replay; after healing, the relay registers again.
        Nothing is lost or stored twice (publishes held in the partition and delivered late are duplicates the
        master drops)."""
        bench, cluster, report = scenario.bench, scenario.cluster, scenario.report
        partitioned, other = REGIONS[1].relay_id, REGIONS[0].relay_id
        dns_hosts = [bench.host_of(a) for a in bench.dns_agents]
        where = await relays_of(scenario, dns_hosts)
        if not any(relay == partitioned for relay in where.values()):
            # Put agents there first: drain relay-eu-west (SIGTERM: "move"), its agents go to us-east; restart it.
            cluster.expected_down.add(other)
            cluster.processes.stop(other)
            await scenario.until(lambda: _on(scenario, dns_hosts, partitioned), f"agents on {partitioned}", timeout=60)
            cluster.processes.restart(other)
            cluster.expected_down.discard(other)
            await scenario.until(lambda: _has(scenario, other), f"{other} registered", timeout=60)
            report.note(f"setup: drained {other} (SIGTERM, restart) so that agents sit on {partitioned}")
            where = await relays_of(scenario, dns_hosts)
        moving = [h for h, relay in where.items() if relay == partitioned]

        bench.relay_bus.black_hole()
        cut = report.inject(f"partition {partitioned} ↔ Redis (bus and registry): black hole, sockets kept open",
                            agents_on_relay=len(moving), seconds=PARTITION_S)  # fmt: skip
        began = time.monotonic()

        async def moved() -> bool:
            now = await relays_of(scenario, moving)
            return all(relay == other for relay in now.values())

        await scenario.until(moved, f"the agents of {partitioned} on {other}", timeout=60)
        moved_after = round(time.monotonic() - began, 1)
        dropped = partitioned not in await registered(scenario)
        await asyncio.sleep(max(0.0, PARTITION_S - (time.monotonic() - began)))
        held = bench.relay_bus.stats.connections
        bench.relay_bus.heal()
        healed = report.inject("healed the partition", held_connections=held)
        await scenario.until(lambda: _has(scenario, partitioned), f"{partitioned} registered again", timeout=60)
        report.verify("during_partition", {"agents_moved": len(moving), "to": other, "moved_within_s": moved_after,
                                           "relay_left_discovery": dropped})  # fmt: skip
        assert cluster.processes.alive(partitioned), f"{partitioned} died in the partition"
        report.verify("after_heal", {"relay_registered_again": True, "relay_process_alive": True,
                                     "back_within_s": round((datetime.now(UTC) - healed).total_seconds(), 1)})  # fmt: skip
        await cluster.wait_healthy()
        await scenario.invariants(covered_after=max(cut, healed))


async def _has(scenario: Scenario, relay_id: str) -> bool:
    return relay_id in await registered(scenario)


async def _on(scenario: Scenario, hosts: list[str], relay_id: str) -> bool:
    return any(relay == relay_id for relay in (await relays_of(scenario, hosts)).values())
