"""The network guard of every rental: host firewall rules that every rental interface (``gm+``) shares.

Each container rental sits on a bridge of its own named ``gm`` + a short hash
(``agent.runtimes.container.bridge_name``), and each process rental in a network namespace of its
own joined to the host by a veth pair whose host end is ``gmp<uid>`` (``agent.runtimes.procnet``),
so a handful of wildcard rules cover every rental, present and future:

- ``INPUT -i gm+ -m conntrack --ctstate ESTABLISHED,RELATED -j ACCEPT`` and ``INPUT -i gm+
  -j DROP`` (IPv4 and IPv6): a rental reaches no service of the host itself (the agent, sshd, a
  database on 0.0.0.0, the gateway's address), only answers to what the host opened;
- ``DOCKER-USER -i gm+ -j GPUMARKET-EGRESS``, a chain rebuilt atomically (``iptables-restore
  --noflush``) from the host's egress policy: no link-local metadata (169.254.0.0/16, whatever the
  provider allows), no other rental (``-o gm+``), none of the engine's other networks, no port the
  host publishes for some other container (``--ctstate DNAT``), the host's own DNS resolvers on port
  53, the provider's ``egress_allow`` ranges, and then no private, shared or special range
  (``BLOCKED_V4``: RFC 1918, RFC 6598 CGNAT, ...); the rest — the internet — passes;
- ``FORWARD -i gm+ -j DROP`` for IPv6: rentals get no IPv6 beyond their own namespace (so no
  fc00::/7 or fe80::/10 either);
- ``DOCKER-USER -o gmp+ --ctstate ESTABLISHED,RELATED -j ACCEPT`` and a ``MASQUERADE`` for the
  process rentals' pool: their answers come back, their traffic leaves with the host's address;
- ``mangle FORWARD -i gm+ -j GPUMARKET-EGRESS``: the same policy's drops once more, in a table the
  engine never writes. The engine moves its ``FORWARD -j DOCKER-USER`` to the top whenever it makes
  a network (``iptables -D`` then ``-I``): between the two a rental's packet skips DOCKER-USER, and
  the suite saw a container reach 169.254.169.254 in that gap while other rentals started.

Installed idempotently (``iptables -C`` first; a rule missing moves all of its chain's rules to the
top in one ``iptables-restore`` transaction, never a moment without them), with the tools run through
``asyncio.create_subprocess_exec`` — never a shell. An agent that is not root (the installer's
unit runs it as a system user) cannot: the unit installs them as root before the agent starts
(``ExecStartPre=-+… gpumarket agent netguard``), which leaves ``MARKER`` in ``/run`` for the
agent to read. Where neither happened (or there is no ``iptables``), ``NetGuardStatus.active`` is
false with the reason: the host then reports its guard off and is not ``isolated``.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import os
import shutil
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final

log = logging.getLogger(__name__)

# Written by ``gpumarket agent netguard`` (as root) once the rules are in place; /run empties at
# boot, as the rules do, and the unit writes it again before each start.
MARKER: Final = Path("/run/gpumarket-netguard")

BRIDGE_PREFIX: Final = "gm"
WILDCARD: Final = f"{BRIDGE_PREFIX}+"
PROCESS_PREFIX: Final = "gmp"  # the host ends of process rentals' veth pairs
EGRESS_CHAIN: Final = "GPUMARKET-EGRESS"
DEFAULT_PROCESS_POOL: Final = "10.214.0.0/15"

# Never reachable from a rental, whatever the provider allows: the cloud metadata service.
LINK_LOCAL_V4: Final = "169.254.0.0/16"
# Refused by default; a provider may allow some of them by name (``egress_allow``).
BLOCKED_V4: Final = (
    "0.0.0.0/8",  # "this network"
    "10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16",  # RFC 1918: the provider's LAN
    "100.64.0.0/10",  # RFC 6598: carrier-grade NAT, often the provider's side of it
    "192.0.0.0/24", "198.18.0.0/15",  # IETF protocol assignments, benchmarking
    "224.0.0.0/4", "240.0.0.0/4",  # multicast, reserved
)  # fmt: skip

INPUT_RULES: Final = (
    ("INPUT", ("-i", WILDCARD, "-m", "conntrack", "--ctstate", "ESTABLISHED,RELATED", "-j", "ACCEPT")),
    ("INPUT", ("-i", WILDCARD, "-j", "DROP")),
)
# In DOCKER-USER, in this order from the top.
FORWARD_RULES: Final = (
    ("DOCKER-USER", ("-i", WILDCARD, "-j", EGRESS_CHAIN)),
    ("DOCKER-USER", ("-o", f"{PROCESS_PREFIX}+", "-m", "conntrack", "--ctstate", "ESTABLISHED,RELATED", "-j", "ACCEPT")),
)
# In mangle's FORWARD, which the engine never writes: the policy's drops again (``EgressPolicy.mangle_rules``).
MANGLE_RULES: Final = (("FORWARD", ("-i", WILDCARD, "-j", EGRESS_CHAIN)),)
# What older agents installed in DOCKER-USER; the egress chain says all of it now.
_OLD_FORWARD_RULES: Final = (
    ("-i", WILDCARD, "-d", LINK_LOCAL_V4, "-j", "DROP"),
    ("-i", WILDCARD, "-o", WILDCARD, "-j", "DROP"),
    ("-i", WILDCARD, "-m", "conntrack", "--ctstate", "DNAT", "-j", "DROP"),
)
INPUT_RULES_V6: Final = INPUT_RULES
FORWARD_RULES_V6: Final = (("FORWARD", ("-i", WILDCARD, "-j", "DROP")),)


@dataclass(frozen=True, slots=True)
class EgressPolicy:
    """What a rental may reach beyond the host: everything public, the host's DNS resolvers on port 53,
    and the private ranges of ``allow`` (the provider's ``egress_allow``); never link-local metadata."""

    allow: tuple[str, ...] = ()
    resolvers: tuple[str, ...] = ()
    process_pool: str = DEFAULT_PROCESS_POOL

    @classmethod
    def for_host(cls, allow: Sequence[str] = (), *, process_pool: str = DEFAULT_PROCESS_POOL, resolv_conf: Path = Path("/etc/resolv.conf")) -> EgressPolicy:
        """The policy with this host's IPv4 resolvers read from ``resolv_conf`` (loopback ones skipped:
        a rental's loopback is its own)."""
        return cls(tuple(normalise_ranges(allow)), tuple(host_resolvers(resolv_conf)), process_pool)

    def egress_rules(self) -> list[tuple[str, ...]]:
        """The egress chain's rules, in order (``iptables -A GPUMARKET-EGRESS`` arguments)."""
        rules: list[tuple[str, ...]] = [
            ("-d", LINK_LOCAL_V4, "-j", "DROP"),
            ("-o", WILDCARD, "-j", "DROP"),
            ("-o", "docker0", "-j", "DROP"),
            ("-o", "br-+", "-j", "DROP"),
            ("-m", "conntrack", "--ctstate", "DNAT", "-j", "DROP"),
        ]

        def passing(*match: str) -> list[tuple[str, ...]]:
            # A process rental's veth has no rule of the engine's behind ours: accept it here. A
            # container's bridge goes back to the engine's own chains (its NAT and accounting).
            return [(*match, "-i", f"{PROCESS_PREFIX}+", "-j", "ACCEPT"), (*match, "-j", "RETURN")]

        for resolver in self.resolvers:
            for proto in ("udp", "tcp"):
                rules += passing("-d", f"{resolver}/32", "-p", proto, "--dport", "53")
        for allowed in self.allow:
            rules += passing("-d", allowed)
        rules += [("-d", blocked, "-j", "DROP") for blocked in BLOCKED_V4]
        rules += passing()
        return rules

    def mangle_rules(self) -> list[tuple[str, ...]]:
        """The same chain for mangle's FORWARD: its drops, in the same order, and what passes returns (the filter
        table, with the engine's rules, decides what is accepted)."""
        return [(*rule[:-1], "RETURN") if rule[-1] == "ACCEPT" else rule for rule in self.egress_rules()]


def normalise_ranges(ranges: Sequence[str]) -> list[str]:
    """``egress_allow`` as IPv4 networks (``10.1.2.0/24``); raises ``ValueError`` naming a bad one, or one
    that would open link-local metadata."""
    out: list[str] = []
    for text in ranges:
        try:
            net = ipaddress.IPv4Network(text.strip(), strict=False)
        except ValueError as exc:
            raise ValueError(f"egress_allow: {text!r} is not an IPv4 address or network ({exc})") from None
        if net.overlaps(ipaddress.IPv4Network(LINK_LOCAL_V4)):
            raise ValueError(f"egress_allow: {text!r} overlaps {LINK_LOCAL_V4} (link-local metadata), which is never allowed")
        out.append(str(net))
    return out


def host_resolvers(resolv_conf: Path = Path("/etc/resolv.conf")) -> list[str]:
    """The IPv4 name servers ``resolv_conf`` names, loopback ones left out."""
    found: list[str] = []
    with contextlib.suppress(OSError):
        for line in resolv_conf.read_text().splitlines():
            words = line.split()
            if len(words) >= 2 and words[0] == "nameserver":
                with contextlib.suppress(ValueError):
                    address = ipaddress.IPv4Address(words[1])
                    if not address.is_loopback and str(address) not in found:
                        found.append(str(address))
    return found


@dataclass(frozen=True, slots=True)
class NetGuardStatus:
    """Whether the guard's rules are in place; ``reason`` says why not (or what was done)."""

    active: bool
    reason: str
    policy: EgressPolicy = field(default_factory=EgressPolicy)


async def _run(tool: str, *args: str, timeout: float, stdin: bytes | None = None) -> tuple[int, str]:
    process = await asyncio.create_subprocess_exec(
        tool, *args,
        stdin=asyncio.subprocess.DEVNULL if stdin is None else asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    try:
        async with asyncio.timeout(timeout):
            _, err = await process.communicate(stdin)
    finally:
        if process.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                process.kill()
            await process.wait()
    assert process.returncode is not None
    return process.returncode, err.decode(errors="replace").strip()


async def _iptables(iptables: str, *args: str, timeout: float) -> tuple[int, str]:
    return await _run(iptables, "-w", "5", *args, timeout=timeout)


def _restore_tool(iptables: str) -> str | None:
    """``iptables-restore`` (or ``ip6tables-restore``) beside ``iptables``."""
    name = f"{os.path.basename(iptables)}-restore"
    return shutil.which(name, path=os.path.dirname(iptables)) or shutil.which(name)


async def _restore(iptables: str, table: str, lines: Sequence[str], *, timeout: float) -> tuple[int, str]:
    """``lines`` applied to ``table`` as one transaction (``iptables-restore --noflush``)."""
    restore = _restore_tool(iptables)
    if restore is None:
        return 1, f"{os.path.basename(iptables)}-restore is not installed"
    return await _run(restore, "-w", "5", "--noflush", timeout=timeout, stdin="\n".join((f"*{table}", *lines, "COMMIT\n")).encode())


async def _ensure_first(path: str, rules: Sequence[tuple[str, tuple[str, ...]]], *, timeout: float, table: str = "filter") -> str | None:
    """Each of ``rules`` present, in this order, at the top of its chain; an error line, or ``None``.

    When one is missing, one transaction deletes a copy of each present one and inserts all at the top: deleting
    first and inserting after, as separate commands, would leave a moment without them (another agent on the host
    may be doing the same; the suite runs many)."""
    present = [(await _iptables(path, "-t", table, "-C", chain, *rule, timeout=timeout))[0] == 0 for chain, rule in rules]
    if all(present):
        return None
    lines = [" ".join(("-D", chain, *rule)) for (chain, rule), there in zip(rules, present, strict=True) if there]
    lines += [" ".join(("-I", chain, "1", *rule)) for chain, rule in reversed(rules)]
    code, err = await _restore(path, table, lines, timeout=timeout)
    return None if code == 0 else f"{os.path.basename(path)}-restore of {table} {', '.join(sorted({c for c, _ in rules}))} failed: {err}"


async def _install_v6(timeout: float) -> str:
    path = shutil.which("ip6tables")
    if path is None:
        return "ip6tables is not installed (rentals get no IPv6 address of ours either way)"
    for rules in (INPUT_RULES_V6, FORWARD_RULES_V6):
        error = await _ensure_first(path, rules, timeout=timeout)
        if error:
            return error
    return ""


async def install_guard(
    *,
    policy: EgressPolicy | None = None,
    iptables: str | None = None,
    timeout: float = 15.0,
    marker: Path = MARKER,
    euid: int | None = None,
) -> NetGuardStatus:
    """Put the rules in place for ``policy`` (default: this host's resolvers, nothing private allowed;
    idempotent); never raises for a host that cannot, says why instead.

    Not root (``euid``, default this process's): the rules count as in place when ``marker``,
    owned by root, says root put them there this boot.
    """
    policy = policy or EgressPolicy.for_host()
    if (os.geteuid() if euid is None else euid) != 0:
        try:
            if marker.stat().st_uid == 0 and marker.read_text().startswith("active"):
                return NetGuardStatus(True, f"iptables rules for {WILDCARD} installed as root before the agent started ({marker})", policy)
        except OSError:
            pass
        return NetGuardStatus(
            False, "the agent is not root, so it cannot add iptables rules for the rentals' networks "
            "(run `gpumarket agent netguard` as root before it starts, as the installer's unit does)", policy,
        )  # fmt: skip
    path = iptables or shutil.which("iptables")
    if path is None:
        return NetGuardStatus(False, "iptables is not installed", policy)
    try:
        code, err = await _iptables(path, "-t", "filter", "-n", "-L", "DOCKER-USER", timeout=timeout)
        if code != 0:
            # The engine makes DOCKER-USER when it starts; make it if this engine did not (yet).
            code, err = await _iptables(path, "-t", "filter", "-N", "DOCKER-USER", timeout=timeout)
            if code != 0:
                return NetGuardStatus(False, f"cannot find or make the DOCKER-USER chain: {err}", policy)
        if (await _iptables(path, "-t", "filter", "-C", "FORWARD", "-j", "DOCKER-USER", timeout=timeout))[0] != 0:
            await _iptables(path, "-t", "filter", "-I", "FORWARD", "1", "-j", "DOCKER-USER", timeout=timeout)
        # Each egress chain in one transaction: never a moment with half a policy.
        for table, rules in (("filter", policy.egress_rules()), ("mangle", policy.mangle_rules())):
            lines = [f":{EGRESS_CHAIN} - [0:0]", f"-F {EGRESS_CHAIN}", *(" ".join(("-A", EGRESS_CHAIN, *rule)) for rule in rules)]
            code, err = await _restore(path, table, lines, timeout=timeout)
            if code != 0:
                return NetGuardStatus(False, f"iptables-restore of {table} {EGRESS_CHAIN} failed: {err}", policy)
        for error in (
            await _ensure_first(path, INPUT_RULES, timeout=timeout),
            await _ensure_first(path, FORWARD_RULES, timeout=timeout),
            await _ensure_first(path, MANGLE_RULES, timeout=timeout, table="mangle"),
        ):
            if error:
                return NetGuardStatus(False, error, policy)
        for rule in _OLD_FORWARD_RULES:
            while (await _iptables(path, "-D", "DOCKER-USER", *rule, timeout=timeout))[0] == 0:
                pass
        masquerade = ("-s", policy.process_pool, "!", "-o", WILDCARD, "-j", "MASQUERADE")
        if (await _iptables(path, "-t", "nat", "-C", "POSTROUTING", *masquerade, timeout=timeout))[0] != 0:
            code, err = await _iptables(path, "-t", "nat", "-I", "POSTROUTING", "1", *masquerade, timeout=timeout)
            if code != 0:
                return NetGuardStatus(False, f"iptables -t nat -I POSTROUTING failed: {err}", policy)
        v6 = await _install_v6(timeout)
        # Process rentals' traffic is routed (the engine turns this on for its bridges; without one, we do).
        forwarding = Path("/proc/sys/net/ipv4/ip_forward")
        if forwarding.read_text().strip() != "1":
            forwarding.write_text("1")
    except (OSError, TimeoutError) as exc:
        return NetGuardStatus(False, f"cannot run {path}: {exc}", policy)
    allowed = f"; private ranges allowed: {', '.join(policy.allow)}" if policy.allow else "; no private range allowed"
    note = f"; IPv6: {v6}" if v6 else ""
    return NetGuardStatus(True, f"iptables rules for {WILDCARD} in INPUT, DOCKER-USER, mangle FORWARD and {EGRESS_CHAIN}{allowed}{note}", policy)


def write_marker(status: NetGuardStatus, marker: Path = MARKER) -> None:
    """Record for a non-root agent that root put the rules in place (or remove a stale record)."""
    if status.active:
        marker.write_text(f"active\n{status.reason}\n")
        marker.chmod(0o644)
    else:
        with contextlib.suppress(FileNotFoundError):
            marker.unlink()
