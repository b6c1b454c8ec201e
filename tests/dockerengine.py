"""The Docker engine for the container tests: make sure one answers, and build the test image locally.

``ensure_engine`` pings the engine's socket and, when nothing answers and we are root,
starts ``dockerd`` (logging to a file under a temporary folder) and waits for its
``/_ping``; it fails — never skips — saying what is missing otherwise. ``busybox_image``
imports a rootfs made of Debian's ``busybox-static`` (``/bin/busybox``, its applets as
symlinks, ``/etc/passwd`` with root and nobody) through the Engine API (``images/create``
with ``fromSrc=-``), tagged ``gpumarket-test/busybox:<content hash>``: nothing is pulled
from a registry, and a second run builds nothing.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import http.client
import io
import json
import os
import shutil
import socket
import subprocess
import tarfile
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Final
from urllib.parse import quote, urlencode

SOCKET: Final = "/var/run/docker.sock"
BUSYBOX: Final = "/bin/busybox"
IMAGE_REPO: Final = "gpumarket-test/busybox"
APPLETS: Final = (
    "sh", "ash", "ls", "cat", "id", "ps", "wget", "nc", "env", "sleep", "head", "kill", "echo", "grep", "find",
    "dd", "mkdir", "rm", "touch", "true", "false", "test", "[", "sed", "awk", "wc", "seq", "tail", "printf",
    "timeout", "ip", "stat", "hostname", "yes", "tr", "cut", "sort", "xargs", "date", "chmod", "readlink",
    "httpd", "sha1sum", "base64", "od",
)
PASSWD: Final = "root:x:0:0:root:/root:/bin/sh\nnobody:x:65534:65534:nobody:/nonexistent:/bin/sh\n"
GROUP: Final = "root:x:0:\nnogroup:x:65534:\n"


class _UnixConnection(http.client.HTTPConnection):
    def __init__(self, path: str, timeout: float) -> None:
        super().__init__("localhost", timeout=timeout)
        self.path = path

    def connect(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.timeout)
        sock.connect(self.path)
        self.sock = sock


def request(method: str, path: str, *, body: bytes | None = None, headers: dict[str, str] | None = None,
            timeout: float = 60.0, socket_path: str = SOCKET) -> tuple[int, bytes]:
    """One Engine API call over the unix socket (synchronous: for fixtures)."""
    connection = _UnixConnection(socket_path, timeout)
    try:
        connection.request(method, path, body=body, headers=headers or {})
        response = connection.getresponse()
        return response.status, response.read()
    finally:
        connection.close()


def ping(socket_path: str = SOCKET) -> str | None:
    """``None`` when the engine answers, else why not."""
    try:
        status, body = request("GET", "/_ping", timeout=5.0, socket_path=socket_path)
    except OSError as exc:
        return f"{socket_path}: {exc}"
    return None if status == 200 else f"{socket_path} answered {status}: {body[:200]!r}"


def ensure_engine(*, timeout: float = 60.0) -> str:
    """Make sure an engine answers at ``SOCKET``; returns how (already running / started). Raises ``RuntimeError`` saying what is missing."""
    why = ping()
    if why is None:
        return "running"
    dockerd = shutil.which("dockerd")
    if os.geteuid() != 0 or dockerd is None:
        raise RuntimeError(
            f"no Docker engine answers ({why}) and this suite cannot start one "
            f"({'not root' if os.geteuid() != 0 else 'dockerd is not installed'}): run `make docker` as root, "
            "or start dockerd (`dockerd --host unix:///var/run/docker.sock &`)"
        )
    log_dir = Path(tempfile.mkdtemp(prefix="gpumarket-dockerd-"))
    log_file = log_dir / "dockerd.log"
    with log_file.open("ab") as out:
        subprocess.Popen(
            [dockerd, "--host", f"unix://{SOCKET}"], stdin=subprocess.DEVNULL, stdout=out, stderr=out, start_new_session=True
        )
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        time.sleep(0.2)
        if ping() is None:
            return f"started dockerd (log: {log_file})"
    raise RuntimeError(f"started dockerd but it did not answer within {timeout:g}s; see {log_file}")


def _rootfs() -> tuple[bytes, str]:
    """The image's rootfs as a tar, and its content hash."""
    busybox = Path(BUSYBOX).read_bytes()
    buffer = io.BytesIO()
    now = 1_700_000_000  # fixed, so the same inputs make the same tar
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        def add_dir(name: str, mode: int = 0o755) -> None:
            entry = tarfile.TarInfo(name)
            entry.type, entry.mode, entry.mtime = tarfile.DIRTYPE, mode, now
            tar.addfile(entry)

        def add_file(name: str, data: bytes, mode: int = 0o644) -> None:
            entry = tarfile.TarInfo(name)
            entry.size, entry.mode, entry.mtime = len(data), mode, now
            tar.addfile(entry, io.BytesIO(data))

        for folder in ("bin", "etc", "proc", "sys", "dev", "root", "usr", "usr/bin"):
            add_dir(folder)
        add_dir("tmp", 0o1777)
        add_file("bin/busybox", busybox, 0o755)
        for applet in APPLETS:
            link = tarfile.TarInfo(f"bin/{applet}")
            link.type, link.linkname, link.mode, link.mtime = tarfile.SYMTYPE, "busybox", 0o777, now
            tar.addfile(link)
        add_file("etc/passwd", PASSWD.encode())
        add_file("etc/group", GROUP.encode())
    data = buffer.getvalue()
    return data, hashlib.sha256(data).hexdigest()[:16]


def image_exists(name: str) -> bool:
    status, _ = request("GET", f"/images/{quote(name, safe='')}/json")
    return status == 200


def busybox_image() -> str:
    """``gpumarket-test/busybox:<hash>``, imported now unless the engine has it already."""
    data, digest = _rootfs()
    name = f"{IMAGE_REPO}:{digest}"
    if image_exists(name):
        return name
    query = urlencode({"fromSrc": "-", "repo": IMAGE_REPO, "tag": digest, "changes": 'CMD ["sh"]'})
    status, body = request("POST", f"/images/create?{query}", body=data, headers={"Content-Type": "application/x-tar"}, timeout=120.0)
    if status != 200 or b'"error"' in body:
        raise RuntimeError(f"importing {name} failed ({status}): {body[-300:]!r}")
    return name


def remove_owned(owner: str) -> list[str]:
    """Remove every container, network and volume labelled ``gpumarket.owner=<owner>`` (a test's clean-up)."""
    filters = quote(json.dumps({"label": [f"gpumarket.owner={owner}"]}))
    removed = []
    status, body = request("GET", f"/containers/json?all=1&filters={filters}")
    for container in json.loads(body) if status == 200 else []:
        request("DELETE", f"/containers/{container['Id']}?force=1&v=1")
        removed.append(container["Id"][:12])
    status, body = request("GET", f"/networks?filters={filters}")
    for network in json.loads(body) if status == 200 else []:
        request("DELETE", f"/networks/{network['Id']}")
        removed.append(network["Name"])
    status, body = request("GET", f"/volumes?filters={filters}")
    volumes: list[dict[str, Any]] = (json.loads(body).get("Volumes") or []) if status == 200 else []
    for volume in volumes:
        request("DELETE", f"/volumes/{volume['Name']}?force=1")
        removed.append(volume["Name"])
    return removed


NETWORK_LOCK = Path(tempfile.gettempdir()) / "gpumarket-test-network.lock"
"""Chromium aborts requests in flight (ERR_NETWORK_CHANGED) when an address of the machine changes, as it does when
a container starts (a veth on Docker's bridge). The console's browser tests hold this lock exclusively for their
module; tests that start containers hold it shared while they run: under pytest-xdist the two never overlap."""


@contextlib.contextmanager
def network_lock(*, exclusive: bool) -> Iterator[None]:
    with open(NETWORK_LOCK, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
