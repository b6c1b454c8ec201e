"""A cluster's private network, from the master's side: which ``create_cluster`` / ``delete_cluster`` to
send, and what the members' agents answered (docs/clusters.md, "The private network").

The cluster's ``private_network`` (JSON) holds one entry per node rank (the member rental it is
for, its host, its **step**, its tunnel key and endpoint) and the pairwise figures measured.
Three rounds, each sent to every member once the round before it is complete, so no tunnel
carries a packet before its peers know its key (WireGuard would drop the first handshake and
retry it only 5 s later):

1. **join** — as each container member runs, ``create_cluster`` without peers: its agent makes
   the tunnel and answers its key and endpoint (step ``creating`` → ``keyed``);
2. **peers** — once every current member is keyed, each gets the others as peers, one member at a
   time, lowest rank first (``peering`` → ``peered``): the handshakes a member starts then reach
   members that already know it (crossing handshakes could leave a pair without a session for 5–15 s);
3. **measure** — once every member is peered, the same again with ``measure``: each measures
   its peers of higher rank (``measuring`` → ``measured``); the network is ``up`` with the
   figures once all have answered.

Each measure answer also teaches the fleet: every pair it measured is a pair of hosts, upserted
into ``host_links`` (``host_links.record``), which placement reads to honour clusters' network
bounds. Once the network is up, its figures are checked against this cluster's own bounds
(``within_bounds``, ``out_of_bounds``, and an event naming each pair outside them); the cluster
keeps running either way: the renter decides.

A replacement member (restart policy ``replace``) joins as in round 1, and rounds 2–3 run again
for all. A member whose agent fails a round makes the network ``failed`` (with the reason, as a
cluster event). Once the cluster is stopping or over, ``delete_cluster`` goes to every member
that joined (its stop takes the tunnel down too; the command says so explicitly).

``follow`` runs in ``clusterstate``'s before-flush hook (a synchronous session); ``apply_result``
on each agent's answer. The commands either writes are published after the commit
(``ISSUED`` in ``session.info``, read by ``clusterstate.issued_commands``).
"""

from __future__ import annotations

import hashlib
import ipaddress
import logging
from collections.abc import Callable, Mapping, Sequence
from datetime import datetime, timedelta
from typing import Any, Final

from pydantic import ValidationError
from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession
from sqlalchemy.orm import Session

from master.models import Cluster, ClusterEvent, Host, Rental
from master.models import Command as CommandRow
from master.services import commands, host_links
from master.services.lifecycle import cluster_paths
from shared import protocol
from shared.crypto.tokens import ConnectClaims, new_claims

log = logging.getLogger(__name__)

ISSUED: Final = "gpumarket_cluster_commands"  # session.info key: commands written by the cluster hooks, published after commit
KINDS: Final = ("create_cluster", "delete_cluster")
_OVER: Final = ("stopping", "stopped", "failed")
_KEYED: Final = ("keyed", "peering", "peered", "measuring", "measured")
RELAY_PORT: Final = 51820  # the port a ``wg`` stream's token names (WireGuard's usual): the member's tunnel itself
# How long a peer's relay token opens streams: a relayed path the agent re-opens (after a drop, a restart) within it.
RELAY_TOKEN_TTL: Final = timedelta(days=7)
Signer = Callable[[ConnectClaims], str]
_MAX_PAIRS_TOLD: Final = 8  # pairs outside the bounds one event names (the view lists them all)


def subnet_for(cluster_id: str) -> str:
    """The cluster's /24 in ``protocol.CLUSTER_SUPERNET``, from its id (two clusters may share one: each
    member's tunnel carries only its own cluster's keys, so a shared range reaches nothing of the other)."""
    blocks = protocol.CLUSTER_SUPERNET.num_addresses // 256
    index = int.from_bytes(hashlib.sha256(cluster_id.encode()).digest()[:4], "big") % blocks
    return str(ipaddress.IPv4Network((int(protocol.CLUSTER_SUPERNET.network_address) + index * 256, 24)))


def node_address(subnet: str, rank: int) -> str:
    return str(ipaddress.IPv4Network(subnet)[rank + 1])


def _state(cluster: Cluster) -> dict[str, Any]:
    return dict(cluster.private_network or {"state": "pending", "members": {}, "pairs": []})


def _issue(session: Session | AsyncSession, member_host: str, rental_id: str, command: protocol.AnyCommand) -> str:
    row = commands.new_command(session, host_id=member_host, command=command, rental_id=rental_id)
    session.info.setdefault(ISSUED, []).append(row.id)
    return row.id


def _event(session: Session | AsyncSession, cluster: Cluster, cause: str, at: datetime | None = None) -> None:
    event = ClusterEvent(cluster_id=cluster.id, from_state=cluster.state, to_state=cluster.state, cause=cause)
    if at is not None:
        event.at = at
    session.add(event)


def follow(session: Session, cluster: Cluster, members: Sequence[Rental]) -> None:
    """Send round 1 to each current container member that runs and has not joined, and ``delete_cluster`` to
    every joined member once the cluster is over. ``members``: the current member of each rank."""
    kind = (cluster.workload or {}).get("kind")
    if kind != "container":
        if cluster.private_network is None:
            cluster.private_network = {"state": "none", "reason": f"a {kind or 'hold'} cluster runs no container: it has no private network",
                                       "members": {}, "pairs": []}  # fmt: skip
        return
    net = _state(cluster)
    entries: dict[str, dict[str, Any]] = {rank: dict(entry) for rank, entry in net.get("members", {}).items()}
    changed = False
    if cluster.state in _OVER:
        for rank, entry in sorted(entries.items()):
            if entry.get("step") not in ("deleted", None) and entry.get("host_id"):
                delete = protocol.DeleteCluster(cluster_id=cluster.id, rental_id=entry["rental_id"])
                _issue(session, entry["host_id"], entry["rental_id"], delete)
                entries[rank] = {**entry, "step": "deleted"}
                changed = True
        if changed or net.get("state") not in ("deleted", "none"):
            net.update(state="deleted", members=entries)
            cluster.private_network = net
        return
    if cluster.subnet is None:
        cluster.subnet = subnet_for(cluster.id)
    for member in members:
        if member.state != "running" or member.host_id is None or member.node_rank is None:
            continue
        rank = str(member.node_rank)
        if entries.get(rank, {}).get("rental_id") == member.id:
            continue
        entries[rank] = _join(session, cluster, member, entries)
        changed = True
    if changed:
        net.update(state="creating", reason=None, members=entries)
        cluster.private_network = net


def _join(session: Session, cluster: Cluster, member: Rental, entries: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
    """Round 1 for ``member``: its entry, with its host's path facts and (on a declared fabric) its fabric address."""
    assert member.host_id is not None and member.node_rank is not None and cluster.subnet is not None
    host = session.get(Host, member.host_id)
    facts = cluster_paths.member_facts(host.owner_id, host.facts) if host is not None else cluster_paths.member_facts("", None)
    joining: dict[str, Any] = {"rental_id": member.id, "host_id": member.host_id, "step": "creating", "public_key": None, "endpoint": None,
                             "net": facts, "fabric_address": None}  # fmt: skip
    fabric = None
    if facts["fabric"]:
        address = cluster_paths.allocate(facts["fabric_subnet"], _fabric_addresses(session, cluster, entries, facts), rental_id=member.id)
        if address is not None:
            fabric = protocol.FabricJoin(name=facts["fabric"], address=address)
            joining["fabric_address"] = address
        else:
            log.warning("cluster %s: fabric %s of host %s has no free address: node-%d uses its tunnel", cluster.id, facts["fabric"],
                        member.host_id, member.node_rank)  # fmt: skip
    command = protocol.CreateCluster(cluster_id=cluster.id, rental_id=member.id, rank=member.node_rank, node_count=cluster.node_count,
                                     subnet=cluster.subnet, fabric=fabric)  # fmt: skip
    return {**joining, "command_id": _issue(session, member.host_id, member.id, command)}


def _fabric_addresses(session: Session, cluster: Cluster, entries: Mapping[str, Mapping[str, Any]], facts: Mapping[str, Any]) -> set[str]:
    """The addresses live members hold on the fabric ``facts`` names (this cluster's, and every other cluster's not over)."""
    key = cluster_paths.fabric_key({"net": facts})
    networks = [cluster.private_network or {}, {"members": entries}]
    rows = session.execute(select(Cluster.private_network).where(Cluster.id != cluster.id, Cluster.state.not_in(_OVER),
                                                                 Cluster.private_network.is_not(None)))  # fmt: skip
    networks += [net for (net,) in rows if net]
    return {e["fabric_address"] for net in networks for e in (net.get("members") or {}).values()
            if e.get("fabric_address") and e.get("step") != "deleted" and cluster_paths.fabric_key(e) == key}  # fmt: skip


async def apply_result(
    session: AsyncSession, command: CommandRow, *, ok: bool, detail: str, data: Mapping[str, object], at: datetime, sign: Signer | None = None,
) -> None:
    """What a member's agent answered to ``create_cluster`` / ``delete_cluster``: its step, and the next round when one is complete.

    ``sign`` signs the ``wg`` stream tokens each peer gets for reaching the others through the relays (the CA's
    ``sign_connect_token``); without it peers get no relay path."""
    cluster_id = command.args.get("cluster_id")
    cluster = await session.get(Cluster, cluster_id, with_for_update=True) if isinstance(cluster_id, str) else None
    if cluster is None or command.kind != "create_cluster" or cluster.state in _OVER:
        return
    net = _state(cluster)
    entries: dict[str, dict[str, Any]] = {rank: dict(entry) for rank, entry in net.get("members", {}).items()}
    rank = str(command.args.get("rank"))
    entry = entries.get(rank)
    if entry is None or entry.get("rental_id") != command.rental_id or entry.get("step") in ("failed", "deleted"):
        return  # a replaced member's, or an answer already overtaken
    if not ok:
        entries[rank] = {**entry, "step": "failed", "error": detail[:300]}
        reason = f"node-{rank} ({command.rental_id}): {detail[:300]}"
        net.update(state="failed", reason=reason, members=entries)
        cluster.private_network = net
        _event(session, cluster, f"private network failed: {reason}", at)
        log.warning("cluster %s: private network failed: %s", cluster.id, reason)
        return
    try:
        joined = protocol.ClusterJoined.model_validate(dict(data))
    except ValidationError:
        joined = None
    peers, measure = bool(command.args.get("peers")), bool(command.args.get("measure"))
    if joined is None:
        return
    if not peers:
        entries[rank] = {**entry, "step": "keyed", "public_key": joined.public_key, "endpoint": joined.endpoints[0] if joined.endpoints else None,
                         "relay_url": joined.relay_url, "tunnel": joined.tunnel or "wireguard-go"}  # fmt: skip
        for other, e in entries.items():  # a member joined late (a replacement): everyone needs its key again
            if other != rank and e.get("step") in ("peered", "measured"):
                entries[other] = {**e, "step": "keyed"}
    elif not measure:
        entries[rank] = {**entry, "step": "peered"}
    else:
        if entry.get("step") == "measuring":
            await _learn_links(session, cluster, entries, entry, joined.measurements, at)
        entries[rank] = {**entry, "step": "measured"}
        pairs = [p for p in net.get("pairs", []) if p.get("a") != int(rank)]
        pairs += [{"a": int(rank), "b": m.rank, "rtt_ms": m.rtt_ms, "mbit_s": m.mbit_s, "loss_pct": m.loss_pct, "error": m.error,
                   "path": m.path}
                  for m in joined.measurements]  # fmt: skip
        net["pairs"] = sorted(pairs, key=lambda p: (p["a"], p["b"]))
    net["members"] = entries
    _next_round(session, cluster, net, at, sign)
    cluster.private_network = net


async def _learn_links(
    session: AsyncSession, cluster: Cluster, entries: Mapping[str, Mapping[str, Any]], entry: Mapping[str, Any],
    measurements: Sequence[protocol.PeerMeasurement], at: datetime,
) -> None:
    """Each pair this member measured, as a pair of hosts in ``host_links``: only peers of this measure round (a rank
    whose member was replaced since is joining again: its new host was not what was measured)."""
    measured: dict[tuple[str, str], host_links.Figures] = {}
    for m in measurements:
        peer = entries.get(str(m.rank), {})
        if peer.get("step") not in ("measuring", "measured") or not peer.get("host_id") or peer["host_id"] == entry["host_id"]:
            continue
        if m.error:
            figures = host_links.Figures(reachable=False, error=m.error, path=m.path)
        elif m.rtt_ms is None and m.mbit_s is None and m.loss_pct is None:
            continue  # nothing measured, nothing learnt
        else:
            figures = host_links.Figures(rtt_ms=m.rtt_ms, mbit_s=m.mbit_s, loss_pct=m.loss_pct, path=m.path)
        measured[host_links.pair(entry["host_id"], peer["host_id"])] = figures
    await host_links.record(session, measured, cluster_id=cluster.id, at=at)


def _check_bounds(session: AsyncSession, cluster: Cluster, net: dict[str, Any], at: datetime) -> None:
    """The measured pairs against the cluster's bounds: ``within_bounds`` (None without bounds), ``out_of_bounds``
    (each pair and bound), and one event naming the pairs outside them. The cluster keeps running: the renter decides."""
    bounds = host_links.NetworkBounds.of(cluster.network)
    if not bounds:
        net.update(within_bounds=None, out_of_bounds=[])
        return
    outside: list[dict[str, Any]] = []
    lines: list[str] = []
    for measured in net.get("pairs", []):
        breaches = bounds.breaches(host_links.Figures.of_pair(measured))
        outside += [{"a": measured["a"], "b": measured["b"], **b.view()} for b in breaches]
        if breaches:
            lines.append(f"network between node-{measured['a']} and node-{measured['b']}: {', '.join(b.text() for b in breaches)}")
    net.update(within_bounds=not outside, out_of_bounds=outside)
    if lines:
        shown = "; ".join(lines[:_MAX_PAIRS_TOLD]) + (f"; and {len(lines) - _MAX_PAIRS_TOLD} more pairs" if len(lines) > _MAX_PAIRS_TOLD else "")
        _event(session, cluster, f"{shown} (the network bounds were {bounds.text()}; the cluster keeps running: stop it if that "
                                 "does not suit you)", at)  # fmt: skip
        log.info("cluster %s: network out of bounds: %s", cluster.id, shown)


def _next_round(session: AsyncSession, cluster: Cluster, net: dict[str, Any], at: datetime, sign: Signer | None) -> None:
    """Send round 2 (or 3) to everyone once every rank has finished the round before; mark the network up after round 3."""
    entries: dict[str, dict[str, Any]] = net["members"]
    if len(entries) < cluster.node_count or any(e.get("step") in ("creating", "failed", "deleted") for e in entries.values()):
        return
    steps = {e["step"] for e in entries.values()}
    if steps & {"peering", "measuring"}:
        return  # a round in flight
    if "keyed" in steps:
        # Round 2 one member at a time, lowest rank first: each sets its peers once those before it know it, so the
        # handshakes it starts are answered (set at once, crossing handshakes left pairs without a session for 5-15 s).
        first = min((r for r, e in entries.items() if e["step"] == "keyed"), key=int)
        _send_round(session, cluster, {first: entries[first]}, measure=False, peers=_peers(cluster, entries, at, sign),
                    everyone=entries)
        net["state"] = "connecting"
    elif steps == {"peered"}:
        _send_round(session, cluster, entries, measure=True, peers=_peers(cluster, entries, at, sign), everyone=entries)
        net["state"] = "measuring"
    elif steps == {"measured"} and net.get("state") != "up":
        net.update(state="up", measured_at=at.isoformat())
        figures = ", ".join(_pair_text(p) for p in net.get("pairs", []))
        _event(session, cluster, f"private network up on {cluster.subnet}: {figures or 'nothing measured'}", at)
        _check_bounds(session, cluster, net, at)


def _peers(cluster: Cluster, entries: dict[str, dict[str, Any]], at: datetime, sign: Signer | None) -> dict[int, protocol.ClusterPeer]:
    """Each member as a peer: its key, its direct endpoint and, with ``sign``, its relay and a ``wg`` token for it."""
    peers = {}
    for rank, e in entries.items():
        relay: dict[str, str | None] = {}
        if sign is not None and e.get("relay_url"):
            claims = new_claims(account_id=cluster.renter_id, rental_id=e["rental_id"], host_id=e["host_id"], kind="wg", port=RELAY_PORT,
                                expires_at=(at + RELAY_TOKEN_TTL).timestamp())  # fmt: skip
            relay = {"relay_url": e["relay_url"], "relay_token": sign(claims)}
        peers[int(rank)] = protocol.ClusterPeer(rank=int(rank), public_key=e["public_key"], endpoint=e.get("endpoint"), **relay)
    return peers


def _send_round(session: AsyncSession, cluster: Cluster, entries: dict[str, dict[str, Any]], *, measure: bool,
                peers: dict[int, protocol.ClusterPeer], everyone: Mapping[str, Mapping[str, Any]]) -> None:  # fmt: skip
    """``create_cluster`` with ``peers`` to each of ``entries`` (of ``everyone``, the cluster's members): each peer
    with its fabric address where the pair's path is the fabric (``cluster_paths.same_fabric``)."""
    assert cluster.subnet is not None
    for rank, entry in sorted(entries.items()):
        fabric = protocol.FabricJoin(name=entry["net"]["fabric"], address=entry["fabric_address"]) if entry.get("fabric_address") else None
        command = protocol.CreateCluster(
            cluster_id=cluster.id, rental_id=entry["rental_id"], rank=int(rank), node_count=cluster.node_count, subnet=cluster.subnet,
            peers=[_on_path(peer, entry, everyone.get(str(other), {})) for other, peer in sorted(peers.items()) if other != int(rank)],
            measure=measure, fabric=fabric,
        )  # fmt: skip
        entry.update(step="measuring" if measure else "peering", command_id=_issue(session, entry["host_id"], entry["rental_id"], command))


def _on_path(peer: protocol.ClusterPeer, entry: Mapping[str, Any], other: Mapping[str, Any]) -> protocol.ClusterPeer:
    """The peer as ``entry``'s member gets it: with its fabric address where the pair's path is the fabric."""
    if cluster_paths.same_fabric(entry, other):
        return peer.model_copy(update={"fabric_address": other["fabric_address"]})
    return peer


def _pair_text(pair: Mapping[str, Any]) -> str:
    if pair.get("error"):
        return f"node-{pair['a']} ↔ node-{pair['b']}: {pair['error']}"
    return f"node-{pair['a']} ↔ node-{pair['b']} {pair.get('rtt_ms')} ms, {pair.get('mbit_s')} Mbit/s"


def view(cluster: Cluster) -> dict[str, Any]:
    """The cluster view's ``private_network``: its state, range, each node's address and step, the pairwise figures, and
    whether they keep the cluster's network bounds (``within_bounds``: None without bounds or before the network is up)."""
    net = _state(cluster)
    members = net.get("members", {})
    return {
        "state": net.get("state"),
        "reason": net.get("reason"),
        "subnet": cluster.subnet,
        "nodes": [
            {"node": f"node-{rank}", "address": node_address(cluster.subnet, rank) if cluster.subnet else None,
             "rental_id": members.get(str(rank), {}).get("rental_id"), "step": members.get(str(rank), {}).get("step"),
             "fabric": (members.get(str(rank), {}).get("net") or {}).get("fabric"),
             "fabric_address": members.get(str(rank), {}).get("fabric_address")}
            for rank in range(cluster.node_count)
        ],
        "pairs": [{k: p.get(k) for k in ("a", "b", "rtt_ms", "mbit_s", "loss_pct", "error", "path")} for p in net.get("pairs", [])],
        "links": cluster_paths.links(members, net.get("pairs", []), cluster.node_count),  # every pair's path
        "measured_at": net.get("measured_at"),
        "within_bounds": net.get("within_bounds"),
        "out_of_bounds": net.get("out_of_bounds", []),
    }
