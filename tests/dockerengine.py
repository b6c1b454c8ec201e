"""The Docker engine for the container tests: make sure one answers, and build the test images locally.

``ensure_engine`` pings the engine's socket and, when nothing answers and we are root,
starts ``dockerd`` (logging to a file under a temporary folder) and waits for its
``/_ping``; it fails — never skips — saying what is missing otherwise. ``busybox_image``
imports a rootfs made of Debian's ``busybox-static`` (``/bin/busybox``, its applets as
symlinks, ``/etc/passwd`` with root, the rental user (1000) and nobody) through the Engine API (``images/create``
with ``fromSrc=-``), tagged ``gpumarket-test/busybox:<content hash>``: nothing is pulled
from a registry, and a second run builds nothing.

``gpumarket/images.py`` builds images of Debian packages as this machine has them installed (``package_image``; the
demo's ``gpumarket/demo`` image is one); the suite builds two more so:

* ``torch_image``, ``gpumarket-test/torch:<hash>``: Debian's PyTorch (``python3-torch``, which ``make docker``
  installs) with the gloo all-reduce workload of ``tests/allreduce.py`` at ``/opt/gpumarket/allreduce.py``
  (~730 MB of files);
* ``openai_image``, ``gpumarket-test/openai-cpu:<hash>``: Debian's ``python3`` with the OpenAI-compatible sample
  server of ``examples/openai_cpu_server.py`` at ``/opt/gpumarket/openai_cpu_server.py``, its default command,
  listening on port 8000 (~48 MB).
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
import subprocess
import tarfile
import tempfile
import time
from pathlib import Path
from typing import Any, Final
from urllib.parse import quote, urlencode

from gpumarket.images import (
    BUSYBOX,
    DEFAULT_PATH,
    GROUP,
    PASSWD,
    SOCKET,
    PackageImage,
    _PackageRootfs,
    image_exists,
    package_image,
    ping,
    request,
)

__all__ = [
    "OPENAI_IMAGE", "OPENAI_SERVER_PATH", "SOCKET", "TORCH_IMAGE", "PackageImage", "_PackageRootfs", "busybox_image",
    "engine_json", "ensure_engine", "image_exists", "openai_image", "package_image", "ping", "remove_owned", "request", "torch_image",
]
IMAGE_REPO: Final = "gpumarket-test/busybox"
APPLETS: Final = (
    "sh", "ash", "ls", "cat", "id", "ps", "wget", "nc", "env", "sleep", "head", "kill", "echo", "grep", "find",
    "dd", "mkdir", "rm", "touch", "true", "false", "test", "[", "sed", "awk", "wc", "seq", "tail", "printf",
    "timeout", "ip", "stat", "hostname", "yes", "tr", "cut", "sort", "xargs", "date", "chmod", "readlink",
    "httpd", "sha1sum", "base64", "od",
)


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


TORCH_IMAGE: Final = PackageImage(
    repo="gpumarket-test/torch",
    roots=("python3-torch", "python3", "libc6"),
    files={"opt/gpumarket/allreduce.py": Path(__file__).with_name("allreduce.py")},
    changes=('CMD ["python3", "/opt/gpumarket/allreduce.py"]', DEFAULT_PATH),
    pruned={
        # Not needed to import torch or to run gloo, and large (the image is then ~730 MB of files instead of ~940).
        "libtorch-test": "torch's C++ test programs (~50 MB)",
        "libgl1-mesa-dri": "Mesa's OpenGL drivers and, through them, LLVM and Z3 (~160 MB): loaded only to draw on a display",
        "mesa-va-drivers": "Mesa's VA-API video drivers",
        "mesa-vdpau-drivers": "Mesa's VDPAU video drivers",
    },
)
OPENAI_SERVER_PATH: Final = "opt/gpumarket/openai_cpu_server.py"
OPENAI_IMAGE: Final = PackageImage(
    repo="gpumarket-test/openai-cpu",
    roots=("python3", "libc6"),
    files={OPENAI_SERVER_PATH: Path(__file__).parent.parent / "examples" / "openai_cpu_server.py"},
    changes=(f'CMD ["python3", "/{OPENAI_SERVER_PATH}"]', "EXPOSE 8000", DEFAULT_PATH),
    pruned={"dpkg": "Debian's package manager and, through it, tar, zstd and SELinux's library (~3.5 MB of ~51): "
                    "nothing installs packages in the image"},
)

def torch_image() -> str:
    """``gpumarket-test/torch:<hash>`` (``TORCH_IMAGE``), built unless the engine has it; see ``package_image``."""
    return package_image(TORCH_IMAGE)


def openai_image() -> str:
    """``gpumarket-test/openai-cpu:<hash>`` (``OPENAI_IMAGE``), built unless the engine has it; see ``package_image``."""
    return package_image(OPENAI_IMAGE)


def engine_json(method: str, path: str, document: dict[str, Any] | None = None) -> Any:
    """One Engine API call that must succeed (200, 201 or 204), its JSON answer (None when empty)."""
    body = None if document is None else json.dumps(document).encode()
    status, answer = request(method, path, body=body, headers={"Content-Type": "application/json"})
    assert status in (200, 201, 204), f"{method} {path}: {status} {answer[-300:]!r}"
    return json.loads(answer) if answer else None


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

