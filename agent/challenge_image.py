"""The GPU challenge's images on a provider's host (docs/verification.md, "The challenge images").

Two images run the same program (``shared/verification/program.py`` beside ``compute.py``):

* ``CPU_IMAGE``, ``gpumarket/verify:latest``: Debian's python3 and numpy (``gpumarket/images.py``,
  ``CHALLENGE_IMAGE``), the simulated and replayed hosts' image. A real GPU challenged in it would compute on the CPU
  and fail as too slow.
* ``gpumarket/verify-cuda:<hash>`` (``cuda_image``): built on the host through the Engine API ``FROM`` a PyTorch CUDA
  runtime image pinned by digest (the ``challenge_cuda_base`` setting, ``DEFAULT_CUDA_BASE``), with the agent's own
  ``program.py`` and ``compute.py`` at ``/opt/gpumarket/verify``. Its tag is a hash over the base and the build
  context, so an agent whose program changed builds anew, and an unchanged one finds its image and builds nothing.
  The provider's host pulls the base (several GB) once, from its registry: the engine's own pull, no credentials.

``challenge_image_for`` chooses: the ``challenge_image`` setting when set, else the CUDA image on an ``nvml`` backend
and the CPU image on ``sim`` and ``replay``. ``CudaImageBuilder.ensure`` builds the CUDA image unless the engine has it
(one build at a time; the agent starts it when it starts and a challenge waits for it).

Imports ``shared`` and aiodocker only (an agent module).
"""

from __future__ import annotations

import asyncio
import gzip
import hashlib
import io
import json
import logging
import re
import tarfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Final

import aiodocker
import aiohttp
from aiodocker.exceptions import DockerError

from shared.errors import GpumarketError
from shared.verification import compute

log = logging.getLogger(__name__)

CPU_IMAGE: Final = "gpumarket/verify:latest"
CUDA_REPO: Final = "gpumarket/verify-cuda"
DEFAULT_CUDA_BASE: Final = (
    "pytorch/pytorch:2.11.0-cuda12.8-cudnn9-runtime@sha256:eee11b3b3872a8c838e35ef48f08b2d5def2080902c7f666831310ca1a0ef2be"
)
"""PyTorch 2.11 (the version the H200 measurements ran, docs/verification-measurements.md) with CUDA 12.8's runtime
(NVIDIA driver ≥ 570), pinned by the digest public Dockerfiles pin it with; not pulled on the development machine
(no registry there)."""
PROGRAM_DIR: Final = "/opt/gpumarket/verify"
PINNED: Final = re.compile(r"^[^\s@]+@sha256:[0-9a-f]{64}$")
SOURCE: Final = Path(compute.__file__).resolve().parent
"""Where the program's two files are: the agent's own copy of ``shared/verification``."""


class ChallengeImageError(GpumarketError):
    """The challenge's CUDA image could not be built (the base could not be pulled, the engine refused the build):
    the challenge fails as ``workload_failed``, the provider's."""

    code = "workload_start_failed"


@dataclass(frozen=True)
class CudaImage:
    """What ``gpumarket/verify-cuda`` is built from: its base, its name (``CUDA_REPO:<hash of the context>``) and its
    build context (a gzipped tar: ``Dockerfile``, ``program.py``, ``compute.py``)."""

    base: str
    name: str
    context: bytes


def dockerfile(base: str) -> str:
    return (
        f"FROM {base}\n"
        f"COPY program.py compute.py {PROGRAM_DIR}/\n"
        "ENV HOME=/workspace PYTHONDONTWRITEBYTECODE=1\n"
        f'CMD ["python3", "{PROGRAM_DIR}/program.py", "/workspace"]\n'
    )


def cuda_image(base: str = DEFAULT_CUDA_BASE, *, source: Path = SOURCE) -> CudaImage:
    """The CUDA image over ``base`` (any reference the engine has or can pull; the ``challenge_cuda_base`` setting
    insists on a digest), with the program of ``source``."""
    if not base or any(c.isspace() for c in base):
        raise ValueError(f"the challenge's base image {base!r} is not an image reference")
    files: Mapping[str, bytes] = {
        "Dockerfile": dockerfile(base).encode(),
        "program.py": (source / "program.py").read_bytes(),
        "compute.py": (source / "compute.py").read_bytes(),
    }
    digest = hashlib.sha256()
    for name in sorted(files):
        digest.update(name.encode() + b"\x00" + len(files[name]).to_bytes(8, "little") + files[name])
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for name in sorted(files):
            info = tarfile.TarInfo(name)
            info.size, info.mode, info.mtime = len(files[name]), 0o644, 0
            tar.addfile(info, io.BytesIO(files[name]))
    return CudaImage(base, f"{CUDA_REPO}:{digest.hexdigest()[:16]}", gzip.compress(raw.getvalue(), mtime=0))


def challenge_image_for(backend: str, configured: str | None, cuda: CudaImage) -> str:
    """The image challenges run in: ``configured`` (the ``challenge_image`` setting) when set; else the CUDA image on
    a real GPU (``nvml``), the CPU image on a simulated or replayed one."""
    if configured:
        return configured
    return cuda.name if backend == "nvml" else CPU_IMAGE


class CudaImageBuilder:
    """Builds ``image`` through the engine unless it has it. ``ensure`` is idempotent and safe to call at once from
    several tasks (one build at a time, the others wait for it)."""

    def __init__(
        self, docker: Callable[[], aiodocker.Docker], image: CudaImage, *,
        # Timeouts
        build_timeout: float = 3600.0, inspect_timeout: float = 30.0,
    ) -> None:  # fmt: skip
        self.docker = docker
        self.image = image
        self.build_timeout = build_timeout
        self.inspect_timeout = inspect_timeout
        self._lock = asyncio.Lock()
        self._ready = False

    async def ensure(self) -> str:
        """The image's name, once the engine has it. ``ChallengeImageError`` when the build fails (the next call tries
        again). Cancelling is safe: a build the engine started goes on there, and the next call finds or builds it."""
        async with self._lock:
            if self._ready:
                return self.image.name
            docker = self.docker()
            if not await self._exists(docker):
                log.info("building the GPU challenge's image %s FROM %s", self.image.name, self.image.base)
                await self._build(docker)
                if not await self._exists(docker):
                    raise ChallengeImageError(f"the engine built {self.image.name} but does not list it")
                log.info("built the GPU challenge's image %s", self.image.name)
            self._ready = True
            return self.image.name

    async def _exists(self, docker: aiodocker.Docker) -> bool:
        try:
            async with asyncio.timeout(self.inspect_timeout):
                await docker.images.inspect(self.image.name)
        except DockerError as exc:
            if exc.status == 404:
                return False
            raise ChallengeImageError(f"the engine could not say whether it has {self.image.name}: {exc}") from None
        except (TimeoutError, OSError, aiohttp.ClientError) as exc:
            raise ChallengeImageError(f"the engine did not answer about {self.image.name}: {exc!r}") from None
        return True

    async def _build(self, docker: aiodocker.Docker) -> None:
        try:
            async with asyncio.timeout(self.build_timeout):
                output = await docker.images.build(
                    fileobj=io.BytesIO(self.image.context), encoding="gzip", tag=self.image.name, rm=True, forcerm=True,
                    labels={"gpumarket.challenge": "cuda", "gpumarket.challenge.base": self.image.base},
                )  # fmt: skip
        except DockerError as exc:
            raise ChallengeImageError(f"building {self.image.name} FROM {self.image.base} failed: {exc}") from None
        except (TimeoutError, OSError, aiohttp.ClientError) as exc:
            raise ChallengeImageError(f"building {self.image.name} FROM {self.image.base} did not finish: {exc!r}") from None
        for line in output if isinstance(output, list) else []:
            if isinstance(line, dict) and (line.get("error") or line.get("errorDetail")):
                detail = line.get("error") or json.dumps(line.get("errorDetail"))
                raise ChallengeImageError(f"building {self.image.name} FROM {self.image.base} failed: {detail}")
