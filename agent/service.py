"""``gpumarket agent``: run the enrolled agent until stopped."""

from __future__ import annotations

import asyncio
import contextlib
import logging

from agent.gpu import open_backend
from agent.runner import Agent
from agent.state import AgentState
from shared.settings import AgentSettings

log = logging.getLogger(__name__)


def agent_from_settings(settings: AgentSettings) -> Agent:
    state = AgentState(settings.data_dir)
    identity = state.identity()
    backend = open_backend(settings.gpus, seed=identity.host_id)
    return Agent(
        state,
        backend,
        relay_urls=[settings.relay_url] if settings.relay_url else None,
        region=settings.region,
        telemetry_interval=settings.telemetry_interval,
        heartbeat_interval=settings.heartbeat_interval,
        max_unacked=settings.max_unacked,
        reconnect_max_delay=settings.reconnect_max_delay,
    )


async def serve_agent(settings: AgentSettings, *, stop: asyncio.Event) -> None:
    agent = agent_from_settings(settings)
    print(f"agent for host {agent.host_id} starting ({agent.backend.name}, {len(agent.backend.gpus())} GPU)", flush=True)
    task = asyncio.create_task(agent.run(), name="agent")
    try:
        await stop.wait()
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await agent.close()
