"""The ``container`` runtime: an image run by docker or podman, whichever answers.

Not on the wire yet: ``shared.protocol`` has no container workload (the "Isolated rentals"
issue adds a ``container`` kind, through the Engine API), so only the agent's own callers
and tests start one, with a ``ContainerSpec``. The container gets the rental's GPUs (docker
``--gpus``, podman CDI), its limits (``--cpus``, ``--memory``), an env file (0600) and the
rental's folder as ``/workspace``; it is named and labelled after the rental, so a stop or
a clean-up can remove it by name.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import re
import shutil
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

from agent.runtimes.base import Workload, now_iso
from agent.runtimes.cgroups import ResourceLimits
from agent.runtimes.pids import proc_stat
from agent.runtimes.process import share_environment, spawn
from agent.state import atomic_write
from shared.errors import BadRequest
from shared.protocol import GpuShare

log = logging.getLogger(__name__)

# What the docker/podman client itself needs to find its daemon; never given to the container.
CONTAINER_CLIENT_ENV: Final = (
    "PATH", "HOME", "DOCKER_HOST", "DOCKER_CONTEXT", "DOCKER_CONFIG", "DOCKER_CERT_PATH",
    "DOCKER_TLS_VERIFY", "CONTAINER_HOST", "XDG_RUNTIME_DIR", "XDG_CONFIG_HOME",
)
_IMAGE_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._/:@+-]{0,254}$")  # never starts with "-"


@dataclass(frozen=True, slots=True)
class ContainerSpec:
    """An image to run in a container (docker or podman): not on the wire yet — the "Isolated
    rentals" issue adds a ``container`` workload kind; until then only the agent's own callers
    (and tests) start one."""

    image: str
    argv: tuple[str, ...] = ()  # empty: the image's own command
    env: Mapping[str, str] = field(default_factory=dict)
    limits: ResourceLimits = field(default_factory=ResourceLimits)

    def __post_init__(self) -> None:
        if not _IMAGE_RE.match(self.image):
            raise BadRequest("'image' must be an image reference such as 'nvcr.io/nvidia/pytorch:24.05-py3'", code="bad_workload_spec")



@dataclass(frozen=True, slots=True)
class ContainerRuntime:
    name: str  # "docker" | "podman"
    path: str
    version: str


@dataclass(frozen=True, slots=True)
class ContainerSupport:
    """The usable container runtime, or why there is none."""

    runtime: ContainerRuntime | None
    reason: str


async def probe(argv: list[str], *, timeout: float) -> tuple[bool, str]:
    try:
        process = await asyncio.create_subprocess_exec(
            *argv, stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
        )
    except OSError as exc:
        return False, exc.strerror or str(exc)
    try:
        async with asyncio.timeout(timeout):
            out, err = await process.communicate()
    except TimeoutError:
        return False, f"no answer within {timeout:g}s"
    finally:
        if process.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                process.kill()
            await process.wait()
    text = (out if process.returncode == 0 else err).decode(errors="replace").strip()
    return process.returncode == 0, (text.splitlines() or [""])[-1][:300]


async def detect_container_runtime(*, candidates: Sequence[str] = ("docker", "podman"), timeout: float = 5.0) -> ContainerSupport:
    """The first of ``candidates`` that is installed and can run containers now.

    docker must reach its daemon (``docker version``); podman must work (``podman info``).
    Cancelling is safe: a probe still running is killed.
    """
    reasons = []
    for name in candidates:
        path = shutil.which(name)
        if path is None:
            reasons.append(f"{name} is not installed")
            continue
        if name == "podman":
            argv = [path, "info", "--format", "{{.Version.Version}}"]
        else:
            argv = [path, "version", "--format", "{{.Server.Version}}"]
        ok, answer = await probe(argv, timeout=timeout)
        if ok and answer:
            return ContainerSupport(ContainerRuntime(name, path, answer), f"{name} {answer}")
        reasons.append(f"{name} ({path}) is installed but cannot run containers: {answer or 'no version reported'}")
    return ContainerSupport(None, "; ".join(reasons) or "no container runtime is configured")


def container_name(rental_id: str) -> str:
    return f"gpumarket-{rental_id}"


def container_argv(
    runtime: ContainerRuntime, rental_id: str, spec: ContainerSpec, gpu_uuids: Sequence[str], *, folder: Path, env_file: Path
) -> list[str]:
    """The ``docker run``/``podman run`` command for an image workload: its GPUs, limits, env file and folder."""
    argv = [runtime.path, "run", "--rm", "--init", "--name", container_name(rental_id), "--label", f"gpumarket.rental={rental_id}"]
    if runtime.name == "podman":
        for gpu_uuid in gpu_uuids:
            argv += ["--device", f"nvidia.com/gpu={gpu_uuid}"]  # CDI names GPUs and MIG instances by UUID
    elif gpu_uuids:
        argv += ["--gpus", f'"device={",".join(gpu_uuids)}"']  # the quotes keep the comma list one value
    if spec.limits.cpu_cores is not None:
        argv += ["--cpus", f"{spec.limits.cpu_cores:g}"]
    if spec.limits.memory_mib is not None:
        argv += ["--memory", f"{spec.limits.memory_mib}m"]
    return [*argv, "--env-file", str(env_file), "-v", f"{folder}:/workspace", "-w", "/workspace", spec.image, *spec.argv]



class ContainerLauncher:
    """Runs ``ContainerSpec``s with the first of ``candidates`` that can run containers."""

    def __init__(
        self, work_dir: Path, *, candidates: Sequence[str] = ("docker", "podman"), probe_timeout: float = 5.0, remove_timeout: float = 5.0
    ) -> None:
        self.work_dir = work_dir
        self.candidates = tuple(candidates)
        self.probe_timeout = probe_timeout
        self.remove_timeout = remove_timeout
        self._runtime: ContainerRuntime | None = None

    async def prepare(self, spec: ContainerSpec) -> None:
        """Find a runtime that answers (asked again each time until one does: a daemon may start later).

        Cancelling is safe: a probe still running is killed.
        """
        if self._runtime is None:
            support = await detect_container_runtime(candidates=self.candidates, timeout=self.probe_timeout)
            if support.runtime is None:
                raise BadRequest(
                    f"this host cannot run container image {spec.image!r}: {support.reason}. Install and start docker "
                    "(with the NVIDIA Container Toolkit) or podman (with NVIDIA CDI), or rent without 'image'",
                    code="container_runtime_unavailable",
                )
            self._runtime = support.runtime

    def start(
        self, rental_id: str, gpus: list[str], spec: ContainerSpec, share: GpuShare | None
    ) -> tuple[Workload, dict[str, Any]]:
        runtime = self._runtime
        assert runtime is not None, "prepare() first"
        folder = self.work_dir / rental_id
        folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        visible = ",".join(gpus)
        inside = {**spec.env, "GPUMARKET_GPU_UUIDS": visible, "GPUMARKET_RENTAL_ID": rental_id}
        if share is not None:
            inside.update(share_environment(share))
        if any("\n" in value for value in inside.values()):
            raise BadRequest("a container workload's environment values cannot contain newlines", code="bad_workload_spec")
        # An env file (0600) rather than "-e NAME=value", which anyone could read in ps.
        env_file = folder / "container.env"
        atomic_write(env_file, "".join(f"{k}={v}\n" for k, v in inside.items()).encode(), mode=0o600)
        name = container_name(rental_id)
        client_env = {k: os.environ[k] for k in CONTAINER_CLIENT_ENV if k in os.environ}
        argv = container_argv(runtime, rental_id, spec, gpus, folder=folder, env_file=env_file)
        try:
            pid, _ = spawn(argv, folder=folder, env=client_env, gated=False)
        except OSError as exc:
            raise BadRequest(f"cannot start {runtime.name}: {exc.strerror or exc}", code="workload_start_failed") from None
        stat = proc_stat(pid)
        workload = Workload(
            rental_id, "container", gpus, now_iso(), pid=pid, start_time=None if stat is None else stat.start_time,
            container=(runtime.path, name),
        )
        limits = "applied" if spec.limits.requested else "none requested"
        return workload, {"kind": "container", "pid": pid, "container": name, "runtime": runtime.name, "limits": limits}

    async def remove(self, workload: Workload) -> None:
        """Remove the workload's container (``rm --force``), if it has one."""
        if workload.container is None:
            return
        runtime, name = workload.container
        ok, answer = await probe([runtime, "rm", "--force", name], timeout=self.remove_timeout)
        if not ok and "no such container" not in answer.lower():
            log.warning("rental %s: cannot remove container %s: %s", workload.rental_id, name, answer)
