"""Container images built from this machine's own files, through the engine's API: no registry is asked.

``package_image`` imports an image made of Debian packages as this machine has them installed — the files of the
packages one needs, the dependency closure dpkg records — with busybox's shell and a few files of this checkout
(``PackageImage`` says which) through the Engine API (``images/create`` with ``fromSrc=-``). Its tag is a hash over
the packages and their versions, the files added, the image's settings and the rules that pick the files, so a second
run builds nothing; the rootfs is streamed to the engine.

``gpumarket up`` builds ``DEMO_IMAGE`` (``demo_image``), ``gpumarket/demo:<hash>``, also tagged
``gpumarket/demo:latest``: busybox's shell and tools, Debian's ``python3`` and the OpenAI-compatible sample server of
``examples/openai_cpu_server.py`` at ``/opt/gpumarket/openai_cpu_server.py``, its default command, serving on port
8000 (``GET /`` a page, ``/v1/chat/completions``; ~50 MB). The demo's ``demo`` template runs it, so that a machine
without a registry still rents, SSHes into and reaches a port of a container. ``CHALLENGE_IMAGE`` (``challenge_image``),
``gpumarket/verify``, is the GPU verification challenge's workload (``shared/verification/program.py`` and
``compute.py`` on Debian's python3 and python3-numpy; docs/verification.md). The suite builds its test images
(``tests/dockerengine.py``) with the same functions.

Synchronous (blocking sockets and subprocesses): callers on an event loop run them in a thread.
"""

from __future__ import annotations

import fcntl
import hashlib
import http.client
import io
import itertools
import os
import re
import socket
import stat
import subprocess
import tarfile
import tempfile
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Final
from urllib.parse import quote, urlencode

from shared.errors import GpumarketError

SOCKET: Final = "/var/run/docker.sock"
BUSYBOX: Final = "/bin/busybox"
# 1000: the user a rental runs as when its image names none (agent/runtimes/containeropts.py), so `whoami` answers.
PASSWD: Final = "root:x:0:0:root:/root:/bin/sh\nrental:x:1000:1000:rental:/workspace:/bin/sh\nnobody:x:65534:65534:nobody:/nonexistent:/bin/sh\n"
GROUP: Final = "root:x:0:\nrental:x:1000:\nnogroup:x:65534:\n"


class ImageBuildError(GpumarketError, RuntimeError):
    """An image could not be built: a package it is made of is not installed, a file is missing, or the engine
    refused the import. The message says what to do."""


class _UnixConnection(http.client.HTTPConnection):
    def __init__(self, path: str, timeout: float) -> None:
        super().__init__("localhost", timeout=timeout, blocksize=1 << 16)
        self.path = path

    def connect(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.timeout)
        sock.connect(self.path)
        self.sock = sock


def request(method: str, path: str, *, body: bytes | IO[bytes] | None = None, headers: dict[str, str] | None = None,
            timeout: float = 60.0, socket_path: str = SOCKET) -> tuple[int, bytes]:
    """One Engine API call over the unix socket (synchronous: for fixtures). A file as ``body`` is streamed (chunked)."""
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


def image_exists(name: str, *, socket_path: str = SOCKET) -> bool:
    status, _ = request("GET", f"/images/{quote(name, safe='')}/json", socket_path=socket_path)
    return status == 200


SKIPPED_TREES: Final = (
    "usr/share/doc", "usr/share/doc-base", "usr/share/man", "usr/share/info", "usr/share/locale", "usr/share/lintian",
    "usr/share/bug", "usr/share/gtk-doc", "usr/share/help", "usr/include",
)
SKIPPED_SUFFIXES: Final = (".a", ".h", ".pyc")
PYTHON_PACKAGES: Final = "usr/lib/python3/dist-packages/"
IMAGE_APPLETS: Final = ("sh", "ls", "cat", "env", "echo", "sleep", "ps", "ip", "hostname", "nc", "kill", "true", "false", "test", "wget")
NSSWITCH: Final = "passwd: files\ngroup: files\nhosts: files dns\n"
DEFAULT_PATH: Final = "ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
RECIPE: Final = "2"
"""Part of each package image's hash: change it when the rules above, or the way the rootfs is made, change."""


@dataclass(frozen=True)
class PackageImage:
    """An image made of this machine's Debian packages: ``roots`` and what they need, but for ``pruned`` (package ->
    why: the closure's walk stops there), with ``files`` of this checkout (rootfs path -> file, executable), the
    Dockerfile instructions ``changes`` (``CMD``, ``ENV``, ``EXPOSE``) that the import applies, and busybox's
    ``applets`` (links beside it, where no package has that command). ``extras`` are roots taken only where this
    machine has them installed: commands the image's users expect that it works without (the hash says which came)."""

    repo: str
    roots: tuple[str, ...]
    files: Mapping[str, Path]
    changes: tuple[str, ...]
    pruned: Mapping[str, str]
    applets: tuple[str, ...] = field(default=IMAGE_APPLETS)
    extras: tuple[str, ...] = ()


_DEPENDENCY: Final = re.compile(r"\s*([a-z0-9][a-z0-9+.-]*)")


class _Package:
    def __init__(self, query_name: str, version: str, depends: str) -> None:
        self.query_name, self.version, self.depends = query_name, version, depends


def _installed_packages() -> tuple[dict[str, _Package], dict[str, list[str]]]:
    """The installed packages of this machine's architecture (or ``all``) by name, and who provides each virtual one."""
    native = subprocess.run(["dpkg", "--print-architecture"], capture_output=True, text=True, check=True).stdout.strip()
    fields = "${binary:Package}\t${Package}\t${Architecture}\t${Version}\t${db:Status-Abbrev}\t${Provides}\t${Pre-Depends}, ${Depends}\n"
    listing = subprocess.run(["dpkg-query", "-W", "-f", fields], capture_output=True, text=True, check=True).stdout
    packages: dict[str, _Package] = {}
    providers: dict[str, list[str]] = {}
    for line in listing.splitlines():
        query_name, name, arch, version, status, provides, depends = line.split("\t")
        if status[1:2] != "i" or arch not in (native, "all"):  # not (fully) installed, or another architecture's
            continue
        packages[name] = _Package(query_name, version, depends)
        for provided in provides.split(","):
            if match := _DEPENDENCY.match(provided):
                providers.setdefault(match.group(1), []).append(name)
    return packages, {virtual: sorted(names) for virtual, names in providers.items()}


def _dependency_closure(
    image: PackageImage, packages: dict[str, _Package], providers: dict[str, list[str]]
) -> dict[str, _Package]:
    """The image's roots and, recursively, what they need (Pre-Depends, Depends) as installed, but for its pruned ones.

    Of alternatives (``a | b``) the first one installed, itself or as a virtual package's provider, counts. Version
    constraints and architecture qualifiers (``:any``) are dpkg's to have enforced: the installed version is taken."""
    chosen: dict[str, _Package] = {}
    todo = [*image.roots, *(extra for extra in image.extras if extra in packages)]
    while todo:
        name = todo.pop()
        if name in chosen or name in image.pruned:
            continue
        chosen[name] = packages[name]
        for clause in packages[name].depends.split(","):
            for alternative in clause.split("|"):
                match = _DEPENDENCY.match(alternative)
                wanted = match.group(1) if match else ""
                if wanted in packages or wanted in providers:
                    todo.append(wanted if wanted in packages else providers[wanted][0])
                    break
    return dict(sorted(chosen.items()))


def _skipped(path: str) -> bool:
    """Docs, manuals, translations, headers, static libraries, byte code, Python packages' tests: none is imported."""
    if any(path == tree or path.startswith(f"{tree}/") for tree in SKIPPED_TREES):
        return True
    parts = path.split("/")
    return path.endswith(SKIPPED_SUFFIXES) or "__pycache__" in parts or (path.startswith(PYTHON_PACKAGES) and "tests" in parts)


def _in_rootfs(path: str) -> str:
    """Where the host's ``path`` goes in the rootfs: under its folder's real path (``/lib/x`` is ``usr/lib/x`` on a
    merged-/usr system), so that no entry goes through a symbolic link; no leading slash."""
    folder, name = os.path.split(os.path.normpath(path))
    return os.path.join(os.path.realpath(folder), name).lstrip("/")


class _PackageRootfs:
    """What goes into a package image: host paths by their path in the rootfs, generated files, and the content hash."""

    def __init__(self, image: PackageImage) -> None:
        if not os.path.isfile(BUSYBOX):
            raise ImageBuildError(f"{BUSYBOX} is missing, and the {image.repo} image's shell is busybox: `apt-get install busybox-static` (as root)")
        packages, providers = _installed_packages()
        if missing := [root for root in image.roots if root not in packages]:
            raise ImageBuildError(
                f"Debian's {' '.join(missing)} is not installed on this machine, and the {image.repo} image is made "
                f"of its files: `apt-get install {' '.join(missing)}` (as root; `make docker` installs the suite's)"
            )
        if absent := [str(source) for source in image.files.values() if not source.is_file()]:
            raise ImageBuildError(f"the {image.repo} image holds {', '.join(absent)}, which is missing: run from a gpumarket checkout")
        self.packages = _dependency_closure(image, packages, providers)
        self.host: dict[str, str] = {}  # rootfs path -> host path (files, links, folders)
        listed = subprocess.run(
            ["dpkg-query", "-L", *(package.query_name for package in self.packages.values())], capture_output=True, text=True, check=True
        ).stdout
        for line in listed.splitlines():
            if line.startswith("/") and os.path.lexists(line):  # not "diverted by …" notes, nor what was removed since
                self._add(line)
        for top in ("bin", "sbin", "lib", "lib64"):  # a merged /usr's links
            if os.path.islink(f"/{top}"):
                self.host[top] = f"/{top}"
        self.followed = self._add_alternatives()
        self.followed.update(self._follow_links())
        self.generated: dict[str, tuple[bytes, int]] = {
            "etc/passwd": (PASSWD.encode(), 0o644),
            "etc/group": (GROUP.encode(), 0o644),
            "etc/nsswitch.conf": (NSSWITCH.encode(), 0o644),
            **{path: (source.read_bytes(), 0o755) for path, source in image.files.items()},
        }
        self.folders = {folder for path in self.generated for folder in itertools.accumulate(path.split("/")[:-1], "{}/{}".format)}
        busybox = _in_rootfs(BUSYBOX)
        self.host[busybox] = BUSYBOX
        bin_dir = os.path.dirname(busybox)
        built_in = set(subprocess.run([BUSYBOX, "--list"], capture_output=True, text=True, check=True).stdout.split())
        self.applets = [f"{bin_dir}/{applet}" for applet in image.applets if applet in built_in and f"{bin_dir}/{applet}" not in self.host]
        for path in self.generated:
            self.host.pop(path, None)
        digest = hashlib.sha256(f"recipe {RECIPE}\n".encode())
        for change in image.changes:
            digest.update(f"change {change}\n".encode())
        for name, package in self.packages.items():
            digest.update(f"package {name} {package.version}\n".encode())
        for path, target in sorted(self.followed.items()):
            digest.update(f"followed {path} {target}\n".encode())
        for path, (data, mode) in sorted(self.generated.items()):
            digest.update(f"file {path} {mode:o} {hashlib.sha256(data).hexdigest()}\n".encode())
        digest.update(f"busybox {hashlib.sha256(Path(BUSYBOX).read_bytes()).hexdigest()} {' '.join(self.applets)}\n".encode())
        self.digest = digest.hexdigest()[:16]

    def _add(self, path: str) -> str | None:
        """Add one host path (and the folders above it); its rootfs path, or ``None`` when skipped."""
        inside = _in_rootfs(path)
        if not inside or _skipped(inside):
            return None
        self.host.setdefault(inside, "/" + inside)
        folder = os.path.dirname(inside)
        while folder and folder not in self.host:
            self.host[folder] = "/" + folder
            folder = os.path.dirname(folder)
        return inside

    def _add_alternatives(self) -> dict[str, str]:
        """The links of ``update-alternatives`` (made by maintainer scripts, so in no package's list) whose chosen file
        is in the rootfs: ``/usr/lib/x86_64-linux-gnu/libblas.so.3`` → ``/etc/alternatives/libblas.so.3-…`` → the
        file of ``libblas3``. Returns them, path -> link."""
        added: dict[str, str] = {}
        selections = subprocess.run(["update-alternatives", "--get-selections"], capture_output=True, text=True).stdout
        for master in (line.split()[0] for line in selections.splitlines() if line.strip()):
            query = subprocess.run(["update-alternatives", "--query", master], capture_output=True, text=True).stdout
            links = [(master, line.removeprefix("Link: ")) for line in query.splitlines() if line.startswith("Link: ")]
            slaves = query.split("\nSlaves:\n", 1)[1].split("\n") if "\nSlaves:\n" in query else []
            for line in itertools.takewhile(lambda line: line.startswith(" "), slaves):
                slave, slave_link = line.split()[:2]
                links.append((slave, slave_link))
            for name, link in links:
                chosen = f"/etc/alternatives/{name}"
                if not (os.path.islink(link) and os.path.islink(chosen) and os.readlink(link) == chosen):
                    continue
                value = os.path.normpath(os.path.join("/etc/alternatives", os.readlink(chosen)))
                if _in_rootfs(value) not in self.host:
                    continue
                for path in (link, chosen):
                    if (inside := self._add(path)) is not None:
                        added[inside] = os.readlink(path)
        return added

    def _follow_links(self) -> dict[str, str]:
        """Add what the links point at where no package of the closure has it (``/etc/localtime``'s zone, the CA bundle
        that certifi links to); a folder so pointed at comes without its contents. Returns them, path -> link, ``file``
        or ``folder``."""
        followed: dict[str, str] = {}
        todo = [path for path, source in self.host.items() if os.path.islink(source)]
        while todo:
            source = self.host[todo.pop()]
            target = os.path.normpath(os.path.join(os.path.dirname(source), os.readlink(source)))
            if not os.path.lexists(target) or _in_rootfs(target) in self.host:
                continue
            added = self._add(target)
            if added is None:
                continue
            is_link = os.path.islink(self.host[added])
            followed[added] = os.readlink(self.host[added]) if is_link else "folder" if os.path.isdir(self.host[added]) else "file"
            if is_link:
                todo.append(added)
        return followed

    def content_size(self) -> int:
        """Bytes of file contents the rootfs holds (what ``write`` streams, but for hard links counted again)."""
        sizes = (os.lstat(source) for path, source in self.host.items())
        return sum(info.st_size for info in sizes if stat.S_ISREG(info.st_mode)) + sum(len(d) for d, _ in self.generated.values())

    def write(self, out: IO[bytes], *, written: Callable[[int], None] | None = None) -> int:
        """The rootfs as a tar stream into ``out``; returns how many bytes of file contents it holds. ``written`` is
        told the count so far after each file."""
        now = 1_700_000_000
        content = 0
        hard_links: dict[tuple[int, int], str] = {}
        entries: list[str] = sorted(
            {*self.host, *self.generated, *self.applets, "proc", "sys", "dev", "root", "tmp", *self.folders},
            key=lambda path: path.split("/"),
        )
        with tarfile.open(fileobj=out, mode="w|", format=tarfile.PAX_FORMAT) as tar:
            for path in entries:
                entry = tarfile.TarInfo(path)
                entry.mtime, entry.mode, entry.type = now, 0o755, tarfile.DIRTYPE
                if path in self.generated:
                    data, entry.mode = self.generated[path]
                    entry.type, entry.size = tarfile.REGTYPE, len(data)
                    tar.addfile(entry, io.BytesIO(data))
                    continue
                if path in self.applets:
                    entry.type, entry.linkname, entry.mode = tarfile.SYMTYPE, "busybox", 0o777
                elif path == "tmp":
                    entry.mode = 0o1777
                elif path in self.host:
                    source = self.host[path]
                    info = os.lstat(source)
                    entry.mode, entry.mtime, entry.uid, entry.gid = stat.S_IMODE(info.st_mode), int(info.st_mtime), info.st_uid, info.st_gid
                    if stat.S_ISLNK(info.st_mode):
                        entry.type, entry.linkname = tarfile.SYMTYPE, os.readlink(source)
                    elif stat.S_ISREG(info.st_mode):
                        first = hard_links.setdefault((info.st_dev, info.st_ino), path) if info.st_nlink > 1 else path
                        if first != path:
                            entry.type, entry.linkname = tarfile.LNKTYPE, first
                        else:
                            entry.type, entry.size = tarfile.REGTYPE, info.st_size
                            with open(source, "rb") as file:
                                tar.addfile(entry, file)
                            content += info.st_size
                            if written is not None:
                                written(content)
                            continue
                    elif not stat.S_ISDIR(info.st_mode):
                        continue  # no device, pipe or socket comes from a package
                tar.addfile(entry)
        return content


def package_image(image: PackageImage, *, socket_path: str = SOCKET, timeout: float = 900.0,
                  progress: Callable[[str], None] | None = None, progress_step: int = 16 << 20) -> str:
    """``<image.repo>:<hash>``, imported now unless the engine has it already (see the module's docstring). One
    build at a time (a lock file per image, for pytest-xdist's workers and several ``up``s): the others then find it
    built. ``progress`` is told a line when a build starts and after each ``progress_step`` bytes streamed (from the
    writer's thread); nothing when the engine has the image.

    Raises ``ImageBuildError`` when a root package is not installed, a file is missing, or the import fails."""
    rootfs = _PackageRootfs(image)
    name = f"{image.repo}:{rootfs.digest}"
    with open(Path(tempfile.gettempdir()) / f"gpumarket-{image.repo.replace('/', '-')}-image.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if image_exists(name, socket_path=socket_path):
            return name
        total = rootfs.content_size()
        say = progress or (lambda _line: None)
        say(f"building {name} from {len(rootfs.packages)} of this machine's packages (~{total / 1e6:.0f} MB)")
        reported = [0]

        def written(count: int) -> None:
            if count - reported[0] >= progress_step:
                reported[0] = count
                say(f"building {name}: {count / 1e6:.0f} of ~{total / 1e6:.0f} MB")

        read_end, write_end = os.pipe()
        failure: list[BaseException] = []

        def produce() -> None:
            try:
                with open(write_end, "wb", buffering=1 << 20) as out:
                    rootfs.write(out, written=written if progress else None)
            except BaseException as exc:  # reported by the caller, once the engine has answered
                failure.append(exc)

        writer = threading.Thread(target=produce, name=f"{image.repo}-rootfs", daemon=True)
        writer.start()
        query = urlencode({"fromSrc": "-", "repo": image.repo, "tag": rootfs.digest, "changes": image.changes}, doseq=True)
        try:
            with open(read_end, "rb", buffering=0) as stream:
                status, body = request(
                    "POST", f"/images/create?{query}", body=stream, headers={"Content-Type": "application/x-tar"}, timeout=timeout,
                    socket_path=socket_path,
                )
        except OSError as exc:
            failure.append(exc)
            status, body = 0, b""
        finally:
            writer.join()
        if failure or status != 200 or b'"error"' in body:
            # A rootfs cut short must not stay under the name.
            request("DELETE", f"/images/{quote(name, safe='')}?force=1", socket_path=socket_path)
            why = f"writing the rootfs failed: {failure[0]!r}" if failure else f"the engine answered {status}: {body[-300:]!r}"
            raise ImageBuildError(f"importing {name} failed ({why})")
        return name


def tag_image(name: str, tag: str, *, socket_path: str = SOCKET) -> None:
    """Tag the image ``name`` also as ``tag`` (``repo:tag``), moving that tag from any image that had it."""
    repo, _, version = tag.rpartition(":")
    status, body = request("POST", f"/images/{quote(name, safe='')}/tag?{urlencode({'repo': repo, 'tag': version})}",
                           socket_path=socket_path)  # fmt: skip
    if status not in (200, 201):
        raise ImageBuildError(f"tagging {name} as {tag} failed ({status}: {body[-300:]!r})")


# ---- the demo image ------------------------------------------------------------------------------

DEMO_REPO: Final = "gpumarket/demo"
DEMO_LATEST: Final = f"{DEMO_REPO}:latest"
DEMO_PORT: Final = 8000
DEMO_SERVER_PATH: Final = "opt/gpumarket/openai_cpu_server.py"
DEMO_SERVER_SOURCE: Final = Path(__file__).resolve().parents[1] / "examples" / "openai_cpu_server.py"
# A renter's shell: busybox's sh and the everyday tools (no package of the closure has them).
DEMO_APPLETS: Final = (
    "sh", "ash", "ls", "cat", "cp", "mv", "rm", "mkdir", "rmdir", "ln", "touch", "chmod", "pwd", "id", "whoami", "env",
    "echo", "printf", "sleep", "ps", "kill", "top", "free", "df", "du", "uname", "hostname", "ip", "nc", "wget", "grep",
    "sed", "awk", "head", "tail", "wc", "sort", "uniq", "cut", "tr", "find", "xargs", "less", "more", "vi", "tar", "gzip",
    "gunzip", "date", "true", "false", "test", "[", "which", "stat", "sha256sum", "md5sum", "base64", "od", "clear",
    "reset", "seq", "tee", "basename", "dirname", "readlink", "realpath", "nproc", "timeout", "yes",
)
DEMO_IMAGE: Final = PackageImage(
    repo=DEMO_REPO,
    roots=("python3", "libc6"),
    files={DEMO_SERVER_PATH: DEMO_SERVER_SOURCE},
    changes=(f'CMD ["python3", "/{DEMO_SERVER_PATH}"]', f"EXPOSE {DEMO_PORT}", DEFAULT_PATH, "ENV HOME=/workspace"),
    pruned={"dpkg": "Debian's package manager and, through it, tar, zstd and SELinux's library: nothing installs "
                    "packages in the demo image"},
    applets=DEMO_APPLETS,
    extras=("rsync",),  # `rsync -e ssh` into a rental (README): the client's peer runs `rsync --server` in the container
)


def demo_image(*, socket_path: str = SOCKET, progress: Callable[[str], None] | None = None) -> str:
    """``gpumarket/demo:<hash>`` (``DEMO_IMAGE``), built unless the engine has it, and tagged ``gpumarket/demo:latest``
    too; see ``package_image``."""
    name = package_image(DEMO_IMAGE, socket_path=socket_path, progress=progress)
    tag_image(name, DEMO_LATEST, socket_path=socket_path)
    return name


# ---- the verification challenge's image (issue 40, docs/verification.md) -------------------------

CHALLENGE_REPO: Final = "gpumarket/verify"
CHALLENGE_LATEST: Final = f"{CHALLENGE_REPO}:latest"
CHALLENGE_PROGRAM_PATH: Final = "opt/gpumarket/verify/program.py"
_VERIFICATION_SOURCE: Final = Path(__file__).resolve().parents[1] / "shared" / "verification"
CHALLENGE_IMAGE: Final = PackageImage(
    repo=CHALLENGE_REPO,
    roots=("python3", "python3-numpy", "libc6"),
    files={CHALLENGE_PROGRAM_PATH: _VERIFICATION_SOURCE / "program.py",
           "opt/gpumarket/verify/compute.py": _VERIFICATION_SOURCE / "compute.py"},
    changes=(f'CMD ["python3", "/{CHALLENGE_PROGRAM_PATH}", "/workspace"]', DEFAULT_PATH, "ENV HOME=/workspace"),
    pruned={"dpkg": "Debian's package manager and, through it, tar, zstd and SELinux's library: nothing installs "
                    "packages in the challenge image"},
)
"""The challenge workload on the CPU (numpy: the simulated hosts, and a host whose container sees no GPU). A real
GPU's challenge needs a CUDA build of torch in the image, which Debian's packages do not have."""


def challenge_image(*, socket_path: str = SOCKET, progress: Callable[[str], None] | None = None) -> str:
    """``gpumarket/verify:<hash>`` (``CHALLENGE_IMAGE``), built unless the engine has it, and tagged
    ``gpumarket/verify:latest`` too; see ``package_image``."""
    name = package_image(CHALLENGE_IMAGE, socket_path=socket_path, progress=progress)
    tag_image(name, CHALLENGE_LATEST, socket_path=socket_path)
    return name
