"""The agent package the master hands to installing hosts (``GET /downloads/agent``).

Where the wheel comes from, first match wins:

1. ``agent_package`` (``GPUMARKET_AGENT_PACKAGE``): a ``gpumarket-*.whl`` file, or a folder whose
   newest ``gpumarket-*.whl`` (by modification time) is served. The platform image sets it to
   the folder its own wheel was built into.
2. The source checkout the master runs from (``pyproject.toml`` beside the packages, as under
   ``gpumarket up`` and in development): the wheel is built once with ``pip wheel`` into
   ``DATA_DIR/downloads/agent-<fingerprint>/`` and built again when the sources change. The
   fingerprint covers the path, size and modification time of every file that is packaged.
3. Neither: ``agent_package_unavailable`` (404), saying to set ``GPUMARKET_AGENT_PACKAGE``.

This module knows nothing of HTTP; ``master.api.routes_downloads`` serves what it finds.
"""

from __future__ import annotations

import asyncio
import fnmatch
import hashlib
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import tomllib
from dataclasses import dataclass
from pathlib import Path

from shared.errors import GpumarketError, NotFound

log = logging.getLogger(__name__)

WHEEL_GLOB = "gpumarket-*.whl"
# Files beside the packages that building the wheel reads.
PROJECT_FILES = ("pyproject.toml", "setup.cfg", "setup.py", "MANIFEST.in")
_IGNORED = shutil.ignore_patterns("__pycache__", "*.pyc", "*.pyo", "*.egg-info", ".*")
_UNAVAILABLE = "agent_package_unavailable"


class PackageBuildFailed(GpumarketError):
    """Building the wheel from the source checkout failed (the operator's problem, not the caller's)."""

    code = "agent_package_build_failed"
    http_status = 500


@dataclass(frozen=True)
class AgentPackage:
    path: Path
    sha256: str

    @property
    def filename(self) -> str:
        return self.path.name


def source_checkout(module_file: str = __file__) -> Path | None:
    """The gpumarket source checkout this code runs from, or ``None`` for an installed package."""
    root = Path(module_file).resolve().parents[__name__.count(".")]  # master/services/hosts/agent_package.py: 3 up
    try:
        project = tomllib.loads((root / "pyproject.toml").read_text())
    except (OSError, tomllib.TOMLDecodeError):
        return None
    if project.get("project", {}).get("name") != "gpumarket" or not (root / "master" / "__init__.py").is_file():
        return None
    return root


def packaged_sources(root: Path) -> list[Path]:
    """The project files and top-level packages of the checkout that go into the wheel."""
    project = tomllib.loads((root / "pyproject.toml").read_text())
    find = project.get("tool", {}).get("setuptools", {}).get("packages", {}).get("find", {})
    patterns: list[str] = find.get("include") or ["*"]
    top = [root / name for name in PROJECT_FILES if (root / name).is_file()]
    top += sorted(p for p in root.iterdir() if p.is_file() and p.name.upper().startswith(("README", "LICENSE")))
    top += sorted(
        p for p in root.iterdir()
        if (p / "__init__.py").is_file() and any(fnmatch.fnmatchcase(p.name, pattern) for pattern in patterns)
    )  # fmt: skip
    return top


def _files_under(path: Path) -> list[Path]:
    if path.is_file():
        return [path]
    files = []
    for folder, dirs, names in os.walk(path):
        ignored = _IGNORED(folder, [*dirs, *names])
        dirs[:] = sorted(d for d in dirs if d not in ignored)
        files += [Path(folder) / n for n in sorted(names) if n not in ignored]
    return files


def source_fingerprint(root: Path) -> str:
    """A hash of the path, size and modification time of every packaged file (links followed)."""
    digest = hashlib.sha256()
    for top in packaged_sources(root):
        for file in _files_under(top):
            stat = file.stat()
            digest.update(f"{file.relative_to(root).as_posix()}\0{stat.st_size}\0{stat.st_mtime_ns}\n".encode())
    return digest.hexdigest()


def copy_sources(root: Path, dest: Path) -> None:
    """Copy what the wheel is built from (links are followed: the copy holds the files they name)."""
    dest.mkdir(parents=True)
    for top in packaged_sources(root):
        if top.is_file():
            shutil.copy2(top, dest / top.name)
        else:
            shutil.copytree(top, dest / top.name, symlinks=False, ignore=_IGNORED)


def wheels_in(folder: Path) -> list[Path]:
    """The ``gpumarket-*.whl`` files in ``folder``, oldest first (by modification time, then name)."""
    try:
        wheels = [p for p in folder.glob(WHEEL_GLOB) if p.is_file()]
    except OSError:
        return []
    return sorted(wheels, key=lambda p: (p.stat().st_mtime_ns, p.name))


def configured_wheel(configured: Path) -> Path:
    """The wheel the ``agent_package`` setting names: the file itself, or a folder's newest wheel."""
    if configured.is_dir():
        wheels = wheels_in(configured)
        if not wheels:
            raise NotFound(
                f"the agent package folder {configured} (GPUMARKET_AGENT_PACKAGE) holds no {WHEEL_GLOB}; "
                "put the gpumarket wheel there or point the setting at one",
                code=_UNAVAILABLE,
            )
        return wheels[-1]
    if not configured.is_file():
        raise NotFound(
            f"the agent package {configured} (GPUMARKET_AGENT_PACKAGE) does not exist; point the setting at the "
            "gpumarket wheel, or a folder holding it",
            code=_UNAVAILABLE,
        )
    if not fnmatch.fnmatchcase(configured.name, WHEEL_GLOB):
        raise NotFound(
            f"the agent package {configured} (GPUMARKET_AGENT_PACKAGE) is not a gpumarket wheel ({WHEEL_GLOB})",
            code=_UNAVAILABLE,
        )
    return configured


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


class AgentPackages:
    """Finds the wheel to serve, building it from the checkout when that is where it comes from.

    One per app. Builds run one at a time: concurrent first requests wait for the one build.
    """

    def __init__(
        self,
        *,
        configured: Path | None,
        build_dir: Path,
        source_root: Path | None,
        python: str = sys.executable,
        # Limits
        build_timeout: float = 300.0,
        max_cached_digests: int = 64,
    ) -> None:
        self.configured = configured
        self.build_dir = build_dir
        self.source_root = source_root
        self.python = python
        self.build_timeout = build_timeout
        self.max_cached_digests = max_cached_digests
        self._build_lock = asyncio.Lock()
        self._digests: dict[tuple[Path, int, int], str] = {}

    async def get(self) -> AgentPackage:
        """The wheel to serve and its sha256.

        Cancelling it is safe: a build in progress is killed and leaves nothing behind; the
        next call starts it again.
        """
        if self.configured is not None:
            path = await asyncio.to_thread(configured_wheel, self.configured)
        elif self.source_root is not None:
            path = await self._built_wheel(self.source_root)
        else:
            raise NotFound(
                "this master has no agent package to serve: set GPUMARKET_AGENT_PACKAGE to the gpumarket wheel "
                "(or a folder holding it), or give install-agent.sh the wheel with --package",
                code=_UNAVAILABLE,
            )
        return AgentPackage(path, await self._sha256(path))

    async def _sha256(self, path: Path) -> str:
        stat = await asyncio.to_thread(path.stat)
        key = (path, stat.st_size, stat.st_mtime_ns)
        digest = self._digests.get(key)
        if digest is None:
            digest = await asyncio.to_thread(file_sha256, path)
            if len(self._digests) >= self.max_cached_digests:
                self._digests.clear()
            self._digests[key] = digest
        return digest

    async def _built_wheel(self, root: Path) -> Path:
        async with self._build_lock:
            fingerprint = await asyncio.to_thread(source_fingerprint, root)
            target = self.build_dir / f"agent-{fingerprint[:16]}"
            wheels = await asyncio.to_thread(wheels_in, target)
            if not wheels:
                log.info("building the agent package from %s into %s", root, target)
                await self._build(root, target)
                await asyncio.to_thread(self._prune, keep=target)
                wheels = await asyncio.to_thread(wheels_in, target)
            return wheels[-1]

    async def _build(self, root: Path, target: Path) -> None:
        self.build_dir.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=".build-", dir=self.build_dir))
        try:
            source, out = staging / "source", staging / "wheel"
            await asyncio.to_thread(copy_sources, root, source)
            # Without build isolation when this environment has the build backend (fast, offline),
            # else pip fetches it from the configured index.
            problem = await self._pip_wheel(source, out, isolated=False)
            if problem is not None:
                log.info("building the agent package without build isolation failed; trying with it")
                problem = await self._pip_wheel(source, out, isolated=True)
            if problem is not None or not wheels_in(out):
                raise PackageBuildFailed(
                    f"building the agent package from {root} failed: {(problem or 'pip made no wheel').strip()[-1500:]}; "
                    "fix the build, or set GPUMARKET_AGENT_PACKAGE to a gpumarket wheel"
                )
            try:
                out.rename(target)
            except OSError:
                if not wheels_in(target):  # else another master process sharing the data dir built it first
                    raise
        finally:
            shutil.rmtree(staging, ignore_errors=True)

    async def _pip_wheel(self, source: Path, out: Path, *, isolated: bool) -> str | None:
        """Run ``pip wheel`` on ``source``; ``None`` when it worked, else what it said."""
        args = [self.python, "-m", "pip", "wheel", "--no-deps", "--no-input", "--disable-pip-version-check",
                "--quiet", "--wheel-dir", str(out)]  # fmt: skip
        if not isolated:
            args.append("--no-build-isolation")
        process = await asyncio.create_subprocess_exec(
            *args, str(source), cwd=source, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
        )
        try:
            async with asyncio.timeout(self.build_timeout):
                output, _ = await process.communicate()
        except TimeoutError:
            return f"pip wheel did not finish within {self.build_timeout:g} s"
        finally:
            if process.returncode is None:
                process.kill()
                await process.wait()
        return None if process.returncode == 0 else output.decode(errors="replace")

    def _prune(self, *, keep: Path) -> None:
        """Remove wheels built from earlier states of the checkout."""
        for old in self.build_dir.glob("agent-*"):
            if old != keep and old.is_dir():
                shutil.rmtree(old, ignore_errors=True)
