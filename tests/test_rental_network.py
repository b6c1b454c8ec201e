"""A process rental's network, attacked the way a hostile renter would: real namespaces, real iptables, as root.

Each process rental runs in a network namespace of its own behind the network guard
(``agent.runtimes.procnet``, ``agent.runtimes.netguard``). From inside one, a probe tries the
host's loopback services (the machine's real PostgreSQL and Redis on 127.0.0.1), a server on
every address of the host, a neighbour rental's port, a "LAN" host on a private range and a
metadata address on 169.254.169.254, and a "public" host on TEST-NET-3 (203.0.113.0/24). The LAN
and the public host are this test's own network namespaces joined to the host by veth pairs, so
no packet leaves the machine (``tests.nethosts``: a ``mangle`` DROP on the uplink is the safety net
should a rule ever let one through). Each refusal has a positive control: the host itself reaches
every one of those servers, and the rental reaches the public one (and the LAN once the provider
allows its range), so a probe that reached nothing for a dull reason would fail the test.
"""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import socket
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from agent.gpu.sim import SimulatedBackend
from agent.runtimes.cgroups import CgroupLimiter
from agent.runtimes.containeropts import ContainerOptions, resource_name
from agent.runtimes.isolation import prove_rental_network
from agent.runtimes.manager import WorkloadManager
from agent.runtimes.netguard import EgressPolicy
from agent.runtimes.procnet import netns_path
from shared.protocol import ContainerWorkload, ProcessWorkload
from tests import dockerengine
from tests.helpers import eventually
from tests.nethosts import SERVER, NetHosts, net_hosts
from tests.test_process_isolation import SYSTEM_PYTHON, TOOLS, Host, host_layout, system_py
from tests.workloadfixtures import Exits

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or isinstance(TOOLS, str) or SYSTEM_PYTHON is None or not os.path.exists("/usr/sbin/iptables"),
    reason="rental networks need root, iproute2, iptables and a system python3",
)

WAIT = 20.0
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
@pytest.fixture(scope="module")
def test_hosts() -> Iterator[NetHosts]:
    assert SYSTEM_PYTHON is not None
    with net_hosts(SYSTEM_PYTHON) as hosts:
        yield hosts


def stable_host_addresses() -> list[str]:
    """The host's own IPv4 addresses (its uplink, the engine's default bridge), not those of interfaces other tests
    make and remove meanwhile (rentals' ``gm…`` ends, test hosts' ``gt…``, engine networks ``br-…``): the positive
    control must not race them."""
    listing = subprocess.run(["ip", "-4", "-o", "addr", "show"], capture_output=True, text=True, check=True).stdout
    found = []
    for line in listing.splitlines():
        words = line.split()
        name, address = words[1].split("@")[0], words[words.index("inet") + 1].split("/")[0]
        if not name.startswith(("gm", "gt", "gu", "br-", "veth", "lo")) and address not in found:
            found.append(address)
    return found


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
    """A host layout of the test's own (``tests.test_process_isolation.host_layout``), uids clear of the other tests'."""
    with host_layout("netns", 5_000_000) as made:
        yield made


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
        self, manager: WorkloadManager, rhost: Host, gpus: list[str], test_hosts: NetHosts
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
            host_targets = [f"{address}:{host_port}" for address in stable_host_addresses()]
            targets = [
                "127.0.0.1:5432", "127.0.0.1:6379", *host_targets, f"{neighbour_ip}:8080",
                *test_hosts.targets().values(),
            ]  # fmt: skip
            # The positive control: every one of them answers the host (the neighbour once it listens).

            async def listening() -> bool:
                return await asyncio.to_thread(answers, neighbour_ip, 8080)

            await eventually(listening, timeout=WAIT, what="the neighbour to listen")
            assert sorted(await reachable_from_host(targets)) == sorted(targets)
            reached = await probe(manager, "r-attacker", gpus[0], targets)
        assert reached == [test_hosts.targets()["wan"]]

    async def test_without_the_guard_a_rental_has_only_its_loopback(
        self, manager: WorkloadManager, rhost: Host, gpus: list[str], test_hosts: NetHosts
    ) -> None:
        """Before the guard is in place a process rental still runs in its own namespace, with no way out at all."""
        rhost.users.networks.egress = False
        reached = await probe(manager, "r-offline", gpus[0], ["127.0.0.1:5432", test_hosts.targets()["wan"]])
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


class TestContainerRentalNetwork:
    async def test_a_container_reaches_the_internet_and_nothing_of_the_host_its_neighbours_or_the_lan(
        self, tmp_path: Path, backend: SimulatedBackend, gpus: list[str], docker_image: str, test_hosts: NetHosts
    ) -> None:
        """From a container rental (real engine, busybox ``nc``): the public host answers; the host's PostgreSQL and
        Redis (on 127.0.0.1 and through the bridge's gateway), a server on every host address, a neighbour
        container's declared port, the LAN and the link-local address do not."""
        owner = f"test-{secrets.token_hex(4)}"
        exits = Exits()
        manager = WorkloadManager(
            tmp_path / "work", backend, on_exit=exits, container=ContainerOptions(owner=owner),
            stop_timeout=2.0, kill_timeout=5.0, check_interval=0.05,
        )  # fmt: skip
        try:
            with socket.socket() as listener:
                listener.bind(("0.0.0.0", 0))
                listener.listen(16)
                host_port = listener.getsockname()[1]
                victim = f"v{secrets.token_hex(3)}"
                await manager.start(victim, [gpus[1]], ContainerWorkload(image=docker_image, command=["sh", "-c", "nc -ll -p 8080 -e cat & exec sleep 424242"]))

                async def victim_ip() -> str | None:
                    status, body = dockerengine.request("GET", f"/containers/{resource_name(victim, owner)}/json")
                    if status != 200 or not json.loads(body)["State"]["Running"]:
                        return None
                    return str(next(iter(json.loads(body)["NetworkSettings"]["Networks"].values()))["IPAddress"]) or None

                neighbour = f"{await eventually(victim_ip, timeout=WAIT, what='the victim running')}:8080"

                async def victim_listening() -> list[str]:
                    return await reachable_from_host([neighbour])

                # Running is not listening: nc binds after the container's process starts (fresh run 23 probed first).
                await eventually(victim_listening, timeout=WAIT, what="the victim's nc listening on 8080")
                hosts = [f"{address}:{host_port}" for address in stable_host_addresses()]
                targets = ["127.0.0.1:5432", "127.0.0.1:6379", *hosts, neighbour, *test_hosts.targets().values()]
                assert sorted(await reachable_from_host(targets)) == sorted(targets)  # the positive control
                gateway_services = ["$gateway:5432", "$gateway:6379", f"$gateway:{host_port}"]
                tries = " ".join(f"(echo x | nc -w 2 {t.replace(':', ' ')} >/dev/null 2>&1 && echo REACHED {t}) &" for t in [*targets, *gateway_services])
                script = f"gateway=$(ip route | awk '/^default/ {{print $3}}'); echo gateway=$gateway; {tries} wait; echo probe-done"
                attacker = f"a{secrets.token_hex(3)}"
                await manager.start(attacker, [gpus[0]], ContainerWorkload(image=docker_image, command=["sh", "-c", script]))
                assert await exits.wait_for(attacker) is not None

                async def report() -> str | None:
                    text = manager.logs.path(attacker).read_text(errors="replace") if manager.logs.path(attacker).exists() else ""
                    return text if "probe-done" in text else None

                text = await eventually(report, timeout=WAIT, what="the attacker's report")
        finally:
            await manager.close(stop_workloads=True)
            dockerengine.remove_owned(owner)
        assert "gateway=1" in text, text  # the bridge's gateway was found, so its services were really tried
        reached = sorted(line.split()[1] for line in text.splitlines() if line.startswith("REACHED "))
        assert reached == [test_hosts.targets()["wan"]], text


def ip(*argv: str) -> None:
    subprocess.run(["ip", *argv], check=True, capture_output=True, timeout=30)


class TestEgressPolicy:
    """The guard's rules for a policy, proven in a router of the test's own: a network namespace where the
    guard is installed (its iptables are its own, so no other test's agents rewrite them meanwhile), a
    rental's namespace behind a ``gmp`` veth, and a LAN and a public host behind it."""

    @pytest.mark.parametrize(("allowed", "engine_mid_move"), [(False, False), (True, False), (False, True)],
                             ids=["default", "lan-allowed", "engine-moving-its-jump"])  # fmt: skip
    def test_a_range_the_provider_allows_is_reached_and_metadata_never(self, allowed: bool, engine_mid_move: bool) -> None:
        """By default the rental reaches the public host only; with ``egress_allow`` naming the LAN's range it
        reaches the LAN too; the link-local address and the router itself never. ``engine-moving-its-jump``: with
        ``FORWARD -j DOCKER-USER`` gone, as between the engine's ``-D`` and ``-I`` when it makes a network (a
        container reached 169.254.169.254 in that gap once, in CI), the mangle table's copy still drops."""
        assert SYSTEM_PYTHON is not None
        tag = secrets.token_hex(2)
        router, rental, lan, wan = (f"gmte{part}{tag}" for part in "rxlw")
        lan_net = "192.168.77.0/24"
        policy = f"EgressPolicy(allow=({lan_net!r},) if {allowed} else (), resolvers=())"
        made: list[str] = []
        try:
            for ns in (router, rental, lan, wan):
                ip("netns", "add", ns)
                made.append(ns)
                ip("-n", ns, "link", "set", "lo", "up")
            # The rental: 10.214.0.1/31 behind gmp<tag> (a process rental's veth, as procnet makes it).
            links: tuple[tuple[str, str, str, str, str, list[str]], ...] = ((rental, f"gmp{tag}", "10.214.0.0/31", "10.214.0.1/31", "10.214.0.0", []),
                     (lan, f"gtl{tag}", "192.168.77.1/24", "192.168.77.2/24", "192.168.77.1", ["169.254.77.254/32"]),
                     (wan, f"gtw{tag}", "198.51.100.241/28", "198.51.100.242/28", "198.51.100.241", []))  # fmt: skip
            for far, near_if, near_address, far_address, gateway, extra in links:
                ip("-n", router, "link", "add", near_if, "type", "veth", "peer", "name", "eth0", "netns", far)
                ip("-n", router, "addr", "add", near_address, "dev", near_if)
                ip("-n", router, "link", "set", near_if, "up")
                ip("-n", far, "addr", "add", far_address, "dev", "eth0")
                ip("-n", far, "link", "set", "eth0", "up")
                ip("-n", far, "route", "add", "default", "via", gateway)
                for address in extra:
                    ip("-n", far, "addr", "add", address, "dev", "eth0")
                    ip("-n", router, "route", "add", address, "dev", near_if)
            installed = subprocess.run(
                ["ip", "netns", "exec", router, sys.executable, "-c",
                 "import asyncio\nfrom agent.runtimes.netguard import EgressPolicy, install_guard\n"
                 f"status = asyncio.run(install_guard(policy={policy}))\nprint(status.active, status.reason)"],
                capture_output=True, text=True, timeout=60, check=True, env={**os.environ, "PYTHONPATH": str(Path(__file__).parent.parent)},
            )  # fmt: skip
            assert installed.stdout.startswith("True"), installed
            if engine_mid_move:
                subprocess.run(["ip", "netns", "exec", router, "iptables", "-w", "5", "-D", "FORWARD", "-j", "DOCKER-USER"], check=True)
            servers = [subprocess.Popen(["ip", "netns", "exec", ns, SYSTEM_PYTHON, "-c", SERVER, "8080"]) for ns in (lan, wan, router)]
            try:
                targets = {"lan": "192.168.77.2:8080", "metadata": "169.254.77.254:8080", "wan": "198.51.100.242:8080", "router": "10.214.0.0:8080"}
                for ns, target in ((router, targets["lan"]), (router, targets["wan"]), (lan, targets["metadata"]), (lan, targets["router"])):
                    ready = subprocess.run(["ip", "netns", "exec", ns, SYSTEM_PYTHON, "-c", WAIT_FOR, target], timeout=60, check=False)
                    assert ready.returncode == 0, f"{target} never answered {ns} (the positive control)"
                probed = subprocess.run(
                    ["ip", "netns", "exec", rental, SYSTEM_PYTHON, "-c", PROBE], env={"TARGETS": json.dumps(list(targets.values()))},
                    capture_output=True, text=True, timeout=60, check=True,
                )
            finally:
                for server in servers:
                    server.kill()
                    server.wait()
            reached = json.loads(probed.stdout.removeprefix("REPORT "))
            expected = [targets["wan"], *([targets["lan"]] if allowed else [])]
            assert sorted(reached) == sorted(expected), probed.stdout
        finally:
            for ns in made:
                subprocess.run(["ip", "netns", "del", ns], capture_output=True, check=False)


# Waits up to 30 s until argv[1] ("host:port") accepts a connection; exit 1 if it never does.
WAIT_FOR = """
import socket, sys, time
host, port = sys.argv[1].rsplit(":", 1)
deadline = time.monotonic() + 30
while time.monotonic() < deadline:
    with socket.socket() as s:
        s.settimeout(1)
        if s.connect_ex((host, int(port))) == 0:
            sys.exit(0)
    time.sleep(0.05)
sys.exit(1)
"""


# In a host namespace of the test's own: a dummy "uplink" address, then RentalNetworks.check() with or without the guard.
SELF_TEST = """
import asyncio, json, subprocess, sys
from pathlib import Path
from agent.runtimes.netguard import EgressPolicy, install_guard
from agent.runtimes.procnet import RentalNetworks
uid_min, cache = int(sys.argv[1]), Path(sys.argv[3])
networks = RentalNetworks(uid_min=uid_min, uid_max=uid_min + 9)
checks = []
if sys.argv[2] == "guarded":
    assert asyncio.run(install_guard(policy=EgressPolicy(resolvers=()))).active
    checks.append(networks.check(cache=cache))
    checks.append(networks.check(cache=cache))  # the same rules: the earlier proof holds
    subprocess.run(["iptables", "-w", "5", "-D", "INPUT", "-i", "gm+", "-j", "DROP"], check=True)
checks.append(networks.check(cache=cache))  # no guard (or no longer): tested again, and it fails
print(json.dumps([{"passed": c.passed, "line": c.line} for c in checks]))
"""


class TestSelfTest:
    """The start-up self-test, run in a host namespace of the test's own (its iptables its own): it fails where the
    guard is missing and a rental's namespace reaches the host, passes once the guard is in place, and a passed
    test is taken again only while the rules it tested are unchanged."""

    @pytest.mark.parametrize("guarded", [False, True], ids=["no-guard", "guard"])
    def test_passes_only_where_a_rentals_namespace_reaches_no_host_address(self, guarded: bool, tmp_path: Path) -> None:
        """Without the guard the probe reaches the host's address and the test says so; with it, nothing answers, a
        second agent takes the earlier proof, and once a rule goes the test runs again and fails."""
        tag = secrets.token_hex(2)
        host_ns = f"gmtesth{tag}"
        uid_min = 5_900_000 + secrets.randbelow(1000) * 10
        ip("netns", "add", host_ns)
        try:
            ip("-n", host_ns, "link", "set", "lo", "up")
            ip("-n", host_ns, "link", "add", "uplink0", "type", "veth", "peer", "name", "uplink1")  # no dummy module here
            ip("-n", host_ns, "addr", "add", "198.51.100.250/32", "dev", "uplink0")
            for link in ("uplink0", "uplink1"):
                ip("-n", host_ns, "link", "set", link, "up")
            done = subprocess.run(
                ["ip", "netns", "exec", host_ns, sys.executable, "-c", SELF_TEST, str(uid_min), "guarded" if guarded else "bare",
                 str(tmp_path / "netcheck.json")],
                capture_output=True, text=True, timeout=120, check=False, env={**os.environ, "PYTHONPATH": str(Path(__file__).parent.parent)},
            )  # fmt: skip
            assert done.returncode == 0, done.stderr
            results = json.loads(done.stdout.strip().splitlines()[-1])
        finally:
            subprocess.run(["ip", "netns", "del", host_ns], capture_output=True, check=False)
            subprocess.run(["ip", "netns", "del", f"gmr{uid_min + 9}"], capture_output=True, check=False)
        *proven, last = results
        if guarded:
            first, again = proven
            assert first["passed"] and "earlier" not in first["line"], first
            assert again["passed"] and "tested earlier this boot" in again["line"], again
        assert not last["passed"] and "198.51.100.250" in last["line"], last
