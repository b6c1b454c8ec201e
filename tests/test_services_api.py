"""Elastic services through ``/api/v1/services``: creating (and its 400s), idempotency, bounds, tokens, deleting.

Driven on SQLite and PostgreSQL (the ``api`` fixture); agents' answers are applied as the
ingestor would. The endpoint and the autoscaler have their own tests (``test_gateway.py``,
``test_autoscale.py``, ``test_services_e2e.py``).
"""

from __future__ import annotations

from decimal import Decimal
from typing import Any

from sqlalchemy import select

from master.models import Rental, Service
from shared.ids import secret_hash
from tests.apiclient import Api, assert_error
from tests.factories import create_principal

WORKLOAD = {"kind": "container", "image": "gpumarket-test/openai-cpu:1", "ports": [8000]}
BODY: dict[str, Any] = {"name": "chat", "workload": WORKLOAD, "port": 8000, "min_replicas": 1, "max_replicas": 3,
                        "scaling": {"metric": "inflight", "target": 2, "scale_down_cooldown_s": 20}}  # fmt: skip


async def create(api: Api, key: str | None = None, headers: dict[str, str] | None = None, **changes: Any) -> tuple[int, Any]:
    return await api.call("POST", "/services", key or api.renter_key, json={**BODY, **changes}, headers=headers or {})


class TestCreate:
    async def test_a_service_starts_its_min_replicas_as_rentals_that_name_it(self, api: Api) -> None:
        await api.host(2)
        await api.host(2)
        status, service = await create(api, min_replicas=2)
        assert status == 201, service
        assert service["id"].startswith("svc-") and service["state"] == "active"
        assert service["token"].startswith("gms_") and service["token"].startswith(service["token_prefix"])
        assert service["endpoint_url"].endswith(f"/svc/{service['id']}/")
        assert service["desired_replicas"] == 2 and service["replicas"]["live"] == 2
        assert service["scaling"] == {"metric": "inflight", "target": 2.0, "scale_up_cooldown_s": 30.0, "scale_down_cooldown_s": 20.0}
        for replica in service["replica_rentals"]:
            status, rental = await api.as_renter("GET", f"/rentals/{replica['rental_id']}")
            assert rental["service_id"] == service["id"] and rental["workload"]["image"] == WORKLOAD["image"]
            assert not replica["ready"]  # until its health check passes
        async with api.master.db.session() as session:
            row = await session.get(Service, service["id"])
            assert row is not None and row.token_hash == secret_hash(service["token"])  # the token itself is not kept
        status, again = await api.as_renter("GET", f"/services/{service['id']}")
        assert "token" not in again and Decimal(again["cost_so_far"]) == 0
        assert [e["kind"] for e in again["events"]] == ["created"]
        _, listed = await api.as_renter("GET", "/services")
        [item] = listed["items"]
        assert item["id"] == service["id"] and Decimal(item["cost_so_far"]) == 0 and item["replicas"]["live"] == 2

    async def test_a_template_gives_the_workload_and_its_port(self, api: Api) -> None:
        await api.host(1)
        body = {k: v for k, v in BODY.items() if k != "workload"}
        status, service = await api.call("POST", "/services", api.renter_key, json={**body, "template": "vllm"})
        assert status == 201, service
        assert service["image"].startswith("vllm/") and service["template"] == "vllm"

    async def test_min_replicas_zero_rents_nothing_until_a_request_comes(self, api: Api) -> None:
        status, service = await create(api, min_replicas=0)
        assert status == 201 and service["replicas"]["live"] == 0 and service["desired_replicas"] == 0

    async def test_without_scaling_the_rule_is_inflight_four(self, api: Api) -> None:
        await api.host(1)
        status, service = await create(api, scaling=None)
        assert status == 201 and service["scaling"]["metric"] == "inflight" and service["scaling"]["target"] == 4.0

    async def test_a_price_cap_becomes_a_requirement(self, api: Api) -> None:
        await api.host(1)
        status, body = await create(api, max_price_per_gpu_hour="0.01")
        assert status == 201 and body["requirements"] == "price<=0.01"
        assert body["replicas"] == {"live": 1, "ready": 0, "starting": 0, "queued": 1, "failed": 0}  # no GPU that cheap: it waits


class TestBadInput:
    """Each is a 400 (or 422 for a body the schema refuses) that says why, and leaves no service behind."""

    async def test_min_above_max(self, api: Api) -> None:
        status, body = await create(api, min_replicas=3, max_replicas=2)
        assert_error(status, body, 400, "invalid_replica_bounds")
        assert "min_replicas (3) must be at most max_replicas (2)" in body["message"]

    async def test_a_port_the_workload_does_not_serve(self, api: Api) -> None:
        status, body = await create(api, port=9000)
        assert_error(status, body, 400, "port_not_served")
        assert "its ports: 8000" in body["message"]

    async def test_a_port_the_template_does_not_serve(self, api: Api) -> None:
        body = {k: v for k, v in BODY.items() if k != "workload"}
        status, answer = await api.call("POST", "/services", api.renter_key, json={**body, "template": "vllm", "port": 8888})
        assert_error(status, answer, 400, "port_not_served")

    async def test_a_rule_with_no_metric(self, api: Api) -> None:
        status, body = await create(api, scaling={"target": 4})
        assert_error(status, body, 400, "scaling_metric_missing")
        status, body = await create(api, scaling={"metric": "gpu_util", "period_s": 60})
        assert_error(status, body, 400, "invalid_scaling_rule")
        assert "threshold_pct" in body["message"]

    async def test_a_look_alike_name(self, api: Api) -> None:
        status, body = await create(api, name="ch\u0430t")  # Cyrillic a
        assert_error(status, body, 400, "invalid_service_name")

    async def test_no_container(self, api: Api) -> None:
        status, body = await create(api, workload={"kind": "hold"})
        assert status == 422, body
        body = {k: v for k, v in BODY.items() if k != "workload"}
        status, answer = await api.call("POST", "/services", api.renter_key, json=body)
        assert_error(status, answer, 422, "template_or_workload")

    async def test_a_replica_the_fleet_can_never_hold_undoes_the_service(self, api: Api) -> None:
        await api.host(2)
        status, body = await create(api, gpu_count=8)
        assert_error(status, body, 409, "exceeds_fleet")
        status, listed = await api.as_renter("GET", "/services")
        assert listed["total"] == 0
        async with api.master.db.session() as session:
            assert (await session.scalars(select(Rental).where(Rental.service_id.is_not(None)))).all() == []

    async def test_nothing_was_made(self, api: Api) -> None:
        bad: dict[str, Any]
        for bad in ({"min_replicas": 5, "max_replicas": 1}, {"port": 1}, {"scaling": {}}):
            await create(api, **bad)
        async with api.master.db.session() as session:
            assert (await session.scalars(select(Service))).all() == []


class TestIdempotency:
    async def test_a_repeat_returns_the_first_service_without_its_token(self, api: Api) -> None:
        await api.host(2)
        first_status, first = await create(api, headers={"Idempotency-Key": "svc-1"})
        status, again = await create(api, headers={"Idempotency-Key": "svc-1"})
        assert (first_status, status) == (201, 200)
        assert again["id"] == first["id"] and again["token"] is None and again["replicas"]["live"] == 1

    async def test_the_same_key_for_another_request_is_409(self, api: Api) -> None:
        await api.host(2)
        await create(api, headers={"Idempotency-Key": "svc-2"})
        status, body = await create(api, headers={"Idempotency-Key": "svc-2"}, max_replicas=5)
        assert_error(status, body, 409, "idempotency_key_reused")


class TestChanges:
    async def test_bounds_move_the_target_into_them(self, api: Api) -> None:
        await api.host(2)
        _, service = await create(api)
        status, scaled = await api.as_renter("PUT", f"/services/{service['id']}/replicas", json={"min_replicas": 2, "max_replicas": 4})
        assert status == 200, scaled
        assert (scaled["min_replicas"], scaled["max_replicas"], scaled["desired_replicas"]) == (2, 4, 2)
        assert scaled["events"][-1]["kind"] == "scale_up" and "bounds set to 2..4" in scaled["events"][-1]["cause"]
        status, body = await api.as_renter("PUT", f"/services/{service['id']}/replicas", json={"min_replicas": 5})
        assert_error(status, body, 400, "invalid_replica_bounds")

    async def test_a_new_token_replaces_the_old(self, api: Api) -> None:
        _, service = await create(api, min_replicas=0)
        status, body = await api.as_renter("POST", f"/services/{service['id']}/token")
        assert status == 200 and body["token"] != service["token"]
        async with api.master.db.session() as session:
            row = await session.get(Service, service["id"])
            assert row is not None and row.token_hash == secret_hash(body["token"])

    async def test_delete_stops_every_replica_and_is_idempotent(self, api: Api) -> None:
        await api.host(2)
        _, service = await create(api, min_replicas=2)
        status, deleted = await api.as_renter("DELETE", f"/services/{service['id']}")
        assert status == 202 and deleted["state"] == "deleted" and deleted["desired_replicas"] == 0
        assert {r["state"] for r in deleted["replica_rentals"]} == {"stopping"}
        for replica in deleted["replica_rentals"]:
            assert len(await api.commands(replica["rental_id"], "stop_workload")) == 1
        status, again = await api.as_renter("DELETE", f"/services/{service['id']}")
        assert status == 202 and again["state"] == "deleted"
        _, listed = await api.as_renter("GET", "/services")
        assert listed["total"] == 0
        _, listed = await api.as_renter("GET", "/services?deleted=true")
        assert [s["id"] for s in listed["items"]] == [service["id"]]
        status, body = await api.as_renter("GET", "/services?deleted=maybe")
        assert_error(status, body, 400, "invalid_query")
        status, body = await api.as_renter("PUT", f"/services/{service['id']}/replicas", json={"max_replicas": 2})
        assert_error(status, body, 409, "service_deleted")

    async def test_another_renter_sees_no_service(self, api: Api) -> None:
        _, service = await create(api, min_replicas=0)
        _, other_key = await create_principal(api.master, "renter-2", "renter")
        for method, path in (("GET", ""), ("DELETE", ""), ("POST", "/token"), ("GET", "/stats")):
            status, body = await api.call(method, f"/services/{service['id']}{path}", other_key)
            assert_error(status, body, 404, "service_not_found")
        status, listed = await api.call("GET", "/services", other_key)
        assert listed["total"] == 0
