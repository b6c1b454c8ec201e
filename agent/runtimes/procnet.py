"""A network namespace of its own for each ``process`` rental, behind the same guard as containers.

A process rental's uid (``agent.runtimes.users``) names its network: the namespace ``gmr<uid>``
(bound at ``/run/netns/gmr<uid>`` by ``ip netns``) and, once the network guard is in place, a veth
pair whose host end is ``gmp<uid>`` — a ``gm+`` interface, so every rule of
``agent.runtimes.netguard`` covers it (no host address or port, no other rental, no link-local
metadata, no private range unless the provider allows it) — with a /31 of ``pool`` chosen by the
uid (modulo the pool's size): two live rentals never hold one uid, so never one address. Its traffic
leaves through the guard's ``MASQUERADE`` with the host's address. Inside, the loopback is the
rental's own: ``127.0.0.1`` is nobody else's PostgreSQL.

Where the guard is not in place the namespace has only its loopback: the rental runs, isolated,
without a network (the host's facts say so). ``check_rental_network`` is the agent's start-up
self-test: from a probe namespace made the same way it tries every address of the host and must
reach none.

All of it runs ``ip`` (iproute2) with a fixed environment, never a shell; blocking, a few
milliseconds per command, so callers run it in a thread where an event loop waits.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import hashlib
import ipaddress
import json
import logging
import os
import select
import shutil
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Final, TypeVar

from agent.runtimes.netguard import DEFAULT_PROCESS_POOL, PROCESS_PREFIX
from shared.errors import BadRequest, ConfigError

log = logging.getLogger(__name__)
T = TypeVar("T")

NETNS_DIR: Final = Path("/run/netns")
NETNS_PREFIX: Final = "gmr"
PEER_PREFIX: Final = "gmq"  # the rental's end before it is moved in and renamed eth0
PROBE_LOCK: Final = Path("/run/gpumarket-netprobe.lock")
CHECK_CACHE: Final = Path("/run/gpumarket-netcheck.json")  # the last passed self-test, with what it tested
_TRUSTED_PATH: Final = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
_CLONE_NEWNET: Final = 0x40000000


def netns_name(uid: int) -> str:
    return f"{NETNS_PREFIX}{uid}"


def netns_path(uid: int) -> Path:
    return NETNS_DIR / netns_name(uid)


@dataclass(frozen=True, slots=True)
class NetworkCheck:
    """The start-up self-test's outcome: ``passed``, and one line saying what was tried (or reached)."""

    passed: bool
    line: str


class RentalNetworks:
    """Makes and removes process rentals' namespaces; ``egress`` (the guard is in place) adds the veth.

    ``pool`` must hold a /31 for every uid of ``uid_min``..``uid_max``. ``ip`` is iproute2's tool
    (found on a trusted PATH when not given); ``timeout`` bounds each command.
    """

    def __init__(
        self, *, uid_min: int, uid_max: int, pool: str = DEFAULT_PROCESS_POOL, ip: str | None = None, timeout: float = 10.0
    ) -> None:
        try:
            self.pool = ipaddress.IPv4Network(pool)
        except ValueError as exc:
            raise ConfigError(f"process_subnet_pool {pool!r}: {exc}") from None
        if self.pool.num_addresses < 2 * (uid_max - uid_min + 1):
            need = 32 - (2 * (uid_max - uid_min + 1) - 1).bit_length()
            raise ConfigError(
                f"process_subnet_pool {pool} is too small for rental uids {uid_min}-{uid_max} (a /31 each): use a /{need} or larger"
            )
        found = ip or shutil.which("ip", path=_TRUSTED_PATH)
        if found is None:
            raise ConfigError("ip is not installed (iproute2): process rentals cannot get a network namespace")
        self.ip = found
        self.uid_min = uid_min
        self.uid_max = uid_max
        self.timeout = timeout
        self.egress = False  # set once the network guard is in place

    def addresses(self, uid: int) -> tuple[str, str]:
        """(host end, rental end) of the uid's /31."""
        # By the uid itself, not its place in the range: agents (and tests) with other ranges on one host
        # collide only for uids a multiple of the pool's size apart.
        base = int(self.pool.network_address) + 2 * (uid % (self.pool.num_addresses // 2))
        return str(ipaddress.IPv4Address(base)), str(ipaddress.IPv4Address(base + 1))

    def _ip(self, *args: str, batch: str | None = None) -> None:
        argv = [self.ip, *args, *(("-batch", "-") if batch is not None else ())]
        try:
            done = subprocess.run(
                argv, input=(batch or "").encode(), env={"PATH": _TRUSTED_PATH}, capture_output=True, timeout=self.timeout, check=False
            )
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise OSError(f"{' '.join(argv[:4])}: {exc}") from None
        if done.returncode != 0:
            raise OSError(f"{' '.join(argv[:4])}: {done.stderr.decode(errors='replace').strip() or f'exit {done.returncode}'}")

    def create(self, uid: int, *, egress: bool | None = None) -> Path:
        """The uid's namespace, made afresh (a leftover of a dead rental is removed first); returns its
        path for ``nsenter --net``. Raises ``BadRequest`` (``workload_start_failed``) when it cannot be made."""
        egress = self.egress if egress is None else egress
        self.remove(uid)
        name, host_if, peer = netns_name(uid), f"{PROCESS_PREFIX}{uid}", f"{PEER_PREFIX}{uid}"
        try:
            self._ip("netns", "add", name)
            if egress:
                host_ip, rental_ip = self.addresses(uid)
                self._ip("link", "add", host_if, "type", "veth", "peer", "name", peer, "netns", name)
                # No IPv6 on our end: the guard drops it anyway, and no link-local address invites trying.
                with contextlib.suppress(OSError):
                    Path(f"/proc/sys/net/ipv6/conf/{host_if}/disable_ipv6").write_text("1")
                self._ip("-batch", "-", batch=f"addr add {host_ip}/31 dev {host_if}\nlink set {host_if} up\n")
                self._ip(
                    "-n", name,
                    batch=f"link set lo up\nlink set {peer} name eth0\naddr add {rental_ip}/31 dev eth0\n"
                    f"link set eth0 up\nroute add default via {host_ip}\n",
                )  # fmt: skip
            else:
                self._ip("-n", name, "link", "set", "lo", "up")
        except OSError as exc:
            self.remove(uid)
            raise BadRequest(f"cannot make the rental's network namespace: {exc}", code="workload_start_failed") from None
        return netns_path(uid)

    def remove(self, uid: int) -> None:
        """Remove the uid's veth and namespace (whatever of them exists); never raises."""
        with contextlib.suppress(OSError):
            self._ip("link", "del", f"{PROCESS_PREFIX}{uid}")
        if netns_path(uid).exists():
            with contextlib.suppress(OSError):
                self._ip("netns", "del", netns_name(uid))

    @contextlib.contextmanager
    def _host_lock(self) -> Iterator[None]:
        # One probe at a time on this host: they share the probe's slot (and its namespace's name).
        PROBE_LOCK.parent.mkdir(parents=True, exist_ok=True)
        with open(PROBE_LOCK, "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            yield

    @contextlib.contextmanager
    def _probe_namespace(self, *, egress: bool) -> Iterator[Path]:
        try:
            yield self.create(self.uid_max, egress=egress)
        finally:
            self.remove(self.uid_max)

    @contextlib.contextmanager
    def probe(self, *, egress: bool) -> Iterator[Path]:
        """A namespace made like a rental's in the probe's slot (the range's last uid, which no rental is
        given), one probe at a time on this host (a lock in /run); removed on exit."""
        with self._host_lock(), self._probe_namespace(egress=egress) as path:
            yield path

    def check(
        self, *, timeout: float = 0.5, control_timeout: float = 10.0, slack: float = 10.0, max_timeout: float = 3.0, cache: Path = CHECK_CACHE
    ) -> NetworkCheck:
        """The self-test: a probe namespace with the guard's veth tries every IPv4 address of the host on a
        port the agent listens on (all addresses), and must reach none. A probe that is only slow must not pass
        for one that was dropped: first a control connection from the host into the probe's namespace (the
        same veth, the other way) must succeed, and the probes then wait ``slack`` times as long as it took
        (at least ``timeout``, at most ``max_timeout`` seconds). Blocking.

        A passed test holds while what it tested is unchanged: it is kept in ``cache`` (root's, in /run, gone at
        boot) with a fingerprint of this namespace's INPUT rules and addresses, and an agent starting while the
        fingerprint is the same takes it instead of testing again (the demo's and a test suite's many agents)."""
        with self._host_lock():
            fingerprint = rules_fingerprint(self.ip)
            earlier = _cached_check(cache, fingerprint)
            if earlier is not None:
                return earlier
            found = self._check(timeout=timeout, control_timeout=control_timeout, slack=slack, max_timeout=max_timeout)
            if found.passed and fingerprint is not None:
                with contextlib.suppress(OSError):
                    tmp = cache.with_suffix(".tmp")
                    tmp.write_text(json.dumps({"fingerprint": fingerprint, "line": found.line}))
                    tmp.chmod(0o600)
                    tmp.replace(cache)
            return found

    def _check(self, *, timeout: float, control_timeout: float, slack: float, max_timeout: float) -> NetworkCheck:
        try:
            with self._probe_namespace(egress=True) as path, socket.socket(socket.AF_INET, socket.SOCK_STREAM) as listener:
                listener.bind(("0.0.0.0", 0))
                listener.listen(16)
                port = listener.getsockname()[1]
                try:
                    control = control_connect(path, self.addresses(self.uid_max)[1], timeout=control_timeout)
                except OSError as exc:
                    return NetworkCheck(False, f"network self-test could not run: the host cannot reach a rental's namespace ({exc})")
                targets = [address for address in host_addresses(self.ip) if not ipaddress.IPv4Address(address).is_loopback]
                wait = min(max_timeout, max(timeout, slack * control))
                reached = connect_from(path, [(address, port) for address in targets], timeout=wait)
        except (BadRequest, OSError) as exc:
            return NetworkCheck(False, f"network self-test could not run: {exc}")
        if reached:
            return NetworkCheck(False, f"network self-test failed: a rental's namespace reached the host at {', '.join(reached)}")
        return NetworkCheck(True, f"network self-test passed: none of the host's {len(targets)} addresses answered a rental's namespace")


def rules_fingerprint(ip: str = "ip") -> str | None:
    """What the self-test's outcome depends on, hashed: this network namespace, its INPUT rules (IPv4) and its
    addresses; ``None`` when the rules cannot be read."""
    iptables = shutil.which("iptables", path=_TRUSTED_PATH)
    if iptables is None:
        return None
    try:
        rules = subprocess.run([iptables, "-w", "5", "-S", "INPUT"], env={"PATH": _TRUSTED_PATH}, capture_output=True, timeout=30, check=False)
        namespace = os.readlink("/proc/thread-self/ns/net")
    except (OSError, subprocess.TimeoutExpired):
        return None
    if rules.returncode != 0:
        return None
    text = "\n".join([namespace, rules.stdout.decode(errors="replace"), *sorted(host_addresses(ip))])
    return hashlib.sha256(text.encode()).hexdigest()


def _cached_check(cache: Path, fingerprint: str | None) -> NetworkCheck | None:
    if fingerprint is None:
        return None
    try:
        st = cache.stat()
        if st.st_uid != 0 or st.st_mode & 0o077:
            return None
        record = json.loads(cache.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(record, dict) or record.get("fingerprint") != fingerprint or not isinstance(record.get("line"), str):
        return None
    return NetworkCheck(True, f"{record['line']} (tested earlier this boot against the same rules)")


def host_addresses(ip: str = "ip") -> list[str]:
    """Every IPv4 address of this host's interfaces (rental ends excluded: they live in namespaces)."""
    found: list[str] = []
    done = subprocess.run([ip, "-4", "-o", "addr", "show"], env={"PATH": _TRUSTED_PATH}, capture_output=True, timeout=10, check=False)
    for line in done.stdout.decode(errors="replace").splitlines():
        words = line.split()
        if "inet" in words:
            address = words[words.index("inet") + 1].split("/")[0]
            if address not in found:
                found.append(address)
    return found


def in_namespace(netns: Path, work: Callable[[], T]) -> T:
    """``work()``'s result, run in a thread of its own inside the network namespace at ``netns`` (``setns`` changes
    the calling thread only: a pooled thread must never be left in the wrong namespace; if going back failed,
    that thread ends with the error). Sockets made by ``work`` keep the namespace they were made in. Blocking."""
    results: list[T] = []
    errors: list[BaseException] = []

    def run() -> None:
        libc = ctypes.CDLL(None, use_errno=True)
        try:
            own = os.open("/proc/thread-self/ns/net", os.O_RDONLY | os.O_CLOEXEC)
            target = os.open(netns, os.O_RDONLY | os.O_CLOEXEC)
            try:
                if libc.setns(target, _CLONE_NEWNET) != 0:
                    raise OSError(ctypes.get_errno(), f"setns into {netns}")
                try:
                    results.append(work())
                finally:
                    if libc.setns(own, _CLONE_NEWNET) != 0:
                        raise OSError(ctypes.get_errno(), "setns back to the agent's namespace")
            finally:
                os.close(own)
                os.close(target)
        except BaseException as exc:  # handed to the caller
            errors.append(exc)

    thread = threading.Thread(target=run, name="netns-work", daemon=True)
    thread.start()
    thread.join()
    if errors:
        raise errors[0]
    return results[0]


def connect_from(netns: Path, targets: list[tuple[str, int]], *, timeout: float) -> list[str]:
    """Try a TCP connection to each of ``targets`` from inside ``netns`` at once; the ones that connected
    (``address:port``) within ``timeout`` seconds. Blocking."""

    def start_connects() -> dict[socket.socket, str]:
        started: dict[socket.socket, str] = {}
        for address, port in targets:
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.setblocking(False)
            code = sock.connect_ex((address, port))
            if code not in (0, errno.EINPROGRESS):  # refused at once (no route, ...): never writable as "connected"
                sock.close()
                continue
            started[sock] = f"{address}:{port}"
        return started

    sockets = in_namespace(netns, start_connects)
    try:
        reached: list[str] = []
        pending = set(sockets)
        deadline = time.monotonic() + timeout
        while pending and (left := deadline - time.monotonic()) > 0:
            _, writable, _ = select.select([], list(pending), [], left)
            for sock in writable:
                pending.discard(sock)
                if sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR) == 0:
                    reached.append(sockets[sock])
        return reached
    finally:
        for sock in sockets:
            sock.close()


def control_connect(netns: Path, address: str, *, timeout: float) -> float:
    """Seconds a TCP connection from the host into ``netns`` (a listener there, at ``address``) takes: the
    self-test's positive control, which crosses the same veth the probes do. Raises ``OSError`` when it fails."""

    def listen() -> socket.socket:
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.bind((address, 0))
        listener.listen(1)
        return listener

    listener = in_namespace(netns, listen)
    try:
        started = time.monotonic()
        with socket.create_connection(listener.getsockname(), timeout=timeout):
            return time.monotonic() - started
    finally:
        listener.close()
