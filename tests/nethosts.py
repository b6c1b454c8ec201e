"""Test hosts for the rentals' network boundaries: a "LAN" host on a private range and a "public" host on
TEST-NET-2, each a network namespace of the test's own joined to this machine by a veth pair, each serving
one TCP port (accept, close). Every packet to them stays on this machine; a ``mangle`` DROP on the uplink
for the ranges tried is the safety net should a rule ever let one through. Several test processes (xdist
workers) may hold them at once: each takes a slot of its own (an ``flock`` held for the fixture's life), so
their addresses never collide.
"""

from __future__ import annotations

import contextlib
import fcntl
import secrets
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO

SLOTS = 16
SAFETY_NET = ("10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16", "198.51.100.0/24", "169.254.0.0/16")
# A server inside a test host's namespace: accepts and closes, for ever.
SERVER = (
    "import socket,sys\ns=socket.socket()\ns.setsockopt(socket.SOL_SOCKET,socket.SO_REUSEADDR,1)\n"
    "s.bind(('0.0.0.0',int(sys.argv[1])))\ns.listen(64)\nwhile True: s.accept()[0].close()"
)


@dataclass(frozen=True)
class NetHosts:
    """Where the test hosts answer: ``lan`` (private), ``metadata`` (a 169.254/16 address on the LAN host)
    and ``wan`` (public), all on ``port``; ``lan_net`` is the LAN's range, for ``egress_allow``."""

    lan: str
    lan_net: str
    metadata: str
    wan: str
    port: int

    def targets(self) -> dict[str, str]:
        return {"lan": f"{self.lan}:{self.port}", "metadata": f"{self.metadata}:{self.port}", "wan": f"{self.wan}:{self.port}"}


def _run(*argv: str) -> None:
    subprocess.run(argv, check=True, capture_output=True, timeout=30)


@contextlib.contextmanager
def _slot() -> Iterator[int]:
    folder = Path("/run/gpumarket-nethosts")
    folder.mkdir(exist_ok=True)
    for index in range(SLOTS):
        lock: IO[str] = open(folder / f"{index}.lock", "a")
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            lock.close()
            continue
        try:
            yield index
        finally:
            lock.close()
        return
    raise RuntimeError(f"all {SLOTS} test-host slots are taken")


def _wait_listening(address: str, port: int, *, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        with socket.socket() as sock:
            sock.settimeout(1)
            if sock.connect_ex((address, port)) == 0:
                return
        if time.monotonic() > deadline:
            raise RuntimeError(f"the test host {address}:{port} never listened")
        time.sleep(0.05)


@contextlib.contextmanager
def net_hosts(python: str) -> Iterator[NetHosts]:
    """Make the two test hosts (``python`` serves their port) and the safety net; remove all of it after."""
    with _slot() as index:
        lan_prefix, wan_prefix = f"192.168.{200 + index}", "198.51.100"
        wan_base = 16 * index
        hosts = NetHosts(
            lan=f"{lan_prefix}.2", lan_net=f"{lan_prefix}.0/24", metadata=f"169.254.{200 + index}.254",
            wan=f"{wan_prefix}.{wan_base + 2}", port=20000 + secrets.randbelow(20000),
        )  # fmt: skip
        tag = f"{index}{secrets.token_hex(2)}"
        uplinks = sorted({
            words[4] for words in (line.split() for line in subprocess.run(
                ["ip", "-4", "route", "show", "default"], capture_output=True, text=True, check=False).stdout.splitlines())
            if len(words) > 4
        })  # fmt: skip
        safety = [("-o", uplink, "-d", net, "-j", "DROP") for uplink in uplinks for net in SAFETY_NET]
        made: list[str] = []
        links: list[str] = []
        servers: list[subprocess.Popen[bytes]] = []
        iptables = shutil.which("iptables") or "iptables"
        try:
            for rule in safety:
                _run(iptables, "-w", "5", "-t", "mangle", "-I", "POSTROUTING", *rule)
            layout: tuple[tuple[str, str, str, str, list[str]], ...] = (
                ("l", f"{lan_prefix}.1/24", f"{hosts.lan}/24", f"{lan_prefix}.1", [hosts.metadata]),
                ("w", f"{wan_prefix}.{wan_base + 1}/28", f"{hosts.wan}/28", f"{wan_prefix}.{wan_base + 1}", []),
            )
            for name, host_side, far_side, gateway, extra in layout:
                ns, host_if, peer = f"gmtest{name}{tag}", f"gt{name}{tag}", f"gu{name}{tag}"
                _run("ip", "netns", "add", ns)
                made.append(ns)
                links.append(host_if)
                _run("ip", "link", "add", host_if, "type", "veth", "peer", "name", peer, "netns", ns)
                _run("ip", "addr", "add", host_side, "dev", host_if)
                _run("ip", "link", "set", host_if, "up")
                for address in extra:
                    _run("ip", "route", "add", f"{address}/32", "dev", host_if)
                _run("ip", "-n", ns, "link", "set", "lo", "up")
                _run("ip", "-n", ns, "link", "set", peer, "up")
                _run("ip", "-n", ns, "addr", "add", far_side, "dev", peer)
                for address in extra:
                    _run("ip", "-n", ns, "addr", "add", f"{address}/32", "dev", peer)
                _run("ip", "-n", ns, "route", "add", "default", "via", gateway)
                servers.append(subprocess.Popen(["ip", "netns", "exec", ns, python, "-c", SERVER, str(hosts.port)]))
            for address in (hosts.lan, hosts.wan):
                _wait_listening(address, hosts.port)
            yield hosts
        finally:
            for server in servers:
                server.kill()
                server.wait()
            for link in links:  # the pair goes at once (a namespace's deletion takes its end with it only later)
                subprocess.run(["ip", "link", "del", link], capture_output=True, check=False)
            for ns in made:
                subprocess.run(["ip", "netns", "del", ns], capture_output=True, check=False)
            for rule in safety:
                subprocess.run([iptables, "-w", "5", "-t", "mangle", "-D", "POSTROUTING", *rule], capture_output=True, check=False)
