"""A host's cluster network paths, as its hello reports them, and the fabric a member joins (docs/clusters.md,
"Three paths").

Three paths join two members of a cluster, chosen per pair by the master (``master.services.lifecycle.cluster_paths``):

- ``fabric``: both hosts are one provider's and declare the same **trusted fabric** (a private network between their
  hosts: a name, the parent interface, the members' subnet, a VLAN): each member gets an interface on it, unencrypted;
- ``kernel``: both hosts have kernel WireGuard; ``wireguard-go``: the userspace tunnel (``relay`` when no handshake
  completes directly).

One strict grammar for all of it: the master refuses a hello whose facts do not parse, as it refuses any other bad
body. Imports only ``base``.
"""

from __future__ import annotations

import ipaddress
from typing import Annotated, Final, Literal

from pydantic import BeforeValidator, Field, model_validator

from shared.protocol.base import StrictModel

PathName = Literal["fabric", "kernel", "wireguard-go", "relay"]
TunnelKind = Literal["kernel", "wireguard-go"]
FABRIC_NAME_PATTERN: Final = r"^[a-z0-9][a-z0-9._-]{0,62}$"
INTERFACE_PATTERN: Final = r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,14}$"  # the kernel's IFNAMSIZ: 15 characters
MAX_RDMA_DEVICES: Final = 64
# A fabric's members' subnet: private (RFC 1918 or RFC 6598), from /8 to /28 (a cluster member per address).
_FABRIC_RANGES: Final = tuple(ipaddress.IPv4Network(n) for n in ("10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16", "100.64.0.0/10"))


def _fabric_subnet(value: object) -> object:
    try:
        network = ipaddress.IPv4Network(value)  # strict: host bits set is an error, not a guess
    except (ValueError, TypeError):
        raise ValueError(f"'subnet' {value!r:.40} must be an IPv4 network like 10.200.0.0/16") from None
    if not 8 <= network.prefixlen <= 28 or not any(network.subnet_of(r) for r in _FABRIC_RANGES):
        raise ValueError(f"'subnet' {value!r:.40} must be a private IPv4 network (RFC 1918 or 100.64.0.0/10) from /8 to /28")
    return str(network)


def _ipv4(value: object) -> object:
    try:
        return str(ipaddress.IPv4Address(value))
    except (ValueError, TypeError):
        raise ValueError(f"{value!r:.40} must be an IPv4 address") from None


FabricName = Annotated[str, Field(pattern=FABRIC_NAME_PATTERN, description="The fabric's name, the same on every host of it.")]
InterfaceName = Annotated[str, Field(pattern=INTERFACE_PATTERN)]
FabricSubnet = Annotated[str, Field(max_length=18), BeforeValidator(_fabric_subnet)]
IPv4Text = Annotated[str, Field(max_length=15), BeforeValidator(_ipv4)]
RdmaDevice = Annotated[str, Field(pattern=r"^/dev/infiniband/[A-Za-z0-9_.-]{1,64}$")]


class FabricDeclaration(StrictModel):
    """A provider's private network between their hosts, as the agent's config declares it: members get an
    interface on ``parent`` (on its VLAN ``vlan`` where given) with an address of ``subnet`` (addresses the provider
    keeps for cluster members, not their hosts'); ``rdma``: members get the host's RDMA devices (``/dev/infiniband/*``)."""

    name: FabricName
    parent: InterfaceName
    subnet: FabricSubnet
    vlan: Annotated[int, Field(ge=1, le=4094)] | None = None
    # RDMA verbs bypass the members' filter on ``fabric0`` (the adapter moves the bytes): the provider says with ``rdma``
    # that the fabric partitions RDMA per tenant itself (InfiniBand P_Keys, RoCE on per-tenant VLANs), and only then
    # do cluster members on it get the host's ``/dev/infiniband`` devices.
    rdma: bool = False


class ClusterNetworkFacts(StrictModel):
    """What this host offers a cluster's members, found at start: kernel WireGuard (the module loaded, or loadable:
    an interface of its type could be made in a scratch namespace), ``wireguard-go`` on the path, the fabric its
    provider declared (``None``: none), its RDMA devices (``/sys/class/infiniband``'s names, ``/dev/infiniband``'s
    character devices) and, in one line, why a path is missing."""

    kernel_wireguard: bool = False
    wireguard_go: bool = False
    fabric: FabricDeclaration | None = None
    rdma_names: list[Annotated[str, Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")]] = Field(default_factory=list, max_length=MAX_RDMA_DEVICES)
    rdma_devices: list[RdmaDevice] = Field(default_factory=list, max_length=MAX_RDMA_DEVICES)
    reason: Annotated[str, Field(max_length=512)] = ""


class FabricJoin(StrictModel):
    """``create_cluster``'s fabric part: the member's interface on the fabric ``name`` (the one its host declares)
    gets ``address`` (the master allocated it from the declared subnet: one per cluster member on the fabric)."""

    name: FabricName
    address: IPv4Text

    @model_validator(mode="after")
    def _usable(self) -> FabricJoin:
        if ipaddress.IPv4Address(self.address).is_unspecified:
            raise ValueError("'address' must be a member's address, not 0.0.0.0")
        return self
