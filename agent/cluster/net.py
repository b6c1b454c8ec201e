"""A cluster's private network on this host: one WireGuard tunnel per member container.

``create_cluster`` joins a member (a running container rental) to its cluster's network; this
module does it with **userspace WireGuard** (Debian's ``wireguard-go``), because this kind of
host has no kernel WireGuard module while ``/dev/net/tun`` is everywhere (docs/clusters.md says
why WireGuard rather than a tunnel of our own over the relays' streams):

1. a key pair (X25519, ``cryptography``) and a ``wireguard-go -f wgm<hash>`` process, started
   in a session of its own (it outlives an agent restart, as the containers do); its UDP
   socket stays in the host's namespace, so the tunnel's packets travel the host's network;
2. its private key and a kernel-chosen listen port set through its UAPI socket
   (``/var/run/wireguard/<name>.sock``, WireGuard's text protocol: no ``wg`` needed);
3. the interface moved into the container's network namespace (``ip link set … netns PID``),
   renamed ``cluster0``, given the subnet's address ``rank + 1`` and brought up there
   (``wireguard-go`` notices "up" across namespaces by design); the rest of the container's
   network is untouched;
4. ``node-0 … node-(N-1)`` written into the container's ``/etc/hosts`` (the engine's file on
   the host, written in place: the container sees a bind mount of it; never through a path the
   container could turn into a symlink);
5. a small responder on ``<address>:29499`` inside the container, which the other members
   measure round trip and throughput against.

The answer is the member's public key and the UDP endpoint its peers reach it at. Once every
member answered, the master sends ``create_cluster`` again with the peers: those new or changed
since the last command are set, those gone removed, the others left with their sessions (each
allowed only its own ``/32``: WireGuard's cryptokey routing drops anything else, so no other
tenant's packet enters, and this member reaches nothing but its cluster through the tunnel),
and, with ``measure``, each member measures its peers of higher rank: the round trips at once,
then the throughputs one peer at a time. Setting a peer starts a handshake at once (the
persistent keepalive); a member that has not got its peers yet drops it (retried after 5 s),
and handshakes of two members configured in the same instant can cross and leave the pair
without a session for 5–15 s in wireguard-go 0.0.20220316: send the peers member after member,
then ``measure``. ``delete_cluster`` (or the member's stop) ends the ``wireguard-go`` process; its
interface goes with it. What was made is kept in ``<work>/clusters/<rental>.json`` (the key
0600), so a restarted agent answers the same request the same and can still take it down; a
tunnel found gone (``wireguard-go`` ended, or the container has a new network namespace) is made
again with the same key and port, and the peers it had.

Since issue 42 (docs/clusters.md, "Three paths"): where the host has kernel WireGuard (``kernel``), the tunnel is a
kernel interface made and moved the same way, configured through ``agent.cluster.wgkernel`` (the same UAPI requests,
as ``wg`` command lines); where the command gives the member a fabric address, it also gets ``fabric0`` on the
provider's declared fabric (``agent.cluster.fabric``), and the peers the master put on the fabric with it are routed
there (their cluster addresses unchanged) instead of through the tunnel.

Beside it: ``agent.cluster.wgcontrol`` (keys, the UAPI requests and the ``wireguard-go`` process), ``agent.cluster.hosts`` (the
``/etc/hosts`` block), ``agent.cluster.probe`` (the responder
and the round-trip and throughput probes), ``agent.cluster.relay`` (a peer reached through the
relays when no handshake completes directly, or with ``direct=False``), ``agent.cluster.tools`` (running ``ip``,
``nsenter``, ``wg``) and ``agent.cluster.paths`` (what the hello says of this host's paths).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hashlib
import json
import logging
import os
import shutil
import signal
import socket
import ssl
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Final

from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey
from cryptography.hazmat.primitives.serialization import Encoding, NoEncryption, PrivateFormat

from agent.cluster import fabric, wgkernel
from agent.cluster.hosts import hosts_block, rewrite_hosts
from agent.cluster.probe import MEASURE_PORT, UdpEcho, attempt, echo, loss_to, respond, throughput
from agent.cluster.relay import RelayedPeer
from agent.cluster.tools import run
from agent.cluster.wgcontrol import (
    UAPI_DIR,
    ClusterNetworkError,
    address_of,
    clear_stale_socket,
    exited,
    hex_key,
    is_wireguard,
    peer_state_text,
    peer_states_of,
    uapi_lines,
    uapi_peer_changes,
    uapi_set,
    wg_public_key,
)
from agent.runtimes.netns import NamespaceUnavailable, socket_in_namespace
from shared import protocol

log = logging.getLogger(__name__)

INTERFACE: Final = "cluster0"  # the tunnel's name inside the member's container


@dataclass
class MemberNet:
    """One member's tunnel on this host: what ``create_cluster`` made (kept as JSON, the key aside)."""

    cluster_id: str
    rental_id: str
    rank: int
    subnet: str
    node_count: int
    device: str  # wireguard-go's own name for it (its UAPI socket's)
    listen_port: int
    public_key: str
    wg_pid: int
    peers: list[dict[str, object]] = field(default_factory=list)
    relayed: list[int] = field(default_factory=list)  # peer ranks reached through the relays
    netns: int = 0  # the inode of the container's network namespace the interface went into (0: not known)
    fabric_address: str | None = None  # its ``fabric0``'s address (``agent.cluster.fabric``; None: not on the fabric)
    fabric_peers: dict[str, list[str]] = field(default_factory=dict)  # rank → [cluster address, fabric address]
    tunnel: str = "wireguard-go"  # or "kernel": kernel WireGuard (``agent.cluster.wgkernel``), where the host has it
    ns_pid: int = 0  # kernel: a process in the namespace its interface moved into (0: not moved yet)

    @property
    def address(self) -> str:
        return address_of(self.subnet, self.rank)


def device_name(rental_id: str) -> str:
    """``wgm`` + 10 hex digits of the rental's id: unique on the host, under the kernel's 15 characters."""
    return "wgm" + hashlib.sha256(rental_id.encode()).hexdigest()[:10]


class ClusterNetworks:
    """The cluster tunnels of this host's member containers (``create``/``delete``, ``forget_rental`` on a stop).

    ``namespace(rental_id)`` is the workload manager's ``container_namespace``; ``local_address()`` the
    address this host reaches its relay from (the endpoint its peers are told); ``relay_url()`` where peers reach
    this host's members through its relay (``wss://…/v1/connect``), ``relay_tls()`` the TLS context for a peer's
    relay (``agent.cluster.relay``). ``direct=False`` offers peers no direct endpoint and uses none of theirs:
    every tunnel then goes through the relays (for hosts known to be unreachable, and to test that path).
    """

    def __init__(
        self,
        work_dir: Path,
        namespace: Callable[[str], Awaitable[tuple[int, Path] | None]],
        local_address: Callable[[], str | None],
        *,
        wireguard_go: str = "wireguard-go",
        uapi_dir: Path = UAPI_DIR,
        relay_url: Callable[[], str | None] = lambda: None,
        relay_tls: Callable[[], ssl.SSLContext] | None = None,
        direct: bool = True,
        fabric: protocol.FabricDeclaration | None = None,
        tunnel_mtu: int | None = None,
        kernel: bool = False,
        measure_bytes: int = 8 << 20,
        measure_timeout: float = 15.0,
        handshake_timeout: float = 6.0,
    ) -> None:
        self.dir = work_dir / "clusters"
        self.namespace = namespace
        self.local_address = local_address
        self.wireguard_go = wireguard_go
        self.uapi_dir = uapi_dir
        self.relay_url = relay_url
        self.relay_tls = relay_tls
        self.direct = direct
        self.fabric = fabric  # the trusted fabric this host's provider declared (None: none)
        self.tunnel_mtu = tunnel_mtu  # cluster0's MTU (None: wireguard-go's own, 1420)
        self.kernel = kernel  # kernel WireGuard for new tunnels (the hello's facts said the host has it, and ``wg`` is here)
        self.measure_bytes = measure_bytes
        self.measure_timeout = measure_timeout
        self.handshake_timeout = handshake_timeout
        self._relays: dict[tuple[str, int], RelayedPeer] = {}  # (member rental, peer rank) → its path through the relays
        self._responders: dict[str, asyncio.Server] = {}
        self._echoes: dict[str, asyncio.DatagramTransport] = {}  # the loss probes' UDP echo, beside each responder
        self._locks: dict[str, asyncio.Lock] = {}

    # ---- the commands ------------------------------------------------------------------------

    async def create(self, command: protocol.CreateCluster) -> protocol.ClusterJoined:
        """Make (or find) the member's tunnel, set its peers when given and measure them with ``measure``.

        Raises ``ClusterNetworkError`` (never a bare ``OSError``: the command fails, the agent goes on)."""
        async with self._locks.setdefault(command.rental_id, asyncio.Lock()):
            found = await self.namespace(command.rental_id)
            if found is None:
                raise ClusterNetworkError(f"rental {command.rental_id} runs no container here: a cluster's network joins container members only")
            pid, hosts = found
            net = self._load(command.rental_id)
            if net is not None and (net.cluster_id, net.rank, net.subnet) != (command.cluster_id, command.rank, command.subnet):
                raise ClusterNetworkError(f"rental {command.rental_id} is already node-{net.rank} of cluster {net.cluster_id}")
            try:
                return await self._create(command, net, pid, hosts)
            except OSError as exc:  # a socket, file, namespace or program that failed: this command's error
                raise ClusterNetworkError(f"rental {command.rental_id}'s cluster network could not be made: {exc}") from exc

    async def _create(self, command: protocol.CreateCluster, net: MemberNet | None, pid: int, hosts: Path) -> protocol.ClusterJoined:
        if net is None:
            net = await self._make(command, pid, hosts)
        elif not self._intact(net, pid):
            await self._close_relays(net.rental_id)
            net = await self._remake(net, command, pid, hosts)
        await self._ensure_responder(net, pid)
        await self._join_fabric(net, command, pid)
        measurements: list[protocol.PeerMeasurement] = []
        if command.peers:
            peers = [peer if self.direct else peer.model_copy(update={"endpoint": None}) for peer in command.peers]
            # Only what changed: the same peers again (the command resent, or with ``measure``) keep their sessions, and a
            # new relay token alone changes nothing for wireguard-go.
            old = [_bare(protocol.ClusterPeer.model_validate(peer)) for peer in net.peers]
            change = uapi_peer_changes(old, [_bare(peer) for peer in peers], net.subnet)
            if change is not None:
                await self._close_relays(net.rental_id)  # the paths are chosen again below
                await self._request(net, change)
            net.peers = [peer.model_dump(mode="json") for peer in peers]
            self._save(net)
            await self._set_fabric_peers(net, peers, pid)
            await self._choose_paths(net, [p for p in peers if str(p.rank) not in net.fabric_peers], wait=command.measure)
            if command.measure:
                measurements = await self._measure(net, pid, [p for p in peers if p.rank > net.rank])
        address = self.local_address() if self.direct else None
        return protocol.ClusterJoined(
            public_key=net.public_key, address=net.address, listen_port=net.listen_port,
            endpoints=[_endpoint(address, net.listen_port)] if address else [], relay_url=self.relay_url(), peers=len(net.peers),
            measurements=measurements, tunnel="kernel" if net.tunnel == "kernel" else "wireguard-go", fabric_address=net.fabric_address,
        )  # fmt: skip

    def listen_port(self, rental_id: str) -> int | None:
        """The UDP port of the member's ``wireguard-go`` (where a ``wg`` stream's datagrams go); ``None``: not a member here."""
        net = self._load(rental_id)
        return net.listen_port if net is not None and net.listen_port else None

    def path_to(self, rental_id: str, rank: int) -> str:
        net = self._load(rental_id)
        if net is not None and str(rank) in net.fabric_peers:
            return "fabric"
        return "relay" if (rental_id, rank) in self._relays else "direct"

    async def _join_fabric(self, net: MemberNet, command: protocol.CreateCluster, pid: int) -> None:
        """``fabric0`` on the declared fabric when the command gives the member an address on it (again when the
        address changed); a command for a fabric this host does not declare fails."""
        if command.fabric is None or command.fabric.address == net.fabric_address:
            return
        if self.fabric is None or self.fabric.name != command.fabric.name:
            raise ClusterNetworkError(f"this host declares no fabric {command.fabric.name} (its fabric: {self.fabric.name if self.fabric else 'none'})")
        await fabric.join(pid, net.rental_id, self.fabric, command.fabric.address, net.address)
        net.fabric_address, net.fabric_peers = command.fabric.address, {}
        self._save(net)

    async def _set_fabric_peers(self, net: MemberNet, peers: list[protocol.ClusterPeer], pid: int) -> None:
        """The peers the master put on the fabric with this member get their routes and rules (``fabric.set_peers``)."""
        wanted = {str(p.rank): [address_of(net.subnet, p.rank), p.fabric_address] for p in peers if p.fabric_address and net.fabric_address}
        if wanted == net.fabric_peers:
            return
        as_pairs = {int(rank): (pair[0], pair[1]) for rank, pair in wanted.items()}
        await fabric.set_peers(pid, net.address, as_pairs, {int(r): (p[0], p[1]) for r, p in net.fabric_peers.items()})
        net.fabric_peers = wanted
        self._save(net)

    async def _choose_paths(self, net: MemberNet, peers: list[protocol.ClusterPeer], *, wait: bool) -> None:
        """Direct where a peer has an endpoint and a handshake with it completes (``wait``: within ``handshake_timeout``);
        else through the relays, when the master gave the way (``relay_url`` and token)."""
        relayable = [p for p in peers if p.relay_url and p.relay_token and (net.rental_id, p.rank) not in self._relays]
        now = [p for p in relayable if p.endpoint is None]
        later = [p for p in relayable if p.endpoint is not None]
        if later and wait:
            deadline = time.monotonic() + self.handshake_timeout
            while later and time.monotonic() < deadline:
                done = {key: int(state.get("last_handshake_time_sec", "0")) for key, state in (await self._peer_states(net)).items()}
                later = [p for p in later if not done.get(p.public_key)]
                if later:
                    await asyncio.sleep(0.2)
            now += later
        for peer in now:
            await self._relay(net, peer)

    async def _relay(self, net: MemberNet, peer: protocol.ClusterPeer) -> None:
        if self.relay_tls is None or peer.relay_url is None or peer.relay_token is None:
            return
        relayed = RelayedPeer(peer.relay_url, peer.relay_token, net.listen_port, self.relay_tls())
        port = relayed.start()
        self._relays[(net.rental_id, peer.rank)] = relayed
        await self._request(net, f"set=1\npublic_key={hex_key(peer.public_key)}\nendpoint=127.0.0.1:{port}\n\n")
        if peer.rank not in net.relayed:
            net.relayed.append(peer.rank)
            self._save(net)
        log.info("rental %s: node-%d reached through the relays (%s)", net.rental_id, peer.rank, peer.relay_url)

    async def _close_relays(self, rental_id: str) -> None:
        for key in [k for k in self._relays if k[0] == rental_id]:
            await self._relays.pop(key).close()

    async def delete(self, command: protocol.DeleteCluster) -> protocol.ClusterLeft:
        async with self._locks.setdefault(command.rental_id, asyncio.Lock()):
            net = self._load(command.rental_id)
            if net is None or net.cluster_id != command.cluster_id:
                return protocol.ClusterLeft(deleted=False)
            await self._take_down(net)
            return protocol.ClusterLeft(deleted=True)

    async def forget_rental(self, rental_id: str) -> None:
        """The rental stopped: its tunnel (if any) goes."""
        async with self._locks.setdefault(rental_id, asyncio.Lock()):
            net = self._load(rental_id)
            if net is not None:
                await self._take_down(net)
        self._locks.pop(rental_id, None)

    async def resume(self) -> None:
        """After a restart: answer measurements again for the tunnels that outlived the agent; forget the dead ones."""
        if not self.dir.is_dir():
            return
        for path in sorted(self.dir.glob("*.json")):
            net = self._load(path.stem)
            if net is None:
                continue
            found = await self.namespace(net.rental_id)
            if found is None or not self._intact(net, found[0]):
                await self._take_down(net)
                continue
            with contextlib.suppress(OSError, NamespaceUnavailable):
                await self._ensure_responder(net, found[0])
            for peer in [protocol.ClusterPeer.model_validate(p) for p in net.peers]:
                if peer.rank in net.relayed:
                    with contextlib.suppress(OSError, ClusterNetworkError):
                        await self._relay(net, peer)

    async def close(self) -> None:
        """Stop answering measurements and carrying relayed datagrams; the tunnels stay (as the containers do) for the
        next agent, which opens the relayed paths again (``resume``)."""
        for relayed in self._relays.values():
            await relayed.close()
        self._relays.clear()
        for server in self._responders.values():
            server.close()
        self._responders.clear()
        for transport in self._echoes.values():
            transport.close()
        self._echoes.clear()

    # ---- making and taking down ---------------------------------------------------------------

    def _intact(self, net: MemberNet, pid: int) -> bool:
        """Whether the member's tunnel still works: its ``wireguard-go`` runs (not a process that took its pid) and its
        interface is in the container's namespace of now (a restarted container has a new one, without it)."""
        if net.tunnel == "kernel":
            return net.netns == _netns_inode(pid) and wgkernel.has_interface(pid, INTERFACE)
        return is_wireguard(net.wg_pid, net.device) and net.netns in (0, _netns_inode(pid))

    async def _remake(self, net: MemberNet, command: protocol.CreateCluster, pid: int, hosts: Path) -> MemberNet:
        """The tunnel is gone (``wireguard-go`` ended, or the container got a new namespace): make it again with the
        same key and, when free, the same port, so the answer stays the same and the peers set earlier apply again."""
        log.warning("rental %s: its cluster tunnel is gone (wireguard-go ended or the container's network changed); making it again",
                    net.rental_id)  # fmt: skip
        private_raw = self._load_key(net.rental_id)
        peers = [protocol.ClusterPeer.model_validate(peer) for peer in net.peers]
        await self._take_down(net)
        remade = await self._make(command, pid, hosts, private_raw=private_raw, listen_port=net.listen_port)
        if peers:
            await self._request(remade, uapi_set(None, peers, remade.subnet))
            remade.peers = net.peers
            self._save(remade)
        return remade

    async def _make(self, command: protocol.CreateCluster, pid: int, hosts: Path, *, private_raw: bytes | None = None,
                    listen_port: int = 0) -> MemberNet:  # fmt: skip
        kernel = self.kernel
        if not kernel and shutil.which(self.wireguard_go) is None:
            raise ClusterNetworkError("wireguard-go is not installed on this host (apt-get install wireguard-go); the cluster has no private network here")
        device = device_name(command.rental_id)
        if not kernel and not await clear_stale_socket(self.uapi_dir / f"{device}.sock"):
            raise ClusterNetworkError(f"another wireguard-go already serves {device} (rental {command.rental_id}) without this agent's record; not started twice")
        private = X25519PrivateKey.from_private_bytes(private_raw) if private_raw is not None else X25519PrivateKey.generate()
        private_raw = private.private_bytes(Encoding.Raw, PrivateFormat.Raw, NoEncryption())
        process = None if kernel else await asyncio.create_subprocess_exec(
            self.wireguard_go, "-f", device, stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.DEVNULL, start_new_session=True, env={**os.environ, "LOG_LEVEL": "error"},
        )  # fmt: skip
        net = MemberNet(
            cluster_id=command.cluster_id, rental_id=command.rental_id, rank=command.rank, subnet=command.subnet,
            node_count=command.node_count, device=device, listen_port=0, public_key=wg_public_key(private),
            wg_pid=process.pid if process is not None else 0, netns=_netns_inode(pid), tunnel="kernel" if kernel else "wireguard-go",
        )  # fmt: skip
        self._save(net, private_raw)  # first: a failure below can still take it down by its pid
        try:
            if process is None:
                await run("ip", "link", "add", device, "type", "wireguard")  # its UDP socket stays in the host's namespace
            else:
                await self._wait_for_socket(device, process)
            try:
                await self._request(net, uapi_set(private_raw.hex(), None, command.subnet, listen_port=listen_port))
            except ClusterNetworkError:
                if not listen_port:
                    raise
                await self._request(net, uapi_set(private_raw.hex(), None, command.subnet, listen_port=0))  # taken meanwhile
            net.listen_port = int((await self._request(net, "get=1\n\n")).get("listen_port", "0"))
            inside = ("nsenter", f"--net=/proc/{pid}/ns/net", "ip")
            await run("ip", "link", "set", device, "netns", str(pid))
            await run(*inside, "link", "set", device, "name", INTERFACE)
            net.ns_pid = pid if kernel else 0
            await run(*inside, "address", "add", f"{net.address}/24", "dev", INTERFACE)
            if self.tunnel_mtu is not None:
                await run(*inside, "link", "set", INTERFACE, "mtu", str(self.tunnel_mtu))
            await run(*inside, "link", "set", INTERFACE, "up")
            await asyncio.to_thread(rewrite_hosts, hosts, hosts_block(command.subnet, command.node_count))
        except BaseException:
            await self._take_down(net)
            raise
        self._save(net)
        log.info("rental %s joined cluster %s as node-%d (%s, UDP port %d)", net.rental_id, net.cluster_id, net.rank, net.address, net.listen_port)
        return net

    async def _wait_for_socket(self, device: str, process: asyncio.subprocess.Process, timeout: float = 5.0) -> None:
        """Until ``wireguard-go`` answers on its control socket: the file appears when it is bound, a moment before it
        listens (a request in between was refused)."""
        path = self.uapi_dir / f"{device}.sock"
        deadline = time.monotonic() + timeout
        while True:
            if path.exists():
                with contextlib.suppress(ConnectionRefusedError, FileNotFoundError):
                    _, writer = await asyncio.open_unix_connection(str(path))
                    writer.close()
                    return
            if process.returncode is not None or time.monotonic() > deadline:
                raise ClusterNetworkError(
                    "wireguard-go could not make the tunnel (it needs root or CAP_NET_ADMIN and /dev/net/tun)"
                    if process.returncode is not None else f"wireguard-go did not open its control socket within {timeout:g}s"
                )  # fmt: skip
            await asyncio.sleep(0.02)

    async def _take_down(self, net: MemberNet, *, stop_timeout: float = 5.0) -> None:
        """End the member's ``wireguard-go`` (its interface goes with it) and wait for it to have ended, so that the
        answer comes when the tunnel is gone and a new one for the rental never meets the old one's socket."""
        await self._close_relays(net.rental_id)
        server = self._responders.pop(net.rental_id, None)
        if server is not None:
            server.close()
        echo_transport = self._echoes.pop(net.rental_id, None)
        if echo_transport is not None:
            echo_transport.close()
        if net.tunnel == "kernel":
            await wgkernel.take_down(net.device, INTERFACE, net.ns_pid if net.ns_pid and _netns_inode(net.ns_pid) == net.netns else None)
        ours = net.tunnel != "kernel" and is_wireguard(net.wg_pid, net.device)
        for sig, wait_s in ((signal.SIGTERM, stop_timeout), (signal.SIGKILL, 2.0)):
            if not is_wireguard(net.wg_pid, net.device):
                break
            with contextlib.suppress(ProcessLookupError):
                os.kill(net.wg_pid, sig)
            deadline = time.monotonic() + wait_s
            while is_wireguard(net.wg_pid, net.device):
                if time.monotonic() > deadline:
                    break
                await asyncio.sleep(0.02)
        if is_wireguard(net.wg_pid, net.device):
            log.error("rental %s: wireguard-go (pid %d) did not end after SIGKILL", net.rental_id, net.wg_pid)
        deadline = time.monotonic() + 2.0
        while ours and not exited(net.wg_pid):  # its command line goes first, its files (socket, TUN device) a moment later
            if time.monotonic() > deadline:
                break
            await asyncio.sleep(0.01)
        await clear_stale_socket(self.uapi_dir / f"{net.device}.sock")
        found = await self.namespace(net.rental_id)
        if net.fabric_address is not None:
            with contextlib.suppress(OSError, ClusterNetworkError):
                await fabric.leave(found[0] if found is not None else None, net.rental_id)
        if found is not None:
            with contextlib.suppress(OSError, ClusterNetworkError):
                await asyncio.to_thread(rewrite_hosts, found[1], None)
        self._drop(net)
        log.info("rental %s left cluster %s", net.rental_id, net.cluster_id)

    # ---- measuring ------------------------------------------------------------------------------

    async def _ensure_responder(self, net: MemberNet, pid: int) -> None:
        server = self._responders.get(net.rental_id)
        if server is not None and server.is_serving():
            return

        def listen() -> socket.socket:
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((net.address, MEASURE_PORT))
            sock.listen(16)
            return sock

        def bind_udp() -> socket.socket:
            sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
            sock.bind((net.address, MEASURE_PORT))
            return sock

        sock = await socket_in_namespace(pid, listen, name="cluster-responder")
        self._responders[net.rental_id] = await asyncio.start_server(respond, sock=sock)
        old = self._echoes.pop(net.rental_id, None)
        if old is not None:
            old.close()
        udp = await socket_in_namespace(pid, bind_udp, name="cluster-echo")
        self._echoes[net.rental_id], _ = await asyncio.get_running_loop().create_datagram_endpoint(UdpEcho, sock=udp)

    async def _measure(self, net: MemberNet, pid: int, peers: list[protocol.ClusterPeer]) -> list[protocol.PeerMeasurement]:
        """The round trips to every peer first (at once: a few bytes each, and where waiting for handshakes happens),
        then the throughputs one peer at a time: a throughput run beside a round trip inflated the round trip tenfold
        (0.3 → 10 ms here), and two beside each other share the link."""
        targets = {peer.rank: address_of(net.subnet, peer.rank) for peer in peers}
        rtts = await asyncio.gather(*(attempt(pid, target, echo, timeout=self.measure_timeout) for target in targets.values()))
        measurements = []
        for (rank, target), (rtt_ms, unanswered) in zip(targets.items(), rtts, strict=True):
            if unanswered is not None:
                why = (f"node-{rank} did not answer through the tunnel within {self.measure_timeout:g}s ({unanswered[:160]}; "
                       f"{await self._peer_text(net, peers, rank)})")  # fmt: skip
                measurements.append(protocol.PeerMeasurement(rank=rank, error=why, path=self.path_to(net.rental_id, rank)))
                continue
            loss_pct = await loss_to(pid, target)
            tries = functools.partial(attempt, pid, target, timeout=self.measure_timeout)
            mbit_s, failed = await throughput(tries, self.measure_bytes) if self.measure_bytes else (None, None)
            error = None if failed is None else f"node-{rank} answered, but no throughput run finished within {self.measure_timeout:g}s ({failed[:120]})"
            measurements.append(protocol.PeerMeasurement(rank=rank, rtt_ms=rtt_ms, mbit_s=mbit_s, loss_pct=loss_pct, error=error,
                                                         path=self.path_to(net.rental_id, rank)))  # fmt: skip
        return measurements

    async def _peer_text(self, net: MemberNet, peers: list[protocol.ClusterPeer], rank: int) -> str:
        """What this member's ``wireguard-go`` says of the peer of ``rank`` (its handshake, bytes each way, endpoint)."""
        key = next((p.public_key for p in peers if p.rank == rank), None)
        relayed = self._relays.get((net.rental_id, rank))
        path = "" if relayed is None else (
            "; the relay path is open" if relayed.connected.is_set() else f"; the relay path is not open ({relayed.last_error or 'not yet tried'})"
        )  # fmt: skip
        try:
            states = await self._peer_states(net)
        except ClusterNetworkError as exc:
            return str(exc) + path
        return peer_state_text(states.get(key) if key else None, time.time()) + path

    # ---- the tunnel's control: wireguard-go's UAPI socket, or kernel WireGuard through ``wg`` -----------------------

    async def _lines(self, net: MemberNet, text: str) -> list[tuple[str, str]]:
        if net.tunnel == "kernel":
            return await wgkernel.request(INTERFACE if net.ns_pid else net.device, text, netns_pid=net.ns_pid or None)
        return await uapi_lines(net.device, text, directory=self.uapi_dir)

    async def _request(self, net: MemberNet, text: str) -> dict[str, str]:
        return dict(await self._lines(net, text))

    async def _peer_states(self, net: MemberNet) -> dict[str, dict[str, str]]:
        return peer_states_of(await self._lines(net, "get=1\n\n"))

    # ---- the record ------------------------------------------------------------------------------

    def _path(self, rental_id: str) -> Path:
        return self.dir / f"{rental_id}.json"

    def _save(self, net: MemberNet, private_raw: bytes | None = None) -> None:
        self.dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        if private_raw is not None:
            key = self.dir / f"{net.rental_id}.key"
            fd = os.open(key, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
            with os.fdopen(fd, "wb") as out:
                out.write(private_raw)
        tmp = self._path(net.rental_id).with_suffix(".tmp")
        tmp.write_text(json.dumps(asdict(net)))
        tmp.replace(self._path(net.rental_id))

    def _load_key(self, rental_id: str) -> bytes | None:
        try:
            key = (self.dir / f"{rental_id}.key").read_bytes()
        except OSError:
            return None
        return key if len(key) == 32 else None

    def _load(self, rental_id: str) -> MemberNet | None:
        try:
            return MemberNet(**json.loads(self._path(rental_id).read_text()))
        except (OSError, ValueError, TypeError):
            return None

    def _drop(self, net: MemberNet) -> None:
        for path in (self._path(net.rental_id), self.dir / f"{net.rental_id}.key"):
            path.unlink(missing_ok=True)


def _bare(peer: protocol.ClusterPeer) -> protocol.ClusterPeer:
    """The peer as ``wireguard-go`` knows it (rank, key, endpoint): its relay and token are the agent's own business."""
    return peer.model_copy(update={"relay_url": None, "relay_token": None})


def _endpoint(address: str, port: int) -> str:
    return f"[{address}]:{port}" if ":" in address else f"{address}:{port}"


def _netns_inode(pid: int) -> int:
    """The inode of process ``pid``'s network namespace (0: not readable)."""
    try:
        return os.stat(f"/proc/{pid}/ns/net").st_ino
    except OSError:
        return 0
