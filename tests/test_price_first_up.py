"""The renter's price first, tried as a new user would (issue 43, point 3): ``gpumarket up``'s own demo fleet — its
first three hosts, each listed at its tier's default price: 2 × RTX 4090 at $0.40, an RTX 3060 at $0.15, the A100
host at $0.90 — and a service of three replicas naming no model. Before, FGD put them on the A100 host."""

from __future__ import annotations

from collections.abc import AsyncIterator
from decimal import Decimal
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from gpumarket.up import Marketplace, start_marketplace
from tests.helpers import eventually
from tests.test_e2e_up import MISSED, NO_RATE_LIMITS, TICK, Api


@pytest.fixture
async def market(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[Marketplace]:
    for name, value in NO_RATE_LIMITS.items():
        monkeypatch.setenv(name, value)
    m = await start_marketplace(tmp_path / "data", agents=3, http_port=0, relay_port=0, heartbeat_interval=TICK,
                                telemetry_interval=TICK, missed_heartbeats_offline=MISSED)  # fmt: skip
    try:
        yield m
    finally:
        await m.stop()


async def _offers(renter: Api) -> bool:
    """Each host's model and price per GPU-hour once the demo's three hosts are listed, online and take containers."""
    hosts = (await renter.get("/hosts"))["items"]
    if len(hosts) < 3 or any(h["state"] != "online" or "container" not in ((h.get("isolation") or {}).get("kinds") or ()) for h in hosts):
        return False
    names = " ".join(o["gpu_name"] for o in (await renter.get("/offers"))["items"])
    return all(model in names for model in ("A100", "3060", "4090"))


async def test_a_services_replicas_go_to_the_cheap_gpus_of_the_demo_fleet(market: Marketplace, docker_image: str) -> None:
    async with aiohttp.ClientSession() as http:
        renter = Api(http, market.api_url, market.credentials["renter"]["api_key"])
        await eventually(lambda: _offers(renter), timeout=60, what="the demo's three hosts listed and online")
        offers = (await renter.get("/offers"))["items"]
        price_of = {o["host_id"]: Decimal(o["price_per_gpu_hour"]) for o in offers}
        assert sorted(set(price_of.values())) == [Decimal("0.15"), Decimal("0.40"), Decimal("0.90")], offers
        workload: dict[str, Any] = {"kind": "container", "image": docker_image, "command": ["sh", "-c", "sleep 600"], "ports": [8000]}
        status, service = await renter.call("POST", "/services", json={"name": "chat", "workload": workload, "port": 8000,
                                                                       "min_replicas": 3, "max_replicas": 3})  # fmt: skip
        assert status == 201, service
        paid = []
        for replica in service["replica_rentals"]:
            rental = await renter.get(f"/rentals/{replica['rental_id']}")
            paid.append(Decimal(rental["price_per_gpu_hour"]))
        assert sorted(paid) == [Decimal("0.15"), Decimal("0.40"), Decimal("0.40")]  # not the $0.90 A100s
        await renter.call("DELETE", f"/services/{service['id']}")
