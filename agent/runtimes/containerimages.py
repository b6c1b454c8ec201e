"""A container workload's image: the host's image policy (``check_image``), the pull through the engine with the
renter's progress and, when the start brings one, the registry login for that pull only (``pull_image``), and the
stable code of a failed pull (``pull_failure_code``).

Split from ``agent.runtimes.container``, whose ``ContainerRuntime.prepare`` puts them together (inspect, pull when the
image is not here, the size check).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any

import aiodocker
from aiodocker.exceptions import DockerError

from agent.runtimes.containeropts import ContainerOptions, ProgressStage
from agent.runtimes.registry_login import SealedLogin
from shared.errors import BadRequest
from shared.imageref import ImageReference, image_allowed, parse_image_reference

DOCKER_HUB_INDEX = "https://index.docker.io/v1/"
# What registries (through the engine) answer a pull they refuse: the renter's login, or the renter's image name.
_REFUSED_LOGIN = ("unauthorized", "authentication required", "no basic auth credentials", "access denied", "denied:",
                  "incorrect username or password")  # fmt: skip
_UNKNOWN_IMAGE = ("manifest unknown", "name unknown", "not found: manifest")


def pull_failure_code(message: str) -> str:
    """The stable code of a failed pull: ``registry_auth_failed`` (the registry refused the login, or wants one),
    ``image_not_found`` (it has no such image or tag) — both the renter's — else ``image_pull_failed``."""
    lowered = message.lower()
    if any(words in lowered for words in _REFUSED_LOGIN):
        return "registry_auth_failed"
    if any(words in lowered for words in _UNKNOWN_IMAGE):
        return "image_not_found"
    return "image_pull_failed"


def check_image(image: str, allowed: list[str] | tuple[str, ...]) -> ImageReference:
    """``image`` parsed, or ``BadRequest`` (``bad_workload_spec``); one the host's ``allowed`` images do not match is
    ``image_not_allowed``."""
    try:
        reference = parse_image_reference(image)
    except ValueError as exc:
        raise BadRequest(str(exc), code="bad_workload_spec") from None
    if not image_allowed(reference, allowed):
        raise BadRequest(
            f"image {reference.canonical} is not allowed on this host: its provider runs only {', '.join(allowed)}",
            code="image_not_allowed",
        )
    return reference


async def pull_image(
    docker: aiodocker.Docker, options: ContainerOptions, image: str, reference: ImageReference, registry_auth: SealedLogin | None,
    progress: Callable[[ProgressStage, str, float | None], Awaitable[None]],
) -> None:
    """Pull ``image`` through the engine within ``options.pull_timeout``, calling ``progress`` at most every
    ``options.progress_interval`` (the bytes downloaded of the layers' total, when the engine says).

    ``registry_auth`` is opened here, for this pull only. A refused or failed pull is ``BadRequest`` with
    ``pull_failure_code``'s code; an engine that does not answer raises its ``aiohttp.ClientError`` or ``OSError``
    (the runtime says so as ``container_runtime_unavailable``). Cancelling is safe: a pull cancelled half-way leaves
    the engine's partial layers, as ``docker pull`` would.
    """
    await progress("pulling", f"pulling {reference.canonical}", None)
    layers: dict[str, tuple[int, int]] = {}
    last = 0.0
    auth: dict[str, Any] | None = None
    if registry_auth is not None:
        login = registry_auth.open()  # here, for this pull only
        # With a login the engine wants the registry named (Docker Hub's own, its index URL).
        server = DOCKER_HUB_INDEX if login.server == "docker.io" else login.server
        auth = {"username": login.username, "password": login.password, "serveraddress": server}
        image = reference.canonical
    try:
        async with asyncio.timeout(options.pull_timeout):
            async for event in docker.images.pull(image, auth=auth, stream=True):
                if "error" in event:
                    raise DockerError(500, str(event.get("error")))
                detail = event.get("progressDetail") or {}
                layer = event.get("id")
                if layer and isinstance(detail.get("total"), int) and event.get("status") == "Downloading":
                    layers[str(layer)] = (int(detail.get("current") or 0), int(detail["total"]))
                now = time.monotonic()
                if now - last >= options.progress_interval:
                    last = now
                    total = sum(t for _, t in layers.values())
                    percent = round(100.0 * sum(c for c, _ in layers.values()) / total, 1) if total else None
                    text = f"pulling {reference.canonical}: {event.get('status', '')}"[:512]
                    await progress("pulling", text, percent)
    except TimeoutError:
        raise BadRequest(f"pulling {reference.canonical} took longer than {options.pull_timeout:g}s", code="image_pull_failed") from None
    except DockerError as exc:
        raise BadRequest(f"cannot pull {reference.canonical}: {exc.message}", code=pull_failure_code(str(exc.message))) from None
    await progress("pulled", f"pulled {reference.canonical}", 100.0)
