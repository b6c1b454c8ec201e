"""What ``gpumarket up`` gives its simulated hosts so that every example of the README has an answer.

* **Seeded history.** A host that just enrolled has no uptime to score (``master.services.market.reliability``
  needs an hour observed). Each demo host gets ``SEEDED_DAYS`` of made-up state changes before its
  enrollment, with a few outages that leave it ``DEMO_UPTIMES[i]`` up, recorded by
  ``reliability.SEEDED_ACTOR`` with a cause that says so; the score's inputs and the API say
  ``seeded`` (``reliability_seeded`` on hosts and offers). Seeded once per host, so a restarted demo
  keeps its past and adds its real one.
* **A first speed test.** Real agents spread their first measurement over their interval; a demo
  host measures its network to the relay as soon as it is connected (the agent's own
  ``measure_network``, through the relay's speed-test endpoints), so offers show speeds at once.
* **Shares and storage.** Every demo host is listed by its provider at its tier's default price, lending
  ``DEMO_VOLUME_GIB`` of its disk to volumes at a storage price of its own (``demo_storage_price``: the cheapest
  differ, so ``gpumarket volume create`` has a choice); the first for shares (``smallest_unit`` ``SHARE_UNIT``). Once:
  a provider's later listing stands. Its agent keeps volumes where ``gpumarket up`` runs as root (loop disks).

* **The demo image and template.** Where a container engine answers, ``build_demo_image`` builds (or finds)
  ``gpumarket/demo:<hash>`` from this machine's own packages (``gpumarket.images.DEMO_IMAGE``: a shell, Python 3 and
  the OpenAI-compatible sample server on port 8000), and ``register_demo_template`` points the ``demo`` template at
  it at every start, so the README's rentals, SSH sessions, ports and services work offline. Where none answers (or
  the build fails), the template stays, saying why in its description and naming ``gpumarket/demo:latest``; no demo
  host then runs containers, and a rental of it is refused saying so.

MIG slices need nothing here: the A100 host of ``gpumarket.up.DEMO_FLEET`` has a GPU in MIG mode.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from decimal import Decimal

from sqlalchemy import select

from agent.runner import Agent
from gpumarket import images
from master.context import Master
from master.models import Account, Gpu, Host, HostEvent, HostListing
from master.services import market, rentals
from master.services.accounts import Principal
from shared import protocol

log = logging.getLogger(__name__)

SEEDED_DAYS = 30
SEEDED_OUTAGES = 3
# Uptime over the seeded days, by demo host: most above 0.98 (the README's filter), one below it.
DEMO_UPTIMES = (0.9995, 0.972, 0.9985, 0.9991, 0.991, 0.985, 0.9975, 0.96, 0.999, 0.994)
SEEDED_CAUSE = "seeded demo history (gpumarket up): made up, not measured"
SHARE_UNIT = "milli:250"
DEMO_VOLUME_GIB = 64  # each demo host lends this much of its disk to volumes (sparse images: taken as written)
READY_TIMEOUT_S = 120.0  # how long the demo set-up waits for its hosts' first hello
_POLL_S = 0.2
DEMO_TEMPLATE = "demo"
DEMO_DESCRIPTION = (
    "gpumarket up's demo image, built on this machine from its own packages (no registry needed): busybox's shell and "
    "tools, Python 3 and an OpenAI-compatible sample server on port 8000 (GET / a page, POST /v1/chat/completions). "
    "Rent it, gpumarket ssh into it, open its port 8000, or run it as a service."
)


@dataclass(frozen=True)
class DemoImage:
    """What ``build_demo_image`` made: the image's name, or why there is none."""

    image: str | None
    why: str = ""


def engine_socket(docker_url: str | None) -> str | None:
    """The unix socket of the engine ``docker_url`` (else ``$DOCKER_HOST``, else the system's) names; ``None`` for
    one over TCP."""
    url = docker_url or os.environ.get("DOCKER_HOST") or f"unix://{images.SOCKET}"
    return url.removeprefix("unix://") if url.startswith("unix://") else None


async def build_demo_image(engine: str | None, engine_reason: str, *, docker_url: str | None = None,
                           progress: Callable[[str], None] | None = None) -> DemoImage:
    """Build (or find: instant once built) the demo image through the engine, which ``engine`` names (``None``: none
    answers, ``engine_reason`` says why). Never raises for a build that cannot be done: says why instead.
    Cancelling is safe: the build's thread finishes on its own, and a later one finds the image or builds it again."""
    if engine is None:
        return DemoImage(None, f"no container engine answers ({engine_reason})")
    socket_path = engine_socket(docker_url)
    if socket_path is None:
        return DemoImage(None, f"the engine at {docker_url or os.environ.get('DOCKER_HOST')} is not a unix socket, "
                               "which gpumarket up builds the demo image through")  # fmt: skip
    try:
        return DemoImage(await asyncio.to_thread(images.demo_image, socket_path=socket_path, progress=progress))
    except (images.ImageBuildError, OSError) as exc:
        return DemoImage(None, f"building it failed: {exc}")


async def register_demo_template(master: Master, built: DemoImage) -> None:
    """Point the ``demo`` template at the image built now or, without one, keep it saying why (idempotent)."""
    if built.image is not None:
        description = DEMO_DESCRIPTION
        workload = protocol.ContainerWorkload(image=built.image, ports=[images.DEMO_PORT])
    else:
        description = (f"Not available on this demo: {built.why}. Start a Docker engine and run gpumarket up again: it "
                       "builds the demo image (a shell, Python 3 and an OpenAI-compatible sample server on port 8000).")
        workload = protocol.ContainerWorkload(image=images.DEMO_LATEST, ports=[images.DEMO_PORT])
    async with master.db.session() as session:
        await rentals.put_template(session, DEMO_TEMPLATE, description=description[: rentals.MAX_DESCRIPTION_CHARS],
                                   workload=workload, now=master.clock.now())  # fmt: skip


def demo_uptime(index: int) -> float:
    return DEMO_UPTIMES[index % len(DEMO_UPTIMES)]


async def seed_history(master: Master, host_id: str, *, uptime: float, days: int = SEEDED_DAYS, outages: int = SEEDED_OUTAGES) -> bool:
    """Give the host ``days`` of seeded state changes ending at its enrollment, ``uptime`` of it up, and score it.

    Returns False (and writes nothing) when the host has seeded history already.
    """
    if not 0.0 < uptime <= 1.0 or days < 1 or outages < 1:
        raise ValueError("uptime in (0, 1], at least one day and one outage")
    async with master.db.session() as session:
        seeded = await session.scalar(
            select(HostEvent.id).where(HostEvent.host_id == host_id, HostEvent.actor == market.SEEDED_ACTOR).limit(1)
        )
        host = await session.get(Host, host_id)
        if seeded is not None or host is None:
            return False
        end = host.created_at - timedelta(seconds=1)  # strictly before the host's own first event
        start = end - timedelta(days=days)
        span = end - start
        outage = span * (1.0 - uptime) / outages
        events = [HostEvent(host_id=host_id, at=start, from_state=None, to_state="online", cause=SEEDED_CAUSE, actor=market.SEEDED_ACTOR)]
        for n in range(outages):
            down_at = start + span * (n + 0.5) / outages
            events.append(HostEvent(host_id=host_id, at=down_at, from_state="online", to_state="offline", cause=SEEDED_CAUSE,
                                    actor=market.SEEDED_ACTOR))  # fmt: skip
            events.append(HostEvent(host_id=host_id, at=down_at + outage, from_state="offline", to_state="online", cause=SEEDED_CAUSE,
                                    actor=market.SEEDED_ACTOR))  # fmt: skip
        session.add_all(events)
        await session.flush()
        await market.rescore_host(session, host, now=master.clock.now())
    return True


async def prepare_demo_hosts(master: Master, agents: Sequence[Agent], *, provider: str, timeout: float = READY_TIMEOUT_S) -> None:
    """Once the demo hosts are connected: a speed test on each, and their listings (shares on the first, storage on all).

    Logs what it could not do instead of raising; cancelling it (``Marketplace.stop``) is safe.
    """
    try:
        async with asyncio.timeout(timeout):
            await asyncio.gather(*(_first_speed_test(agent) for agent in agents))
            for i, agent in enumerate(agents):
                await list_demo_host(master, agent.host_id, provider=provider, index=i)
    except TimeoutError:
        log.warning("demo set-up: the demo hosts were not all connected and classified within %g s", timeout)
    except Exception:
        log.exception("demo set-up failed")


async def _first_speed_test(agent: Agent) -> None:
    await agent.connected.wait()
    report = await agent.measure_network()
    if report.error:
        log.warning("demo host %s: first speed test failed: %s", agent.host_id, report.error)


def demo_storage_price(index: int) -> Decimal:
    """USD per GiB-hour the ``index``-th demo host asks for its volumes' storage (0.0001 to 0.00025)."""
    return Decimal("0.0001") + Decimal("0.00005") * (index % 4)


async def list_demo_host(master: Master, host_id: str, *, provider: str, index: int) -> bool:
    """List the host at its tier's default price, lending ``DEMO_VOLUME_GIB`` to volumes (the first host: for shares
    of ``SHARE_UNIT``), unless it has a listing; waits for its GPUs to be classified (its first hello). Returns
    whether it listed it."""
    unit = SHARE_UNIT if index == 0 else "gpu"
    while True:
        async with master.db.session() as session:
            if await session.get(HostListing, host_id) is not None:
                return False
            tiers = (await session.scalars(select(Gpu.tier).where(Gpu.host_id == host_id, Gpu.present.is_(True)))).all()
            tier = market.best_tier(tiers)
            if tier is not None:
                account = await session.get(Account, provider)
                assert account is not None
                terms = market.ListingTerms(price_per_gpu_hour=market.load_price_bounds()[tier].default, smallest_unit=unit,
                                            storage_price_per_gib_hour=demo_storage_price(index), volume_gib=DEMO_VOLUME_GIB)  # fmt: skip
                await market.put_listing(session, Principal(account.id, account.name, account.role), host_id, terms,
                                           now=master.clock.now())  # fmt: skip
                log.info("demo host %s listed (%s, %d GiB for volumes)", host_id, unit, DEMO_VOLUME_GIB)
                return True
        await asyncio.sleep(_POLL_S)
