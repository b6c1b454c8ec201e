"""An elastic service's endpoint and autoscaler against the same replica called directly, in one run.

The marketplace is the embedded one (``gpumarket.up.start_marketplace``: master, relay, three
simulated-GPU agents, the local container engine) running the sample OpenAI-compatible image
(``tests/dockerengine.py``: ``openai_image``, ``examples/openai_cpu_server.py``). A request through the
endpoint takes the renter's path: the master's gateway (``/svc/<id>/``: the service token checked, a
ready replica picked) → a kept-alive stream through the relay → the agent's link → the container's
port. The baseline is the same request to the same container's address on its bridge, from this
process, with the same HTTP client (aiohttp, keep-alive).

Figures:

1. Requests/s of ``--requests`` chat completions (``POST /v1/chat/completions``, a few words each),
   ``--concurrency`` at once, through the endpoint and directly, interleaved in blocks. Goal: at
   least 0.5× direct.
2. Round trip of one request at a time, p50/p99 over ``--round-trips``, interleaved in blocks; the
   added latency is the difference of the p50s. Goal: under 2 ms.
3. Scale-up decision to a ready replica: a service's bounds raised from 0 to 1 ``--scale-ups`` times;
   from the replica rental's creation (the autoscaler's decision) to its ``ready_at`` (its health
   check passed through the gateway; the autoscaler probes every ``autoscale_interval``: production's 5 s, or
   0.25 s with ``--timers fast``).
   Baseline: the same image started with the Engine API directly until its ``/health`` answers.
   Goal: p50 under 10 s.
4. Cold start: the first request to a service asleep at zero replicas, to its answer.

Processes (``--layout``): ``one-process`` puts the relay, the agents and the gateway in one process and its event
loop (in production they are different machines), so the endpoint's figures are a lower bound. By default
(``processes``) each of the three agents runs in a process of its own, on the agent's
event loop (uvloop), as in production, and the relay in a child process of its own (uvloop, as ``gpumarket access``),
talking with the master over the Redis bus and registry (``GPUMARKET_REDIS_URL``, keys under a prefix of this run's
own), as ``bench_scp.py`` runs it; this process keeps the master: its API with the gateway, and its background loops.
The renter's client is a child process, for both paths. The CPU per request is this process's (all its threads) and,
with ``processes``, the relay's and the agents' processes'.

Usage: ``python bench/bench_services.py [--quick] [--requests N] [--concurrency N] [--round-trips N] [--scale-ups N]
[--layout one-process|processes]``
(root or a docker group member, an engine answering)
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import multiprocessing
import os
import signal
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import ProcessPoolExecutor
from datetime import datetime
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any, TypeVar

import aiodocker
import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/dockerengine.py builds the image
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import describe_machine, process_cpu_seconds, quantile, record, unmount_under
from sqlalchemy import select

from agent.runtimes.containeropts import ContainerOptions
from agent.runtimes.isolation import HostIsolation
from bench._children import REDIS_URL, RelayProcess, forget_prefix, run_prefix
from gpumarket.demo import list_demo_host
from gpumarket.up import Marketplace, demo_agent, enroll_demo_host, start_marketplace
from master.models import Account
from shared import eventloop
from shared.bus import open_bus
from shared.registry import open_registry
from tests import dockerengine

T = TypeVar("T")
BODY = {"model": "gpumarket-echo", "messages": [{"role": "user", "content": "how fast is the endpoint"}]}
SETTINGS = {"GPUMARKET_RATE_LIMITS_ENABLED": "false", "GPUMARKET_SERVICE_STATS_BUCKET_S": "1"}
# The master's and agents' timers (``--timers``): production's defaults (shared/settings.py: the autoscaler every 5 s,
# heartbeats and telemetry every 10 s, queued rentals every 2 s), or the short ones earlier runs used, whose loops cost
# the master's process more CPU per second than the requests do (docs/performance.md, "The relay in a process of its
# own too").
TIMERS = {
    "production": {"autoscale": 5.0, "heartbeat": 10.0, "telemetry": 10.0, "queue": 2.0},
    "fast": {"autoscale": 0.25, "heartbeat": 1.0, "telemetry": 5.0, "queue": 1.0},
}
RPS_GOAL, ADDED_GOAL_MS, READY_GOAL_S = 0.5, 2.0, 10.0


async def until(check: Callable[[], Awaitable[T | None]], *, timeout: float, what: str) -> T:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if (value := await check()) is not None:
            return value
        await asyncio.sleep(0.1)
    raise SystemExit(f"bench_services: timed out after {timeout:g}s waiting for {what}")


class Renter:
    def __init__(self, http: aiohttp.ClientSession, market: Marketplace) -> None:
        self.http, self.api = http, market.api_url
        self.headers = {"Authorization": f"Bearer {market.credentials['renter']['api_key']}"}

    async def call(self, method: str, path: str, body: Any = None) -> Any:
        async with self.http.request(method, self.api + path, json=body, headers=self.headers) as response:
            answer = await response.json()
            if response.status >= 300:
                raise SystemExit(f"bench_services: {method} {path}: {response.status} {answer}")
            return answer

    async def service(self, image: str, name: str, *, low: int, high: int) -> dict[str, Any]:
        return dict(await self.call("POST", "/services", {
            "name": name, "workload": {"kind": "container", "image": image, "ports": [8000]}, "port": 8000,
            "requirements": "vram<=24", "min_replicas": low, "max_replicas": high,
            "scaling": {"metric": "inflight", "target": 1000, "scale_up_cooldown_s": 0, "scale_down_cooldown_s": 0},
        }))  # fmt: skip

    async def offered(self) -> None:
        """Wait until a host that fits the services' requirements is online and offered (the agents connect after start)."""

        async def check() -> bool | None:
            offers = await self.call("GET", "/offers?q=vram<=24")
            return True if offers["items"] else None

        await until(check, timeout=120, what="a host with vram<=24 offered")

    async def ready(self, service_id: str, count: int) -> dict[str, Any]:
        async def check() -> dict[str, Any] | None:
            view = await self.call("GET", f"/services/{service_id}")
            return view if view["replicas"]["ready"] == count and view["replicas"]["live"] == count else None

        return await until(check, timeout=120, what=f"{count} ready replicas of {service_id}")


async def container_url(rental_id: str) -> str:
    async with aiodocker.Docker() as docker:
        [container] = await docker.containers.list(filters={"label": [f"gpumarket.rental={rental_id}"]})
        info = await container.show()
    address = next(n["IPAddress"] for n in info["NetworkSettings"]["Networks"].values() if n.get("IPAddress"))
    return f"http://{address}:8000/"


async def one(http: aiohttp.ClientSession, url: str, headers: dict[str, str]) -> None:
    async with http.post(url + "v1/chat/completions", json=BODY, headers=headers) as response:
        answer = await response.read()
        if response.status != 200:
            raise SystemExit(f"bench_services: {url} answered {response.status}: {answer[:300].decode(errors='replace')}")


async def _throughput(url: str, headers: dict[str, str], requests: int, concurrency: int) -> float:
    left = requests
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as http:
        await asyncio.gather(*(one(http, url, headers) for _ in range(concurrency)))  # connections open, paths warm

        async def worker() -> None:
            nonlocal left
            while left > 0:
                left -= 1
                await one(http, url, headers)

        started = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return requests / (time.perf_counter() - started)


async def _round_trips(url: str, headers: dict[str, str], count: int) -> list[float]:
    times = []
    async with aiohttp.ClientSession() as http:
        await one(http, url, headers)
        for _ in range(count):
            started = time.perf_counter()
            await one(http, url, headers)
            times.append((time.perf_counter() - started) * 1e3)
    return times


def throughput_in_child(url: str, headers: dict[str, str], requests: int, concurrency: int) -> float:
    """Run in the renter's process: requests/s of ``requests``, ``concurrency`` at once, on kept-alive connections."""
    return asyncio.run(_throughput(url, headers, requests, concurrency))


def round_trips_in_child(url: str, headers: dict[str, str], count: int) -> list[float]:
    """Run in the renter's process: ``count`` requests one after another, each one's round trip in ms."""
    return asyncio.run(_round_trips(url, headers, count))


async def engine_start_to_health(image: str) -> float:
    """The baseline of a scale-up: the image started by the Engine API until its /health answers, seconds."""
    async with aiodocker.Docker() as docker, aiohttp.ClientSession() as http:
        started = time.perf_counter()
        container = await docker.containers.run({"Image": image})
        try:
            url = await _address(container)
            while True:
                with contextlib.suppress(aiohttp.ClientError):
                    async with http.get(url + "health", timeout=aiohttp.ClientTimeout(total=1)) as response:
                        if response.status == 200:
                            return time.perf_counter() - started
                await asyncio.sleep(0.02)
        finally:
            await container.delete(force=True)


async def _address(container: Any) -> str:
    info = await container.show()
    address = next(n["IPAddress"] for n in info["NetworkSettings"]["Networks"].values() if n.get("IPAddress"))
    return f"http://{address}:8000/"


def _at(text: str) -> datetime:
    return datetime.fromisoformat(text.replace("Z", "+00:00"))


async def scale_ups(renter: Renter, image: str, count: int) -> list[float]:
    service = await renter.service(image, "scale", low=0, high=1)
    sid, took = service["id"], []
    for _ in range(count):
        await renter.call("PUT", f"/services/{sid}/replicas", {"min_replicas": 1})
        view = await renter.ready(sid, 1)
        [replica] = [r for r in view["replica_rentals"] if r["ready"]]
        took.append((_at(replica["ready_at"]) - _at(replica["created_at"])).total_seconds())
        await renter.call("PUT", f"/services/{sid}/replicas", {"min_replicas": 0})
        await until(lambda: _live(renter, sid, 0), timeout=60, what="the replica stopped")
    await renter.call("DELETE", f"/services/{sid}")
    return took


async def _live(renter: Renter, service_id: str, count: int) -> bool | None:
    view = await renter.call("GET", f"/services/{service_id}")
    return True if view["replicas"]["live"] == count else None


async def cold_starts(http: aiohttp.ClientSession, renter: Renter, image: str, count: int) -> list[float]:
    service = await renter.service(image, "cold", low=0, high=1)
    sid, headers, took = service["id"], {"Authorization": f"Bearer {service['token']}"}, []
    for _ in range(count):
        started = time.perf_counter()
        await one(http, service["endpoint_url"], headers)
        took.append(time.perf_counter() - started)
        # No traffic: asleep again once the figures show it (three buckets: scaling.decide), its cool-down being 0.
        await until(lambda: _live(renter, sid, 0), timeout=60, what="the service asleep")
    await renter.call("DELETE", f"/services/{sid}")
    return took


def agent_in_child(folder: str, index: int, relay_url: str, dns: tuple[str, int] | None, intervals: tuple[float, float],
                   isolation: HostIsolation, ready: Connection) -> None:
    """Run in a process of its own (``--layout processes``): the ``index``-th demo host's agent on the agent's event
    loop, until SIGTERM; sends its host id on ``ready`` once connected and speed-tested (a listing needs one)."""

    async def run() -> None:
        agent = demo_agent(Path(folder), index, relay_url, heartbeat_interval=intervals[0], telemetry_interval=intervals[1],
                           network_interval=3600.0, dns=dns, isolation=isolation, container=ContainerOptions())  # fmt: skip
        stop = asyncio.Event()
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
        task = asyncio.create_task(agent.run(), name=f"bench-agent-{index}")
        try:
            await agent.connected.wait()
            await agent.measure_network()
            ready.send(agent.host_id)
            await stop.wait()
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            await agent.close()  # its replicas stopped

    eventloop.run(run())


class AgentProcesses:
    """The demo hosts' agents in processes of their own (``--layout processes``), enrolled and listed from here, on
    the relay at ``relay_url`` (no geo DNS: the embedded marketplace's own relay would answer it too)."""

    def __init__(self) -> None:
        self.processes: list[multiprocessing.process.BaseProcess] = []

    async def start(self, market: Marketplace, data_dir: Path, count: int, relay_url: str) -> None:
        master, context = market.master, multiprocessing.get_context("spawn")
        async with master.db.session() as session:
            provider = await session.scalar(select(Account.id).where(Account.name == "demo-provider"))
        assert provider is not None
        base = market.api_url.removesuffix("/api/v1")
        intervals = (master.settings.heartbeat_interval, master.settings.telemetry_interval)
        for i in range(count):
            folder = data_dir / "agents" / f"agent-{i:02d}"
            host_id = await enroll_demo_host(master, folder, i, base, relay_url, provider)
            ours, theirs = context.Pipe(duplex=False)
            process = context.Process(target=agent_in_child, name=f"bench-agent-{i}", args=(
                str(folder), i, relay_url, None, intervals, market.isolation, theirs))  # fmt: skip
            process.start()
            self.processes.append(process)
            if not await asyncio.to_thread(ours.poll, 120):
                raise SystemExit(f"bench_services: agent {i} did not connect within 120 s")
            assert ours.recv() == host_id
            await list_demo_host(master, host_id, provider=provider, index=i)

    def cpu_seconds(self) -> float:
        return sum(process_cpu_seconds(p.pid) for p in self.processes if p.pid is not None)

    async def stop(self) -> None:
        for process in self.processes:
            if process.is_alive() and process.pid is not None:
                os.kill(process.pid, signal.SIGTERM)
        for process in self.processes:
            await asyncio.to_thread(process.join, 60)
            if process.is_alive():
                process.kill()


async def main(args: argparse.Namespace) -> None:
    timers = TIMERS[args.timers]
    os.environ.update(SETTINGS, GPUMARKET_AUTOSCALE_INTERVAL=str(timers["autoscale"]), GPUMARKET_QUEUE_INTERVAL=str(timers["queue"]))
    image = await asyncio.to_thread(dockerengine.openai_image)
    print(describe_machine())
    with tempfile.TemporaryDirectory(prefix="bench-services-") as folder:
        separate, data_dir, prefix = args.layout == "processes", Path(folder) / "data", run_prefix("bench-services")
        shared: dict[str, Any] = {}
        if separate:  # the master and the relay talk over Redis, as in production
            print(f"layout processes: the relay and 3 agents in child processes, the Redis bus and registry under {prefix}")
            shared = {"bus": await open_bus(REDIS_URL, prefix=prefix), "registry": await open_registry(REDIS_URL, prefix=prefix)}
        market = await start_marketplace(data_dir, agents=0 if separate else 3, http_port=0, relay_port=0, heartbeat_interval=timers["heartbeat"],
                                         telemetry_interval=timers["telemetry"], missed_heartbeats_offline=30, **shared)  # fmt: skip
        agents, relay = AgentProcesses(), None
        try:
            if separate:
                relay = await RelayProcess.beside(market, data_dir, prefix)
                await agents.start(market, data_dir, 3, relay.url)
            async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as http:
                await measure(http, Renter(http, market), image, args, agents, relay)
        finally:
            await agents.stop()
            if relay is not None:
                await relay.close()
            await market.stop()
            if separate:
                await forget_prefix(prefix)
            unmount_under(Path(folder))  # the stopped replicas' disks, kept until forgotten


async def measure(http: aiohttp.ClientSession, renter: Renter, image: str, args: argparse.Namespace, agents: AgentProcesses,
                  relay: RelayProcess | None) -> None:  # fmt: skip
    await renter.offered()
    service = await renter.service(image, "echo", low=1, high=1)
    view = await renter.ready(service["id"], 1)
    # The ready one: on a loaded machine a replica whose health check ran late may have been replaced (still stopping).
    [replica] = [r for r in view["replica_rentals"] if r["ready"]]
    endpoint, token = service["endpoint_url"], {"Authorization": f"Bearer {service['token']}"}
    direct = await container_url(replica["rental_id"])
    loop = asyncio.get_running_loop()
    # The renter is a process of its own (as it is a machine of its own): its client work does not share the loop that
    # runs the gateway, the relay and the agents.
    with ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn")) as renter_process:
        blocks = 4
        rates: dict[str, list[float]] = {"endpoint": [], "direct": []}
        cpu: dict[str, list[float]] = {"endpoint": [], "direct": []}  # this process's CPU (all its threads) per request
        agents_cpu: dict[str, list[float]] = {"endpoint": [], "direct": []}  # the agents' processes' (--layout processes)
        relay_cpu: dict[str, list[float]] = {"endpoint": [], "direct": []}  # the relay's process's (--layout processes)

        def relay_seconds() -> float:
            return process_cpu_seconds(relay.pid) if relay is not None else 0.0

        for _ in range(blocks):
            for name, url, headers in (("direct", direct, {}), ("endpoint", endpoint, token)):
                began, agents_began, relay_began = time.process_time(), agents.cpu_seconds(), relay_seconds()
                rates[name].append(await loop.run_in_executor(renter_process, throughput_in_child, url, headers,
                                                              args.requests // blocks, args.concurrency))  # fmt: skip
                cpu[name].append((time.process_time() - began) / (args.requests // blocks) * 1e6)
                agents_cpu[name].append((agents.cpu_seconds() - agents_began) / (args.requests // blocks) * 1e6)
                relay_cpu[name].append((relay_seconds() - relay_began) / (args.requests // blocks) * 1e6)
        trips: dict[str, list[float]] = {"endpoint": [], "direct": []}
        for _ in range(10):
            for name, url, headers in (("direct", direct, {}), ("endpoint", endpoint, token)):
                trips[name] += await loop.run_in_executor(renter_process, round_trips_in_child, url, headers, args.round_trips // 10)
    via, plain = sorted(rates["endpoint"])[blocks // 2], sorted(rates["direct"])[blocks // 2]
    print(f"requests/s, {args.concurrency} at once: endpoint {via:,.0f}, direct {plain:,.0f} ({via / plain:.2f}×, goal ≥ {RPS_GOAL}×)")
    record("services", f"chat completions per second through the endpoint ({args.concurrency} at once)", round(via, 1), "req/s",
           "the same replica directly", round(plain, 1), note=f"goal ≥ {RPS_GOAL}× direct; median of {blocks} blocks")
    # The marketplace's process (gateway, relay, agents, master) per request; beside the direct blocks' figure, which is
    # what the agents spend following and shipping the replica's log lines (the request itself skips this process).
    cpu_via, cpu_direct = quantile(cpu["endpoint"], 0.5), quantile(cpu["direct"], 0.5)
    what = "the master's process (API, gateway, loops)" if relay is not None else "the marketplace process"
    print(f"{what}'s CPU per request: endpoint {cpu_via:,.0f} µs, direct {cpu_direct:,.0f} µs "
          f"(its logs and background loops only), blocks {' '.join(f'{v:,.0f}' for v in cpu['endpoint'])}")
    if relay is not None:
        relay_via, relay_direct = quantile(relay_cpu["endpoint"], 0.5), quantile(relay_cpu["direct"], 0.5)
        print(f"the relay's process's CPU per request: endpoint {relay_via:,.0f} µs, direct {relay_direct:,.0f} µs")
        record("services", "the relay's process's CPU per endpoint request", round(relay_via, 1), "µs",
               "its CPU per direct request (heartbeats, telemetry, log chunks)", round(relay_direct, 1),
               note=f"--layout processes; median of {blocks} blocks")
    if agents.processes:
        agents_via, agents_direct = quantile(agents_cpu["endpoint"], 0.5), quantile(agents_cpu["direct"], 0.5)
        print(f"the agents' processes' CPU per request: endpoint {agents_via:,.0f} µs, direct {agents_direct:,.0f} µs")
        record("services", "the agents' processes' CPU per endpoint request", round(agents_via, 1), "µs",
               "their CPU per direct request (the replica's logs, heartbeats)", round(agents_direct, 1),
               note=f"--layout processes; median of {blocks} blocks")
    record("services", "the master's process's CPU per endpoint request (API, gateway, background loops)" if relay is not None
           else "the marketplace process's CPU per endpoint request (gateway, relay, agents, master in one)",
           round(cpu_via, 1), "µs", "the same process's CPU per direct request (the replica's logs, background loops)",
           round(cpu_direct, 1), note=f"median of {blocks} blocks; all the process's threads; layout {args.layout}")
    p50, p50_direct = quantile(trips["endpoint"], 0.5), quantile(trips["direct"], 0.5)
    p99, p99_direct = quantile(trips["endpoint"], 0.99), quantile(trips["direct"], 0.99)
    print(f"round trip p50 {p50:.2f} ms (direct {p50_direct:.2f} ms: +{p50 - p50_direct:.2f} ms, goal < {ADDED_GOAL_MS} ms), "
          f"p99 {p99:.2f} ms (direct {p99_direct:.2f} ms)")
    record("services", "round trip through the endpoint, p50", round(p50, 3), "ms", "the same replica directly", round(p50_direct, 3),
           note=f"added {p50 - p50_direct:.2f} ms; goal under {ADDED_GOAL_MS} ms added")
    record("services", "round trip through the endpoint, p99", round(p99, 3), "ms", "the same replica directly", round(p99_direct, 3))
    await renter.call("DELETE", f"/services/{service['id']}")
    await until(lambda: _live(renter, service["id"], 0), timeout=60, what="the benchmark's replica stopped")

    if args.scale_ups == 0:
        return
    ready = await scale_ups(renter, image, args.scale_ups)
    engine = [await engine_start_to_health(image) for _ in range(args.scale_ups)]
    print(f"scale-up decision to a ready replica: p50 {quantile(ready, 0.5):.2f} s, max {max(ready):.2f} s "
          f"(the image by the Engine API to /health: p50 {quantile(engine, 0.5):.2f} s; goal p50 < {READY_GOAL_S:g} s)")
    record("services", f"scale-up decision to a ready replica, p50 of {len(ready)}", round(quantile(ready, 0.5), 3), "s",
           "the image started by the Engine API until /health answers", round(quantile(engine, 0.5), 3),
           note=f"goal p50 under {READY_GOAL_S:g} s; ready is seen by the autoscaler's next probe (every {TIMERS[args.timers]['autoscale']:g} s here)")
    cold = await cold_starts(http, renter, image, max(1, args.scale_ups // 2))
    print(f"cold start (first request to a service at zero replicas, answered): p50 {quantile(cold, 0.5):.2f} s")
    record("services", f"cold start: first request at zero replicas to its answer, p50 of {len(cold)}", round(quantile(cold, 0.5), 3), "s",
           "a request to a ready replica", round(quantile(trips["endpoint"], 0.5) / 1e3, 4))


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--requests", type=int, default=4000, help="requests per throughput run, each way (default 4000)")
    parser.add_argument("--concurrency", type=int, default=16, help="requests at once (default 16)")
    parser.add_argument("--round-trips", type=int, default=1000, help="sequential requests, each way (default 1000)")
    parser.add_argument("--scale-ups", type=int, default=5, help="scale-ups from zero to time (default 5; 0: none, and no cold start)")
    parser.add_argument("--layout", choices=("one-process", "processes"), default="processes",
                        help="processes (default): the relay and each agent in a process of its own, as in production; one-process: all in this one")
    parser.add_argument("--timers", choices=tuple(TIMERS), default="production",
                        help="the master's and agents' intervals: production's defaults, or the short ones (default production)")
    parser.add_argument("--quick", action="store_true", help="small sizes: 800 requests, 200 round trips, 2 scale-ups")
    args = parser.parse_args(argv)
    if args.quick:
        args.requests, args.round_trips, args.scale_ups = 800, 200, 2
    return args


if __name__ == "__main__":
    asyncio.run(main(parse()))
