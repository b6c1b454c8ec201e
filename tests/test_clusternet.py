"""A cluster's private network (``agent.cluster.net``) on a real Docker engine with real ``wireguard-go``.

One module-wide setting: three member containers of one cluster and a member of another cluster, each on a Docker
network of its own (as the agent gives each rental), and a plain container in no cluster; the containers' names are
the rental ids. Phase 1 (no peers) for every member, then the peers member after member, then ``measure`` on every
member at once. The peers go one member at a time because setting a peer starts a handshake at once (the persistent
keepalive): a member without its peers yet drops it (retried after 5 s), and two members configured in the same
instant start handshakes that cross, which wireguard-go (0.0.20220316) can leave without a session for 5–15 s.
Reachability is checked at the application level, a token read back through ``nc``: this machine's
outbound network accepts any TCP connection, so a connection that succeeds proves nothing.

Nothing is skipped: the engine (``docker_image``), root and ``wireguard-go`` are required, and their absence fails.
Everything is labelled with the module's owner (``dockerengine.remove_owned``) and every ``wireguard-go`` started
here is ended, whatever happened.
"""

from __future__ import annotations

import asyncio
import base64
import ipaddress
import json
import os
import re
import secrets
import shutil
import signal
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import quote

import pytest
import pytest_asyncio
from pydantic import ValidationError

from agent.cluster.hosts import (
    HOSTS_BEGIN,
    HOSTS_END,
    MAX_HOSTS_BYTES,
    hosts_block,
    rewrite_hosts,
    with_hosts_block,
)
from agent.cluster.net import INTERFACE, ClusterNetworks, device_name
from agent.cluster.wgcontrol import (
    UAPI_DIR,
    ClusterNetworkError,
    peer_state_text,
    peer_states,
    uapi_peer_changes,
    uapi_set,
)
from shared import protocol
from shared.errors import ProtocolError
from shared.protocol.commands import WIREGUARD_KEY_PATTERN
from tests import dockerengine
from tests.helpers import eventually

NODES = 3
TOKEN_PORT = 7000
KEY_A = base64.b64encode(bytes(range(32))).decode()  # any 32 bytes are a valid WireGuard public key
KEY_B = base64.b64encode(bytes(range(32, 64))).decode()


# ---- the engine's side -----------------------------------------------------------------------------


def _json_request(method: str, path: str, payload: dict[str, Any] | None = None, *, timeout: float = 60.0) -> tuple[int, Any]:
    body = json.dumps(payload).encode() if payload is not None else None
    status, answer = dockerengine.request(method, path, body=body, headers={"Content-Type": "application/json"}, timeout=timeout)
    return status, (json.loads(answer) if answer.strip().startswith((b"{", b"[")) else answer)


def start_container(name: str, image: str, owner: str) -> None:
    """A container ``name`` running ``sleep`` on a bridge network of its own (also ``name``), both labelled ``owner``."""
    labels = {"gpumarket.owner": owner}
    status, answer = _json_request("POST", "/networks/create", {"Name": name, "Driver": "bridge", "Labels": labels})
    assert status == 201, answer
    status, answer = _json_request("POST", f"/containers/create?name={quote(name)}", {
        "Image": image, "Cmd": ["sleep", "100000"], "Labels": labels, "HostConfig": {"NetworkMode": name},
    })  # fmt: skip
    assert status == 201, answer
    status, answer = _json_request("POST", f"/containers/{quote(name)}/start")
    assert status == 204, answer


def exec_in(container: str, *argv: str, detach: bool = False, timeout: float = 30.0) -> tuple[int | None, str]:
    """``argv`` run in ``container`` through the engine: its exit code and output (stdout and stderr), or (``None``,
    "") at once with ``detach``."""
    status, answer = _json_request("POST", f"/containers/{quote(container)}/exec", {"Cmd": list(argv), "AttachStdout": True, "AttachStderr": True})
    assert status == 201, answer
    exec_id = answer["Id"]
    status, stream = dockerengine.request(
        "POST", f"/exec/{exec_id}/start", body=json.dumps({"Detach": detach, "Tty": False}).encode(),
        headers={"Content-Type": "application/json"}, timeout=timeout,
    )  # fmt: skip
    assert status == 200, stream
    if detach:
        return None, ""
    output = bytearray()
    while len(stream) >= 8:  # the engine's multiplexed stream: 8-byte headers (stream, size)
        size = int.from_bytes(stream[4:8], "big")
        output += stream[8 : 8 + size]
        stream = stream[8 + size :]
    status, info = _json_request("GET", f"/exec/{exec_id}/json")
    assert status == 200, info
    return info["ExitCode"], output.decode(errors="replace")


async def run_in(container: str, *argv: str, timeout: float = 30.0) -> str:
    """``argv``'s output in ``container``; fails the test when it exits non-zero."""
    code, output = await asyncio.to_thread(exec_in, container, *argv, timeout=timeout)
    assert code == 0, f"{argv} in {container} exited {code}: {output}"
    return output


async def read_token(container: str, host: str) -> str:
    """What ``nc`` in ``container`` reads from ``host:TOKEN_PORT`` (empty when nothing answers, or when this
    machine's proxy accepts the connection in the server's place)."""
    _, output = await asyncio.to_thread(exec_in, container, "timeout", "10", "nc", "-w", "3", host, str(TOKEN_PORT))
    return output.strip()


async def namespace(rental_id: str) -> tuple[int, Path] | None:
    """The ``namespace`` seam of ``ClusterNetworks``: the container named ``rental_id``'s pid and hosts file."""
    status, info = await asyncio.to_thread(_json_request, "GET", f"/containers/{quote(rental_id, safe='')}/json")
    if status != 200 or not info["State"].get("Running"):
        return None
    return info["State"]["Pid"], Path(info["HostsPath"])


def process_running(pid: int) -> bool:
    """Whether ``pid`` runs (an ended process not reaped yet does not)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return False
    return fields[0] not in ("Z", "X")


def wireguard_pids(devices: set[str]) -> list[int]:
    """The running ``wireguard-go`` processes for any of ``devices``."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                argv = (entry / "cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if argv[0].endswith(b"wireguard-go") and any(device.encode() in argv for device in devices):
                found.append(int(entry.name))
    return found


# ---- the setting ------------------------------------------------------------------------------------


@dataclass
class Setting:
    networks: ClusterNetworks  # the one in use: the "restarted agent"'s
    work_dir: Path
    owner: str
    cluster_id: str
    subnet: str
    members: list[str]  # by rank
    other: str  # node-0 of another cluster
    other_subnet: str
    plain: str  # in no cluster
    token: str
    phase_one: list[protocol.ClusterJoined] = field(default_factory=list)
    phase_one_s: list[float] = field(default_factory=list)
    again: list[protocol.ClusterJoined] = field(default_factory=list)  # the same command, the same agent
    restarted: list[protocol.ClusterJoined] = field(default_factory=list)  # the same command, a new agent
    with_peers: list[protocol.ClusterJoined] = field(default_factory=list)
    measured: list[protocol.ClusterJoined] = field(default_factory=list)

    def create(self, rank: int, *, peers: bool = False, measure: bool = False) -> protocol.CreateCluster:
        joined = self.phase_one
        return protocol.CreateCluster(
            cluster_id=self.cluster_id, rental_id=self.members[rank], rank=rank, node_count=NODES, subnet=self.subnet,
            peers=[protocol.ClusterPeer(rank=r, public_key=joined[r].public_key, endpoint=joined[r].endpoints[0])
                   for r in range(NODES) if r != rank and peers],
            measure=measure,
        )  # fmt: skip


def free_subnets(count: int) -> list[str]:
    """``count`` consecutive /24s in the clusters' range, chosen at random (parallel runs use others)."""
    first = ipaddress.IPv4Network("10.64.0.0/24").network_address + 256 * secrets.randbelow((1 << 14) - count)
    return [str(ipaddress.IPv4Network(f"{first + 256 * i}/24")) for i in range(count)]


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def setting(docker_image: str, tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Setting]:
    if os.geteuid() != 0:
        pytest.fail("the cluster network tests need root (wireguard-go makes a TUN device; the interface moves into a container)")
    if shutil.which("wireguard-go") is None:
        pytest.fail("wireguard-go is not installed: run `make docker` (or `apt-get install wireguard-go wireguard-tools`)")
    tag = secrets.token_hex(3)
    owner = f"test-cnet-{tag}"
    subnet, other_subnet = free_subnets(2)
    work_dir = tmp_path_factory.mktemp("clusternet")
    s = Setting(
        networks=ClusterNetworks(work_dir, namespace, lambda: "127.0.0.1"), work_dir=work_dir, owner=owner,
        cluster_id=f"c-cnet-{tag}", subnet=subnet, members=[f"gm-cnet-{tag}-n{rank}" for rank in range(NODES)],
        other=f"gm-cnet-{tag}-other", other_subnet=other_subnet, plain=f"gm-cnet-{tag}-plain", token=f"token-{secrets.token_hex(8)}",
    )  # fmt: skip
    everyone = [*s.members, s.other, s.plain]
    first = s.networks
    try:
        await asyncio.gather(*(asyncio.to_thread(start_container, name, docker_image, owner) for name in everyone))
        # Phase 1 on the first agent, then again (idempotent), then on a new agent over the same work dir.
        for rank in range(NODES):
            started = time.perf_counter()
            s.phase_one.append(await first.create(s.create(rank)))
            s.phase_one_s.append(time.perf_counter() - started)
        s.again = [await first.create(s.create(rank)) for rank in range(NODES)]
        await first.close()  # the old agent is gone: its responders with it
        s.networks = ClusterNetworks(work_dir, namespace, lambda: "127.0.0.1")
        await s.networks.resume()
        s.restarted = [await s.networks.create(s.create(rank)) for rank in range(NODES)]
        await s.networks.create(protocol.CreateCluster(cluster_id=f"c-cnet-{tag}-other", rental_id=s.other, rank=0, node_count=2, subnet=other_subnet))
        # Every member's peers first, one member after another (see the module's docstring), then the measurements,
        # all members at once: the same peers again, which must leave the sessions as they are.
        s.with_peers = [await s.networks.create(s.create(rank, peers=True)) for rank in range(NODES)]
        s.measured = list(await asyncio.gather(*(s.networks.create(s.create(rank, peers=True, measure=True)) for rank in range(NODES))))
        await asyncio.to_thread(exec_in, s.members[2], "nc", "-ll", "-p", str(TOKEN_PORT), "-e", "echo", s.token, detach=True)
        yield s
    finally:
        for networks in (s.networks, first):
            for name in everyone:
                try:
                    await networks.forget_rental(name)
                except Exception as exc:  # the clean-up goes on
                    print(f"forget_rental({name}) failed: {exc!r}")
            await networks.close()
        for pid in wireguard_pids({device_name(name) for name in everyone}):  # whatever a failure left running
            os.kill(pid, signal.SIGKILL)
        await asyncio.to_thread(dockerengine.remove_owned, owner)


# ---- with containers ----------------------------------------------------------------------------------


@pytest.mark.asyncio(loop_scope="module")
class TestClusterNetwork:
    """Three members of a cluster on one host, a member of another cluster and a container in none."""

    async def test_phase_one_answers_a_key_an_address_and_an_endpoint_idempotently(self, setting: Setting) -> None:
        """Each member gets a WireGuard key, the subnet's address ``rank + 1`` on ``cluster0`` in its container,
        ``node-0..2`` in its ``/etc/hosts`` and an endpoint; the same command again, and on a restarted agent, answers the same."""
        subnet = ipaddress.IPv4Network(setting.subnet)
        keys = set()
        for rank, joined in enumerate(setting.phase_one):
            assert re.fullmatch(WIREGUARD_KEY_PATTERN, joined.public_key) and len(base64.b64decode(joined.public_key)) == 32
            keys.add(joined.public_key)
            assert joined.address == str(subnet[rank + 1])
            assert 0 < joined.listen_port < 65536 and joined.endpoints == [f"127.0.0.1:{joined.listen_port}"]
            assert joined.peers == 0 and joined.measurements == []
            for later in (setting.again[rank], setting.restarted[rank]):
                assert (later.public_key, later.address, later.endpoints) == (joined.public_key, joined.address, joined.endpoints)
            interface = await run_in(setting.members[rank], "ip", "-4", "-o", "address", "show", "dev", INTERFACE)
            assert f"inet {joined.address}/24" in interface, interface
            hosts = await run_in(setting.members[rank], "cat", "/etc/hosts")
            assert "localhost" in hosts and hosts_block(setting.subnet, NODES) in hosts, hosts
            assert [f"{subnet[r + 1]}\tnode-{r}" in hosts for r in range(NODES)] == [True] * NODES
            assert setting.with_peers[rank].peers == NODES - 1
        assert len(keys) == NODES
        print(f"phase 1 per member: {', '.join(f'{t * 1000:.0f} ms' for t in setting.phase_one_s)}")

    async def test_every_pair_measures_a_round_trip_and_a_throughput(self, setting: Setting) -> None:
        """With every member's peers set, ``measure`` makes each member measure its higher-ranked peers: every pair once, no error."""
        pairs = {(rank, m.rank): m for rank, joined in enumerate(setting.measured) for m in joined.measurements}
        assert sorted(pairs) == [(0, 1), (0, 2), (1, 2)]
        for pair, measurement in pairs.items():
            assert measurement.error is None, (pair, measurement)
            assert measurement.rtt_ms is not None and measurement.rtt_ms > 0, (pair, measurement)
            assert measurement.mbit_s is not None and measurement.mbit_s > 0, (pair, measurement)
            assert measurement.loss_pct is not None and 0 <= measurement.loss_pct < 50, (pair, measurement)  # one machine: ~0
        print("measured: " + "; ".join(f"node-{a}→node-{b} {m.rtt_ms} ms {m.mbit_s} Mbit/s" for (a, b), m in pairs.items()))

    async def test_the_same_peers_again_keep_their_sessions(self, setting: Setting) -> None:
        """Regression: every ``create_cluster`` with peers replaced them all (``replace_peers``), so the ``measure``
        command — the same peers again — ended every session on every member at once and the handshakes that followed
        crossed, leaving pairs without a session for up to 15 s (measurements failed). Now an unchanged peer is not touched."""
        device = device_name(setting.members[0])
        before = await peer_states(device)
        assert len(before) == NODES - 1 and all(int(peer["rx_bytes"]) > 0 and peer["last_handshake_time_sec"] != "0" for peer in before.values())
        await setting.networks.create(setting.create(0, peers=True))
        after = await peer_states(device)
        for key, peer in before.items():
            assert after[key]["last_handshake_time_sec"] == peer["last_handshake_time_sec"]
            assert int(after[key]["rx_bytes"]) >= int(peer["rx_bytes"])

    async def test_peer_states_name_each_peers_handshake_and_bytes(self, setting: Setting) -> None:
        """``peer_states`` (what an unanswered measurement reports) reads each peer of the member's ``wireguard-go``."""
        states = await peer_states(device_name(setting.members[0]))
        assert sorted(states) == sorted(setting.phase_one[rank].public_key for rank in (1, 2))
        for state in states.values():
            assert int(state["last_handshake_time_sec"]) > 0 and int(state["rx_bytes"]) > 0, state
            assert peer_state_text(state, time.time()).startswith("last handshake "), state

    async def test_members_reach_each_other_by_name_and_nobody_else_does(self, setting: Setting) -> None:
        """node-0 and node-1 read node-2's token (by name, by address); a member of another cluster and a container in
        no cluster do not, at node-2's private address — and the server still answers afterwards."""
        node_2 = setting.phase_one[2].address
        assert await eventually(lambda: read_token(setting.members[2], "127.0.0.1"), timeout=10, what="node-2's token server") == setting.token
        assert setting.token not in await read_token(setting.other, node_2)
        assert setting.token not in await read_token(setting.plain, node_2)
        assert await read_token(setting.members[0], "node-2") == setting.token
        assert await read_token(setting.members[1], node_2) == setting.token

    async def test_a_create_without_a_container_or_for_a_member_of_another_cluster_is_refused(self, setting: Setting) -> None:
        """No container runs under the name: ``cluster_network_unavailable``; a rental already in another cluster (or
        in this one at another rank) is refused, and its tunnel is left as it was."""
        with pytest.raises(ClusterNetworkError) as refused:
            await setting.networks.create(protocol.CreateCluster(
                cluster_id=setting.cluster_id, rental_id=f"{setting.plain}-none", rank=0, node_count=2, subnet=setting.subnet,
            ))  # fmt: skip
        assert refused.value.code == "cluster_network_unavailable" and "runs no container" in str(refused.value)
        for cluster_id, rank in ((setting.cluster_id, 1), (f"{setting.cluster_id}-other", 1)):
            with pytest.raises(ClusterNetworkError, match="is already node-0 of cluster") as refused:
                await setting.networks.create(protocol.CreateCluster(
                    cluster_id=cluster_id, rental_id=setting.other, rank=rank, node_count=NODES, subnet=setting.subnet,
                ))  # fmt: skip
            assert refused.value.code == "cluster_network_unavailable"
        interface = await run_in(setting.other, "ip", "-4", "-o", "address", "show", "dev", INTERFACE)
        assert f"inet {ipaddress.IPv4Network(setting.other_subnet)[1]}/24" in interface

    async def test_delete_and_forget_take_everything_down(self, setting: Setting) -> None:
        """The plain container joins a cluster; ``delete_cluster`` ends its wireguard-go, its interface, its hosts block
        (the engine's lines kept), its UAPI socket and its record; again it answers ``deleted=False``. The same for
        ``forget_rental``."""
        networks, rental = setting.networks, setting.plain
        hosts_before = await run_in(rental, "cat", "/etc/hosts")
        command = protocol.CreateCluster(cluster_id=f"{setting.cluster_id}-del", rental_id=rental, rank=1, node_count=2, subnet=free_subnets(1)[0])
        device = device_name(rental)
        record, key = setting.work_dir / "clusters" / f"{rental}.json", setting.work_dir / "clusters" / f"{rental}.key"
        for take_down in ("delete", "forget"):
            joined = await networks.create(command)
            wg_pid = json.loads(record.read_text())["wg_pid"]
            assert process_running(wg_pid) and key.stat().st_mode & 0o777 == 0o600 and (UAPI_DIR / f"{device}.sock").exists()
            assert joined.address in await run_in(rental, "ip", "-4", "-o", "address", "show", "dev", INTERFACE)
            assert HOSTS_BEGIN in await run_in(rental, "cat", "/etc/hosts")
            if take_down == "delete":
                wrong = protocol.DeleteCluster(cluster_id=f"{setting.cluster_id}-not-this", rental_id=rental)
                assert (await networks.delete(wrong)).deleted is False  # another cluster's delete leaves it
                assert (await networks.delete(protocol.DeleteCluster(cluster_id=command.cluster_id, rental_id=rental))).deleted is True
            else:
                await networks.forget_rental(rental)
            assert not process_running(wg_pid)
            assert not (UAPI_DIR / f"{device}.sock").exists()
            assert not record.exists() and not key.exists()
            assert list((setting.work_dir / "clusters").glob(f"{rental}.*")) == []
            code, output = await asyncio.to_thread(exec_in, rental, "ip", "link", "show", INTERFACE)
            assert code != 0, output
            assert await run_in(rental, "cat", "/etc/hosts") == hosts_before
            assert (await networks.delete(protocol.DeleteCluster(cluster_id=command.cluster_id, rental_id=rental))).deleted is False
            await networks.forget_rental(rental)  # nothing left: nothing done

    async def test_a_tunnel_that_died_is_made_again_with_the_same_key(self, setting: Setting) -> None:
        """Regression: a killed wireguard-go left its UAPI socket behind, and every later create for the rental failed
        with a bare ConnectionRefusedError (which ended the agent's command loop). Now the same create makes the tunnel
        again — same key, same port — as it does when the container restarted (a new network namespace)."""
        networks, rental = setting.networks, setting.plain
        command = protocol.CreateCluster(cluster_id=f"{setting.cluster_id}-again", rental_id=rental, rank=0, node_count=2, subnet=free_subnets(1)[0])
        record = setting.work_dir / "clusters" / f"{rental}.json"
        try:
            joined = await networks.create(command)
            os.kill(json.loads(record.read_text())["wg_pid"], signal.SIGKILL)

            async def interface_gone() -> bool:
                code, _ = await asyncio.to_thread(exec_in, rental, "ip", "link", "show", INTERFACE)
                return code != 0

            await eventually(interface_gone, timeout=10, what="the killed tunnel's interface to go")
            assert (UAPI_DIR / f"{device_name(rental)}.sock").exists()  # what wireguard-go left behind
            again = await networks.create(command)
            assert (again.public_key, again.listen_port) == (joined.public_key, joined.listen_port)
            assert joined.address in await run_in(rental, "ip", "-4", "-o", "address", "show", "dev", INTERFACE)

            status, answer = await asyncio.to_thread(_json_request, "POST", f"/containers/{quote(rental)}/restart?t=0")
            assert status == 204, answer
            again = await networks.create(command)
            assert again.public_key == joined.public_key
            assert joined.address in await run_in(rental, "ip", "-4", "-o", "address", "show", "dev", INTERFACE)
            assert HOSTS_BEGIN in await run_in(rental, "cat", "/etc/hosts")
        finally:
            await networks.forget_rental(rental)


# ---- without containers ---------------------------------------------------------------------------------


class TestHostsFile:
    """The ``node-N`` block of a container's hosts file."""

    ENGINE = "127.0.0.1\tlocalhost\n::1\tlocalhost ip6-localhost\n172.18.0.2\tabc123\n"

    def test_the_block_goes_at_the_end_and_other_lines_stay(self) -> None:
        """The engine's lines are kept; a file without a final newline gets one before the block."""
        block = hosts_block("10.70.3.0/24", 2)
        assert block == f"{HOSTS_BEGIN}\n10.70.3.1\tnode-0\n10.70.3.2\tnode-1\n{HOSTS_END}\n"
        assert with_hosts_block(self.ENGINE, block) == self.ENGINE + block
        assert with_hosts_block(self.ENGINE.rstrip("\n"), block) == self.ENGINE + block

    def test_an_earlier_block_is_replaced_and_none_removes_it(self) -> None:
        """A second block replaces the first wherever it was; ``None`` leaves the file as it was before any."""
        earlier = f"127.0.0.1\tlocalhost\n{hosts_block('10.70.3.0/24', 2)}10.0.0.9\tadded-later\n"
        block = hosts_block("10.70.4.0/24", 3)
        assert with_hosts_block(earlier, block) == f"127.0.0.1\tlocalhost\n10.0.0.9\tadded-later\n{block}"
        assert with_hosts_block(earlier, None) == "127.0.0.1\tlocalhost\n10.0.0.9\tadded-later\n"
        assert with_hosts_block(with_hosts_block(self.ENGINE, block), None) == self.ENGINE

    def test_rewrite_writes_in_place_and_keeps_bytes_that_are_not_utf8(self, tmp_path: Path) -> None:
        """The same inode (the container's bind mount sees it); bytes that are not UTF-8 come back unchanged."""
        hosts = tmp_path / "hosts"
        hosts.write_bytes(self.ENGINE.encode() + b"10.0.0.7\tcaf\xe9\n")
        inode = hosts.stat().st_ino
        rewrite_hosts(hosts, hosts_block("10.70.3.0/24", 2))
        assert hosts.stat().st_ino == inode
        assert hosts.read_bytes() == self.ENGINE.encode() + b"10.0.0.7\tcaf\xe9\n" + hosts_block("10.70.3.0/24", 2).encode()
        rewrite_hosts(hosts, None)
        assert hosts.read_bytes() == self.ENGINE.encode() + b"10.0.0.7\tcaf\xe9\n" and hosts.stat().st_ino == inode

    def test_rewrite_refuses_a_symlink_a_huge_file_and_a_missing_one(self, tmp_path: Path) -> None:
        """A symlink (the target stays untouched), a file over ``MAX_HOSTS_BYTES`` and a missing file are refused
        with the command's error code."""
        target = tmp_path / "elsewhere"
        target.write_text("precious\n")
        link = tmp_path / "hosts"
        link.symlink_to(target)
        huge = tmp_path / "huge"
        huge.write_bytes(b"#" * (MAX_HOSTS_BYTES + 1))
        for path, why in ((link, "could not be opened"), (huge, "larger than"), (tmp_path / "missing", "could not be opened")):
            with pytest.raises(ClusterNetworkError, match=why) as refused:
                rewrite_hosts(path, hosts_block("10.70.3.0/24", 2))
            assert refused.value.code == "cluster_network_unavailable"
        assert target.read_text() == "precious\n" and huge.stat().st_size == MAX_HOSTS_BYTES + 1


class TestUapiAndNames:
    def test_a_peers_state_in_words(self) -> None:
        """What a measurement that got no answer says of the peer: never shaken hands, or how long ago, and the bytes."""
        assert peer_state_text(None, 1000.0) == "WireGuard does not know this peer"
        never = {"last_handshake_time_sec": "0", "tx_bytes": "148", "rx_bytes": "0", "endpoint": "127.0.0.1:40000"}
        assert peer_state_text(never, 1000.0) == "no handshake yet, 148 bytes sent and 0 received, endpoint 127.0.0.1:40000"
        recent = {**never, "last_handshake_time_sec": "993", "rx_bytes": "92"}
        assert peer_state_text(recent, 1000.0) == "last handshake 7s ago, 148 bytes sent and 92 received, endpoint 127.0.0.1:40000"
        assert peer_state_text({}, 1000.0) == "no handshake yet, 0 bytes sent and 0 received, endpoint none"

    def test_uapi_set_with_a_key_and_a_port(self) -> None:
        """Phase 1: the private key and the port, no peers touched."""
        assert uapi_set("ab" * 32, None, "10.70.3.0/24", listen_port=0) == f"set=1\nprivate_key={'ab' * 32}\nlisten_port=0\n\n"

    def test_uapi_set_replaces_the_peers_each_allowed_its_own_address(self) -> None:
        """Phase 2: ``replace_peers``, then each peer's key in hex, only its /32, the keepalive and its endpoint when known."""
        peers = [protocol.ClusterPeer(rank=0, public_key=KEY_A, endpoint="192.0.2.7:51820"), protocol.ClusterPeer(rank=2, public_key=KEY_B)]
        assert uapi_set(None, peers, "10.70.3.0/24") == (
            "set=1\nreplace_peers=true\n"
            f"public_key={bytes(range(32)).hex()}\nreplace_allowed_ips=true\nallowed_ip=10.70.3.1/32\npersistent_keepalive_interval=25\n"
            "endpoint=192.0.2.7:51820\n"
            f"public_key={bytes(range(32, 64)).hex()}\nreplace_allowed_ips=true\nallowed_ip=10.70.3.3/32\npersistent_keepalive_interval=25\n\n"
        )  # fmt: skip
        assert uapi_set(None, [], "10.70.3.0/24") == "set=1\nreplace_peers=true\n\n"  # every peer removed

    def test_peer_changes_touch_only_the_peers_that_changed(self) -> None:
        """The same peers: no request at all; one gone and one changed: that one removed, the other set, nothing replaced."""
        a, b = protocol.ClusterPeer(rank=1, public_key=KEY_A, endpoint="192.0.2.7:51820"), protocol.ClusterPeer(rank=2, public_key=KEY_B)
        assert uapi_peer_changes([a, b], [b, a], "10.70.3.0/24") is None
        assert uapi_peer_changes([], [a, b], "10.70.3.0/24") == uapi_set(None, [a, b], "10.70.3.0/24").replace("replace_peers=true\n", "")
        moved = protocol.ClusterPeer(rank=1, public_key=KEY_A, endpoint="192.0.2.8:51820")
        assert uapi_peer_changes([a, b], [moved], "10.70.3.0/24") == (
            f"set=1\npublic_key={bytes(range(32, 64)).hex()}\nremove=true\n"
            f"public_key={bytes(range(32)).hex()}\nreplace_allowed_ips=true\nallowed_ip=10.70.3.2/32\npersistent_keepalive_interval=25\n"
            "endpoint=192.0.2.8:51820\n\n"
        )  # fmt: skip

    def test_device_names_fit_the_kernel_and_differ_by_rental(self) -> None:
        """At most 15 characters (IFNAMSIZ − 1) even for the longest rental id; the same id, the same name."""
        longest = "r" + "x" * 63
        names = {device_name(rental) for rental in (longest, "r-1", "r-2", "a")}
        assert len(names) == 4 and all(len(name) <= 15 and re.fullmatch(r"wgm[0-9a-f]{10}", name) for name in names)
        assert device_name(longest) == device_name(longest)


class TestProtocol:
    """``create_cluster`` as the protocol checks it."""

    @staticmethod
    def command(**fields: Any) -> dict[str, Any]:
        return {"cluster_id": "c-abc", "rental_id": "r-1", "rank": 0, "node_count": 3, "subnet": "10.70.3.0/24",
                "peers": [{"rank": 1, "public_key": KEY_A, "endpoint": "192.0.2.7:51820"}, {"rank": 2, "public_key": KEY_B}], **fields}  # fmt: skip

    def test_a_valid_command_and_ipv6_endpoints(self) -> None:
        command = protocol.CreateCluster.model_validate(self.command())
        assert [p.rank for p in command.peers] == [1, 2] and command.measure is False
        peers = [{"rank": 1, "public_key": KEY_A, "endpoint": "[2001:db8::7]:51820"}]
        assert protocol.CreateCluster.model_validate(self.command(node_count=2, peers=peers)).peers[0].endpoint == "[2001:db8::7]:51820"

    @pytest.mark.parametrize("subnet", ["10.128.0.0/24", "10.63.255.0/24", "192.168.1.0/24", "10.70.0.0/16", "10.70.3.0/25",
                                        "10.70.3.0/23", "10.70.3.1/24", "fd00::/120", "not a subnet"])  # fmt: skip
    def test_a_subnet_outside_the_range_or_not_a_24_is_refused(self, subnet: str) -> None:
        with pytest.raises(ValidationError, match="subnet"):
            protocol.CreateCluster.model_validate(self.command(subnet=subnet))

    @pytest.mark.parametrize(("change", "why"), [
        ({"peers": [{"rank": 1, "public_key": KEY_A}, {"rank": 1, "public_key": KEY_B}]}, "each other member once"),
        ({"peers": [{"rank": 0, "public_key": KEY_A}]}, "each other member once"),
        ({"rank": 3}, "below node_count"),
        ({"peers": [{"rank": 3, "public_key": KEY_A}]}, "below node_count"),
        ({"node_count": 1, "peers": []}, "node_count"),
    ])  # fmt: skip
    def test_bad_ranks_are_refused(self, change: dict[str, Any], why: str) -> None:
        with pytest.raises(ValidationError, match=why):
            protocol.CreateCluster.model_validate(self.command(**change))

    @pytest.mark.parametrize("key", [
        "not-a-key", KEY_A[:-2] + "==", KEY_A[:-2] + "B=", base64.b64encode(bytes(31)).decode(), base64.b64encode(bytes(33)).decode(), "",
    ])  # fmt: skip
    def test_a_bad_public_key_is_refused(self, key: str) -> None:
        with pytest.raises(ValidationError, match="public_key"):
            protocol.CreateCluster.model_validate(self.command(peers=[{"rank": 1, "public_key": key}]))

    @pytest.mark.parametrize("endpoint", [
        "192.0.2.7", "192.0.2.7:0", "192.0.2.7:65536", "example.com:51820", "999.0.2.7:51820", "2001:db8::7:51820",
        "[2001:db8::7]", "192.0.2.7:51820 ", "",
    ])  # fmt: skip
    def test_a_bad_endpoint_is_refused(self, endpoint: str) -> None:
        with pytest.raises(ValidationError, match="endpoint"):
            protocol.CreateCluster.model_validate(self.command(peers=[{"rank": 1, "public_key": KEY_A, "endpoint": endpoint}]))

    def test_a_create_cluster_body_round_trips_through_the_wire(self) -> None:
        """``CommandBody.of`` → JSON → ``decode_command`` gives the same typed command back; an unknown field is refused."""
        command = protocol.CreateCluster.model_validate(self.command(measure=True))
        body = protocol.CommandBody.model_validate_json(protocol.CommandBody.of("cmd-1", command).model_dump_json())
        assert body.kind == "create_cluster" and protocol.decode_command(body) == command
        deleted = protocol.DeleteCluster(cluster_id="c-abc", rental_id="r-1")
        assert protocol.decode_command(protocol.CommandBody.of("cmd-2", deleted)) == deleted
        with pytest.raises(ProtocolError) as refused:
            protocol.decode_command(protocol.CommandBody(command_id="cmd-3", kind="create_cluster", args={**body.args, "extra": 1}))
        assert refused.value.code == "bad_command"
