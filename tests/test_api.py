"""The ``/api/v1`` REST API, driven through the real aiohttp app on loopback.

Each test runs on SQLite and on a fresh PostgreSQL database (the ``master`` fixture).
There is no relay here: the agent's side is simulated by feeding hello and command
results to ``master.telemetry.hosts`` exactly as the ingestor would.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from sqlalchemy import func, select

from master.api.base import API
from master.api.table import ROUTES
from master.models import Command, Gpu, Rental
from tests.apiclient import A100, RTX, Api, assert_error
from tests.factories import create_principal, gpu_info, online_host


class TestAuth:
    async def test_missing_authorization_header_is_401_missing_api_key(self, api: Api) -> None:
        """A call without an Authorization header is refused with 401 ``missing_api_key`` as JSON."""
        status, body = await api.call("GET", "/account", None)
        assert_error(status, body, 401, "missing_api_key")

    async def test_wrong_scheme_is_401(self, api: Api) -> None:
        """A key sent with another scheme than Bearer is refused with 401."""
        status, body = await api.call("GET", "/account", None, headers={"Authorization": f"Basic {api.renter_key}"})
        assert_error(status, body, 401, "missing_api_key")

    async def test_unknown_key_is_401_invalid_api_key(self, api: Api) -> None:
        """A well-formed but unknown API key is refused with 401 ``invalid_api_key``."""
        status, body = await api.call("GET", "/account", "gmk_not-a-real-key")
        assert_error(status, body, 401, "invalid_api_key")

    async def test_valid_key_identifies_the_account(self, api: Api) -> None:
        """A valid key signs the caller in as its account."""
        status, body = await api.as_renter("GET", "/account")
        assert status == 200
        assert body["id"] == api.renter.account_id
        assert body["role"] == "renter"

    async def test_public_endpoints_need_no_key(self, api: Api) -> None:
        """Health and the OpenAPI document answer without an API key."""
        status, body = await api.call("GET", "/health", None)
        assert status == 200, body
        assert body["checks"]["database"] == "ok"
        status, body = await api.call("GET", "/openapi.json", None)
        assert status == 200
        assert body["openapi"].startswith("3.")

    async def test_renter_cannot_create_enrollment_tokens(self, api: Api) -> None:
        """Only providers may create enrollment tokens; a renter gets 403 ``forbidden``."""
        status, body = await api.as_renter("POST", "/enrollment-tokens")
        assert_error(status, body, 403, "forbidden")
        status, body = await api.as_provider("POST", "/enrollment-tokens")
        assert status == 201, body
        base, token = str(api.client.make_url("")).rstrip("/"), body["token"]
        # The installer one-liner (deploy/install-agent.sh, served by this master), and the bare enroll command.
        assert body["enroll_command"] == f"curl -fsSL {base}/downloads/install-agent.sh | sh -s -- --master {base} --token {token}"
        assert body["enroll_command_manual"] == f"gpumarket agent enroll --master {base} --token {token}"

    async def test_provider_cannot_rent(self, api: Api) -> None:
        """Only renters may create rentals; a provider gets 403 ``forbidden``."""
        await api.host(1)
        status, body = await api.as_provider("POST", "/rentals", json={"gpu_count": 1})
        assert_error(status, body, 403, "forbidden")
        assert await api.count(Rental) == 0

    async def test_renter_cannot_see_another_renters_rental(self, api: Api) -> None:
        """Another renter's rental is invisible: 404 ``rental_not_found`` on read, stop and in the listing."""
        await api.host(1)
        status, rental = await api.as_renter("POST", "/rentals", json={"gpu_count": 1})
        assert status == 201, rental
        _, other_key = await create_principal(api.master, "renter-2", "renter")
        status, body = await api.call("GET", f"/rentals/{rental['id']}", other_key)
        assert_error(status, body, 404, "rental_not_found")
        status, body = await api.call("DELETE", f"/rentals/{rental['id']}", other_key)
        assert_error(status, body, 404, "rental_not_found")
        status, body = await api.call("GET", "/rentals", other_key)
        assert (status, body["items"], body["total"]) == (200, [], 0)
        assert await api.commands(rental["id"], "stop_workload") == []

    async def test_provider_lists_only_its_own_hosts(self, api: Api) -> None:
        """A provider's GET /hosts and GET /hosts/{id} show its own hosts only; a renter sees them all."""
        mine, _ = await api.host(1)
        other, other_key = await create_principal(api.master, "provider-2", "provider")
        theirs = await online_host(api.master, other, [gpu_info(0)])
        status, body = await api.as_provider("GET", "/hosts")
        assert status == 200
        assert [h["id"] for h in body["items"]] == [mine]
        assert body["total"] == 1
        status, body = await api.call("GET", "/hosts", other_key)
        assert [h["id"] for h in body["items"]] == [theirs]
        status, body = await api.as_provider("GET", f"/hosts/{theirs}")
        assert_error(status, body, 404, "host_not_found")
        status, body = await api.as_renter("GET", "/hosts")
        assert {h["id"] for h in body["items"]} == {mine, theirs}


class TestErrors:
    async def test_invalid_json_body_is_400_invalid_json(self, api: Api) -> None:
        """A body that is not JSON is refused with 400 ``invalid_json``."""
        status, body = await api.as_renter(
            "POST", "/rentals", data=b"{not json", headers={"Content-Type": "application/json"}
        )
        assert_error(status, body, 400, "invalid_json")

    @pytest.mark.parametrize(
        ("payload", "field"),
        [
            ({"gpu_count": 0}, "gpu_count"),
            ({"gpu_count": 1, "colour": "blue"}, "colour"),
            ({"gpu_count": 1, "workload": {"kind": "bogus"}}, "workload"),
            ({"gpu_count": "many"}, "gpu_count"),
            ([1, 2], ""),
            ({"gpu_count": 1, "failover_after_s": 9}, "failover_after_s"),
            ({"gpu_count": 1, "failover_after_s": 86401}, "failover_after_s"),
            ({"gpu_count": 1, "failover_after_s": "30"}, "failover_after_s"),
            ({"gpu_count": 1, "failover_after_s": 30.5}, "failover_after_s"),
            ({"gpu_count": 1, "failover_after_s": True}, "failover_after_s"),
        ],
        ids=["gpu_count_zero", "unknown_field", "bogus_workload_kind", "gpu_count_not_int", "not_an_object",
             "failover_under_10_s", "failover_over_a_day", "failover_a_string", "failover_not_whole", "failover_a_bool"],
    )
    async def test_invalid_body_is_422_with_problems(self, api: Api, payload: Any, field: str) -> None:
        """A body that fails validation is refused with 422 ``validation_failed`` listing each problem."""
        status, body = await api.as_renter("POST", "/rentals", json=payload)
        assert_error(status, body, 422, "validation_failed")
        problems = body["details"]["problems"]
        assert problems and all(set(p) == {"field", "problem"} for p in problems)
        assert any(p["field"].startswith(field) for p in problems), problems
        assert await api.count(Rental) == 0

    async def test_unknown_endpoint_is_404_json(self, api: Api) -> None:
        """An unknown path is a JSON 404 pointing at the OpenAPI document."""
        status, body = await api.as_renter("GET", "/no-such-thing")
        assert_error(status, body, 404, "not_found")
        assert "openapi.json" in body["message"]

    async def test_wrong_method_is_405_json(self, api: Api) -> None:
        """A known path with a method it does not take is a JSON 405."""
        status, body = await api.as_renter("PUT", "/rentals")
        assert_error(status, body, 405, "method_not_allowed")

    @pytest.mark.parametrize("query", ["limit=abc", "limit=0", "limit=501", "offset=-1"])
    @pytest.mark.parametrize("path", ["/hosts", "/offers", "/rentals"])
    async def test_bad_paging_query_is_400_invalid_query(self, api: Api, path: str, query: str) -> None:
        """A paging parameter that is not an integer in range is refused with 400 ``invalid_query``."""
        status, body = await api.as_renter("GET", f"{path}?{query}")
        assert_error(status, body, 400, "invalid_query")

    async def test_bad_offer_filters_are_400_invalid_query(self, api: Api) -> None:
        """Offer filters out of range or too long are refused with 400 ``invalid_query``."""
        for query in ("num_gpus=0", "num_gpus=x", "gpu_model=" + "x" * 129):
            status, body = await api.as_renter("GET", f"/offers?{query}")
            assert_error(status, body, 400, "invalid_query")

    async def test_unknown_ids_are_404(self, api: Api) -> None:
        """Unknown rental and host ids are 404 with their own codes, also for DELETE."""
        status, body = await api.as_renter("GET", "/rentals/r_nope")
        assert_error(status, body, 404, "rental_not_found")
        status, body = await api.as_renter("DELETE", "/rentals/r_nope")
        assert_error(status, body, 404, "rental_not_found")
        status, body = await api.as_renter("GET", "/hosts/h_nope")
        assert_error(status, body, 404, "host_not_found")


class TestHostsAndOffers:
    async def test_online_host_is_listed_with_its_gpus(self, api: Api) -> None:
        """A host that said hello is listed online with each of its GPUs, free."""
        host_id, uuids = await api.host(3)
        status, body = await api.as_renter("GET", "/hosts")
        assert status == 200
        [host] = body["items"]
        assert host["id"] == host_id
        assert host["state"] == "online"
        assert host["gpu_count"] == 3
        assert [g["uuid"] for g in host["gpus"]] == uuids
        assert [g["index"] for g in host["gpus"]] == [0, 1, 2]
        assert all(g["name"] == RTX and not g["rented"] for g in host["gpus"])

    async def test_host_detail_has_recent_events(self, api: Api) -> None:
        """GET /hosts/{id} adds facts and the host's recent state changes, newest first."""
        host_id, _ = await api.host(2)
        status, body = await api.as_provider("GET", f"/hosts/{host_id}")
        assert status == 200, body
        assert body["id"] == host_id
        assert body["state"] == "online"
        assert body["gpu_count"] == 2
        assert body["facts"] == {"hostname": "test"}
        assert body["recent_events"][0]["from"] == "enrolling"
        assert body["recent_events"][0]["to"] == "online"
        assert body["recent_events"][-1]["from"] is None

    async def test_offers_group_free_gpus_per_host_and_model(self, api: Api) -> None:
        """Each rentable host offers its free GPUs grouped by model."""
        gpus = [gpu_info(0), gpu_info(1), gpu_info(2, name=A100, memory=81920)]
        host_id = await online_host(api.master, api.provider, gpus)
        status, body = await api.as_renter("GET", "/offers")
        assert status == 200
        assert body["total"] == 2
        offers = {o["gpu_name"]: o for o in body["items"]}
        assert offers[RTX]["num_gpus"] == 2
        assert offers[RTX]["host_id"] == host_id
        assert offers[RTX]["vram_mib"] == 24564
        assert offers[A100]["num_gpus"] == 1
        assert offers[A100]["vram_mib"] == 81920

    @pytest.mark.parametrize(
        ("gpu_model", "expected"),
        [
            ("RTX 4090", {RTX}),
            ("rtx4090", {RTX}),
            ("A100", {A100}),
            ("A100 80GB", {A100}),
            ("A10", set()),
            ("H100", set()),
        ],
    )
    async def test_offers_filter_by_model_words(self, api: Api, gpu_model: str, expected: set[str]) -> None:
        """``gpu_model`` matches whole words of the NVML name: "RTX 4090" finds the 4090, "A10" is not an A100."""
        await online_host(api.master, api.provider, [gpu_info(0), gpu_info(1, name=A100)])
        status, body = await api.as_renter("GET", "/offers", params={"gpu_model": gpu_model})
        assert status == 200
        assert {o["gpu_name"] for o in body["items"]} == expected
        assert body["total"] == len(expected)

    async def test_offers_filter_by_num_gpus(self, api: Api) -> None:
        """``num_gpus`` keeps only offers with at least that many free GPUs on one host."""
        big, _ = await api.host(4)
        await api.host(1)
        status, body = await api.as_renter("GET", "/offers", params={"num_gpus": "2"})
        assert status == 200
        assert [(o["host_id"], o["num_gpus"]) for o in body["items"]] == [(big, 4)]
        assert body["total"] == 1
        status, body = await api.as_renter("GET", "/offers", params={"num_gpus": "5"})
        assert (body["items"], body["total"]) == ([], 0)

    async def test_offers_paginate(self, api: Api) -> None:
        """``limit`` and ``offset`` page through the offers while ``total`` counts them all."""
        host_ids = sorted([(await api.host(1))[0] for _ in range(3)])
        seen: list[str] = []
        for offset in (0, 2, 4):
            status, body = await api.as_renter("GET", "/offers", params={"limit": "2", "offset": str(offset)})
            assert status == 200
            assert (body["total"], body["limit"], body["offset"]) == (3, 2, offset)
            seen += [o["host_id"] for o in body["items"]]
        assert seen == host_ids


    async def test_offers_show_tier_and_score_best_first_and_filter_by_tier(self, api: Api) -> None:
        """Each GPU is classified at its hello; offers carry tier, score and reliability, best score first."""
        h100 = await online_host(api.master, api.provider, [gpu_info(0, name="NVIDIA H100 80GB HBM3", memory=81559)])
        rtx, _ = await api.host(1)
        mystery = await online_host(api.master, api.provider, [gpu_info(0, name="NVIDIA Quantum GPU 9000", memory=16384)])
        status, body = await api.as_renter("GET", "/offers")
        assert status == 200
        assert [o["host_id"] for o in body["items"]] == [h100, rtx, mystery]
        by_host = {o["host_id"]: o for o in body["items"]}
        assert (by_host[h100]["tier"], by_host[rtx]["tier"], by_host[mystery]["tier"]) == ("flagship", "prosumer", "consumer")
        assert by_host[h100]["performance_score"] > by_host[rtx]["performance_score"] > 0
        assert by_host[mystery]["needs_review"] is True and by_host[rtx]["needs_review"] is False
        assert all("reliability" in o for o in body["items"])
        status, body = await api.as_renter("GET", "/offers", params={"tier": "prosumer"})
        assert [o["host_id"] for o in body["items"]] == [rtx]
        status, body = await api.as_renter("GET", "/offers", params={"tier": "legendary"})
        assert_error(status, body, 400, "invalid_query")
        assert "flagship" in body["message"]
        status, detail = await api.as_provider("GET", f"/hosts/{rtx}")
        assert detail["gpus"][0]["classification"]["tier"] == "prosumer"
        assert detail["gpus"][0]["classification"]["reasons"]
        assert set(detail["reliability"]) == {"score", "computed_at", "inputs", "seeded", "failed_rentals"}
        assert detail["reliability"]["seeded"] is False  # measured here, not the demo's seeded history

    async def test_a_provider_asks_its_host_for_a_health_check(self, api: Api) -> None:
        """POST /hosts/{id}/health-check queues one health_check command; others' hosts are 404, renters 403."""
        host_id, uuids = await api.host(2)
        status, body = await api.as_provider("POST", f"/hosts/{host_id}/health-check")
        assert status == 202, body
        async with api.master.db.session() as session:
            command = await session.get(Command, body["command_id"])
        assert command is not None and command.kind == "health_check" and sorted(command.args["gpu_uuids"]) == sorted(uuids)
        status, again = await api.as_provider("POST", f"/hosts/{host_id}/health-check")
        assert status == 202 and again["command_id"] == body["command_id"]  # one open check at a time
        status, body = await api.as_renter("POST", f"/hosts/{host_id}/health-check")
        assert status == 403
        _, other_key = await create_principal(api.master, "provider-2", "provider")
        status, body = await api.call("POST", f"/hosts/{host_id}/health-check", other_key)
        assert_error(status, body, 404, "host_not_found")


class TestRentals:
    async def test_rental_lifecycle_start_run_stop(self, api: Api) -> None:
        """A rental starts, runs once the agent confirms, stops on DELETE and frees its GPUs when the agent confirms."""
        host_id, uuids = await api.host(2)
        status, rental = await api.as_renter("POST", "/rentals", json={"gpu_count": 2, "workload": {"kind": "hold"}})
        assert status == 201, rental
        assert rental["state"] == "starting"
        assert rental["host_id"] == host_id
        assert sorted(rental["gpu_uuids"]) == sorted(uuids)
        assert rental["gpu_model"] == RTX
        [start] = await api.commands(rental["id"], "start_workload")
        assert start.host_id == host_id
        assert sorted(start.args["gpu_uuids"]) == sorted(uuids)
        assert start.args["workload"] == {"kind": "hold"}
        status, offers = await api.as_renter("GET", "/offers")
        assert offers["items"] == []

        await api.agent_reports(rental["id"], "start_workload")
        status, body = await api.as_renter("GET", f"/rentals/{rental['id']}")
        assert status == 200
        assert body["state"] == "running"
        assert body["started_at"] is not None
        assert [e["to"] for e in body["events"]] == ["pending", "starting", "running"]
        assert [e["from"] for e in body["events"]] == [None, "pending", "starting"]
        status, host = await api.as_renter("GET", f"/hosts/{host_id}")
        assert host["state"] == "rented"
        assert all(g["rented"] for g in host["gpus"])

        status, body = await api.as_renter("DELETE", f"/rentals/{rental['id']}")
        assert status == 202, body
        assert body["state"] == "stopping"
        [stop] = await api.commands(rental["id"], "stop_workload")
        assert stop.args == {"rental_id": rental["id"]}

        await api.agent_reports(rental["id"], "stop_workload")
        status, body = await api.as_renter("GET", f"/rentals/{rental['id']}")
        assert body["state"] == "stopped"
        assert body["stopped_at"] is not None
        assert [e["to"] for e in body["events"]] == ["pending", "starting", "running", "stopping", "stopped"]
        status, offers = await api.as_renter("GET", "/offers")
        assert [(o["host_id"], o["num_gpus"]) for o in offers["items"]] == [(host_id, 2)]
        status, host = await api.as_renter("GET", f"/hosts/{host_id}")
        assert host["state"] == "online"
        assert not any(g["rented"] for g in host["gpus"])

    async def test_delete_twice_sends_one_stop_command(self, api: Api) -> None:
        """Stopping a rental that is already stopping (or stopped) returns it without another stop command."""
        await api.host(1)
        _, rental = await api.as_renter("POST", "/rentals", json={"gpu_count": 1})
        first = await api.as_renter("DELETE", f"/rentals/{rental['id']}")
        second = await api.as_renter("DELETE", f"/rentals/{rental['id']}")
        assert first == second
        assert first[0] == 202 and first[1]["state"] == "stopping"
        assert len(await api.commands(rental["id"], "stop_workload")) == 1
        await api.agent_reports(rental["id"], "stop_workload")
        status, body = await api.as_renter("DELETE", f"/rentals/{rental['id']}")
        assert (status, body["state"]) == (202, "stopped")
        assert len(await api.commands(rental["id"], "stop_workload")) == 1

    async def test_repeated_results_are_applied_once(self, api: Api) -> None:
        """A start result replayed by the agent (at-least-once delivery) changes nothing the second time."""
        await api.host(1)
        _, rental = await api.as_renter("POST", "/rentals", json={"gpu_count": 1})
        await api.agent_reports(rental["id"], "start_workload")
        await api.agent_reports(rental["id"], "start_workload")
        _, body = await api.as_renter("GET", f"/rentals/{rental['id']}")
        assert [e["to"] for e in body["events"]] == ["pending", "starting", "running"]

    async def test_more_gpus_than_any_host_has_is_409_exceeds_fleet(self, api: Api) -> None:
        """Asking for more GPUs than the largest host has is 409 ``exceeds_fleet``."""
        await api.host(2)
        status, body = await api.as_renter("POST", "/rentals", json={"gpu_count": 3})
        assert_error(status, body, 409, "exceeds_fleet")
        status, body = await api.as_renter("POST", "/rentals", json={"gpu_count": 1, "gpu_model": "H100"})
        assert_error(status, body, 409, "exceeds_fleet")
        assert await api.count(Rental) == 0

    async def test_gpus_taken_is_409_insufficient_capacity(self, api: Api) -> None:
        """GPUs that exist but are rented are 409 ``insufficient_capacity``."""
        await api.host(2)
        status, _ = await api.as_renter("POST", "/rentals", json={"gpu_count": 2})
        assert status == 201
        status, body = await api.as_renter("POST", "/rentals", json={"gpu_count": 1})
        assert_error(status, body, 409, "insufficient_capacity")
        assert await api.count(Rental) == 1

    async def test_rental_honours_gpu_model(self, api: Api) -> None:
        """A rental asking for a model is placed on GPUs of that model only."""
        await api.host(2)
        a100_host, a100_uuids = await api.host(1, name=A100)
        status, rental = await api.as_renter("POST", "/rentals", json={"gpu_count": 1, "gpu_model": "A100"})
        assert status == 201, rental
        assert (rental["host_id"], rental["gpu_uuids"], rental["gpu_model"]) == (a100_host, a100_uuids, A100)

    async def test_failed_start_fails_the_rental_and_frees_gpus(self, api: Api) -> None:
        """An agent reporting that the workload failed to start fails the rental with its reason and frees the GPUs."""
        host_id, _ = await api.host(2)
        _, rental = await api.as_renter("POST", "/rentals", json={"gpu_count": 2})
        await api.agent_reports(rental["id"], "start_workload", ok=False, detail="image not found")
        status, body = await api.as_renter("GET", f"/rentals/{rental['id']}")
        assert status == 200
        assert body["state"] == "failed"
        assert body["failure_reason"] == "image not found"
        assert [e["to"] for e in body["events"]] == ["pending", "starting", "failed"]
        async with api.master.db.session() as session:
            assert await session.scalar(select(func.count()).select_from(Gpu).where(Gpu.rental_id.is_not(None))) == 0
        _, offers = await api.as_renter("GET", "/offers")
        assert [(o["host_id"], o["num_gpus"]) for o in offers["items"]] == [(host_id, 2)]
        _, host = await api.as_renter("GET", f"/hosts/{host_id}")
        assert host["state"] == "online"

    async def test_rentals_listing_is_newest_first_and_paged(self, api: Api) -> None:
        """GET /rentals lists the caller's rentals newest first, paged."""
        await api.host(3)
        ids = []
        for _ in range(3):
            status, rental = await api.as_renter("POST", "/rentals", json={"gpu_count": 1})
            assert status == 201
            ids.append(rental["id"])
        status, body = await api.as_renter("GET", "/rentals", params={"limit": "2"})
        assert status == 200
        assert body["total"] == 3
        assert len(body["items"]) == 2
        _, rest = await api.as_renter("GET", "/rentals", params={"limit": "2", "offset": "2"})
        assert {r["id"] for r in body["items"] + rest["items"]} == set(ids)

    async def test_same_idempotency_key_and_body_returns_the_first_rental(self, api: Api) -> None:
        """Repeating a request with its Idempotency-Key returns the first rental with 200 and places nothing new."""
        await api.host(2)
        request = {"gpu_count": 1, "workload": {"kind": "process", "argv": ["python", "train.py"]}}
        headers = {"Idempotency-Key": "order-42"}
        status, first = await api.as_renter("POST", "/rentals", json=request, headers=headers)
        assert status == 201, first
        status, second = await api.as_renter("POST", "/rentals", json=request, headers=headers)
        assert status == 200, second
        assert second["id"] == first["id"]
        assert await api.count(Rental) == 1
        assert await api.count(Command) == 1

    async def test_same_idempotency_key_with_other_body_is_409(self, api: Api) -> None:
        """Reusing an Idempotency-Key for a different request is 409 ``idempotency_key_reused``."""
        await api.host(2)
        headers = {"Idempotency-Key": "order-43"}
        status, _ = await api.as_renter("POST", "/rentals", json={"gpu_count": 1}, headers=headers)
        assert status == 201
        status, body = await api.as_renter("POST", "/rentals", json={"gpu_count": 2}, headers=headers)
        assert_error(status, body, 409, "idempotency_key_reused")
        assert await api.count(Rental) == 1

    async def test_idempotency_keys_are_per_account(self, api: Api) -> None:
        """Two renters using the same Idempotency-Key get two rentals."""
        await api.host(2)
        _, other_key = await create_principal(api.master, "renter-2", "renter")
        headers = {"Idempotency-Key": "same"}
        status, mine = await api.as_renter("POST", "/rentals", json={"gpu_count": 1}, headers=headers)
        assert status == 201
        status, theirs = await api.call("POST", "/rentals", other_key, json={"gpu_count": 1}, headers=headers)
        assert status == 201
        assert mine["id"] != theirs["id"]

    async def test_over_long_idempotency_key_is_400(self, api: Api) -> None:
        """An Idempotency-Key over 255 characters is refused with 400 ``invalid_idempotency_key``."""
        await api.host(1)
        status, body = await api.as_renter(
            "POST", "/rentals", json={"gpu_count": 1}, headers={"Idempotency-Key": "k" * 300}
        )
        assert_error(status, body, 400, "invalid_idempotency_key")
        assert await api.count(Rental) == 0

    async def test_concurrent_requests_with_one_key_make_one_rental(self, api: Api) -> None:
        """Concurrent repeats of one idempotent request place exactly one rental, and all return it."""
        await api.host(4)
        headers = {"Idempotency-Key": "burst"}
        results = await asyncio.gather(
            *(api.as_renter("POST", "/rentals", json={"gpu_count": 1}, headers=headers) for _ in range(4))
        )
        assert sorted(status for status, _ in results) == [200, 200, 200, 201], results
        assert len({body["id"] for _, body in results}) == 1
        assert await api.count(Rental) == 1
        assert await api.count(Command) == 1

    async def test_a_renter_asks_for_its_own_failover_time(self, api: Api) -> None:
        """failover_after_s is stored on the rental and shown; unset, the view says null (the master's default)."""
        await api.host(2)
        status, own = await api.as_renter("POST", "/rentals", json={"gpu_count": 1, "failover_after_s": 300})
        assert status == 201, own
        status, default = await api.as_renter("POST", "/rentals", json={"gpu_count": 1})
        assert status == 201, default
        assert (own["failover_after_s"], default["failover_after_s"]) == (300, None)
        status, again = await api.as_renter("GET", f"/rentals/{own['id']}")
        assert status == 200 and again["failover_after_s"] == 300
        async with api.master.db.session() as session:
            row = await session.get(Rental, own["id"])
        assert row is not None and row.failover_after_s == 300

    async def test_concurrent_rentals_never_share_a_gpu(self, api: Api) -> None:
        """Six concurrent one-GPU rentals on a four-GPU host: four win distinct GPUs, two get 409."""
        _, uuids = await api.host(4)
        results = await asyncio.gather(
            *(api.as_renter("POST", "/rentals", json={"gpu_count": 1}) for _ in range(6))
        )
        won = [body for status, body in results if status == 201]
        lost = [body for status, body in results if status != 201]
        assert len(won) == 4, results
        assert [(b["code"]) for b in lost] == ["insufficient_capacity"] * 2, results
        taken = [uuid for body in won for uuid in body["gpu_uuids"]]
        assert sorted(taken) == sorted(uuids)
        async with api.master.db.session() as session:
            rows = (await session.execute(select(Gpu.uuid, Gpu.rental_id))).all()
        assert {uuid: rental_id for uuid, rental_id in rows} == {
            uuid: body["id"] for body in won for uuid in body["gpu_uuids"]
        }


class TestOpenApi:
    @pytest.fixture
    async def document(self, api: Api) -> dict[str, Any]:
        status, body = await api.call("GET", "/openapi.json", None)
        assert status == 200
        assert isinstance(body, dict)
        return body

    async def test_is_an_openapi_3_document(self, document: dict[str, Any]) -> None:
        """The document declares OpenAPI 3.x with a title and version."""
        assert document["openapi"].startswith("3.")
        assert document["info"]["title"]
        assert document["info"]["version"]

    async def test_lists_every_route_with_its_method(self, document: dict[str, Any]) -> None:
        """Every route in ROUTES appears under its path and method, and nothing else does."""
        expected = {(API + r.path, r.method.lower()) for r in ROUTES}
        listed = {(path, method) for path, ops in document["paths"].items() for method in ops}
        assert listed == expected

    async def test_secured_routes_declare_bearer_security(self, document: dict[str, Any]) -> None:
        """Routes that need an API key declare the bearer scheme; public ones declare none."""
        assert document["components"]["securitySchemes"]["bearer"] == {"type": "http", "scheme": "bearer"}
        for route in ROUTES:
            op = document["paths"][API + route.path][route.method.lower()]
            if route.public:
                assert "security" not in op, route.path
            else:
                assert op["security"] == [{"bearer": []}], route.path
                assert "401" in op["responses"]

    async def test_rental_create_schema_is_present(self, document: dict[str, Any]) -> None:
        """POST /rentals takes the RentalCreate schema, which lists its fields."""
        schemas = document["components"]["schemas"]
        assert set(schemas["RentalCreate"]["properties"]) == {
            "offer_id", "requirements", "gpu_count", "gpu_model", "gpu_milli", "gpu_memory_mib", "mig_profile", "kind", "bid",
            "network", "queue", "queue_timeout_s", "template", "workload", "restart_on_failure", "failover_after_s", "volumes",
            "price_tolerance",
        }  # fmt: skip
        op = document["paths"][API + "/rentals"]["post"]
        ref = op["requestBody"]["content"]["application/json"]["schema"]["$ref"]
        assert ref == "#/components/schemas/RentalCreate"
        assert "Idempotency-Key" in {p["name"] for p in op["parameters"] if p["in"] == "header"}

    async def test_every_ref_resolves(self, document: dict[str, Any]) -> None:
        """Every "$ref" in the document points at an entry of components.schemas."""
        refs: list[str] = []

        def walk(node: Any) -> None:
            if isinstance(node, dict):
                for key, value in node.items():
                    if key == "$ref":
                        refs.append(value)
                    else:
                        walk(value)
            elif isinstance(node, list):
                for item in node:
                    walk(item)

        walk(document)
        assert refs
        prefix = "#/components/schemas/"
        schemas = document["components"]["schemas"]
        for ref in refs:
            assert ref.startswith(prefix), ref
            assert ref.removeprefix(prefix) in schemas, ref


class TestRoutingBeforeAuth:
    async def test_unknown_paths_are_404_even_without_a_key(self, api: Api) -> None:
        """An endpoint that does not exist is a JSON 404 (and a wrong method 405), not a 401, for anonymous callers too."""
        status, body = await api.call("GET", "/nope", None)
        assert_error(status, body, 404, "not_found")
        status, body = await api.call("PUT", "/health", None)
        assert_error(status, body, 405, "method_not_allowed")
