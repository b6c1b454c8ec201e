"""Fair queues on the database: the weight route, and the queue pass serving the account holding least per weight.

Each test runs on SQLite and PostgreSQL (the ``api`` fixture). The order itself is tested pure in tests/test_fairshare.py.
"""

from __future__ import annotations

from typing import Any

import pytest

from master.models import Rental
from master.services import queue as rental_queue
from tests.apiclient import Api, assert_error
from tests.factories import create_principal


async def rent(api: Api, key: str, **body: Any) -> dict[str, Any]:
    status, rental = await api.call("POST", "/rentals", key, json={"gpu_count": 1, **body})
    assert status == 201, rental
    return dict(rental)


async def state(api: Api, rental_id: str) -> str:
    _, view = await api.as_renter("GET", f"/rentals/{rental_id}")
    return str(view["state"])


class TestWeightRoute:
    async def test_an_admin_sets_the_weight_and_the_account_shows_it(self, api: Api) -> None:
        _, admin_key = await create_principal(api.master, "admin-1", "admin")
        _, account = await api.as_renter("GET", "/account")
        assert account["fair_share_weight"] == 1  # the default: equal shares
        path = f"/accounts/{api.renter.account_id}/fair-share"
        status, body = await api.call("PUT", path, admin_key, json={"weight": 3})
        assert (status, body) == (200, {"account_id": api.renter.account_id, "fair_share_weight": 3})
        _, account = await api.as_renter("GET", "/account")
        assert account["fair_share_weight"] == 3

    async def test_renters_and_providers_are_refused(self, api: Api) -> None:
        path = f"/accounts/{api.renter.account_id}/fair-share"
        status, body = await api.as_renter("PUT", path, json={"weight": 99})
        assert_error(status, body, 403, "forbidden")
        status, body = await api.as_provider("PUT", path, json={"weight": 99})
        assert_error(status, body, 403, "forbidden")
        _, account = await api.as_renter("GET", "/account")
        assert account["fair_share_weight"] == 1

    @pytest.mark.parametrize("weight", [0, -2, 1001, 1.5, "2", True, None])
    async def test_a_weight_that_is_not_a_whole_number_from_1_to_1000_is_422(self, api: Api, weight: Any) -> None:
        _, admin_key = await create_principal(api.master, "admin-1", "admin")
        status, body = await api.call("PUT", f"/accounts/{api.renter.account_id}/fair-share", admin_key, json={"weight": weight})
        assert_error(status, body, 422, "validation_failed")
        assert body["details"]["problems"][0]["field"] == "weight", body

    async def test_a_missing_weight_is_422_and_bad_json_400(self, api: Api) -> None:
        _, admin_key = await create_principal(api.master, "admin-1", "admin")
        path = f"/accounts/{api.renter.account_id}/fair-share"
        status, body = await api.call("PUT", path, admin_key, json={})
        assert_error(status, body, 422, "validation_failed")
        status, body = await api.call("PUT", path, admin_key, data=b"{weight: 2", headers={"Content-Type": "application/json"})
        assert_error(status, body, 400, "invalid_json")

    async def test_an_unknown_account_is_404(self, api: Api) -> None:
        _, admin_key = await create_principal(api.master, "admin-1", "admin")
        status, body = await api.call("PUT", "/accounts/acct-nope/fair-share", admin_key, json={"weight": 2})
        assert_error(status, body, 404, "account_not_found")


class TestQueuePass:
    async def _two_accounts_queued(self, api: Api) -> tuple[str, dict[str, Any], dict[str, Any]]:
        """A full 3-GPU host: the renter holds 2 GPUs, another renter 1. The renter queues one GPU, then the other
        renter does; returns the other renter's id and the two queued rentals (the renter's is older)."""
        await api.host(3)
        other, other_key = await create_principal(api.master, "renter-2", "renter")
        await rent(api, api.renter_key, gpu_count=2)
        await rent(api, other_key)
        older = await rent(api, api.renter_key, queue=True, queue_timeout_s=600)
        newer = await rent(api, other_key, queue=True, queue_timeout_s=600)
        assert older["queued"] and newer["queued"]
        assert await rental_queue.process_queue(api.master) == 0  # full
        return other.account_id, older, newer

    async def test_the_account_holding_fewer_gpus_is_placed_first(self, api: Api) -> None:
        """Equal weights: one GPU frees up (a new host), and the other renter's newer rental takes it — it holds 1 GPU
        against the renter's 2; FIFO would have given it to the renter's older one."""
        other_id, older, newer = await self._two_accounts_queued(api)
        await api.host(1)
        assert await rental_queue.process_queue(api.master) == 1
        async with api.master.db.session() as session:
            placed = await session.get(Rental, newer["id"])
            waiting = await session.get(Rental, older["id"])
            assert placed is not None and waiting is not None
            assert (placed.state, placed.host_id is not None, placed.renter_id) == ("starting", True, other_id)
            assert (waiting.state, waiting.host_id) == ("pending", None)

    async def test_a_weight_makes_the_larger_holder_go_first(self, api: Api) -> None:
        """The renter at weight 4 holds 2 GPUs (0.5 per weight) against the other's 1 (1 per weight): its rental goes first."""
        _, admin_key = await create_principal(api.master, "admin-1", "admin")
        status, body = await api.call("PUT", f"/accounts/{api.renter.account_id}/fair-share", admin_key, json={"weight": 4})
        assert status == 200, body
        _, older, newer = await self._two_accounts_queued(api)
        await api.host(1)
        assert await rental_queue.process_queue(api.master) == 1
        assert await state(api, older["id"]) == "starting"
        async with api.master.db.session() as session:
            waiting = await session.get(Rental, newer["id"])
            assert waiting is not None and (waiting.state, waiting.host_id) == ("pending", None)
