"""An elastic service on `gpumarket up`, for real: the sample OpenAI-compatible image, grown 1 → 3 by a load
generator and back to 1 after it, a replica's agent killed mid-request with no idempotent request lost,
token streaming through the endpoint with the `openai` package, and another renter kept out.

Everything is the real thing: the embedded marketplace (``gpumarket.up.start_marketplace``: master, relay,
three simulated-GPU agents), the container engine running ``gpumarket-test/openai-cpu`` (``tests/dockerengine.py``),
the gateway (``/svc/<id>/``, through the relay and the agents' links), and the autoscaler's loop with its lease.
The service asks for ``vram<=24``: the demo's RTX 4090 host (two GPUs) and RTX 3060 host (one) — so three
replicas are on two hosts, and killing the 3060 host's agent (its task cancelled: its link drops as a
killed process's would) leaves two replicas serving.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiodocker
import aiohttp
import pytest

from examples.openai_client import chat
from gpumarket.up import Marketplace, start_marketplace
from tests.factories import MS, create_principal
from tests.helpers import eventually

pytestmark = pytest.mark.slow

TICK = 100 * MS
SETTINGS = {
    "GPUMARKET_RATE_LIMITS_ENABLED": "false", "GPUMARKET_AUTOSCALE_INTERVAL": "1", "GPUMARKET_SERVICE_STATS_BUCKET_S": "1",
    "GPUMARKET_QUEUE_INTERVAL": "1",
}  # fmt: skip
SCALING = {"metric": "inflight", "target": 2, "scale_up_cooldown_s": 2, "scale_down_cooldown_s": 12}
DELAY_MS = 300  # each request's time in the replica: 8 workers keep about 8 in flight, 4 replicas' worth at target 2
SLOW_DELAY_MS = 4000  # the requests in flight when an agent dies


@pytest.fixture
async def market(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, openai_image: str) -> AsyncIterator[Marketplace]:
    for name, value in SETTINGS.items():
        monkeypatch.setenv(name, value)
    m = await start_marketplace(tmp_path / "data", agents=3, http_port=0, relay_port=0, heartbeat_interval=TICK,
                                telemetry_interval=TICK, missed_heartbeats_offline=20)  # fmt: skip
    rentals: set[str] = set()
    try:
        yield m
    finally:
        async with m.master.db.session() as session:
            from sqlalchemy import select

            from master.models import Rental

            rentals = set((await session.scalars(select(Rental.id).where(Rental.service_id.is_not(None)))).all())
        await m.stop()
        await _remove_containers(rentals)


async def _remove_containers(rental_ids: set[str]) -> None:
    async with aiodocker.Docker() as docker:
        for rental_id in rental_ids:
            for container in await docker.containers.list(all=True, filters={"label": [f"gpumarket.rental={rental_id}"]}):
                with contextlib.suppress(aiodocker.DockerError):
                    await container.delete(force=True)


class Client:
    def __init__(self, http: aiohttp.ClientSession, market: Marketplace, key: str) -> None:
        self.http, self.api, self.key = http, market.api_url, key

    async def call(self, method: str, path: str, body: Any = None) -> tuple[int, Any]:
        async with self.http.request(method, self.api + path, json=body, headers={"Authorization": f"Bearer {self.key}"}) as r:
            return r.status, await r.json()

    async def service(self, service_id: str) -> dict[str, Any]:
        status, body = await self.call("GET", f"/services/{service_id}")
        assert status == 200, body
        return dict(body)


class Load:
    """``workers`` clients each sending one idempotent chat completion after another until stopped."""

    def __init__(self, http: aiohttp.ClientSession, endpoint: str, token: str, workers: int) -> None:
        self.http, self.url, self.token, self.workers = http, endpoint + "v1/chat/completions", token, workers
        self.outcomes: Counter[str] = Counter()
        self.replicas: Counter[str] = Counter()
        self.failures: list[str] = []
        self._stop = asyncio.Event()
        self._go = asyncio.Event()  # cleared while held: the workers send nothing new
        self._go.set()
        self.in_flight = 0  # the workers' requests not yet answered
        self._tasks: list[asyncio.Task[None]] = []

    def start(self) -> None:
        self._tasks = [asyncio.create_task(self._worker(i)) for i in range(self.workers)]

    async def stop(self) -> None:
        self._stop.set()
        self._go.set()
        await asyncio.gather(*self._tasks)

    async def hold(self) -> None:
        """Until ``resume``: no new requests, and back once the workers' last ones are answered."""
        self._go.clear()

        async def answered() -> bool:
            return self.in_flight == 0

        await eventually(answered, timeout=60, what="the load's requests answered")

    def resume(self) -> None:
        self._go.set()

    async def _worker(self, number: int) -> None:
        n = 0
        while not self._stop.is_set():
            await self._go.wait()
            n += 1
            self.in_flight += 1
            try:
                await self.request(f"worker {number} request {n}", DELAY_MS)
            finally:
                self.in_flight -= 1

    async def request(self, words: str, delay_ms: int) -> None:
        """One idempotent chat completion that the replica holds ``delay_ms``; its outcome lands in the counters."""
        headers = {"Authorization": f"Bearer {self.token}", "Idempotency-Key": str(uuid.uuid4()), "X-Delay-Ms": str(delay_ms)}
        body = {"model": "gpumarket-echo", "messages": [{"role": "user", "content": words}]}
        try:
            async with self.http.post(self.url, json=body, headers=headers, timeout=aiohttp.ClientTimeout(total=60)) as response:
                answer = await response.json(content_type=None)
                if response.status != 200 or answer["choices"][0]["message"]["content"] != f"echo: {words}":
                    self.failures.append(f"{response.status} {str(answer)[:200]}")
                    return
                self.replicas[response.headers.get("X-Replica", "?")] += 1
                self.outcomes["ok"] += 1
        except (aiohttp.ClientError, TimeoutError) as exc:
            self.failures.append(repr(exc))


def _ready(view: dict[str, Any]) -> int:
    return int(view["replicas"]["ready"])


async def test_a_service_grows_under_load_survives_a_killed_agent_and_shrinks_after(market: Marketplace, openai_image: str) -> None:
    async with aiohttp.ClientSession() as http:
        renter = Client(http, market, market.credentials["renter"]["api_key"])

        async def hosts_offered() -> bool | None:  # the 4090 and 3060 hosts online and offered (a loaded CI is slow)
            status, offers = await renter.call("GET", "/offers?q=vram<=24")
            return True if status == 200 and len({o["host_id"] for o in offers["items"]}) >= 2 else None

        await eventually(hosts_offered, timeout=60, every=0.5, what="the demo's two small hosts offered")
        status, service = await renter.call("POST", "/services", {
            "name": "chat", "workload": {"kind": "container", "image": openai_image, "ports": [8000]}, "port": 8000,
            "requirements": "vram<=24", "min_replicas": 1, "max_replicas": 3, "scaling": SCALING,
        })  # fmt: skip
        assert status == 201, service
        sid, token, endpoint = service["id"], service["token"], service["endpoint_url"]

        async def one_ready() -> dict[str, Any] | None:
            view = await renter.service(sid)
            return view if _ready(view) == 1 else None

        await eventually(one_ready, timeout=90, every=0.5, what="the first replica ready")

        # Tokens stream through the endpoint to the openai client, word by word.
        pieces = await asyncio.to_thread(lambda: list(chat(endpoint, token, "stream these words", stream=True)))
        assert "".join(pieces) == "echo: stream these words" and len(pieces) >= 3
        # Another renter's key reaches nothing; no key is 401; the renter's own key works as the token does.
        _, other_key = await create_principal(market.master, "renter-2", "renter")
        for key, expected in ((other_key, 404), (None, 401), (market.credentials["renter"]["api_key"], 200)):
            headers = {"Authorization": f"Bearer {key}"} if key else {}
            async with http.get(endpoint + "v1/models", headers=headers) as response:
                assert response.status == expected, await response.text()

        # Under load: 1 → 3 replicas.
        load = Load(http, endpoint, token, workers=8)
        load.start()
        started = time.monotonic()

        latest: dict[str, Any] = {}

        async def three_ready() -> dict[str, Any] | None:
            view = await renter.service(sid)
            latest.update(view)
            return view if _ready(view) == 3 else None

        try:
            view = await eventually(three_ready, timeout=150, every=0.5, what="3 replicas ready under load")
        except AssertionError as exc:  # say why (failed once beside a CPU hog, 2026-11-29, with nothing to go on)
            raise AssertionError(f"{exc}; the service's replicas then: {latest.get('replicas')} "
                                 f"{latest.get('replica_rentals')}; the load's outcomes: {dict(load.outcomes)}") from None
        grew_in = time.monotonic() - started
        hosts = Counter(r["host_id"] for r in view["replica_rentals"] if r["ready"])
        assert sorted(hosts.values()) == [1, 2], hosts  # the 4090 host's two GPUs and the 3060 host's one

        async def every_replica_answered() -> bool:  # within the route's 1 s cache, once ready (run 8, 2026-11-29: a
            return len(load.replicas) == 3  # replica failed while starting sat out 5 s after it was ready, since fixed)

        await eventually(every_replica_answered, timeout=30, what="every replica answering the load")

        # The agent of the host with one replica dies while requests are in flight on it.
        [lone_host] = [host for host, n in hosts.items() if n == 1]
        index = next(i for i, agent in enumerate(market.agents) if agent.host_id == lone_host)
        before = load.outcomes["ok"]
        # Requests surely in flight on the dying replica: the load held and answered first, so that only slow ones are
        # in flight when the gateway counts some on it. (Slow ones beside the load left it none once in a CI run: the
        # wait saw a 300 ms request in flight on it, the slow ones not yet sent, and the kill came as it was answered.)
        await load.hold()
        slow = [asyncio.create_task(load.request(f"slow request {n}", SLOW_DELAY_MS)) for n in range(9)]
        [lone_rental] = [r["rental_id"] for r in view["replica_rentals"] if r["ready"] and r["host_id"] == lone_host]

        async def in_flight_on_the_lone_replica() -> bool:
            pool = market.master.gateway.pools.get(lone_rental) if market.master.gateway is not None else None
            return pool is not None and pool.inflight > 0

        await eventually(in_flight_on_the_lone_replica, timeout=60, what="slow requests in flight on the lone replica")
        load.resume()
        market.agent_tasks[index].cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await market.agent_tasks[index]
        await market.agents[index].close()
        await asyncio.sleep(6)
        await asyncio.gather(*slow)
        await load.stop()
        assert load.failures == [], load.failures[:5]
        assert load.outcomes["ok"] > before + 20

        # Load over: back to one replica once the down cool-down passes.
        async def back_to_one() -> dict[str, Any] | None:
            view = await renter.service(sid)
            return view if view["desired_replicas"] == 1 and view["replicas"]["live"] == 1 else None

        view = await eventually(back_to_one, timeout=90, every=0.5, what="back to 1 replica")
        kinds = [e["kind"] for e in view["events"]]
        assert "scale_up" in kinds and "scale_down" in kinds, kinds
        status, stats = await renter.call("GET", f"/services/{sid}/stats?minutes=10")
        assert stats["totals"]["requests"] >= load.outcomes["ok"] and max(p["replicas"] for p in stats["points"]) >= 3
        # Requests were in flight on the killed replica: the gateway sent them again, and the renter saw none fail.
        assert stats["totals"]["retries"] >= 1 and stats["totals"]["errors"] == 0, stats["totals"]
        print(f"grew 1 → 3 in {grew_in:.1f}s; {load.outcomes['ok']} requests, {stats['totals']['retries']} retried, none lost")
