"""A cluster's network bounds honoured from the agents' measurements: the fleet learns its links (``host_links``),
placement keeps host pairs measured outside the bounds apart, and a cluster's own figures are checked once its private
network is up (``master/services/host_links.py``, ``cluster_placement``, ``cluster_network``; docs/clusters.md,
"Network bounds").

Driven through ``/api/v1`` on SQLite and PostgreSQL (the ``api`` fixture); agents' answers are applied as the ingestor
would (``answer_round``), and links a test only needs to exist are recorded with ``host_links.record``, the function
the measure answers go through.
"""

from __future__ import annotations

import hashlib
import json
from datetime import timedelta
from typing import Any

import pytest
from sqlalchemy import select

from master.models import Cluster, Command, GpuAllocation, HostLink, Rental
from master.services import host_links
from master.services.clusters import policy as cluster_policy
from master.services.clusters.request import ClusterRequest
from master.services.host_links import Figures, NetworkBounds
from tests.apiclient import RTX, Api, assert_error
from tests.test_cluster_network import answer_round, key
from tests.test_cluster_policy import running_cluster, view, workload_fails
from tests.test_clusters import IMAGE, create, rows
from tests.test_rentals_market import rent


async def measured_cluster(api: Api, nodes: int, measure: list[dict[str, Any]], **body: Any) -> tuple[str, list[str]]:
    """A running container cluster whose private network the agents made and measured (``measure``: ``{from, rank, …}``)."""
    cluster_id, ids = await running_cluster(api, nodes, **body)
    keys = {r: key() for r in ids}
    await answer_round(api, ids, keys)
    await answer_round(api, ids, keys)
    await answer_round(api, ids, keys, measure=measure)
    return cluster_id, ids


async def hosts_of(api: Api, ids: list[str]) -> list[str]:
    async with api.master.db.session() as session:
        found = {r.id: r.host_id for r in (await session.scalars(select(Rental).where(Rental.id.in_(ids)))).all()}
    return [str(found[r]) for r in ids]


async def links(api: Api) -> dict[tuple[str, str], dict[str, Any]]:
    async with api.master.db.session() as session:
        found = (await session.scalars(select(HostLink))).all()
        return {(link.host_a, link.host_b): {c: getattr(link, c) for c in LINK_COLUMNS} for link in found}


LINK_COLUMNS = ("reachable", "rtt_ms", "mbit_s", "loss_pct", "error", "path", "measured_at", "cluster_id")


async def learn(api: Api, *measured: tuple[str, str, Figures], ago: timedelta = timedelta(0)) -> None:
    """Record links as a measure answer would (``ago``: measured that long before now)."""
    async with api.master.db.session() as session:
        await host_links.record(session, {host_links.pair(a, b): f for a, b, f in measured}, cluster_id=None,
                                at=api.master.clock.now() - ago)  # fmt: skip


async def stop(api: Api, cluster_id: str, ids: list[str]) -> None:
    status, body = await api.as_renter("DELETE", f"/clusters/{cluster_id}")
    assert status == 202, body
    for rental_id in ids:
        await api.agent_reports(rental_id, "stop_workload")
    assert (await view(api, cluster_id))["state"] == "stopped"


async def placed_on(api: Api, **body: Any) -> set[str]:
    status, cluster = await create(api, workload=IMAGE, **body)
    assert status == 201, cluster
    return {m["host_id"] for m in cluster["members"]}


class TestTheFleetLearnsItsLinks:
    async def test_each_measured_pair_is_upserted_as_a_pair_of_hosts(self, api: Api) -> None:
        """A measure answer records every pair it measured (ranks → hosts, smaller host id first), an error as unreachable;
        a later measurement of the same hosts replaces the figures, an older one applied late does not."""
        for _ in range(3):
            await api.host(1)
        measure: list[dict[str, Any]] = [{"from": 0, "rank": 1, "rtt_ms": 0.4, "mbit_s": 900.0, "loss_pct": 0.5, "path": "relay"},
                   {"from": 0, "rank": 2, "error": "node-2 did not answer through the tunnel within 10s (timed out)"},
                   {"from": 1, "rank": 2, "rtt_ms": 0.6, "mbit_s": 700.0}]  # fmt: skip
        cluster_id, ids = await measured_cluster(api, 3, measure)
        hosts = await hosts_of(api, ids)
        learnt = await links(api)
        assert set(learnt) == {host_links.pair(hosts[a], hosts[b]) for a, b in ((0, 1), (0, 2), (1, 2))}
        assert all(a < b for a, b in learnt)
        first = learnt[host_links.pair(hosts[0], hosts[1])]
        assert {k: v for k, v in first.items() if k != "measured_at"} == {
            "reachable": True, "rtt_ms": 0.4, "mbit_s": 900.0, "loss_pct": 0.5, "error": None, "path": "relay", "cluster_id": cluster_id,
        }  # fmt: skip
        unreachable = learnt[host_links.pair(hosts[0], hosts[2])]
        assert (unreachable["reachable"], unreachable["rtt_ms"], unreachable["mbit_s"]) == (False, None, None)
        assert "did not answer" in unreachable["error"]
        assert learnt[host_links.pair(hosts[1], hosts[2])]["loss_pct"] is None  # absent from the answer: not measured

        # A second cluster on hosts 0 and 1 measures them again: its figures win.
        await stop(api, cluster_id, ids)
        status, busy = await rent(api, offer_id=f"{hosts[2]}:{RTX}")
        assert status == 201, busy
        second, second_ids = await measured_cluster(api, 2, [{"from": 0, "rank": 1, "rtt_ms": 3.0, "mbit_s": 100.0}])
        assert set(await hosts_of(api, second_ids)) == {hosts[0], hosts[1]}
        again = (await links(api))[host_links.pair(hosts[0], hosts[1])]
        assert (again["rtt_ms"], again["mbit_s"], again["loss_pct"], again["cluster_id"]) == (3.0, 100.0, None, second)
        assert again["measured_at"] > first["measured_at"]

        # An older measurement applied late changes nothing.
        await learn(api, (hosts[0], hosts[1], Figures(rtt_ms=99.0)), ago=timedelta(hours=1))
        assert (await links(api))[host_links.pair(hosts[0], hosts[1])]["rtt_ms"] == 3.0


class TestPlacementHonoursTheBounds:
    async def test_a_pair_measured_over_max_latency_is_not_placed_together_again(self, api: Api) -> None:
        """Two hosts measured 5 ms apart by one cluster: a second cluster bounded to 2 ms takes the new, unmeasured host."""
        first = [(await api.host(1))[0] for _ in range(2)]
        cluster_id, ids = await measured_cluster(api, 2, [{"from": 0, "rank": 1, "rtt_ms": 5.0, "mbit_s": 900.0}])
        await stop(api, cluster_id, ids)
        third, _ = await api.host(1)
        for _ in range(3):  # not by chance: every placement avoids the pair
            status, cluster = await create(api, node_count=2, workload=IMAGE, network={"max_latency_ms": 2})
            assert status == 201, cluster
            placed = {m["host_id"] for m in cluster["members"]}
            assert third in placed and placed != set(first)
            assert cluster["network"] == {"max_latency_ms": 2.0, "max_loss_pct": None, "min_mbit_s": None}
            await stop(api, cluster["id"], [m["rental_id"] for m in cluster["members"]])

    async def test_a_pair_measured_within_the_bound_is_preferred_to_unmeasured_ones(self, api: Api) -> None:
        """Measured within the bound beats never measured; never measured beats measured outside it (not placed at all)."""
        hosts = [(await api.host(1))[0] for _ in range(4)]
        await learn(api, (hosts[2], hosts[3], Figures(rtt_ms=0.3, mbit_s=9000.0)), (hosts[0], hosts[1], Figures(rtt_ms=5.0)))
        assert await placed_on(api, node_count=2, network={"max_latency_ms": 2}) == {hosts[2], hosts[3]}
        # hosts 2 and 3 are taken: 0 and 1 were measured over the bound, and no other host is left.
        status, body = await create(api, node_count=2, workload=IMAGE, network={"max_latency_ms": 2})
        assert_error(status, body, 409, "insufficient_capacity")

    async def test_without_bounds_the_smallest_measured_round_trip_still_wins(self, api: Api) -> None:
        """No bounds: the pair measured 0.3 ms apart is chosen over a pair measured 8 ms apart and over unmeasured ones."""
        hosts = [(await api.host(1))[0] for _ in range(4)]
        await learn(api, (hosts[0], hosts[3], Figures(rtt_ms=0.3)), (hosts[1], hosts[2], Figures(rtt_ms=8.0)))
        assert await placed_on(api, node_count=2) == {hosts[0], hosts[3]}

    async def test_an_unreachable_pair_is_kept_apart_by_any_bound_and_ranked_last_without(self, api: Api) -> None:
        """A pair whose tunnel carried nothing: never together under any bound; without bounds only when nothing else fits."""
        hosts = [(await api.host(1))[0] for _ in range(3)]
        await learn(api, (hosts[0], hosts[1], Figures(reachable=False, error="node-1 did not answer")))
        status, body = await create(api, node_count=3, workload=IMAGE, network={"min_mbit_s": 10})
        assert_error(status, body, 409, "insufficient_capacity")
        assert "unreachable (node-1 did not answer)" in body["message"]
        status, whole = await create(api, node_count=3, workload=IMAGE)
        assert status == 201, whole  # without bounds: allowed when nothing else fits
        await stop(api, whole["id"], [m["rental_id"] for m in whole["members"]])
        for _ in range(3):  # ranked after every other pair
            status, cluster = await create(api, node_count=2, workload=IMAGE)
            assert status == 201, cluster
            assert hosts[2] in {m["host_id"] for m in cluster["members"]}
            await stop(api, cluster["id"], [m["rental_id"] for m in cluster["members"]])

    @pytest.mark.parametrize(
        ("network", "bad", "good", "words"),
        [
            ({"min_mbit_s": 1000}, Figures(rtt_ms=0.2, mbit_s=100.0), Figures(rtt_ms=0.2, mbit_s=5000.0), "100 Mbit/s under the 1000 Mbit/s bound"),
            ({"max_loss_pct": 1}, Figures(rtt_ms=0.2, loss_pct=3.0), Figures(rtt_ms=0.2, loss_pct=0.5), "3 % loss over the 1 % bound"),
        ],
    )
    async def test_min_mbit_s_and_max_loss_pct_keep_a_pair_apart_likewise(
        self, api: Api, network: dict[str, float], bad: Figures, good: Figures, words: str
    ) -> None:
        """A pair measured under min_mbit_s (or over max_loss_pct) is avoided, one keeping it is used; with only the bad
        pair left the 409 says which bound refused it."""
        hosts = [(await api.host(1))[0] for _ in range(4)]
        await learn(api, (hosts[0], hosts[1], bad), (hosts[2], hosts[3], good))
        assert await placed_on(api, node_count=2, network=network) == {hosts[2], hosts[3]}
        status, body = await create(api, node_count=2, workload=IMAGE, network=network)
        assert_error(status, body, 409, "insufficient_capacity")
        assert words in body["message"]

    async def test_no_set_keeping_the_bound_is_409_saying_so_and_leaves_nothing(self, api: Api) -> None:
        """Two free hosts measured 5 ms apart and a 2 ms bound: 409 insufficient_capacity naming the network bound, and no
        cluster, member, allocation or command is left."""
        hosts = [(await api.host(1))[0] for _ in range(2)]
        await learn(api, (hosts[0], hosts[1], Figures(rtt_ms=5.0, mbit_s=900.0)))
        status, body = await create(api, node_count=2, workload=IMAGE, network={"max_latency_ms": 2, "max_loss_pct": 1})
        assert_error(status, body, 409, "insufficient_capacity")
        pair = " ↔ ".join(sorted(hosts))
        assert "keep the cluster's network bounds" in body["message"], body
        assert f"1 pair of the hosts with room was measured outside them (round trip ≤ 2 ms, loss ≤ 1 %), e.g. {pair}: " \
               "5 ms round trip over the 2 ms bound" in body["message"], body  # fmt: skip
        assert [await rows(api, m) for m in (Cluster, Rental, GpuAllocation, Command)] == [0, 0, 0, 0]
        # The same hosts without the bound: placed.
        assert await placed_on(api, node_count=2) == set(hosts)

    async def test_a_link_measured_long_ago_counts_as_never_measured(self, api: Api) -> None:
        """Figures older than host_link_max_age_s no longer keep a pair apart (the fleet tries it again)."""
        hosts = [(await api.host(1))[0] for _ in range(2)]
        age = timedelta(seconds=api.master.settings.host_link_max_age_s)
        await learn(api, (hosts[0], hosts[1], Figures(rtt_ms=5.0)), ago=age + timedelta(minutes=1))
        assert await placed_on(api, node_count=2, network={"max_latency_ms": 2}) == set(hosts)

    async def test_node_by_node_placement_avoids_a_pair_measured_outside_the_bounds(self, api: Api) -> None:
        """The gang search finds no free set (the two free hosts breach the bound); placing node by node, node 1 avoids the
        host measured outside the bound with node 0's and preempts the interruptible rental on the third host instead."""
        free = [(await api.host(1))[0] for _ in range(2)]
        busy, _ = await api.host(1)
        status, victim = await rent(api, offer_id=f"{busy}:{RTX}", kind="interruptible", bid="0.20")
        assert status == 201, victim
        await api.agent_reports(victim["id"], "start_workload")
        await learn(api, (free[0], free[1], Figures(rtt_ms=5.0)))
        placed = await placed_on(api, node_count=2, network={"max_latency_ms": 2})
        assert busy in placed and placed != set(free)
        _, marked = await api.as_renter("GET", f"/rentals/{victim['id']}")
        assert marked["state"] == "running" and marked["preempting_by"] is not None  # until its taker really starts
        await api.agent_reports(marked["preempting_by"], "start_workload")
        _, preempted = await api.as_renter("GET", f"/rentals/{victim['id']}")
        assert preempted["state"] == "preempted"


class TestReplacement:
    async def test_a_replacement_avoids_hosts_measured_outside_the_bounds_with_the_others(self, api: Api) -> None:
        """A replace cluster bounded to 2 ms: node 1's replacement skips the free host measured 5 ms from node 0's and takes
        the unmeasured one; when only the far host is left, no host can replace it and the cluster fails."""
        for _ in range(2):
            await api.host(1)
        cluster_id, ids = await running_cluster(api, 2, restart_policy="replace", network={"max_latency_ms": 2})
        node0 = (await hosts_of(api, ids))[0]
        far, _ = await api.host(1)
        near, _ = await api.host(1)
        await learn(api, (node0, far, Figures(rtt_ms=5.0)))
        await workload_fails(api, ids[1])
        await cluster_policy.replace_broken_members(api.master)
        body = await view(api, cluster_id)
        [new] = [m for m in body["members"] if m["rental_id"] not in ids]
        assert new["host_id"] == near
        await api.agent_reports(new["rental_id"], "start_workload")
        await workload_fails(api, new["rental_id"])
        await cluster_policy.replace_broken_members(api.master)
        body = await view(api, cluster_id)
        assert body["state"] == "stopping" and "no host could replace it" in body["failure_reason"], body
        assert far not in {m["host_id"] for m in body["members"]}


class TestAfterCreation:
    async def test_figures_outside_the_bounds_say_so_and_the_cluster_keeps_running(self, api: Api) -> None:
        """Measured 4.2 ms between node 0 and node 2 against a 2 ms bound: within_bounds false, the pair and bound listed,
        an event saying so, and the cluster still running."""
        for _ in range(3):
            await api.host(1)
        measure = [{"from": 0, "rank": 1, "rtt_ms": 0.4, "mbit_s": 900.0}, {"from": 0, "rank": 2, "rtt_ms": 4.2, "mbit_s": 800.0},
                   {"from": 1, "rank": 2, "rtt_ms": 0.6, "mbit_s": 50.0}]  # fmt: skip
        cluster_id, _ = await measured_cluster(api, 3, measure, network={"max_latency_ms": 2, "min_mbit_s": 100})
        body = await view(api, cluster_id)
        net = body["private_network"]
        assert net["state"] == "up" and net["within_bounds"] is False
        assert net["out_of_bounds"] == [
            {"a": 0, "b": 2, "bound": "max_latency_ms", "measured": 4.2, "limit": 2.0},
            {"a": 1, "b": 2, "bound": "min_mbit_s", "measured": 50.0, "limit": 100.0},
        ]
        [event] = [e for e in body["events"] if e["cause"].startswith("network between")]
        assert event["cause"].startswith("network between node-0 and node-2: 4.2 ms round trip over the 2 ms bound; "
                                         "network between node-1 and node-2: 50 Mbit/s under the 100 Mbit/s bound")  # fmt: skip
        assert "keeps running" in event["cause"]
        assert body["state"] == "running"

    async def test_figures_within_the_bounds_and_no_bounds(self, api: Api) -> None:
        """Every pair within the bounds: within_bounds true and no event; a cluster without bounds: within_bounds null."""
        for _ in range(4):
            await api.host(1)
        bounded, _ = await measured_cluster(api, 2, [{"from": 0, "rank": 1, "rtt_ms": 1.5, "mbit_s": 900.0}], network={"max_latency_ms": 2})
        body = await view(api, bounded)
        assert (body["private_network"]["within_bounds"], body["private_network"]["out_of_bounds"]) == (True, [])
        assert not any(e["cause"].startswith("network between") for e in body["events"])
        free, _ = await measured_cluster(api, 2, [{"from": 0, "rank": 1, "error": "node-1 did not answer"}])
        assert (await view(api, free))["private_network"]["within_bounds"] is None


class TestRequest:
    @pytest.mark.parametrize(
        "network",
        [{"min_mbit_s": 0}, {"min_mbit_s": -5}, {"min_mbit_s": 400_001}, {"min_mbit_s": "fast"}, {"max_latency_ms": 0},
         {"max_loss_pct": 101}, {"min_bandwidth": 10}, {"max_latency_ms": 2, "jitter": 1}],
    )  # fmt: skip
    async def test_bad_bounds_are_refused(self, api: Api, network: dict[str, Any]) -> None:
        """min_mbit_s must be above 0 and at most 400,000; every bound is a number in its range; no other field."""
        status, body = await create(api, node_count=2, network=network)
        assert_error(status, body, 422, "validation_failed")
        assert body["message"].startswith("network."), body
        assert await rows(api, Cluster) == 0

    async def test_min_mbit_s_is_stored_and_a_repeat_is_idempotent(self, api: Api) -> None:
        for _ in range(2):
            await api.host(1)
        network = {"max_latency_ms": 5, "min_mbit_s": 400_000}
        first = await create(api, headers={"Idempotency-Key": "k"}, node_count=2, network=network)
        again = await create(api, headers={"Idempotency-Key": "k"}, node_count=2, network=network)
        assert (first[0], again[0], again[1]["id"]) == (201, 200, first[1]["id"])
        assert first[1]["network"] == {"max_latency_ms": 5.0, "max_loss_pct": None, "min_mbit_s": 400_000.0}
        status, body = await create(api, headers={"Idempotency-Key": "k"}, node_count=2, network={"max_latency_ms": 5, "min_mbit_s": 1})
        assert_error(status, body, 409, "idempotency_key_reused")


def test_the_fingerprint_of_a_request_without_min_mbit_s_is_unchanged() -> None:
    """Regression: adding min_mbit_s (null when not given) must not change the fingerprint of a request without it, or an
    Idempotency-Key sent before the upgrade would be refused as reused."""
    request = ClusterRequest(node_count=2, network={"max_latency_ms": 5.0, "max_loss_pct": None, "min_mbit_s": None})
    before = {"n": 2, "g": 1, "m": None, "mixed": False, "q": "", "kind": "on_demand", "bid": None,
              "net": {"max_latency_ms": 5.0, "max_loss_pct": None}, "restart": "stop", "w": {}}  # fmt: skip
    assert request.fingerprint() == hashlib.sha256(json.dumps(before, sort_keys=True).encode()).hexdigest()
    with_bandwidth = ClusterRequest(node_count=2, network={"max_latency_ms": 5.0, "max_loss_pct": None, "min_mbit_s": 10.0})
    assert with_bandwidth.fingerprint() != request.fingerprint()


class TestPlacementRtt:
    """``host_links.placement_rtt``: the round trips the gang search sees, so that it honours the bounds unchanged."""

    LINKS = {("a", "b"): Figures(rtt_ms=5.0), ("a", "c"): Figures(rtt_ms=0.5, mbit_s=50.0), ("b", "c"): Figures(reachable=False)}

    def test_no_links_means_no_rtt_work(self) -> None:
        assert host_links.placement_rtt({}, NetworkBounds(max_latency_ms=2), str) == (None, None)

    def test_with_a_latency_bound(self) -> None:
        rtt, limit = host_links.placement_rtt(self.LINKS, NetworkBounds(max_latency_ms=2), str)
        assert rtt is not None and limit == 2
        assert [rtt("a", "b"), rtt("c", "a"), rtt("b", "c"), rtt("a", "d")] == [None, 0.5, None, 2]

    def test_with_other_bounds_only(self) -> None:
        rtt, limit = host_links.placement_rtt(self.LINKS, NetworkBounds(min_mbit_s=100), str)
        assert rtt is not None and limit == host_links.UNBOUNDED_MS
        assert [rtt("a", "b"), rtt("a", "c"), rtt("b", "c"), rtt("a", "d")] == [5.0, None, None, host_links.UNBOUNDED_MS]

    def test_without_bounds(self) -> None:
        rtt, limit = host_links.placement_rtt(self.LINKS, NetworkBounds(), str)
        assert rtt is not None and limit is None
        assert [rtt("a", "b"), rtt("a", "c"), rtt("b", "c"), rtt("a", "d")] == [5.0, 0.5, None, host_links.UNBOUNDED_MS]
