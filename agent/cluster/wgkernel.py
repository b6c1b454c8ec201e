"""Kernel WireGuard for a cluster member's tunnel, where the host has the module (docs/clusters.md, "Three paths").

``agent.cluster.net`` speaks WireGuard's text protocol (UAPI) to ``wireguard-go``; the kernel's WireGuard is configured
over netlink instead, which ``wg`` (wireguard-tools) speaks. This module keeps ``net`` one protocol: it turns a UAPI
``set`` request into one ``wg set`` command line (``wg_set_argv``) and ``wg show DEV dump`` into a UAPI ``get``
answer's lines (``dump_lines``), and runs ``wg`` inside the member's network namespace (the interface lives there,
renamed ``cluster0``; its UDP socket stays in the host's namespace, where it was made, as ``wireguard-go``'s does).

Unproven end to end on the machines this was written on (no kernel module: docs/performance.md says so); the
translations are tested.
"""

from __future__ import annotations

import base64
import contextlib
from collections.abc import Sequence
from pathlib import Path
from typing import Final

from agent.cluster.tools import run
from agent.cluster.wgcontrol import ClusterNetworkError

WG: Final = "wg"
_PEER_OPTIONS: Final = {"endpoint": "endpoint", "persistent_keepalive_interval": "persistent-keepalive"}


def _b64(hex_key: str) -> str:
    return base64.b64encode(bytes.fromhex(hex_key)).decode()


def wg_set_argv(device: str, request: str, *, current_peers: Sequence[str] = ()) -> tuple[list[str], str | None]:
    """``wg set`` for a UAPI ``set=1`` request: its arguments and the private key to write to its stdin (``None``:
    none). ``replace_peers=true`` removes ``current_peers`` (base64) the request does not name, as UAPI would."""
    argv = [WG, "set", device]
    private: str | None = None
    named: list[str] = []
    replace = False
    peer_args: list[str] = []
    allowed: list[str] = []

    def close_peer() -> None:
        if allowed:
            peer_args.extend(["allowed-ips", ",".join(allowed)])
            allowed.clear()

    for line in request.splitlines():
        key, _, value = line.partition("=")
        if not key or key == "set":
            continue
        if key == "private_key":
            private = _b64(value)
            argv += ["private-key", "/dev/stdin"]
        elif key == "listen_port":
            argv += ["listen-port", value]
        elif key == "replace_peers":
            replace = value == "true"
        elif key == "public_key":
            close_peer()
            named.append(_b64(value))
            peer_args += ["peer", named[-1]]
        elif key == "remove" and value == "true":
            peer_args.append("remove")
        elif key == "allowed_ip":
            allowed.append(value)
        elif key in _PEER_OPTIONS:
            peer_args += [_PEER_OPTIONS[key], value]
        elif key == "replace_allowed_ips":
            continue  # ``wg set … allowed-ips`` replaces them
        else:
            raise ClusterNetworkError(f"kernel WireGuard: no wg option for the UAPI line {key}")
    close_peer()
    if replace:
        for gone in [key for key in current_peers if key not in named]:
            argv += ["peer", gone, "remove"]
    return argv + peer_args, private


def dump_lines(dump: str) -> list[tuple[str, str]]:
    """``wg show DEV dump`` (tab-separated: the interface, then one line per peer) as a UAPI ``get`` answer's lines."""
    lines: list[tuple[str, str]] = []
    rows = [row.split("\t") for row in dump.splitlines() if row.strip()]
    if rows:
        private, _public, port, *_ = rows[0]
        if private != "(none)":
            lines.append(("private_key", base64.b64decode(private).hex()))
        lines.append(("listen_port", port))
    for row in rows[1:]:
        if len(row) < 8:
            continue
        public, _psk, endpoint, allowed, handshake, rx, tx, keepalive = row[:8]
        lines.append(("public_key", base64.b64decode(public).hex()))
        if endpoint != "(none)":
            lines.append(("endpoint", endpoint))
        lines += [("allowed_ip", a) for a in allowed.split(",") if a and a != "(none)"]
        lines += [("last_handshake_time_sec", handshake), ("rx_bytes", rx), ("tx_bytes", tx),
                  ("persistent_keepalive_interval", "0" if keepalive == "off" else keepalive)]  # fmt: skip
    return lines


async def _wg(netns_pid: int | None, argv: list[str], stdin: str | None = None) -> str:
    full = ["nsenter", f"--net=/proc/{netns_pid}/ns/net", *argv] if netns_pid is not None else argv
    _, out = await run(*full, stdin=stdin.encode() if stdin is not None else b"", timeout=5.0)
    return out.decode()


async def request(device: str, text: str, *, netns_pid: int | None) -> list[tuple[str, str]]:
    """One UAPI request (``get=1`` or ``set=1``) to the kernel interface ``device`` (in ``netns_pid``'s namespace, or
    the host's with ``None``), answered as ``wgcontrol.uapi_lines`` answers."""
    if text.startswith("get=1"):
        return dump_lines(await _wg(netns_pid, [WG, "show", device, "dump"]))
    current: list[str] = []
    if "replace_peers=true" in text:
        current = [base64.b64encode(bytes.fromhex(v)).decode() for k, v in dump_lines(await _wg(netns_pid, [WG, "show", device, "dump"]))
                   if k == "public_key"]  # fmt: skip
    argv, private = wg_set_argv(device, text, current_peers=current)
    await _wg(netns_pid, argv, private)
    return [("errno", "0")]


def has_interface(pid: int, name: str) -> bool:
    """Whether the network namespace of process ``pid`` has an interface ``name`` (its ``/proc/<pid>/net/dev``)."""
    try:
        lines = Path(f"/proc/{pid}/net/dev").read_text().splitlines()[2:]
    except OSError:
        return False
    return any(line.split(":", 1)[0].strip() == name for line in lines)


async def take_down(device: str, name: str, netns_pid: int | None) -> None:
    """Delete the member's kernel interface: ``name`` in ``netns_pid``'s namespace once moved there, else ``device`` in the
    host's (a failure midway). A namespace that is gone took its interface with it."""
    argv = ["ip", "link", "del", name] if netns_pid is not None else ["ip", "link", "del", device]
    if netns_pid is not None:
        if not has_interface(netns_pid, name):
            return
        argv = ["nsenter", f"--net=/proc/{netns_pid}/ns/net", *argv]
    with contextlib.suppress(ClusterNetworkError):
        await run(*argv, check=False)
