"""``gpumarket agent``: run the enrolled agent until stopped."""

from __future__ import annotations

import asyncio
import contextlib
import logging

from agent.challenge_image import CPU_IMAGE, CUDA_REPO
from agent.gpu import open_backend
from agent.runner import Agent
from agent.runtimes.ceilings import CeilingPolicy
from agent.runtimes.containeropts import ContainerOptions
from agent.runtimes.isolation import HostIsolation, host_isolation, isolation_summary
from agent.runtimes.netguard import EgressPolicy
from agent.state import AgentState
from agent.timings import AgentTimings
from shared.imageref import parse_image_reference
from shared.protocol import FabricDeclaration, ImagePolicyModel
from shared.settings import AgentSettings

log = logging.getLogger(__name__)


def agent_from_settings(settings: AgentSettings, *, container_engine: str | None = None) -> Agent:
    """The agent the settings describe; ``container_engine`` is what the engine probe answered
    (``"docker 24.0.7"``; ``None``: none answers)."""
    state = AgentState(settings.data_dir)
    if settings.gpus.strip().lower() == "nvml":
        backend = open_backend("nvml")  # first: "no driver" is the more fundamental problem
        identity = state.identity()
    else:
        identity = state.identity()
        backend = open_backend(settings.gpus, seed=identity.host_id)
    return Agent(
        state,
        backend,
        relay_urls=[settings.relay_url] if settings.relay_url else None,
        zone=settings.zone,
        resolver=settings.resolver,
        resolver_port=settings.resolver_port,
        resolver_source=settings.resolver_source,
        region=settings.region,
        timings=AgentTimings(
            sample_interval=settings.sample_interval,
            telemetry_interval=settings.telemetry_interval,
            heartbeat_interval=settings.heartbeat_interval,
            network_interval=settings.network_interval,
            reconnect_max_delay=settings.reconnect_max_delay,
        ),
        network_probes=settings.network_probes,
        network_max_bytes=settings.network_max_bytes,
        spool_max_messages=settings.spool_max_messages,
        spool_max_bytes=settings.spool_max_bytes,
        cluster_direct=settings.cluster_direct,
        cluster_tunnel_mtu=settings.cluster_tunnel_mtu,
        cluster_fabric=FabricDeclaration.model_validate(settings.cluster_fabric) if settings.cluster_fabric else None,
        isolation=isolation_from_settings(settings, container_engine=container_engine),
        container=container_options(settings),
        ceilings=CeilingPolicy.detect(
            state.work_dir, reserved_cpu_cores=settings.reserved_cpu_cores,
            reserved_memory_mib=settings.reserved_memory_mib, reserved_pids=settings.reserved_pids,
            reserved_disk_gib=settings.reserved_disk_gib, rental_disk_gib=settings.rental_disk_gib, disk_quota=settings.disk_quota,
            container_pids_limit=settings.container_pids_limit, container_memory_mib=settings.container_memory_mib,
        ),
        max_streams=settings.max_streams,
        max_streams_per_rental=settings.max_streams_per_rental,
        max_stream_buffer=settings.max_stream_buffer_mib << 20,
        stream_window=settings.stream_window_kib << 10,
        stream_data=settings.stream_data_kib << 10,
        challenge_image=settings.challenge_image,
        challenge_cuda_base=settings.challenge_cuda_base,
        challenge_simulate=settings.challenge_simulate,
    )


def container_options(settings: AgentSettings) -> ContainerOptions:
    """The container runtime's options from the agent's settings (the owner is the host id, set by ``Agent``)."""
    return ContainerOptions(
        docker_url=settings.docker_url,
        # The platform's challenge image runs whatever the provider allows renters (an empty list allows every image).
        allowed_images=tuple(settings.allowed_images) + (challenge_image_names(settings) if settings.allowed_images else ()),
        max_image_mib=settings.max_image_mib,
        default_pids_limit=settings.container_pids_limit,
        default_memory_mib=settings.container_memory_mib,
        default_shm_mib=settings.container_shm_mib,
        egress=EgressPolicy.for_host(settings.egress_allow, process_pool=settings.process_subnet_pool),
    )


def challenge_image_names(settings: AgentSettings) -> tuple[str, ...]:
    """The challenge images' names as ``allowed_images`` patterns (canonical, any tag): the configured image's, or
    both defaults' (the CPU image and the CUDA one, whichever the backend takes)."""
    images = (settings.challenge_image,) if settings.challenge_image else (CPU_IMAGE, CUDA_REPO)
    return tuple(parse_image_reference(image).name for image in images)


def isolation_from_settings(settings: AgentSettings, *, container_engine: str | None) -> HostIsolation:
    """Decide what this host runs isolated (blocking: one probe run); logs the outcome in one line."""
    isolation = host_isolation(
        allow_unisolated=settings.allow_unisolated_workloads,
        container_engine=container_engine,
        rentals_root=settings.rentals_root,
        uid_min=settings.rental_uid_min,
        uid_max=settings.rental_uid_max,
        image_policy=ImagePolicyModel(allowed=settings.allowed_images, max_image_mib=settings.max_image_mib),
        private_dirs=[settings.data_dir],
        process_pool=settings.process_subnet_pool,
    )
    return isolation


async def serve_agent(settings: AgentSettings, *, stop: asyncio.Event) -> None:
    """Run the agent until ``stop`` is set, or until it stops on its own: then its error is raised.

    The agent stops on its own only when retrying cannot help (its certificate was revoked or has
    expired: a ``ConfigError`` saying to enroll again), and ``gpumarket agent run`` exits with that line.
    """
    agent = agent_from_settings(settings)
    await agent.refresh_isolation()  # asks the container engine: the line below says whether containers run
    facts = agent.isolation.facts
    (log.info if facts.isolated else log.warning)("%s", isolation_summary(facts))
    print(f"agent for host {agent.host_id} starting ({agent.backend.name}, {len(agent.backend.gpus())} GPU)", flush=True)
    task = asyncio.create_task(agent.run(), name="agent")
    stopping = asyncio.create_task(stop.wait(), name="agent-stop")
    try:
        await asyncio.wait({task, stopping}, return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            task.result()  # the agent's own reason to stop (a ConfigError), raised to the command line
    finally:
        for pending in (task, stopping):
            if not pending.done():
                pending.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await pending
        await agent.close()
