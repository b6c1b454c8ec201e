"""What this host offers a cluster's members, for the hello (``protocol.ClusterNetworkFacts``): kernel WireGuard,
``wireguard-go``, the trusted fabric its provider declared and its RDMA devices (docs/clusters.md, "Three paths").

Kernel WireGuard counts as there when its module is loaded (``/sys/module/wireguard``) or loadable: an interface of
its type can be made in a scratch network namespace (the kernel loads the module on demand), which is deleted at
once. A declared fabric whose parent interface is missing is not reported (the reason says so): a member could not
join it. RDMA devices: ``/sys/class/infiniband``'s names and ``/dev/infiniband``'s character devices.
"""

from __future__ import annotations

import asyncio
import os
import secrets
import shutil
import stat
from collections.abc import Sequence
from pathlib import Path

from shared import protocol
from shared.protocol.clusterpaths import MAX_RDMA_DEVICES


async def _quiet(*argv: str, timeout: float = 10.0) -> bool:
    try:
        process = await asyncio.create_subprocess_exec(*argv, stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL)
    except OSError:
        return False
    try:
        async with asyncio.timeout(timeout):
            return await process.wait() == 0
    except TimeoutError:
        process.kill()
        await process.wait()
        return False


async def kernel_wireguard(root: Path = Path("/")) -> bool:
    """Whether this kernel has WireGuard: the module loaded, or an interface of its type made in a scratch namespace."""
    if (root / "sys/module/wireguard").is_dir():
        return True
    if os.geteuid() != 0 or shutil.which("ip") is None:
        return False
    scratch = f"gmwgprobe-{secrets.token_hex(4)}"
    if not await _quiet("ip", "netns", "add", scratch):
        return False
    try:
        return await _quiet("ip", "-n", scratch, "link", "add", "wgprobe", "type", "wireguard")
    finally:
        await _quiet("ip", "netns", "del", scratch)


def rdma_devices(root: Path = Path("/")) -> tuple[list[str], list[str]]:
    """(the RDMA devices' names in ``/sys/class/infiniband``, the character devices in ``/dev/infiniband``), sorted."""
    names: list[str] = []
    devices: list[str] = []
    with_names = root / "sys/class/infiniband"
    if with_names.is_dir():
        names = sorted(entry.name for entry in with_names.iterdir())[: MAX_RDMA_DEVICES]
    nodes = root / "dev/infiniband"
    if nodes.is_dir():
        for entry in sorted(nodes.iterdir()):
            try:
                if stat.S_ISCHR(entry.lstat().st_mode):
                    devices.append(f"/dev/infiniband/{entry.name}")
            except OSError:
                continue
    return names, devices[: MAX_RDMA_DEVICES]


async def detect(
    fabric: protocol.FabricDeclaration | None, *, wireguard_go: str = "wireguard-go", root: Path = Path("/"), probe_kernel: bool = True,
) -> protocol.ClusterNetworkFacts:
    """This host's cluster network facts. ``probe_kernel=False``: only the loaded module counts (no scratch namespace)."""
    reasons: list[str] = []
    kernel = await kernel_wireguard(root) if probe_kernel else (root / "sys/module/wireguard").is_dir()
    if not kernel:
        reasons.append("no kernel WireGuard (the module is neither loaded nor loadable)")
    userspace = shutil.which(wireguard_go) is not None
    if not userspace:
        reasons.append(f"{wireguard_go} is not installed")
    if fabric is not None and not (root / "sys/class/net" / fabric.parent).exists():
        reasons.append(f"the fabric {fabric.name}'s parent interface {fabric.parent} does not exist here: not offered")
        fabric = None
    names, devices = rdma_devices(root)
    return protocol.ClusterNetworkFacts(
        kernel_wireguard=kernel, wireguard_go=userspace, fabric=fabric, rdma_names=names, rdma_devices=devices, reason="; ".join(reasons)[:512],
    )  # fmt: skip


def present_devices(devices: Sequence[str], root: Path = Path("/")) -> list[str]:
    """Those of ``devices`` (a start command's RDMA devices) that are character devices under ``/dev/infiniband`` here:
    the master's list is of the host's last hello, and a device gone since would fail the container's creation."""
    found = []
    for device in devices:
        path = root / device.lstrip("/")
        try:
            if device.startswith("/dev/infiniband/") and "/.." not in device and stat.S_ISCHR(path.lstat().st_mode):
                found.append(device)
        except OSError:
            continue
    return found
