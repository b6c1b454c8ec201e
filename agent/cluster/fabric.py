"""A cluster member's interface on its provider's **trusted fabric** (docs/clusters.md, "Three paths").

A provider who declares a fabric (``agent.cluster_fabric``: a name, the parent interface of the private network
between their hosts, the subnet members' addresses come from, a VLAN) lets members of one cluster on two of their
hosts talk over it unencrypted, at the wire's rate. Here, for one member:

1. a **macvlan** (mode bridge) on the parent (on its VLAN's sub-interface ``fv<vlan>``, made once where the
   declaration names one) is made in the host's namespace and moved into the container's, renamed ``fabric0``, given
   the address the master allocated it (one per cluster member on the fabric) and no IPv6 at all (no link-local
   address: nothing of the fabric is reachable over IPv6);
2. before it comes up, the namespace's filter table is replaced (``iptables-restore``, atomically) so that
   ``fabric0`` carries only this cluster's traffic: in, from a peer's cluster address to this member's; out, from
   this member's to a peer's; everything else on it dropped, forwarded traffic too;
3. each fabric peer's cluster address (``node-N``, the subnet's ``rank + 1``) is routed through ``fabric0`` to the
   peer's fabric address (a ``/32`` beats the tunnel's ``/24``): the names, addresses and ports stay those of
   the tunnel, only the path changes.

The container cannot undo any of it: it runs with every capability dropped (no ``NET_ADMIN`` to change a route or
a rule, no ``NET_RAW`` to forge a packet). Other renters' members on the fabric have filters of their own that let
nothing but their cluster's addresses out. The provider's hosts on the fabric are never reachable from a member: its
filter lets out only packets to its peers' cluster addresses.
"""

from __future__ import annotations

import hashlib
import ipaddress
from collections.abc import Mapping
from typing import Final

from agent.cluster.tools import run
from agent.cluster.wgcontrol import ClusterNetworkError
from shared import protocol

FABRIC_INTERFACE: Final = "fabric0"  # the member's interface on the fabric, inside its container


def fabric_device(rental_id: str) -> str:
    """``gmf`` + 10 hex digits of the rental's id: the macvlan's name in the host's namespace, before it moves."""
    return "gmf" + hashlib.sha256(rental_id.encode()).hexdigest()[:10]


def filter_rules(own: str, peers: Mapping[int, tuple[str, str]]) -> str:
    """The member namespace's ``filter`` table, as ``iptables-restore`` reads it: ``fabric0`` carries only packets
    between this member's cluster address ``own`` and its fabric peers' (``peers``: rank → (cluster address, fabric
    address)); everything else on it is dropped. Other interfaces are not touched (the engine's rules for them are in
    the host's namespace, not this one)."""
    lines = ["*filter", ":INPUT ACCEPT [0:0]", ":FORWARD ACCEPT [0:0]", ":OUTPUT ACCEPT [0:0]"]
    for _rank, (cluster_address, _fabric) in sorted(peers.items()):
        lines.append(f"-A INPUT -i {FABRIC_INTERFACE} -s {cluster_address}/32 -d {own}/32 -j ACCEPT")
        lines.append(f"-A OUTPUT -o {FABRIC_INTERFACE} -s {own}/32 -d {cluster_address}/32 -j ACCEPT")
    lines += [f"-A INPUT -i {FABRIC_INTERFACE} -j DROP", f"-A OUTPUT -o {FABRIC_INTERFACE} -j DROP",
              f"-A FORWARD -i {FABRIC_INTERFACE} -j DROP", f"-A FORWARD -o {FABRIC_INTERFACE} -j DROP", "COMMIT", ""]  # fmt: skip
    return "\n".join(lines)


def _inside(pid: int, *argv: str) -> tuple[str, ...]:
    return ("nsenter", f"--net=/proc/{pid}/ns/net", *argv)


async def _lower(declaration: protocol.FabricDeclaration) -> str:
    """The interface members' macvlans hang from: the parent, or its VLAN's sub-interface (made once, kept)."""
    if declaration.vlan is None:
        return declaration.parent
    lower = f"fv{declaration.vlan}"
    if (await run("ip", "link", "show", lower, check=False))[0] != 0:
        await run("ip", "link", "add", "link", declaration.parent, "name", lower, "type", "vlan", "id", str(declaration.vlan))
    await run("ip", "link", "set", lower, "up")
    return lower


async def join(pid: int, rental_id: str, declaration: protocol.FabricDeclaration, address: str, own: str) -> None:
    """Give the member (the container of process ``pid``) ``fabric0`` with ``address`` on the declared fabric, filtered
    to nothing until its peers are set (``set_peers``). Raises ``ClusterNetworkError``."""
    network = ipaddress.IPv4Network(declaration.subnet)
    if ipaddress.IPv4Address(address) not in network:
        raise ClusterNetworkError(f"fabric address {address} is not in the fabric {declaration.name}'s subnet {declaration.subnet}")
    if (await run(*_inside(pid, "ip", "link", "show", FABRIC_INTERFACE), check=False))[0] == 0:
        await run(*_inside(pid, "ip", "link", "del", FABRIC_INTERFACE))  # an older one (an agent restarted midway): made again
    device = fabric_device(rental_id)
    await run("ip", "link", "del", device, check=False)
    lower = await _lower(declaration)
    await run("ip", "link", "add", device, "link", lower, "type", "macvlan", "mode", "bridge")
    try:
        await run("ip", "link", "set", device, "addrgenmode", "none")  # no IPv6 link-local address, ever
        await run("ip", "link", "set", device, "netns", str(pid))
    except BaseException:
        await run("ip", "link", "del", device, check=False)
        raise
    await run(*_inside(pid, "ip", "link", "set", device, "name", FABRIC_INTERFACE))
    await run(*_inside(pid, "iptables-restore"), stdin=filter_rules(own, {}).encode())
    await run(*_inside(pid, "sysctl", "-q", "-w", f"net.ipv6.conf.{FABRIC_INTERFACE}.disable_ipv6=1"), check=False)  # no IPv6 in the namespace: nothing to turn off
    await run(*_inside(pid, "ip", "address", "add", f"{address}/{network.prefixlen}", "dev", FABRIC_INTERFACE))
    await run(*_inside(pid, "ip", "link", "set", FABRIC_INTERFACE, "up"))


async def set_peers(pid: int, own: str, peers: Mapping[int, tuple[str, str]], old: Mapping[int, tuple[str, str]]) -> None:
    """Route each fabric peer's cluster address through ``fabric0`` to its fabric address and let only their traffic
    through (``filter_rules``); routes of peers no longer on the fabric go (their tunnel's ``/24`` takes over)."""
    for rank, (cluster_address, _fabric) in old.items():
        if rank not in peers:
            await run(*_inside(pid, "ip", "route", "del", f"{cluster_address}/32", "dev", FABRIC_INTERFACE), check=False)
    await run(*_inside(pid, "iptables-restore"), stdin=filter_rules(own, peers).encode())
    for cluster_address, fabric_address in peers.values():
        await run(*_inside(pid, "ip", "route", "replace", f"{cluster_address}/32", "via", fabric_address, "dev", FABRIC_INTERFACE,
                            "src", own))  # fmt: skip


async def leave(pid: int | None, rental_id: str) -> None:
    """Take the member's ``fabric0`` away (with its routes); its filter stays, dropping what ``fabric0`` would carry."""
    if pid is not None:
        await run(*_inside(pid, "ip", "link", "del", FABRIC_INTERFACE), check=False)
    await run("ip", "link", "del", fabric_device(rental_id), check=False)  # made, never moved (a failure midway)
