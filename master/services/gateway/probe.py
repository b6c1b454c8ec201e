"""The health probe the autoscaler asks before it marks a replica ready (and while it is).

``probe`` sends ``GET {service.health_path}`` to the replica through the gateway's own pool of
connections to it (the path a request would take: the relay, the agent, the container's port), and
calls the replica healthy when it answers 2xx within ``timeout`` seconds. A healthy answer ends the replica's
ejection: the probes that failed while it was starting (its port not yet open) do not keep it out once it is ready.
"""

from __future__ import annotations

import asyncio

import aiohttp
from yarl import URL

from master.context import Master
from master.models import Rental, Service
from master.services.gateway.core import gateway_of
from master.services.gateway.proxy import UPSTREAM
from master.services.gateway.upstream import UpstreamUnavailable

MAX_HEALTH_BODY = 64 * 1024


async def probe(master: Master, service: Service, rental: Rental, *, timeout: float = 2.0) -> str | None:
    """``None`` when the replica ``rental`` of ``service`` answers its health path 2xx within ``timeout``; else why
    not, in a few words for a service event. Read-only; cancelling is safe."""
    gateway = gateway_of(master)
    route = await gateway.routes.get(service.id)
    replica = next((r for r in route.replicas if r.rental_id == rental.id), None) if route is not None else None
    if replica is None:  # just started: read the route again rather than wait for its cache
        route = await gateway.routes.get(service.id, max_age=0)
        replica = next((r for r in route.replicas if r.rental_id == rental.id), None) if route is not None else None
    if route is None or replica is None:
        return f"replica {rental.id} is not a running replica of service {service.id}"
    if replica.relay_url is None:
        return f"the host of replica {rental.id} is on no relay"
    pool = gateway.pool(route, replica)
    path = service.health_path if service.health_path.startswith("/") else f"/{service.health_path}"
    try:
        async with asyncio.timeout(timeout):
            async with pool.session.get(URL(UPSTREAM + path), headers={"User-Agent": "gpumarket-health"},
                                        allow_redirects=False) as response:  # fmt: skip
                await response.content.read(MAX_HEALTH_BODY)
                status = response.status
    except UpstreamUnavailable as exc:
        return exc.message
    except TimeoutError:
        return f"GET {path} did not answer within {timeout:g} s"
    except aiohttp.ClientError as exc:
        return f"GET {path} failed: {type(exc).__name__}: {exc}"
    if not 200 <= status < 300:
        return f"GET {path} answered {status}"
    pool.recovered()  # a replica that failed its probes while starting takes requests once ready, not eject_s later
    return None
