"""``wireguard-go``'s control, for a cluster member's tunnel (``agent.cluster.net``): keys, and the requests of
WireGuard's text protocol (UAPI) on its control socket ``/var/run/wireguard/<device>.sock`` — no ``wg`` needed —, and
the process itself: whether a pid is still our ``wireguard-go``, and a socket an ended one left behind."""

from __future__ import annotations

import asyncio
import base64
import ipaddress
from pathlib import Path
from typing import Final

from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

from shared import protocol
from shared.errors import BadRequest

UAPI_DIR: Final = Path("/var/run/wireguard")
KEEPALIVE_S: Final = 25  # keeps a NAT's mapping open between members that are idle


class ClusterNetworkError(BadRequest):
    """The member's tunnel could not be made; ``code`` is ``cluster_network_unavailable``."""

    def __init__(self, message: str) -> None:
        super().__init__(message, code="cluster_network_unavailable")


def address_of(subnet: str, rank: int) -> str:
    """``node-<rank>``'s private address: the subnet's ``rank + 1``."""
    return str(ipaddress.IPv4Network(subnet)[rank + 1])


def wg_public_key(private: X25519PrivateKey) -> str:
    return base64.b64encode(private.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)).decode()


def hex_key(b64: str) -> str:
    return base64.b64decode(b64).hex()


def uapi_set(private_hex: str | None, peers: list[protocol.ClusterPeer] | None, subnet: str, *, listen_port: int | None = None) -> str:
    """A UAPI ``set`` request: the private key and port (when given) and, when ``peers`` is not ``None``, the peers
    replacing any earlier ones, each allowed only its own address."""
    lines = ["set=1"]
    if private_hex is not None:
        lines.append(f"private_key={private_hex}")
    if listen_port is not None:
        lines.append(f"listen_port={listen_port}")
    if peers is not None:
        lines += ["replace_peers=true", *_peer_lines(peers, subnet)]
    return "\n".join(lines) + "\n\n"


def _peer_lines(peers: list[protocol.ClusterPeer], subnet: str) -> list[str]:
    lines = []
    for peer in peers:
        lines += [f"public_key={hex_key(peer.public_key)}", "replace_allowed_ips=true", f"allowed_ip={address_of(subnet, peer.rank)}/32",
                  f"persistent_keepalive_interval={KEEPALIVE_S}"]  # fmt: skip
        if peer.endpoint is not None:
            lines.append(f"endpoint={peer.endpoint}")
    return lines


def uapi_peer_changes(old: list[protocol.ClusterPeer], new: list[protocol.ClusterPeer], subnet: str) -> str | None:
    """A UAPI ``set`` request that turns the peers ``old`` into ``new`` (``None``: nothing to change): the peers
    gone removed, the new or changed ones set; a peer that did not change is not touched. ``replace_peers`` would
    end every session, and members setting their peers at once would then all start handshakes at once: in
    wireguard-go (0.0.20220316) handshakes that cross can leave a pair without a session for 5–15 s."""
    keys = {peer.public_key for peer in new}
    lines = [f"public_key={hex_key(peer.public_key)}\nremove=true" for peer in old if peer.public_key not in keys]
    lines += _peer_lines([peer for peer in new if peer not in old], subnet)
    return "\n".join(["set=1", *lines]) + "\n\n" if lines else None


async def uapi_lines(device: str, request: str, *, directory: Path = UAPI_DIR, timeout: float = 5.0) -> list[tuple[str, str]]:
    """Send one UAPI request to ``wireguard-go``'s socket; its answer's ``key=value`` lines in order. Raises
    ``ClusterNetworkError`` when it answers ``errno`` other than 0, or cannot be asked (no socket, no answer within
    ``timeout``)."""
    try:
        async with asyncio.timeout(timeout):
            reader, writer = await asyncio.open_unix_connection(str(directory / f"{device}.sock"))
            try:
                writer.write(request.encode())
                await writer.drain()
                lines: list[tuple[str, str]] = []
                while True:
                    line = (await reader.readline()).decode().strip()
                    if not line:
                        break
                    key, _, value = line.partition("=")
                    lines.append((key, value))
            finally:
                writer.close()
    except OSError as exc:  # TimeoutError included
        raise ClusterNetworkError(f"wireguard-go's control socket for {device} did not answer ({exc or type(exc).__name__})") from None
    errno = dict(lines).get("errno", "0")
    if errno != "0":
        raise ClusterNetworkError(f"wireguard-go refused its configuration (errno {errno})")
    return lines


async def uapi(device: str, request: str, *, directory: Path = UAPI_DIR, timeout: float = 5.0) -> dict[str, str]:
    """``uapi_lines`` as a dict (the last line of each key wins)."""
    return dict(await uapi_lines(device, request, directory=directory, timeout=timeout))


async def peer_states(device: str, *, directory: Path = UAPI_DIR) -> dict[str, dict[str, str]]:
    """Each peer's (public key, base64) state as ``wireguard-go`` reports it: ``endpoint``, ``last_handshake_time_sec``
    (0: never), ``rx_bytes``, ``tx_bytes`` and the rest of its lines."""
    return peer_states_of(await uapi_lines(device, "get=1\n\n", directory=directory))


def peer_states_of(lines: list[tuple[str, str]]) -> dict[str, dict[str, str]]:
    """``peer_states`` of a UAPI ``get`` answer's lines (``wireguard-go``'s, or kernel WireGuard's as ``wgkernel`` gives them)."""
    found: dict[str, dict[str, str]] = {}
    peer: dict[str, str] | None = None
    for name, value in lines:
        if name == "public_key":
            peer = found.setdefault(base64.b64encode(bytes.fromhex(value)).decode(), {})
        elif peer is not None:
            peer[name] = value
    return found


async def handshakes(device: str, *, directory: Path = UAPI_DIR) -> dict[str, int]:
    """Each peer's (public key, base64) last handshake, seconds since the epoch (0: never)."""
    return {key: int(state.get("last_handshake_time_sec", "0")) for key, state in (await peer_states(device, directory=directory)).items()}


def peer_state_text(state: dict[str, str] | None, now: float) -> str:
    """What WireGuard says of one peer, in words (for an error that says why a peer did not answer)."""
    if state is None:
        return "WireGuard does not know this peer"
    last = int(state.get("last_handshake_time_sec", "0") or 0)
    handshake = "no handshake yet" if last == 0 else f"last handshake {max(0, round(now - last))}s ago"
    return f"{handshake}, {state.get('tx_bytes', '0')} bytes sent and {state.get('rx_bytes', '0')} received, endpoint {state.get('endpoint', 'none')}"


def is_wireguard(pid: int, device: str) -> bool:
    """Whether ``pid`` runs and is still our ``wireguard-go`` for ``device`` (a pid can be reused; an ended process
    not yet reaped has no command line)."""
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    return any(a.endswith(b"wireguard-go") for a in argv[:1]) and device.encode() in argv


def exited(pid: int) -> bool:
    """Whether process ``pid`` is gone or a zombie (its files closed)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return True
    return state in ("Z", "X")


async def clear_stale_socket(path: Path) -> bool:
    """Remove ``path``, a UAPI socket that a ``wireguard-go`` which ended (killed, crashed) left behind — a new
    process would take it over, but nothing could tell its socket from the old one until then. ``False``: a live
    process answers on it (left alone)."""
    if not path.exists():
        return True
    try:
        async with asyncio.timeout(1.0):
            _, writer = await asyncio.open_unix_connection(str(path))
    except TimeoutError:
        return False  # someone holds it, slowly: not ours to remove
    except OSError:  # refused (or gone meanwhile): nobody listens any more
        path.unlink(missing_ok=True)
        return True
    writer.close()
    return False
