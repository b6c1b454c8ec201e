"""A process rental's network, attacked the way a hostile renter would: real namespaces, real iptables, as root.

Each process rental runs in a network namespace of its own behind the network guard
(``agent.runtimes.procnet``, ``agent.runtimes.netguard``). From inside one, a probe tries the
host's loopback services (the machine's real PostgreSQL and Redis on 127.0.0.1), a server on
every address of the host, a neighbour rental's port, a "LAN" host on a private range and a
metadata address on 169.254.169.254, and a "public" host on TEST-NET-3 (203.0.113.0/24). The LAN
and the public host are this test's own network namespaces joined to the host by veth pairs, so
no packet leaves the machine; a ``mangle`` DROP on the uplink for those ranges is the safety net
should a rule ever let one through. Each refusal has a positive control: the host itself reaches
every one of those servers, and the rental reaches the public one (and the LAN once the provider
allows its range), so a probe that reached nothing for a dull reason would fail the test.
"""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import shutil
import socket
import subprocess
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from agent.gpu.sim import SimulatedBackend
from agent.runtimes.cgroups import CgroupLimiter
from agent.runtimes.isolation import prove_rental_network
from agent.runtimes.manager import WorkloadManager
from agent.runtimes.netguard import EgressPolicy, install_guard
from agent.runtimes.procnet import host_addresses, netns_path
from agent.runtimes.users import RentalUser, kill_uid
from shared.protocol import ProcessWorkload
from tests.helpers import eventually
from tests.test_process_isolation import SYSTEM_PYTHON, TOOLS, Host, system_py
from tests.workloadfixtures import Exits

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or isinstance(TOOLS, str) or SYSTEM_PYTHON is None or not os.path.exists("/usr/sbin/iptables"),
    reason="rental networks need root, iproute2, iptables and a system python3",
)

WAIT = 20.0
LAN_NET, LAN_HOST = "192.168.231.0/24", "192.168.231.2"
WAN_NET, WAN_HOST = "203.0.113.0/24", "203.0.113.2"
METADATA = "169.254.169.254"
SAFETY_NET = ("10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16", WAN_NET, "169.254.0.0/16")

# Tries a TCP connection to each "host:port" of $TARGETS at once (2 s) and prints which connected.
PROBE = r"""
import errno, json, os, select, socket, time
targets = json.loads(os.environ["TARGETS"])
socks = {}
for target in targets:
    host, port = target.rsplit(":", 1)
    s = socket.socket()
    s.setblocking(False)
    if s.connect_ex((host, int(port))) in (0, errno.EINPROGRESS):  # else refused at once (no route, ...)
        socks[s] = target
reached, pending, deadline = [], set(socks), time.monotonic() + 2.0
while pending and (left := deadline - time.monotonic()) > 0:
    _, ready, _ = select.select([], list(pending), [], left)
    for s in ready:
        pending.discard(s)
        if s.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR) == 0:
            reached.append(socks[s])
print("REPORT " + json.dumps(sorted(reached)), flush=True)
"""
# A server inside a test host's namespace: accepts and closes, for ever.
SERVER = "import socket,sys\ns=socket.socket()\ns.setsockopt(socket.SOL_SOCKET,socket.SO_REUSEADDR,1)\ns.bind(('0.0.0.0',int(sys.argv[1])))\ns.listen(64)\nwhile True: s.accept()[0].close()"


def run(*argv: str) -> None:
    subprocess.run(argv, check=True, capture_output=True, timeout=30)


@dataclass
class TestHosts:
    """The LAN and public test hosts (namespaces of this test's own), each serving ``port``."""

    port: int
    uplinks: list[str]


@pytest.fixture(scope="module")
def test_hosts() -> Iterator[TestHosts]:
    tag = secrets.token_hex(3)
    made: list[str] = []
    servers: list[subprocess.Popen[bytes]] = []
    port = 20000 + secrets.randbelow(20000)
    uplinks = sorted({line.split()[4] for line in subprocess.run(["ip", "-4", "route", "show", "default"], capture_output=True, text=True).stdout.splitlines() if len(line.split()) > 4})
    safety = [("-o", uplink, "-d", net, "-j", "DROP") for uplink in uplinks for net in SAFETY_NET]
    try:
        for rule in safety:
            run("iptables", "-w", "5", "-t", "mangle", "-I", "POSTROUTING", *rule)
        for name, net, address, extra in (("l", LAN_NET, LAN_HOST, [METADATA]), ("w", WAN_NET, WAN_HOST, [])):
            ns, host_if, peer = f"gmtest{name}{tag}", f"gt{name}{tag}", f"gu{name}{tag}"
            run("ip", "netns", "add", ns)
            made.append(ns)
            run("ip", "link", "add", host_if, "type", "veth", "peer", "name", peer, "netns", ns)
            run("ip", "addr", "add", f"{net.rsplit('.', 1)[0]}.1/24", "dev", host_if)
            run("ip", "link", "set", host_if, "up")
            for extra_address in extra:
                run("ip", "route", "add", f"{extra_address}/32", "dev", host_if)
            run("ip", "-n", ns, "link", "set", "lo", "up")
            run("ip", "-n", ns, "link", "set", peer, "up")
            run("ip", "-n", ns, "addr", "add", f"{address}/24", "dev", peer)
            for extra_address in extra:
                run("ip", "-n", ns, "addr", "add", f"{extra_address}/32", "dev", peer)
            run("ip", "-n", ns, "route", "add", "default", "via", f"{net.rsplit('.', 1)[0]}.1")
            servers.append(subprocess.Popen(["ip", "netns", "exec", ns, str(SYSTEM_PYTHON), "-c", SERVER, str(port)]))
        yield TestHosts(port, uplinks)
    finally:
        for server in servers:
            server.kill()
            server.wait()
        for ns in made:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        for rule in safety:
            subprocess.run(["iptables", "-w", "5", "-t", "mangle", "-D", "POSTROUTING", *rule], capture_output=True)


async def reachable_from_host(targets: list[str]) -> list[str]:
    """The positive control: which targets the host itself reaches."""
    reached = []
    for target in targets:
        address, port = target.rsplit(":", 1)
        try:
            _, writer = await asyncio.wait_for(asyncio.open_connection(address, int(port)), 5)
        except (OSError, TimeoutError):
            continue
        writer.close()
        reached.append(target)
    return reached


@pytest.fixture
def rhost() -> Iterator[Host]:
    """A host layout of the test's own (``tests.test_process_isolation.Host``), with a uid range of its own."""
    base = Path(f"/tmp/gpumarket-netns-{secrets.token_hex(4)}")
    base.mkdir(mode=0o755)
    os.chmod(base, 0o755)
    made = Host(base, 3_700_000 + secrets.randbelow(1000) * 1000)
    yield made
    assert not isinstance(TOOLS, str)
    for uid, rental_id in made.users.claimed().items():  # after a failed test: leave no process or namespace behind
        kill_uid(RentalUser(rental_id, uid, uid, made.users.root / rental_id), TOOLS, timeout=2)
        made.users.networks.remove(uid)
    shutil.rmtree(base, ignore_errors=True)


@pytest.fixture
async def manager(rhost: Host, backend: SimulatedBackend, cgroups: CgroupLimiter, exits: Exits) -> AsyncIterator[WorkloadManager]:
    made = WorkloadManager(
        rhost.work_dir, backend, on_exit=exits, cgroups=cgroups, rental_users=rhost.users, isolation=rhost.facts,
        stop_timeout=2.0, kill_timeout=2.0, check_interval=0.02,
    )  # fmt: skip
    yield made
    await made.close(stop_workloads=True)


async def probe(manager: WorkloadManager, rental_id: str, gpu: str, targets: list[str]) -> list[str]:
    await manager.start(rental_id, [gpu], ProcessWorkload(argv=system_py(PROBE), env={"TARGETS": json.dumps(targets)}))

    async def reported() -> str | None:
        text = manager.read_log(rental_id, offset=0)[0].decode(errors="replace")
        return next((line.removeprefix("REPORT ") for line in text.splitlines() if line.startswith("REPORT ")), None)

    found: list[str] = json.loads(await eventually(reported, timeout=WAIT, every=0.02, what=f"{rental_id}'s probe"))
    return found


async def guarded(rhost: Host, allow: tuple[str, ...] = ()) -> None:
    network = await prove_rental_network(EgressPolicy.for_host(allow), rhost.users)
    assert network.proven, network.why_not
    rhost.users.networks.egress = True


class TestProcessRentalNetwork:
    async def test_reaches_the_internet_and_nothing_of_the_host_its_neighbours_or_the_lan(
        self, manager: WorkloadManager, rhost: Host, gpus: list[str], test_hosts: TestHosts
    ) -> None:
        """From a process rental: the public host answers; the host's PostgreSQL and Redis on 127.0.0.1, a server on
        every host address, a neighbour rental's port, the LAN and the metadata address do not."""
        await guarded(rhost)
        with socket.socket() as listener:
            listener.bind(("0.0.0.0", 0))
            listener.listen(16)
            host_port = listener.getsockname()[1]
            neighbour = await manager.start("r-neighbour", [gpus[1]], ProcessWorkload(argv=system_py(SERVER.replace("int(sys.argv[1])", "8080"))))
            neighbour_ip = rhost.users.networks.addresses(neighbour["uid"])[1]
            host_targets = [f"{address}:{host_port}" for address in host_addresses() if not address.startswith("127.")]
            targets = [
                "127.0.0.1:5432", "127.0.0.1:6379", *host_targets, f"{neighbour_ip}:8080",
                f"{LAN_HOST}:{test_hosts.port}", f"{METADATA}:{test_hosts.port}", f"{WAN_HOST}:{test_hosts.port}",
            ]  # fmt: skip
            # The positive control: every one of them answers the host (the neighbour once it listens).

            async def listening() -> bool:
                return await asyncio.to_thread(answers, neighbour_ip, 8080)

            await eventually(listening, timeout=WAIT, what="the neighbour to listen")
            assert sorted(await reachable_from_host(targets)) == sorted(targets)
            reached = await probe(manager, "r-attacker", gpus[0], targets)
        assert reached == [f"{WAN_HOST}:{test_hosts.port}"]

    async def test_a_range_the_provider_allows_is_reached_and_metadata_never(
        self, manager: WorkloadManager, rhost: Host, gpus: list[str], test_hosts: TestHosts
    ) -> None:
        """With ``egress_allow`` naming the LAN's range the rental reaches it; 169.254.169.254 stays out of reach."""
        await guarded(rhost, allow=(LAN_NET,))
        try:
            targets = [f"{LAN_HOST}:{test_hosts.port}", f"{METADATA}:{test_hosts.port}", f"{WAN_HOST}:{test_hosts.port}"]
            reached = await probe(manager, "r-allowed", gpus[0], targets)
            assert reached == sorted([f"{LAN_HOST}:{test_hosts.port}", f"{WAN_HOST}:{test_hosts.port}"])
        finally:
            assert (await install_guard(policy=EgressPolicy.for_host())).active  # back to the default for the other tests

    async def test_without_the_guard_a_rental_has_only_its_loopback(
        self, manager: WorkloadManager, rhost: Host, gpus: list[str], test_hosts: TestHosts
    ) -> None:
        """Before the guard is in place a process rental still runs in its own namespace, with no way out at all."""
        rhost.users.networks.egress = False
        reached = await probe(manager, "r-offline", gpus[0], ["127.0.0.1:5432", f"{WAN_HOST}:{test_hosts.port}"])
        assert reached == []

    async def test_the_namespace_goes_with_the_rental(self, manager: WorkloadManager, rhost: Host, gpus: list[str]) -> None:
        """Stopping a rental removes its namespace and its veth."""
        await guarded(rhost)
        started = await manager.start("r-gone", [gpus[0]], ProcessWorkload(argv=["/bin/sleep", "30"]))
        assert netns_path(started["uid"]).exists() and started["network"] == "own namespace, guarded egress"
        await manager.stop("r-gone")

        async def gone() -> bool:
            return not netns_path(started["uid"]).exists() and not os.path.exists(f"/sys/class/net/gmp{started['uid']}")

        await eventually(gone, timeout=WAIT, what="the namespace to go")


def answers(address: str, port: int) -> bool:
    """Whether something listens at ``address:port``, seen from the host."""
    with socket.socket() as sock:
        sock.settimeout(1)
        return sock.connect_ex((address, port)) == 0
