"""Which path joins each pair of a cluster's members (docs/clusters.md, "Three paths"), from their hosts' hellos.

A host's ``facts["cluster_network"]`` is its hello's ``protocol.ClusterNetworkFacts`` (validated there). Per pair:

- ``fabric`` when both hosts are one provider's (the same owner) and declare the same fabric (by name): each member
  gets an address on it (``allocate``: one per cluster member on the fabric, never one a live member holds);
- else ``kernel`` where both hosts have kernel WireGuard and both members said they made a kernel tunnel;
- else ``wireguard-go``; and ``relay`` where the members measured the pair through the relays.

Pure functions of what ``cluster_network`` keeps in a cluster's ``private_network`` entries: imports nothing of ours
but the protocol.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable, Mapping
from typing import Any, Final

from shared import protocol

# What one WireGuard tunnel between two members carries at most, Mbit/s (bench/bench_clusters.py: wireguard-go between
# two namespaces on one host; kernel WireGuard does better, but no host here has proved it): a cluster asking for more
# between its members than this is placed on one fabric where one has room (``master.services.clusters.placement``).
TUNNEL_MAX_MBIT_S: Final = 2000.0
_RESERVED_HOSTS: Final = 1  # the subnet's first usable address: kept for the provider's gateway, if they have one


def member_facts(owner_id: str, facts: Mapping[str, Any] | None) -> dict[str, Any]:
    """What path choice needs of a member's host, kept in its ``private_network`` entry: owner, fabric, WireGuard."""
    network = (facts or {}).get("cluster_network")
    try:
        parsed = protocol.ClusterNetworkFacts.model_validate(network) if network is not None else None
    except ValueError:
        parsed = None  # stored by an older master, or altered: no fabric, no kernel path
    if parsed is None:
        return {"owner_id": owner_id, "fabric": None, "fabric_subnet": None, "kernel": False}
    fabric = parsed.fabric
    return {"owner_id": owner_id, "fabric": fabric.name if fabric else None, "fabric_subnet": fabric.subnet if fabric else None,
            "kernel": parsed.kernel_wireguard}  # fmt: skip


def fabric_key(entry: Mapping[str, Any]) -> str | None:
    """``owner:fabric`` of a member's host (``None``: not on a fabric): two hosts share a fabric only under one owner."""
    host = entry.get("net") or {}
    return f"{host['owner_id']}:{host['fabric']}" if host.get("fabric") else None


def same_fabric(a: Mapping[str, Any], b: Mapping[str, Any]) -> bool:
    key = fabric_key(a)
    return key is not None and key == fabric_key(b) and bool(a.get("fabric_address")) and bool(b.get("fabric_address"))


def choose(a: Mapping[str, Any], b: Mapping[str, Any], *, measured: str | None = None) -> protocol.PathName:
    """The path between the members of entries ``a`` and ``b`` (``measured``: the path their measure reported)."""
    if measured == "fabric" or (measured is None and same_fabric(a, b)):
        return "fabric"
    if measured == "relay":
        return "relay"
    if all((e.get("net") or {}).get("kernel") and e.get("tunnel") == "kernel" for e in (a, b)):
        return "kernel"
    return "wireguard-go"


def allocate(subnet: str, used: Iterable[str], *, rental_id: str) -> str | None:
    """An address of the fabric's ``subnet`` no live member uses, starting at a place of the rental's id (so retries
    and two masters mostly agree); ``None``: the subnet is full."""
    network = ipaddress.IPv4Network(subnet)
    taken = set(used)
    usable = network.num_addresses - 2 - _RESERVED_HOSTS
    if usable <= 0:
        return None
    start = int.from_bytes(rental_id.encode()[-4:].rjust(4, b"\0"), "big") % usable
    for step in range(usable):
        candidate = str(network.network_address + 1 + _RESERVED_HOSTS + (start + step) % usable)
        if candidate not in taken:
            return candidate
    return None


def links(entries: Mapping[str, Mapping[str, Any]], pairs: Iterable[Mapping[str, Any]], node_count: int) -> list[dict[str, Any]]:
    """Every pair of ranks with its path: measured where it was, else as chosen from the members' hosts."""
    measured = {(p["a"], p["b"]): p.get("path") for p in pairs}
    found: list[dict[str, Any]] = []
    for a in range(node_count):
        for b in range(a + 1, node_count):
            ea, eb = entries.get(str(a)), entries.get(str(b))
            if ea is None or eb is None:
                found.append({"a": a, "b": b, "path": None})
                continue
            found.append({"a": a, "b": b, "path": choose(ea, eb, measured=measured.get((a, b)) or measured.get((b, a)))})
    return found
