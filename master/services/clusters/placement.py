"""Placing a cluster: every member on its own host, in one transaction, or none.

``place_cluster`` is the whole boundary: given the cluster (flushed, in the caller's transaction)
and its request, it adds and places one member rental per node, or raises why it cannot.

1. **Gang search.** The hosts are chosen together by ``master/scheduler/gang.py``'s ``place_gang``
   over the rental's own candidates (``rentals.find_candidates``: requirements, isolation, bid,
   spend quota), each node carrying its host's region: one region (and one model, unless
   ``allow_mixed``) when any has room, then the placer's preference. The renter's price first
   (``master/scheduler/price.py::gang_band``, as for a rental: unless a model is named without a
   ``price_tolerance``): only among the hosts priced at most ``price_tolerance`` above the least price
   a whole set's dearest member can have. Each chosen placement is then
   claimed by the rental's placement pinned to that host and model (``try_place`` with the host's
   offer: quotas, credit, the atomic claim, the start command), all inside one savepoint: a claim that
   fails (a lost race) rolls the savepoint back, so no member, claim or command of it is left.
2. **Member by member (with preemption).** When the gang search finds no set on free GPUs (or loses a
   race), node 0, 1, … are placed in turn by ``try_place`` unpinned — which may preempt interruptible
   rentals, as a rental does — each avoiding the hosts the earlier members took, region by region (the
   one with the most free matching GPUs first), then the whole fleet, each attempt in its own savepoint.

**Network bounds** (the request's ``network``, ``host_links.NetworkBounds``): the links measured among the
candidate hosts are read in one query and handed to the gang search as round trips
(``host_links.placement_rtt``), so a pair measured outside the bounds is never chosen, a pair never measured
is; the node-by-node step avoids every host measured outside them with a host already taken. When no set
keeps them but one would without them, the 409 says the network bounds were why. A ``min_mbit_s`` above what a
tunnel carries (``cluster_paths.TUNNEL_MAX_MBIT_S``) tries one fabric's hosts first (one provider's hosts that declare
the same fabric: their members talk over it unencrypted; docs/clusters.md, "Three paths"), then the whole fleet.
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Mapping, Sequence
from dataclasses import replace
from datetime import datetime, timedelta

from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession

from master.context import Master
from master.models import Cluster, Host, Rental
from master.scheduler import MILLI, Node, Placement, get_placer
from master.scheduler.gang import Rtt, place_gang
from master.scheduler.price import effective_tolerance, gang_band
from master.services import host_links, rentals, volumes
from master.services.clusters.request import ClusterRequest
from master.services.lifecycle import cluster_paths
from master.services.lifecycle.rentals import RentalState
from shared.errors import ClientError, Conflict, InsufficientCapacity
from shared.ids import new_id

log = logging.getLogger(__name__)


async def place_cluster(
    master: Master, session: AsyncSession, cluster: Cluster, request: ClusterRequest, *, now: datetime, queued: Sequence[str] = ()
) -> list[str]:
    """Place every member of ``cluster`` (one rental per node, on distinct hosts); returns the commands to publish.

    ``queued``: the ids of a queued cluster's member rentals, by node rank, placed instead of new ones
    (``cluster_queue``). Raises ``exceeds_fleet`` when the fleet has fewer than ``node_count`` hosts with
    ``gpus_per_node`` matching GPUs, else the reason the last attempt failed (``insufficient_capacity``, a
    quota, credit). Nothing of a failed attempt stays in the session: queued members are left queued.
    """
    hosts = await _hosts_big_enough(session, request)
    if hosts < request.node_count:
        raise InsufficientCapacity(
            f"the fleet has {hosts} host{'s' if hosts != 1 else ''} with {request.gpus_per_node} × {request.gpu_model or 'any GPU'} "
            f"and a cluster of {request.node_count} nodes needs one per node; ask for fewer nodes or GPUs per node",
            code="exceeds_fleet",
        )
    cluster_id, renter_id = cluster.id, cluster.renter_id  # a rolled-back attempt expires the row's attributes
    members = _Members((cluster_id, renter_id), request, tuple(queued), now=now)
    links_since = now - timedelta(seconds=master.settings.host_link_max_age_s)
    network_why: str | None = None
    regions: list[str | None] = [None]
    if request.volumes:  # each node's volumes chose its host: node by node, each to its own (try_place keeps it there)
        await member_volume_hosts(session, renter_id, request, queued)
    else:
        async with session.begin_nested() as attempt:
            commands, reason, network_why = await _place_gang(master, session, members, request, links_since=links_since, now=now)
            if reason is None:
                return commands
            await attempt.rollback()
        log.info("cluster %s: no gang placement on free GPUs (%s); trying node by node", cluster_id, reason)
        regions = [*await _regions_by_free_gpus(master, session, request, now=now), None]
    for region in regions:
        async with session.begin_nested() as attempt:
            commands, reason = await _place_members(master, session, members, request, region=region, links_since=links_since, now=now)
            if reason is None:
                return commands
            await attempt.rollback()
        log.info("cluster %s does not fit%s: %s", cluster_id, f" in region {region}" if region else "", reason)
    assert reason is not None
    if isinstance(reason, InsufficientCapacity) and reason.code == "insufficient_capacity" and not request.volumes:
        wanted = f"{request.gpus_per_node} × {request.gpu_model or 'any GPU'}"
        if network_why is not None:
            raise InsufficientCapacity(
                f"no {request.node_count} distinct hosts with {wanted} free each keep the cluster's network bounds between them "
                f"right now: {network_why}; try again later, loosen network or ask for fewer nodes"
            )
        raise InsufficientCapacity(
            f"no {request.node_count} distinct hosts have {wanted} free each right now ({reason}); try again later or ask for fewer nodes"
        )
    raise reason


async def _place_gang(
    master: Master, session: AsyncSession, members: _Members, request: ClusterRequest, *, links_since: datetime, now: datetime
) -> tuple[list[str], ClientError | None, str | None]:
    """Choose every member's host with ``place_gang``, then claim each (pinned to its host and model). The third
    item says why the network bounds refused every set, when a set would have been found without them."""
    first = request.member_request(0)
    price_cap = await rentals.check_quota(master, session, members.cluster[1], first, exclude="")
    found = await rentals.find_candidates(master, session, first, now=now, price_cap=price_cap)
    host_of: dict[str, str] = {}
    for node in found.nodes:  # fresh nodes of this read: the gang search keeps a cluster in one region
        host = found.hosts[node.node_id][0]
        node.region, host_of[node.node_id] = host.region, host.host_id
    # Links among the hosts with room for a node, in one query: the gang search's round trips.
    roomy = {host_of[node.node_id] for node in found.nodes if node.full >= request.gpus_per_node}
    links = await host_links.among(session, roomy, since=links_since)
    bounds = host_links.NetworkBounds.of(request.network)
    rtt_ms, max_rtt_ms = host_links.placement_rtt(links, bounds, host_of.__getitem__)

    tolerance = effective_tolerance(first.price_tolerance, master.settings.price_tolerance, names_model=first.names_model,
                                    names_offer=False)  # fmt: skip

    def search(rtt: Rtt | None = None, limit: float | None = None, nodes: Sequence[Node] = found.nodes) -> list[Placement] | None:
        def solve(band: Sequence[Node]) -> list[Placement] | None:
            # A placer of its own: the master's keeps its scores for the whole fleet it serves single rentals on.
            return place_gang(first.place_request(), request.node_count, list(band), placer=get_placer(master.settings.placer),
                              same_model=not request.allow_mixed, rtt_ms=rtt, max_rtt_ms=limit)  # fmt: skip

        # The renter's price first: the cheapest band of hosts that holds a whole set (master/scheduler/price.py).
        banded = gang_band(list(nodes), [found.hosts[node.node_id][2] for node in nodes], tolerance, solve)
        return None if banded is None else banded[1]

    placements = None
    if bounds.min_mbit_s is not None and bounds.min_mbit_s > cluster_paths.TUNNEL_MAX_MBIT_S:
        # More than a tunnel carries: one fabric's hosts first (the largest group first), judged only by what was
        # measured over the fabric (a tunnel's figure between two of them says nothing of it).
        for group in await _fabric_groups(session, roomy, request.node_count):
            on_fabric = {key: figures for key, figures in links.items() if figures.path == "fabric" and set(key) <= group}
            rtt, limit = host_links.placement_rtt(on_fabric, bounds, host_of.__getitem__)
            placements = search(rtt, limit, [node for node in found.nodes if host_of[node.node_id] in group])
            if placements is not None:
                log.info("cluster %s: on one fabric (%d hosts), for its %s", members.cluster[0], len(group), bounds.text())
                break
    if placements is None:
        placements = search(rtt_ms, max_rtt_ms)
    if placements is None:
        network_why = None
        if max_rtt_ms is not None and search() is not None:
            network_why = _breaches_text(links, bounds)
        return [], InsufficientCapacity(f"no {request.node_count} hosts with {request.gpus_per_node} free GPUs each, one model"), network_why
    commands: list[str] = []
    for rank, placement in enumerate(placements):
        host, name, _price = found.hosts[placement.node_id]
        unpinned = request.member_request(rank)
        member = await members.row(session, rank, unpinned.spec())
        pinned = replace(unpinned, offer_id=f"{host.host_id}:{name}", gpu_model=None)
        placed, reason = await rentals.try_place(master, session, member, pinned, now=now)
        if reason is not None:
            return [], reason, None
        commands.extend(placed)
    return commands, None, None


async def _fabric_groups(session: AsyncSession, hosts: Collection[str], node_count: int) -> list[set[str]]:
    """The ``hosts`` that share a fabric (one owner, one declared fabric name), in groups of at least ``node_count``,
    the largest first."""
    groups: dict[str, set[str]] = {}
    for host_id, owner_id, facts in (await session.execute(select(Host.id, Host.owner_id, Host.facts).where(Host.id.in_(hosts)))).all():
        key = cluster_paths.fabric_key({"net": cluster_paths.member_facts(owner_id, facts)})
        if key is not None:
            groups.setdefault(key, set()).add(host_id)
    return sorted((g for g in groups.values() if len(g) >= node_count), key=lambda g: (-len(g), sorted(g)))


def _breaches_text(links: Mapping[tuple[str, str], host_links.Figures], bounds: host_links.NetworkBounds) -> str:
    """``2 pairs of the hosts with room were measured outside them (round trip ≤ 2 ms), e.g. h-1 ↔ h-2: 4.2 ms round trip …``."""
    breached = [(key, found) for key, figures in sorted(links.items()) if (found := bounds.breaches(figures))]
    count = len(breached)
    text = f"{count} pair{'s' if count != 1 else ''} of the hosts with room {'were' if count != 1 else 'was'} measured outside them ({bounds.text()})"
    if breached:
        (host_a, host_b), found = breached[0]
        text += f", e.g. {host_a} ↔ {host_b}: {', '.join(b.text() for b in found)}"
    return text


async def _place_members(
    master: Master, session: AsyncSession, members: _Members, request: ClusterRequest, *, region: str | None, links_since: datetime,
    now: datetime,
) -> tuple[list[str], ClientError | None]:
    """Place node 0, 1, … in turn (preempting where a rental would), each on a host none of the others has and none
    measured outside the network bounds with theirs; stops at the first that does not fit."""
    bounds = host_links.NetworkBounds.of(request.network)
    commands: list[str] = []
    taken: set[str] = set()
    apart: set[str] = set()  # hosts measured outside the bounds with a host taken
    model: str | None = None
    for rank in range(request.node_count):
        member_request = request.member_request(rank, avoid_hosts=frozenset(taken | apart), model=model, region=region)
        member = await members.row(session, rank, member_request.spec())
        placed, reason = await rentals.try_place(master, session, member, member_request, now=now)
        if reason is not None:
            return [], reason
        assert member.host_id is not None
        if model is not None and member.gpu_model != model:  # model words matched a longer name: not the same model
            return [], InsufficientCapacity(f"node {rank} got {member.gpu_model}, not {model} as node 0")
        taken.add(member.host_id)
        if bounds and rank + 1 < request.node_count:
            apart |= await host_links.breaching_peers(session, [member.host_id], bounds, since=links_since)
        if not request.allow_mixed:
            model = member.gpu_model
        commands.extend(placed)
    return commands, None


class _Members:
    """The member rental each attempt places for a node: a new row, or the queued cluster's own (read afresh: a
    rolled-back attempt expired it)."""

    def __init__(self, cluster: tuple[str, str], request: ClusterRequest, queued: tuple[str, ...], *, now: datetime) -> None:
        self.cluster, self.request, self.queued, self.now = cluster, request, queued, now

    async def row(self, session: AsyncSession, rank: int, spec: dict[str, object]) -> Rental:
        if not self.queued:
            return new_member(self.cluster, self.request, rank, spec, now=self.now)
        member = await session.get(Rental, self.queued[rank], populate_existing=True)
        assert member is not None and member.host_id is None, f"queued member {self.queued[rank]} is not queued"
        return member


def new_member(cluster: tuple[str, str], request: ClusterRequest, rank: int, spec: dict[str, object], *, now: datetime) -> Rental:
    """Node ``rank`` of the cluster ``(cluster_id, renter_id)``, not placed yet."""
    cluster_id, renter_id = cluster
    return Rental(
        id=new_id("r"), renter_id=renter_id, host_id=None, gpu_model=request.gpu_model, gpu_count=request.gpus_per_node,
        gpu_uuids=[], state=RentalState.PENDING.value, workload=request.member_workload(rank),
        restart_on_failure=False, kind=request.kind, gpu_milli=MILLI, gpu_memory_mib=0, bid_per_gpu_hour=request.bid,
        spec={**spec, "template": request.template, **_cluster_volumes(request)}, created_at=now, cluster_id=cluster_id,
        node_rank=rank,
    )  # fmt: skip


def _cluster_volumes(request: ClusterRequest) -> dict[str, object]:
    """The cluster's own volume entries ({rank} and all), kept on each member for a queued cluster's request."""
    return {"cluster_volumes": [ask.to_json() for ask in request.volumes]} if request.volumes else {}


async def member_volume_hosts(session: AsyncSession, renter_id: str, request: ClusterRequest, queued: Sequence[str] = ()) -> list[str]:
    """Each node's host, as its own volumes decide it (``volumes.resolve``: 404, 409 as for a rental); 409
    ``volumes_share_a_host`` when two nodes' volumes are on one host (a cluster's nodes are on distinct hosts)."""
    hosts: list[str] = []
    for rank in range(request.node_count):
        asks = request.member_request(rank).volumes
        tied = await volumes.resolve(session, renter_id, asks, rental_id=queued[rank] if queued else None)
        [host] = tied.hosts
        if host in hosts:
            other = hosts.index(host)
            raise Conflict(
                f"nodes {other} and {rank} would both go to host {host}, where both their volumes are ({tied.describe()}); "
                "a cluster's nodes are on distinct hosts: copy one node's volume to another host", code="volumes_share_a_host",
            )  # fmt: skip
        hosts.append(host)
    return hosts


async def _hosts_big_enough(session: AsyncSession, request: ClusterRequest) -> int:
    """Hosts of the fleet with at least ``gpus_per_node`` whole matching GPUs of one model, rented or not."""
    gpus = await rentals.whole_gpus(session, request.gpu_model)
    return len({host_id for host_id, _, count in gpus if count >= request.gpus_per_node})


async def _regions_by_free_gpus(master: Master, session: AsyncSession, request: ClusterRequest, *, now: datetime) -> list[str]:
    """Regions with at least ``node_count`` candidate hosts, the one with the most free matching GPUs first."""
    found = await rentals.find_candidates(master, session, request.member_request(0), now=now, price_cap=None)
    free: dict[str, int] = {}
    hosts: dict[str, set[str]] = {}
    for node in found.nodes:
        host, _name, _price = found.hosts[node.node_id]
        if host.region is None or node.full < request.gpus_per_node:
            continue
        free[host.region] = free.get(host.region, 0) + node.full
        hosts.setdefault(host.region, set()).add(host.host_id)
    eligible = [r for r in free if len(hosts[r]) >= request.node_count]
    return sorted(eligible, key=lambda r: (-free[r], r))
