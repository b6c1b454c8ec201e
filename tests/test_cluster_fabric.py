"""The trusted fabric path (``agent.cluster.fabric``) on a real Docker engine, with real interfaces, as root.

The "fabric": a bridge of this module with a veth in it (its carrier) and an address of the provider's own on it
(their host's, ``.1``), standing for the private network between a provider's hosts. Two members of one cluster and a
member of another cluster, each a container on a network of its own, are on it (``fabric0``); the pair of the
cluster goes over it, and nobody else reaches them or the provider's address through it. The path facts
(``agent.cluster.paths``) and the master's path choice (``cluster_paths``) are pure and tested beside it.
"""

from __future__ import annotations

import asyncio
import base64
import os
import secrets
import shutil
import signal
import subprocess
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import pytest_asyncio
from pydantic import ValidationError

from agent.cluster import paths, wgkernel
from agent.cluster.fabric import FABRIC_INTERFACE, filter_rules
from agent.cluster.net import ClusterNetworks, device_name
from agent.cluster.wgcontrol import ClusterNetworkError, peer_states_of, uapi_peer_changes, uapi_set
from agent.runtimes.containerconfig import create_body
from agent.runtimes.containeropts import ContainerOptions, PreparedImage
from master.services.lifecycle import cluster_paths
from shared import protocol
from shared.settings import AgentSettings
from tests import dockerengine
from tests.helpers import eventually
from tests.test_clusternet import (
    TOKEN_PORT,
    exec_in,
    free_subnets,
    namespace,
    read_token,
    run_in,
    start_container,
    wireguard_pids,
)


@dataclass
class Fabric:
    networks: ClusterNetworks
    declaration: protocol.FabricDeclaration
    bridge: str
    cluster_id: str
    subnet: str
    members: list[str]
    other: str
    token: str
    fabric_addresses: list[str]  # members', then the other's
    joined: list[protocol.ClusterJoined] = field(default_factory=list)
    measured: list[protocol.ClusterJoined] = field(default_factory=list)

    def create(self, rank: int, *, peers: bool = False, measure: bool = False) -> protocol.CreateCluster:
        return protocol.CreateCluster(
            cluster_id=self.cluster_id, rental_id=self.members[rank], rank=rank, node_count=2, subnet=self.subnet, measure=measure,
            fabric=protocol.FabricJoin(name=self.declaration.name, address=self.fabric_addresses[rank]),
            peers=[protocol.ClusterPeer(rank=1 - rank, public_key=self.joined[1 - rank].public_key, endpoint=self.joined[1 - rank].endpoints[0],
                                        fabric_address=self.fabric_addresses[1 - rank])] if peers else [],
        )  # fmt: skip


def _ip(*argv: str) -> None:
    subprocess.run(["ip", *argv], check=True, capture_output=True, timeout=10)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def fabric(docker_image: str) -> AsyncIterator[Fabric]:
    if os.geteuid() != 0 or shutil.which("wireguard-go") is None:
        pytest.fail("the fabric tests need root (interfaces move into containers) and wireguard-go (the tunnel beside the fabric)")
    tag = secrets.token_hex(3)
    owner = f"test-cfab-{tag}"
    bridge = f"gmtfab{tag}"
    octet = 16 + secrets.randbelow(200)
    subnet, other_subnet = free_subnets(2)
    declaration = protocol.FabricDeclaration(name="test-fabric", parent=bridge, subnet=f"10.250.{octet}.0/24")
    work = Path(f"/tmp/gpumarket-test-cfab-{tag}")
    s = Fabric(
        networks=ClusterNetworks(work, namespace, lambda: "127.0.0.1", fabric=declaration), declaration=declaration, bridge=bridge,
        cluster_id=f"c-cfab-{tag}", subnet=subnet, members=[f"gm-cfab-{tag}-n{r}" for r in range(2)], other=f"gm-cfab-{tag}-other",
        token=f"token-{secrets.token_hex(8)}", fabric_addresses=[f"10.250.{octet}.{n}" for n in (10, 11, 12)],
    )  # fmt: skip
    everyone = [*s.members, s.other]
    try:
        _ip("link", "add", bridge, "type", "bridge")
        _ip("link", "add", f"{bridge}c", "type", "veth", "peer", "name", f"{bridge}p")
        _ip("link", "set", f"{bridge}p", "master", bridge)
        for link in (bridge, f"{bridge}p", f"{bridge}c"):
            _ip("link", "set", link, "up")
        _ip("address", "add", f"10.250.{octet}.1/24", "dev", bridge)  # the provider's host on its fabric
        await asyncio.gather(*(asyncio.to_thread(start_container, name, docker_image, owner) for name in everyone))
        s.joined = [await s.networks.create(s.create(rank)) for rank in range(2)]
        await s.networks.create(protocol.CreateCluster(
            cluster_id=f"c-cfab-{tag}-other", rental_id=s.other, rank=0, node_count=2, subnet=other_subnet,
            fabric=protocol.FabricJoin(name=declaration.name, address=s.fabric_addresses[2]),
        ))  # fmt: skip
        for rank in range(2):
            await s.networks.create(s.create(rank, peers=True))
        s.measured = [await s.networks.create(s.create(rank, peers=True, measure=True)) for rank in range(2)]
        await asyncio.to_thread(exec_in, s.members[1], "nc", "-ll", "-p", str(TOKEN_PORT), "-e", "echo", s.token, detach=True)
        yield s
    finally:
        for name in everyone:
            try:
                await s.networks.forget_rental(name)
            except Exception as exc:  # the clean-up goes on
                print(f"forget_rental({name}) failed: {exc!r}")
        await s.networks.close()
        for pid in wireguard_pids({device_name(name) for name in everyone}):
            os.kill(pid, signal.SIGKILL)
        await asyncio.to_thread(dockerengine.remove_owned, owner)
        for link in (f"{bridge}c", bridge):
            await asyncio.to_thread(subprocess.run, ["ip", "link", "del", link], capture_output=True, timeout=10, check=False)
        shutil.rmtree(work, ignore_errors=True)


@pytest.mark.asyncio(loop_scope="module")
class TestFabricPath:
    """Two members of a cluster on one declared fabric, a member of another cluster on it too."""

    async def test_the_pair_goes_over_the_fabric_and_is_measured_there(self, fabric: Fabric) -> None:
        """node-1's cluster address is routed through fabric0 in node-0, and the measure says ``fabric`` with figures."""
        assert [j.fabric_address for j in fabric.joined] == fabric.fabric_addresses[:2]
        [measurement] = fabric.measured[0].measurements
        assert (measurement.rank, measurement.path, measurement.error) == (1, "fabric", None)
        assert measurement.mbit_s is not None and measurement.mbit_s > 0
        route = await run_in(fabric.members[0], "ip", "route", "get", fabric.joined[1].address)
        assert f"dev {FABRIC_INTERFACE}" in route and fabric.fabric_addresses[1] in route, route

    async def test_members_reach_each_other_and_nobody_else_does(self, fabric: Fabric) -> None:
        """node-0 reads node-1's token by name; the other cluster's member does not, at node-1's cluster or fabric address."""
        assert await eventually(lambda: read_token(fabric.members[1], "127.0.0.1"), timeout=10, what="node-1's token server") == fabric.token
        assert await read_token(fabric.members[0], "node-1") == fabric.token
        for target in (fabric.joined[1].address, fabric.fabric_addresses[1]):
            assert fabric.token not in await read_token(fabric.other, target)

    async def test_a_member_reaches_no_address_of_the_fabric_but_its_peers(self, fabric: Fabric) -> None:
        """Not the provider's host (``.1``), not the other cluster's member: fabric0 lets out only the peers' traffic."""
        provider = fabric.declaration.subnet.replace(".0/24", ".1")

        async def serve(_reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            writer.write(f"{fabric.token}\n".encode())
            await writer.drain()
            writer.close()

        server = await asyncio.start_server(serve, provider, TOKEN_PORT)
        try:
            _reader, writer = await asyncio.open_connection(provider, TOKEN_PORT)  # the provider's service answers
            assert (await _reader.readline()).decode().strip() == fabric.token
            writer.close()
            assert fabric.token not in await read_token(fabric.members[0], provider)
        finally:
            server.close()
        await asyncio.to_thread(exec_in, fabric.other, "nc", "-ll", "-p", str(TOKEN_PORT), "-e", "echo", fabric.token, detach=True)
        assert await eventually(lambda: read_token(fabric.other, "127.0.0.1"), timeout=10, what="the other's token server") == fabric.token
        assert fabric.token not in await read_token(fabric.members[0], fabric.fabric_addresses[2])

    async def test_the_fabric_interface_has_no_ipv6(self, fabric: Fabric) -> None:
        assert "inet6" not in await run_in(fabric.members[0], "ip", "-6", "address", "show", "dev", FABRIC_INTERFACE)

    async def test_forget_takes_fabric0_away(self, fabric: Fabric) -> None:
        """The other cluster's member leaves: its fabric0 goes with its tunnel."""
        await fabric.networks.forget_rental(fabric.other)
        code, _ = await asyncio.to_thread(exec_in, fabric.other, "ip", "link", "show", FABRIC_INTERFACE)
        assert code != 0


class TestFilterRules:
    def test_only_the_peers_cluster_addresses_pass_on_fabric0(self) -> None:
        rules = filter_rules("10.70.1.1", {1: ("10.70.1.2", "10.250.0.11")})
        assert "-A INPUT -i fabric0 -s 10.70.1.2/32 -d 10.70.1.1/32 -j ACCEPT" in rules
        assert "-A OUTPUT -o fabric0 -s 10.70.1.1/32 -d 10.70.1.2/32 -j ACCEPT" in rules
        assert rules.index("-A INPUT -i fabric0 -j DROP") > rules.index("-A INPUT -i fabric0 -s")
        assert "10.250.0.11" not in rules  # fabric addresses are next hops, never allowed as such
        assert rules.rstrip().endswith("COMMIT")


class TestPathFacts:
    async def test_rdma_devices_are_listed_from_sys_and_dev(self, tmp_path: Path) -> None:
        """``/sys/class/infiniband``'s names, and only ``/dev/infiniband``'s character devices (not a stray file)."""
        (tmp_path / "sys/class/infiniband/mlx5_0").mkdir(parents=True)
        (tmp_path / "sys/class/infiniband/mlx5_1").mkdir()
        devices = tmp_path / "dev/infiniband"
        devices.mkdir(parents=True)
        if os.geteuid() == 0:
            os.mknod(devices / "uverbs0", 0o600 | 0o020000, os.makedev(231, 192))
            os.mknod(devices / "rdma_cm", 0o600 | 0o020000, os.makedev(10, 58))
        (devices / "README").write_text("not a device")
        names, nodes = paths.rdma_devices(tmp_path)
        assert names == ["mlx5_0", "mlx5_1"]
        assert nodes == (["/dev/infiniband/rdma_cm", "/dev/infiniband/uverbs0"] if os.geteuid() == 0 else [])

    async def test_a_fabric_whose_parent_is_missing_is_not_offered(self, tmp_path: Path) -> None:
        (tmp_path / "sys/class/net/eth1").mkdir(parents=True)
        here = protocol.FabricDeclaration(name="dc1", parent="eth1", subnet="10.200.0.0/16")
        facts = await paths.detect(here, root=tmp_path, probe_kernel=False, wireguard_go="no-such-wireguard-go")
        assert (facts.fabric, facts.kernel_wireguard, facts.wireguard_go) == (here, False, False)
        gone = await paths.detect(here.model_copy(update={"parent": "eth9"}), root=tmp_path, probe_kernel=False)
        assert gone.fabric is None and "eth9 does not exist" in gone.reason

    async def test_a_loaded_module_is_kernel_wireguard(self, tmp_path: Path) -> None:
        (tmp_path / "sys/module/wireguard").mkdir(parents=True)
        assert (await paths.detect(None, root=tmp_path, probe_kernel=False)).kernel_wireguard

    @pytest.mark.parametrize("declaration", [
        {"name": "dc1", "parent": "eth1", "subnet": "8.8.8.0/24"},  # not private
        {"name": "dc1", "parent": "eth1", "subnet": "10.200.0.1/16"},  # host bits set
        {"name": "dc1", "parent": "eth1", "subnet": "10.200.0.0/30"},  # too small
        {"name": "DC 1", "parent": "eth1", "subnet": "10.200.0.0/16"},
        {"name": "dc1", "parent": "eth1; reboot", "subnet": "10.200.0.0/16"},
        {"name": "dc1", "parent": "eth1", "subnet": "10.200.0.0/16", "vlan": 4095},
        {"name": "dc1", "parent": "eth1", "subnet": "10.200.0.0/16", "mtu": 9000},  # one grammar: no unknown field
    ])  # fmt: skip
    def test_the_grammar_refuses_bad_declarations(self, declaration: dict[str, object]) -> None:
        with pytest.raises(ValidationError):
            protocol.FabricDeclaration.model_validate(declaration)


class TestRdmaPassthrough:
    """A fabric member's container gets the RDMA devices its start command lists, where the host has them (the device
    list only: no RDMA hardware here)."""

    def test_the_container_gets_the_devices_and_unbounded_locked_memory(self) -> None:
        image = PreparedImage(id="sha256:x", user="", env=(), size=1, pulled=False)
        spec = protocol.ContainerWorkload(image="ubuntu:24.04")
        devices = ["/dev/infiniband/rdma_cm", "/dev/infiniband/uverbs0"]
        body = create_body(ContainerOptions(), "r-1", [], spec, image, None, user="u", name="n", labels={}, device_requests=False,
                           storage_opt=False, devices=devices)  # fmt: skip
        host = body["HostConfig"]
        assert host["Devices"] == [{"PathOnHost": d, "PathInContainer": d, "CgroupPermissions": "rw"} for d in devices]
        assert host["Ulimits"] == [{"Name": "memlock", "Soft": -1, "Hard": -1}] and host["CapDrop"] == ["ALL"]
        plain = create_body(ContainerOptions(), "r-1", [], spec, image, None, user="u", name="n", labels={}, device_requests=False,
                            storage_opt=False)["HostConfig"]  # fmt: skip
        assert "Devices" not in plain and "Ulimits" not in plain

    def test_only_character_devices_present_here_are_passed(self, tmp_path: Path) -> None:
        nodes = tmp_path / "dev/infiniband"
        nodes.mkdir(parents=True)
        (nodes / "notadevice").write_text("")
        if os.geteuid() == 0:
            os.mknod(nodes / "uverbs0", 0o600 | 0o020000, os.makedev(231, 192))
        asked = ["/dev/infiniband/uverbs0", "/dev/infiniband/uverbs1", "/dev/infiniband/notadevice", "/dev/infiniband/../../etc/passwd"]
        assert paths.present_devices(asked, root=tmp_path) == (["/dev/infiniband/uverbs0"] if os.geteuid() == 0 else [])

    def test_the_start_command_refuses_a_device_outside_dev_infiniband(self) -> None:
        with pytest.raises(ValidationError):
            protocol.StartWorkload(rental_id="r-1", gpu_uuids=[], rdma_devices=["/dev/sda"])


class TestAgentSettings:
    def test_cluster_fabric_is_checked_at_load_and_names_the_field(self) -> None:
        good = {"name": "dc1", "parent": "eth1", "subnet": "10.200.0.0/16", "vlan": 120}
        assert AgentSettings(cluster_fabric=good).cluster_fabric == good
        with pytest.raises(ValidationError, match="cluster_fabric"):
            AgentSettings(cluster_fabric={**good, "subnet": "8.8.8.0/24"})


def _entry(owner: str, fabric: str | None, address: str | None, *, kernel: bool = False, tunnel: str = "wireguard-go") -> dict[str, object]:
    return {"net": {"owner_id": owner, "fabric": fabric, "fabric_subnet": "10.200.0.0/16" if fabric else None, "kernel": kernel},
            "fabric_address": address, "tunnel": tunnel}  # fmt: skip


class TestPathChoice:
    def test_one_providers_fabric_is_the_path_another_providers_same_name_is_not(self) -> None:
        a, b = _entry("p1", "dc1", "10.200.0.2"), _entry("p1", "dc1", "10.200.0.3")
        assert cluster_paths.choose(a, b) == "fabric"
        assert cluster_paths.choose(a, _entry("p2", "dc1", "10.200.0.4")) == "wireguard-go"
        assert cluster_paths.choose(a, _entry("p1", "dc2", "10.200.0.4")) == "wireguard-go"

    def test_kernel_where_both_made_kernel_tunnels_and_relay_where_measured_so(self) -> None:
        both = _entry("p1", None, None, kernel=True, tunnel="kernel"), _entry("p2", None, None, kernel=True, tunnel="kernel")
        assert cluster_paths.choose(*both) == "kernel"
        assert cluster_paths.choose(both[0], _entry("p2", None, None)) == "wireguard-go"
        assert cluster_paths.choose(*both, measured="relay") == "relay"

    def test_links_list_every_pair(self) -> None:
        entries = {"0": _entry("p1", "dc1", "10.200.0.2"), "1": _entry("p1", "dc1", "10.200.0.3"), "2": _entry("p2", None, None)}
        found = cluster_paths.links(entries, [{"a": 0, "b": 2, "path": "relay"}], 4)
        assert [(x["a"], x["b"], x["path"]) for x in found] == [
            (0, 1, "fabric"), (0, 2, "relay"), (0, 3, None), (1, 2, "wireguard-go"), (1, 3, None), (2, 3, None)]

    def test_allocation_skips_used_addresses_and_says_when_full(self) -> None:
        first = cluster_paths.allocate("10.200.0.0/28", [], rental_id="r-a")
        assert first is not None and first not in ("10.200.0.0", "10.200.0.1", "10.200.0.15")
        every = [first]
        while (more := cluster_paths.allocate("10.200.0.0/28", every, rental_id="r-a")) is not None:
            every.append(more)
        assert sorted(every, key=lambda a: int(a.rsplit(".", 1)[1])) == [f"10.200.0.{n}" for n in range(2, 15)]


KEY_A = "yAnz5TF+lXXJte14tji3zlMNq+hd2rYUIgJBgB3fBmk="
KEY_B = "xTIBA5rboUvnH4htodjb6e697QjLERt1NAB4mZqp8Dg="


class TestKernelWireguard:
    """``wgkernel`` turns ``net``'s UAPI requests into ``wg`` command lines and ``wg show dump`` into UAPI answers."""

    def test_a_set_with_key_port_and_peers_is_one_wg_set(self) -> None:
        peers = [protocol.ClusterPeer(rank=1, public_key=KEY_B, endpoint="203.0.113.7:51820")]
        request = uapi_set(bytes(32).hex(), peers, "10.70.1.0/24", listen_port=0)
        argv, private = wgkernel.wg_set_argv("cluster0", request, current_peers=[KEY_A, KEY_B])
        assert argv == ["wg", "set", "cluster0", "private-key", "/dev/stdin", "listen-port", "0", "peer", KEY_A, "remove",
                        "peer", KEY_B, "persistent-keepalive", "25", "endpoint", "203.0.113.7:51820", "allowed-ips", "10.70.1.2/32"]  # fmt: skip
        assert private == base64.b64encode(bytes(32)).decode()

    def test_changes_remove_and_set_only_what_changed(self) -> None:
        old = [protocol.ClusterPeer(rank=1, public_key=KEY_A)]
        new = [protocol.ClusterPeer(rank=2, public_key=KEY_B)]
        change = uapi_peer_changes(old, new, "10.70.1.0/24")
        assert change is not None
        argv, private = wgkernel.wg_set_argv("cluster0", change)
        assert private is None
        assert argv == ["wg", "set", "cluster0", "peer", KEY_A, "remove", "peer", KEY_B, "persistent-keepalive", "25",
                        "allowed-ips", "10.70.1.3/32"]  # fmt: skip

    def test_a_dump_reads_as_the_uapi_answer_peer_states_reads(self) -> None:
        dump = (f"{base64.b64encode(bytes(32)).decode()}\t{KEY_A}\t41234\toff\n"
                f"{KEY_B}\t(none)\t203.0.113.7:51820\t10.70.1.2/32\t1700000000\t1200\t3400\t25\n")  # fmt: skip
        lines = wgkernel.dump_lines(dump)
        assert dict(lines)["listen_port"] == "41234"
        states = peer_states_of(lines)
        assert states[KEY_B]["last_handshake_time_sec"] == "1700000000"
        assert (states[KEY_B]["rx_bytes"], states[KEY_B]["tx_bytes"], states[KEY_B]["endpoint"]) == ("1200", "3400", "203.0.113.7:51820")

    def test_an_unknown_uapi_line_is_refused(self) -> None:
        with pytest.raises(ClusterNetworkError):
            wgkernel.wg_set_argv("cluster0", "set=1\nfwmark=7\n\n")
