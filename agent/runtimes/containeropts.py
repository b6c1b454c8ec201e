"""What the container runtime is told and tells: ``ContainerOptions`` (every limit bounded), the
names and labels of a rental's container, network and volume, the engine's answers
(``ContainerFacts``, ``PreparedImage``) and the progress callback of a start.

Split from ``agent.runtimes.container`` so that the runtime, the log follower
(``agent.runtimes.containerlogs``) and the manager share them without a cycle.
"""


from __future__ import annotations

import functools
import hashlib
import ipaddress
import signal
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Final, Literal

import aiohttp
from aiodocker.exceptions import DockerError

from agent.runtimes.netguard import BRIDGE_PREFIX, EgressPolicy, NetGuardStatus
from shared.errors import ConfigError

RENTAL_LABEL: Final = "gpumarket.rental"
OWNER_LABEL: Final = "gpumarket.owner"
WORKSPACE: Final = "/workspace"
SINCE_NAME: Final = "container.since"
DEFAULT_SOCKET: Final = "unix:///var/run/docker.sock"

ProgressStage = Literal["pulling", "pulled", "starting"]
ProgressCallback = Callable[[str, ProgressStage, str, float | None], Awaitable[None]]
"""``on_progress(rental_id, stage, text, percent)``: a step of a start the renter should see."""

ENGINE_ERRORS: Final = (DockerError, aiohttp.ClientError, OSError, TimeoutError)


@dataclass(frozen=True, slots=True)
class ContainerOptions:
    """How this agent runs container workloads; every limit bounded (``ConfigError`` otherwise)."""

    owner: str = "gpumarket"  # this agent's identity (its host id): the owner label
    docker_url: str | None = None  # None: $DOCKER_HOST, else unix:///var/run/docker.sock
    allowed_images: tuple[str, ...] = ()  # image-name patterns (shared.imageref.image_allowed); empty: any
    max_image_mib: int | None = None  # largest image (unpacked size) a rental may run
    default_pids_limit: int = 4096
    default_memory_mib: int | None = None
    default_cpu_cores: float | None = None
    default_shm_mib: int = 64
    user: str = "1000:1000"  # when the image names no user
    isolate_network: bool = True  # a bridge of its own per rental (else the engine's default bridge)
    device_requests: bool | None = None  # GPUs through DeviceRequests; None: when the GPU backend is real
    subnet_pool: str = "10.213.0.0/16"  # rental networks' subnets come from here
    egress: EgressPolicy | None = None  # what rentals may reach (None: this host's resolvers, no private range)
    subnet_prefix: int = 28
    log_max_mib: int = 16  # the engine's own log (the "local" driver: bytes as written), per file (two files)
    # Timeouts
    pull_timeout: float = 1800.0
    engine_timeout: float = 30.0  # one engine call (create, inspect, remove, ...)
    progress_interval: float = 1.0
    retry_interval: float = 1.0  # a watcher asks again this often while the engine does not answer

    def __post_init__(self) -> None:
        if not isinstance(self.owner, str) or not 1 <= len(self.owner) <= 256 or not self.owner.isprintable():
            raise ConfigError("container owner must be 1-256 printable characters (the agent's host id)")
        ConfigError.check_bounds("container setting", (
            ("default_pids_limit", self.default_pids_limit, 16, 1 << 22),
            ("default_shm_mib", self.default_shm_mib, 1, 1 << 20),
            ("subnet_prefix", self.subnet_prefix, 16, 29),
            ("log_max_mib", self.log_max_mib, 1, 1 << 10),
            ("pull_timeout", self.pull_timeout, 1.0, 86400.0),
            ("engine_timeout", self.engine_timeout, 0.1, 600.0),
            ("progress_interval", self.progress_interval, 0.01, 60.0),
            ("retry_interval", self.retry_interval, 0.01, 60.0),
        ))
        optional = (
            ("max_image_mib", self.max_image_mib, 1, 1 << 30),
            ("default_memory_mib", self.default_memory_mib, 6, 1 << 30),
            ("default_cpu_cores", self.default_cpu_cores, 0.01, 4096),
        )
        ConfigError.check_bounds("container setting", ((n, v, low, high) for n, v, low, high in optional if v is not None))
        try:
            pool = ipaddress.ip_network(self.subnet_pool)
        except ValueError as exc:
            raise ConfigError(f"container subnet_pool {self.subnet_pool!r}: {exc}") from None
        if not isinstance(pool, ipaddress.IPv4Network) or pool.prefixlen > self.subnet_prefix:
            raise ConfigError(f"container subnet_pool {self.subnet_pool} must be IPv4 and no smaller than /{self.subnet_prefix}")
        if not self.user or any(c.isspace() for c in self.user):
            raise ConfigError("container user must be 'uid:gid' or a user name")
        for pattern in self.allowed_images:
            if not isinstance(pattern, str) or not pattern:
                raise ConfigError("allowed_images holds image-name patterns such as 'docker.io/library/*'")


def owner_tag(owner: str) -> str:
    return hashlib.sha256(owner.encode()).hexdigest()[:8]


def resource_name(rental_id: str, owner: str) -> str:
    """The name of the rental's container, network and volume."""
    return f"gpumarket-{rental_id}-{owner_tag(owner)}"


def bridge_name(rental_id: str, owner: str) -> str:
    """``gm`` + 13 hex digits: a Linux interface name (at most 15 characters) that ``gm+`` matches."""
    return BRIDGE_PREFIX + hashlib.sha256(f"{owner}\0{rental_id}".encode()).hexdigest()[:13]


def exit_code_of(state: Mapping[str, Any]) -> int | None:
    """The engine's exit code as the manager reports it: ``-N`` for signal N (128+N, or an OOM kill)."""
    if state.get("OOMKilled"):
        return -signal.SIGKILL
    code = state.get("ExitCode")
    if not isinstance(code, int):
        return None
    if 128 < code <= 128 + 64:
        return -(code - 128)
    return code


def parse_timestamp_ns(text: bytes) -> int | None:
    """An RFC 3339 timestamp as the engine writes it (``2024-01-02T03:04:05.123456789Z``) in ns since the epoch."""
    fraction_z = text[20:]
    if text[19:20] == b"." and fraction_z[-1:] == b"Z" and fraction_z[:-1].isdigit():  # the engine's own (UTC): every line's
        utc = _utc_seconds(text[:19])
        if utc is not None:
            return utc * 1_000_000_000 + int((fraction_z[:-1] + b"000000000")[:9])
    try:
        raw = text.decode("ascii")
        whole, _, rest = raw.partition(".")
        fraction = "".join(c for c in rest if c.isdigit())
        zone = rest[len(fraction):] if rest else whole[19:]
        seconds = datetime.fromisoformat(whole[:19] + (zone if zone not in ("", "Z") else "+00:00")).timestamp()
        return int(seconds) * 1_000_000_000 + int((fraction + "000000000")[:9])
    except ValueError:
        return None


@functools.lru_cache(maxsize=64)
def _utc_seconds(whole: bytes) -> int | None:
    """``2024-01-02T03:04:05`` (UTC) in seconds since the epoch; kept, as a chatty workload's lines share their second."""
    try:
        return int(datetime.fromisoformat(whole.decode("ascii") + "+00:00").timestamp())
    except ValueError:
        return None


@dataclass(frozen=True, slots=True)
class ContainerFacts:
    """What a host's hello says of its containers: the engine (``None``: none answers, ``reason`` says why)
    and whether the network guard is on."""

    engine: str | None  # "docker 20.10.24"
    reason: str
    network_guard: NetGuardStatus


@dataclass(frozen=True, slots=True)
class PreparedImage:
    """What ``prepare`` learnt of the image: its id and what its config asks for."""

    id: str
    user: str
    env: tuple[str, ...]
    size: int
    pulled: bool
