"""The network guard of container rentals: host firewall rules that every rental bridge (``gm+``) shares.

Each container rental sits on a bridge of its own named ``gm`` + a short hash
(``agent.runtimes.container.bridge_name``), so a handful of wildcard iptables rules cover
every rental, present and future:

- ``INPUT -i gm+ -m conntrack --ctstate ESTABLISHED,RELATED -j ACCEPT`` and ``INPUT -i gm+
  -j DROP``: a rental reaches no service of the host itself (the agent, sshd, a database on
  0.0.0.0, the bridge gateway's address), only answers to what the host opened;
- ``DOCKER-USER -i gm+ -d 169.254.0.0/16 -j DROP``: no link-local metadata service (cloud
  credentials at 169.254.169.254);
- ``DOCKER-USER -i gm+ -o gm+ -j DROP``: no other rental's bridge (the engine's own
  isolation chains say the same; this does not depend on them);
- ``DOCKER-USER -i gm+ -m conntrack --ctstate DNAT -j DROP``: no port the host publishes for
  some other container.

Installed once, idempotently (``iptables -C`` before ``-I``), with ``iptables`` run through
``asyncio.create_subprocess_exec`` — never a shell. An agent that is not root (the installer's
unit runs it as a system user) cannot: the unit installs them as root before the agent
starts (``ExecStartPre=-+… gpumarket agent netguard``), which leaves ``MARKER`` in ``/run``
for the agent to read. Where neither happened (or there is no ``iptables``),
``NetGuardStatus.active`` is false with the reason: the host then reports its guard off
(rentals still reach the outside and not each other's bridges, but they may reach the host's
services and link-local addresses).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Final

log = logging.getLogger(__name__)

# Written by ``gpumarket agent netguard`` (as root) once the rules are in place; /run empties at
# boot, as the rules do, and the unit writes it again before each start.
MARKER: Final = Path("/run/gpumarket-netguard")

BRIDGE_PREFIX: Final = "gm"
WILDCARD: Final = f"{BRIDGE_PREFIX}+"

# (chain, rule) in the order they must be matched; INPUT's ACCEPT must precede its DROP.
INPUT_RULES: Final = (
    ("INPUT", ("-i", WILDCARD, "-m", "conntrack", "--ctstate", "ESTABLISHED,RELATED", "-j", "ACCEPT")),
    ("INPUT", ("-i", WILDCARD, "-j", "DROP")),
)
FORWARD_RULES: Final = (
    ("DOCKER-USER", ("-i", WILDCARD, "-d", "169.254.0.0/16", "-j", "DROP")),
    ("DOCKER-USER", ("-i", WILDCARD, "-o", WILDCARD, "-j", "DROP")),
    ("DOCKER-USER", ("-i", WILDCARD, "-m", "conntrack", "--ctstate", "DNAT", "-j", "DROP")),
)


@dataclass(frozen=True, slots=True)
class NetGuardStatus:
    """Whether the guard's rules are in place; ``reason`` says why not (or what was done)."""

    active: bool
    reason: str


async def _iptables(iptables: str, *args: str, timeout: float) -> tuple[int, str]:
    process = await asyncio.create_subprocess_exec(
        iptables, "-w", "5", *args,
        stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE,
    )
    try:
        async with asyncio.timeout(timeout):
            _, err = await process.communicate()
    finally:
        if process.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                process.kill()
            await process.wait()
    assert process.returncode is not None
    return process.returncode, err.decode(errors="replace").strip()


async def install_guard(
    *, iptables: str | None = None, timeout: float = 15.0, marker: Path = MARKER, euid: int | None = None
) -> NetGuardStatus:
    """Put the rules in place (idempotent); never raises for a host that cannot, says why instead.

    Not root (``euid``, default this process's): the rules count as in place when ``marker``,
    owned by root, says root put them there this boot.
    """
    if (os.geteuid() if euid is None else euid) != 0:
        try:
            if marker.stat().st_uid == 0 and marker.read_text().startswith("active"):
                return NetGuardStatus(True, f"iptables rules for {WILDCARD} bridges installed as root before the agent started ({marker})")
        except OSError:
            pass
        return NetGuardStatus(
            False, "the agent is not root, so it cannot add iptables rules for the rental bridges "
            "(run `gpumarket agent netguard` as root before it starts, as the installer's unit does)",
        )  # fmt: skip
    path = iptables or shutil.which("iptables")
    if path is None:
        return NetGuardStatus(False, "iptables is not installed")
    try:
        code, err = await _iptables(path, "-t", "filter", "-n", "-L", "DOCKER-USER", timeout=timeout)
        if code != 0:
            # The engine makes DOCKER-USER when it starts; make it if this engine did not (yet).
            code, err = await _iptables(path, "-t", "filter", "-N", "DOCKER-USER", timeout=timeout)
            if code != 0:
                return NetGuardStatus(False, f"cannot find or make the DOCKER-USER chain: {err}")
            await _iptables(path, "-t", "filter", "-I", "FORWARD", "1", "-j", "DOCKER-USER", timeout=timeout)
        present = [(await _iptables(path, "-C", chain, *rule, timeout=timeout))[0] == 0 for chain, rule in INPUT_RULES]
        if not all(present):
            for chain, rule in INPUT_RULES:  # drop a lone one, then insert both in order
                while (await _iptables(path, "-D", chain, *rule, timeout=timeout))[0] == 0:
                    pass
            for chain, rule in reversed(INPUT_RULES):
                code, err = await _iptables(path, "-I", chain, "1", *rule, timeout=timeout)
                if code != 0:
                    return NetGuardStatus(False, f"iptables -I {chain} failed: {err}")
        for chain, forward in FORWARD_RULES:
            if (await _iptables(path, "-C", chain, *forward, timeout=timeout))[0] != 0:
                code, err = await _iptables(path, "-I", chain, "1", *forward, timeout=timeout)
                if code != 0:
                    return NetGuardStatus(False, f"iptables -I {chain} failed: {err}")
    except (OSError, TimeoutError) as exc:
        return NetGuardStatus(False, f"cannot run {path}: {exc}")
    return NetGuardStatus(True, f"iptables rules for {WILDCARD} bridges in INPUT and DOCKER-USER")


def write_marker(status: NetGuardStatus, marker: Path = MARKER) -> None:
    """Record for a non-root agent that root put the rules in place (or remove a stale record)."""
    if status.active:
        marker.write_text(f"active\n{status.reason}\n")
        marker.chmod(0o644)
    else:
        with contextlib.suppress(FileNotFoundError):
            marker.unlink()
