"""Templates and isolated rentals on the master: template CRUD and roles, rentals that name a template
or an image, placement by the hosts' isolation facts, the ``isolated`` offer filter, workload
progress as rental events, and failed starts that end a rental ``failed`` with nothing charged.

Driven through the REST API on SQLite and PostgreSQL (the ``api`` fixture); agents are simulated by
applying their hello, progress and command results as the ingestor would.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from sqlalchemy import select

from billing.rating import RatingPolicy, rate_open_rentals
from master.api.base import API
from master.api.openapi import build_openapi
from master.api.table import ROUTES
from master.models import Command, Host, LedgerTransaction, Rental
from master.telemetry import hosts
from master.telemetry.ingest import Ingestor
from shared import protocol
from tests.apiclient import RTX, Api, assert_error
from tests.factories import command_result, create_principal, envelope, gpu_info, online_host
from tests.helpers import eventually

BASE = {"kind": "container", "image": "ubuntu:24.04", "command": ["sleep", "infinity"], "env": {}, "ports": []}


@pytest.fixture
async def admin_key(api: Api) -> str:
    _, key = await create_principal(api.master, "admin-1", "admin")
    return key


async def rent(api: Api, **body: Any) -> tuple[int, Any]:
    return await api.call("POST", "/rentals", api.renter_key, json=body)


async def start_command(api: Api, rental_id: str) -> Command:
    [command] = await api.commands(rental_id, "start_workload")
    return command


def facts(
    *kinds: str, allowed: tuple[str, ...] = (), isolated: bool = True, reason: str = "", cores: float | None = None, memory_mib: int | None = None
) -> protocol.IsolationFacts:
    return protocol.IsolationFacts.model_validate({
        "kinds": ["hold", *kinds], "isolated": isolated, "container_engine": "docker 26.1.5" if "container" in kinds else None,
        "process_isolation": "uid" if "process" in kinds else "none", "reason": reason,
        "image_policy": {"allowed": list(allowed), "max_image_mib": 20480}, "max_cpu_cores": cores, "max_memory_mib": memory_mib,
        "network_guard": isolated, "egress_allow": ["10.20.0.0/16"] if isolated else [], "network_check": "network self-test passed",
    })  # fmt: skip


async def host_with(api: Api, isolation: protocol.IsolationFacts | None, *, count: int = 1) -> str:
    """An online host of the provider with ``count`` RTX 4090s whose agent said ``isolation`` (None: an older agent)."""
    return await online_host(api.master, api.provider, [gpu_info(i) for i in range(count)], isolation=isolation)


CONTAINER = {"kind": "container", "image": "ubuntu:24.04", "command": ["sleep", "infinity"]}
PROCESS = {"kind": "process", "argv": ["sleep", "infinity"]}
_seq = itertools.count(1000)


async def agent_says(api: Api, message: protocol.AnyAgentMessage) -> None:
    """Apply one agent message as the ingestor would."""
    async with api.master.db.session() as session:
        match message:
            case protocol.WorkloadProgress():
                await hosts.handle_workload_progress(session, envelope(message))
            case protocol.CommandResult():
                await hosts.handle_command_result(session, envelope(message))


def progress(host_id: str, rental_id: str, stage: str, text: str, at: datetime, percent: float | None = None) -> protocol.WorkloadProgress:
    body = protocol.WorkloadProgressBody(rental_id=rental_id, at=at, stage=stage, text=text, percent=percent)
    return protocol.WorkloadProgress(host_id=host_id, seq=next(_seq), ts=at, body=body)


class TestTemplates:
    async def test_the_seeded_templates_are_listed_in_name_order(self, api: Api) -> None:
        """base, jupyter, pytorch and vllm come with the database, each with its image and what it serves."""
        status, body = await api.as_renter("GET", "/templates")
        assert status == 200, body
        by_name = {t["name"]: t for t in body["templates"]}
        assert list(by_name) == ["base", "jupyter", "pytorch", "vllm"]
        assert by_name["base"]["image"] == "ubuntu:24.04" and by_name["base"]["command"] == ["sleep", "infinity"]
        assert by_name["pytorch"]["shm_mib"] == 8192
        assert by_name["jupyter"]["ports"] == [8888]
        assert by_name["vllm"]["image"] == "vllm/vllm-openai:v0.6.3" and by_name["vllm"]["ports"] == [8000]
        for template in body["templates"]:
            assert set(template) >= {"name", "description", "image", "command", "args", "env", "ports", "shm_mib", "updated_at"}
            assert template["workload"]["kind"] == "container"

    async def test_an_admin_creates_replaces_and_deletes_a_template(self, api: Api, admin_key: str) -> None:
        """PUT creates (201) then replaces (200); GET shows the new version; DELETE removes it (then 404)."""
        body = {"image": "nvcr.io/nvidia/pytorch:24.05-py3", "command": ["python", "-m", "http.server", "8080"],
                "env": {"MODE": "demo"}, "ports": [8080], "shm_mib": 2048, "description": "NGC PyTorch"}  # fmt: skip
        status, created = await api.call("PUT", "/templates/ngc", admin_key, json=body)
        assert status == 201, created
        assert created["name"] == "ngc" and created["ports"] == [8080] and created["env"] == {"MODE": "demo"}
        status, replaced = await api.call("PUT", "/templates/ngc", admin_key, json={**body, "ports": [8080, 8081]})
        assert status == 200, replaced
        status, read = await api.as_renter("GET", "/templates/ngc")
        assert status == 200 and read["ports"] == [8080, 8081] and read["description"] == "NGC PyTorch"
        status, deleted = await api.call("DELETE", "/templates/ngc", admin_key)
        assert status == 200 and deleted == {"name": "ngc", "deleted": True}
        status, gone = await api.as_renter("GET", "/templates/ngc")
        assert_error(status, gone, 404, "template_not_found")
        assert "GET /api/v1/templates" in gone["message"]

    async def test_only_admins_edit_templates(self, api: Api) -> None:
        """Renters and providers read templates but are refused PUT and DELETE (403)."""
        for key in (api.renter_key, api.provider_key):
            status, body = await api.call("PUT", "/templates/base", key, json={"image": "alpine:3.20"})
            assert_error(status, body, 403, "forbidden")
            status, body = await api.call("DELETE", "/templates/base", key)
            assert_error(status, body, 403, "forbidden")
        status, body = await api.as_provider("GET", "/templates/base")
        assert status == 200 and body["image"] == "ubuntu:24.04"

    async def test_an_unknown_template_is_404(self, api: Api, admin_key: str) -> None:
        """GET and DELETE of a template that does not exist say template_not_found."""
        for method, key in (("GET", api.renter_key), ("DELETE", admin_key)):
            status, body = await api.call(method, "/templates/nope", key)
            assert_error(status, body, 404, "template_not_found")

    @pytest.mark.parametrize(
        ("body", "field"),
        [
            ({"image": "Ubuntu:24.04"}, "image"),  # upper case is not a repository
            ({"image": "ubunt\u0443:24.04"}, "image"),  # a Cyrillic 'у' looking like a 'u'
            ({"image": ""}, "image"),
            ({"image": "ubuntu", "ports": [0]}, "ports"),
            ({"image": "ubuntu", "ports": [70000]}, "ports"),
            ({"image": "ubuntu", "ports": [22, 22]}, "ports"),
            ({"image": "ubuntu", "shm_mib": 0}, "shm_mib"),
            ({"image": "ubuntu", "env": {"CUDA_VISIBLE_DEVICES": "0"}}, "env"),
            ({"image": "ubuntu", "command": "sleep infinity"}, "command"),
            ({"image": "ubuntu", "description": "x" * 501}, "description"),
            ({"image": "ubuntu", "privileged": True}, "privileged"),
            ({}, "image"),
        ],
    )
    async def test_a_bad_template_is_refused_with_its_field(self, api: Api, admin_key: str, body: dict[str, Any], field: str) -> None:
        """Each invalid field is a 422 that names it, and nothing is stored."""
        status, answer = await api.call("PUT", "/templates/bad", admin_key, json=body)
        assert_error(status, answer, 422, "validation_failed")
        assert answer["details"]["problems"][0]["field"] == field, answer
        status, _ = await api.as_renter("GET", "/templates/bad")
        assert status == 404

    @pytest.mark.parametrize("name", ["Base", "-x", "a" * 41, "a_b"])
    async def test_a_bad_template_name_is_refused(self, api: Api, admin_key: str, name: str) -> None:
        """A name must match ^[a-z0-9][a-z0-9-]{0,39}$."""
        status, body = await api.call("PUT", f"/templates/{name}", admin_key, json={"image": "ubuntu"})
        assert_error(status, body, 422, "invalid_template_name")
        assert body["details"]["problems"][0]["field"] == "name"


class TestRentalsOfTemplates:
    async def test_a_rental_of_a_template_starts_its_container_workload(self, api: Api) -> None:
        """The start command carries the template's container workload, and the rental names the template."""
        await api.host(1)
        status, body = await rent(api, template="base")
        assert status == 201, body
        assert body["template"] == "base" and body["workload"] == BASE
        command = await start_command(api, body["id"])
        assert command.args["workload"] == BASE

    async def test_editing_a_template_does_not_change_an_existing_rental(self, api: Api, admin_key: str) -> None:
        """The rental keeps the workload it was created with; a new rental gets the edited one."""
        await api.host(2)
        _, first = await rent(api, template="base")
        status, _ = await api.call("PUT", "/templates/base", admin_key, json={"image": "ubuntu:22.04"})
        assert status == 200
        status, read = await api.as_renter("GET", f"/rentals/{first['id']}")
        assert read["workload"]["image"] == "ubuntu:24.04"
        _, second = await rent(api, template="base")
        assert second["workload"] == {"kind": "container", "image": "ubuntu:22.04", "env": {}, "ports": []}

    async def test_an_unknown_template_is_404_and_rents_nothing(self, api: Api) -> None:
        """template_not_found, and no rental or command is written."""
        await api.host(1)
        status, body = await rent(api, template="nope")
        assert_error(status, body, 404, "template_not_found")
        assert await api.count(Rental) == 0 and await api.count(Command) == 0

    async def test_a_template_and_a_workload_together_are_refused(self, api: Api) -> None:
        """422 template_and_workload: a rental runs one of them."""
        await api.host(1)
        status, body = await rent(api, template="base", workload={"kind": "hold"})
        assert_error(status, body, 422, "template_and_workload")
        assert await api.count(Rental) == 0

    async def test_without_template_or_workload_a_rental_holds(self, api: Api) -> None:
        """The API's default stays a hold (the external contract); the rental names no template."""
        await api.host(1)
        status, body = await rent(api, gpu_count=1)
        assert status == 201 and body["workload"] == {"kind": "hold"} and body["template"] is None

    async def test_a_repeat_with_the_same_key_returns_the_rental_even_after_the_template_changed(
        self, api: Api, admin_key: str
    ) -> None:
        """An Idempotency-Key repeat names the same template: the same rental (200), not a conflict."""
        await api.host(2)
        headers = {"Idempotency-Key": "k-1"}
        status, first = await api.call("POST", "/rentals", api.renter_key, json={"template": "base"}, headers=headers)
        assert status == 201
        await api.call("PUT", "/templates/base", admin_key, json={"image": "ubuntu:22.04"})
        status, again = await api.call("POST", "/rentals", api.renter_key, json={"template": "base"}, headers=headers)
        assert status == 200 and again["id"] == first["id"]

    @pytest.mark.parametrize(
        ("workload", "field"),
        [
            ({"kind": "container", "image": "ubuntu:24.04", "ports": [0]}, "workload.container.ports"),
            ({"kind": "container", "image": "ubuntu:24.04", "ports": [70000]}, "workload.container.ports"),
            ({"kind": "container", "image": "not a reference"}, "workload.container.image"),
            ({"kind": "container", "image": "\u0440ytorch/pytorch"}, "workload.container.image"),  # Cyrillic 'р'
        ],
    )
    async def test_a_bad_container_workload_is_refused_with_its_field(self, api: Api, workload: dict[str, Any], field: str) -> None:
        """Invalid image references (look-alike letters too) and ports out of range are 422 naming the field."""
        await api.host(1)
        status, body = await rent(api, workload=workload)
        assert_error(status, body, 422, "validation_failed")
        assert body["details"]["problems"][0]["field"] == field, body



class TestHostsSayHowTheyIsolate:
    async def test_hello_facts_show_on_the_host_and_its_offers(self, api: Api) -> None:
        """The hello's isolation facts are the host's ``isolation`` in host views and offers; an older agent's is null."""
        isolated = await host_with(api, facts("container", allowed=("docker.io/library/*",)))
        legacy = await host_with(api, None)
        status, body = await api.as_renter("GET", f"/hosts/{isolated}")
        assert status == 200
        assert body["isolation"] == {
            "isolated": True, "kinds": ["hold", "container"], "container_engine": "docker 26.1.5", "process_isolation": "none",
            "reason": "", "image_policy": {"allowed": ["docker.io/library/*"], "max_image_mib": 20480},
            "network": {"guarded": True, "egress_allow": ["10.20.0.0/16"], "self_test": "network self-test passed"},
        }  # fmt: skip
        status, body = await api.as_renter("GET", f"/hosts/{legacy}")
        assert body["isolation"] is None
        status, body = await api.as_renter("GET", "/offers")
        by_host = {o["host_id"]: o for o in body["items"]}
        assert by_host[isolated]["isolation"]["kinds"] == ["hold", "container"] and by_host[legacy]["isolation"] is None
        assert by_host[isolated]["isolation"]["network"]["egress_allow"] == ["10.20.0.0/16"]  # the renter sees the egress policy

    async def test_offers_filter_on_isolated_by_parameter_and_query(self, api: Api) -> None:
        """isolated=true keeps hosts whose facts say isolated; false those that say not; older agents' hosts match neither."""
        isolated = await host_with(api, facts("container"))
        unisolated = await host_with(api, facts("process", isolated=False, reason="no engine, not root"))
        await host_with(api, None)
        for params, expected in (
            ({"isolated": "true"}, {isolated}), ({"q": "isolated=true"}, {isolated}),
            ({"isolated": "false"}, {unisolated}), ({"q": "isolated=false"}, {unisolated}),
        ):  # fmt: skip
            status, body = await api.as_renter("GET", "/offers", params=params)
            assert status == 200, body
            assert {o["host_id"] for o in body["items"]} == expected, params
        status, body = await api.as_renter("GET", "/offers", params={"q": "isolated=maybe"})
        assert_error(status, body, 400, "invalid_query")

    def test_the_isolated_filter_and_the_templates_are_in_the_openapi_document(self) -> None:
        """GET /offers documents isolated (a boolean); the template routes and RentalCreate.template are documented."""
        document = build_openapi(ROUTES)
        offers = document["paths"][f"{API}/offers"]["get"]
        [isolated] = [p for p in offers["parameters"] if p["name"] == "isolated"]
        assert "isolate" in isolated["description"]
        assert set(document["paths"][f"{API}/templates/{{name}}"]) == {"get", "put", "delete"}
        assert "template" in document["components"]["schemas"]["RentalCreate"]["properties"]

    async def test_a_newer_hello_without_facts_makes_them_unknown(self, api: Api) -> None:
        """An agent downgraded to one that does not say is unknown again, not stuck with its old facts."""
        host_id = await host_with(api, facts("container"), count=0)
        async with api.master.db.session() as session:
            await hosts.handle_hello(session, envelope(protocol.Hello(
                host_id=host_id, seq=5, ts=datetime.now(UTC),
                body=protocol.HelloBody(agent_version="old", gpu_backend="sim", gpus=[]),
            )))  # fmt: skip
            isolation = await session.scalar(select(Host.isolation).where(Host.id == host_id))
        assert isolation is None


class TestPlacementByIsolation:
    async def test_a_container_goes_only_to_a_host_that_runs_containers(self, api: Api) -> None:
        """Hosts that run processes only are skipped; the container host gets the rental."""
        await host_with(api, facts("process"), count=4)
        wanted = await host_with(api, facts("container"))
        status, body = await rent(api, workload=CONTAINER)
        assert status == 201, body
        assert body["host_id"] == wanted

    async def test_a_container_skips_hosts_whose_image_policy_refuses_the_image(self, api: Api) -> None:
        """A provider that allows nvcr.io only does not get an ubuntu rental; one that allows Docker Hub's library does."""
        await host_with(api, facts("container", allowed=("nvcr.io",)), count=4)
        wanted = await host_with(api, facts("container", allowed=("docker.io/library/*",)))
        status, body = await rent(api, workload=CONTAINER)
        assert status == 201 and body["host_id"] == wanted, body

    async def test_a_process_goes_only_to_a_host_that_runs_processes(self, api: Api) -> None:
        """Container-only hosts are skipped for a process workload."""
        await host_with(api, facts("container"), count=4)
        wanted = await host_with(api, facts("process"))
        status, body = await rent(api, workload=PROCESS)
        assert status == 201 and body["host_id"] == wanted, body

    async def test_hosts_of_older_agents_keep_todays_placement(self, api: Api) -> None:
        """A host with no facts takes containers, processes and holds as before."""
        legacy = await host_with(api, None, count=3)
        for workload in (CONTAINER, PROCESS, {"kind": "hold"}):
            status, body = await rent(api, workload=workload)
            assert status == 201 and body["host_id"] == legacy, body

    async def test_a_hold_goes_anywhere(self, api: Api) -> None:
        """Reserving GPUs runs nothing: a host that runs no workloads at all still takes it."""
        host_id = await host_with(api, facts())
        status, body = await rent(api, gpu_count=1)
        assert status == 201 and body["host_id"] == host_id

    async def test_no_host_that_runs_containers_says_why(self, api: Api) -> None:
        """409 insufficient_capacity naming container workloads and how many hosts were left out for it."""
        await host_with(api, facts("process"), count=2)
        await host_with(api, facts("container", allowed=("nvcr.io",)))
        status, body = await rent(api, template="base")
        assert_error(status, body, 409, "insufficient_capacity")
        assert "no host that runs container workloads of ubuntu:24.04" in body["message"]
        assert "not running container workloads" in body["message"] and "image policy" in body["message"]
        assert await api.count(Rental) == 0

    async def test_an_offer_on_a_host_that_cannot_run_it_is_refused(self, api: Api) -> None:
        """Naming an offer whose host lacks the kind (or refuses the image) is a 422 with the host's reason."""
        process_only = await host_with(api, facts("process", reason="no container engine answers"))
        status, body = await rent(api, offer_id=f"{process_only}:{RTX}", workload=CONTAINER)
        assert_error(status, body, 422, "workload_kind_unsupported")
        assert "no container engine answers" in body["message"]
        strict = await host_with(api, facts("container", allowed=("nvcr.io",)))
        status, body = await rent(api, offer_id=f"{strict}:{RTX}", workload=CONTAINER)
        assert_error(status, body, 422, "image_not_allowed")

    async def test_limits_above_the_hosts_are_refused(self, api: Api) -> None:
        """A workload asking for more CPU or memory than a host has is never placed there: 422 on its offer, 409 saying why."""
        small = await host_with(api, facts("container", cores=4, memory_mib=8192))
        status, body = await rent(api, offer_id=f"{small}:{RTX}", workload={**CONTAINER, "cpu_cores": 8})
        assert_error(status, body, 422, "limits_exceed_host")
        assert "8 CPU cores (it has 4)" in body["message"]
        status, body = await rent(api, offer_id=f"{small}:{RTX}", workload={**CONTAINER, "memory_mib": 16384})
        assert_error(status, body, 422, "limits_exceed_host")
        status, body = await rent(api, workload={**CONTAINER, "memory_mib": 16384})  # no host could: the field and the most
        assert_error(status, body, 422, "limits_exceed_host")
        assert body["details"]["problems"][0]["field"] == "workload.memory_mib" and "at most" in body["details"]["problems"][0]["problem"]
        status, body = await rent(api, offer_id=f"{small}:{RTX}", workload={**CONTAINER, "cpu_cores": 4, "memory_mib": 8192})
        assert status == 201, body


class TestStartProgressAndFailures:
    async def test_pull_progress_becomes_rate_bounded_rental_events(self, api: Api) -> None:
        """Progress is an event; within 2 s only a stage change adds one; a redelivery adds nothing."""
        host_id = await host_with(api, facts("container"))
        _, rental = await rent(api, template="pytorch")
        t0 = datetime.now(UTC)
        reports = [
            progress(host_id, rental["id"], "pulling", "pulling pytorch/pytorch", t0, 0),
            progress(host_id, rental["id"], "pulling", "downloading layers", t0 + timedelta(seconds=1), 40),  # too soon
            progress(host_id, rental["id"], "pulling", "downloading layers", t0 + timedelta(seconds=2.5), 80),
            progress(host_id, rental["id"], "pulled", "pulled pytorch/pytorch", t0 + timedelta(seconds=2.6)),  # a new stage
            progress(host_id, rental["id"], "starting", "starting the container", t0 + timedelta(seconds=2.7)),
        ]
        for report in [*reports, reports[3]]:
            await agent_says(api, report)
        _, body = await api.as_renter("GET", f"/rentals/{rental['id']}")
        causes = [e["cause"] for e in body["events"] if e["cause"].startswith("workload ")]
        assert causes == [
            "workload pulling: pulling pytorch/pytorch (0%)", "workload pulling: downloading layers (80%)",
            "workload pulled: pulled pytorch/pytorch", "workload starting: starting the container",
        ]  # fmt: skip
        assert all(e["from"] == e["to"] == "starting" for e in body["events"] if e["cause"].startswith("workload "))

    async def test_progress_travels_the_bus_to_the_rentals_events(self, api: Api) -> None:
        """A workload_progress frame the relay published is applied by the ingestor like any agent message."""
        host_id = await host_with(api, facts("container"))
        _, rental = await rent(api, template="base")
        now = datetime.now(UTC)
        message = progress(host_id, rental["id"], "pulling", "pulling ubuntu:24.04", now, 12.5)
        await api.master.bus.publish(protocol.AGENT_EVENTS_STREAM, protocol.encode_bus_envelope("relay-t", message, now))
        ingestor = Ingestor(api.master, block=0.05)
        task = asyncio.create_task(ingestor.run())

        async def pulled() -> list[str]:
            _, body = await api.as_renter("GET", f"/rentals/{rental['id']}")
            return [e["cause"] for e in body["events"] if e["cause"].startswith("workload ")]

        try:
            assert await eventually(pulled, what="the progress event") == ["workload pulling: pulling ubuntu:24.04 (12%)"]
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def test_progress_for_a_rental_of_another_host_is_ignored(self, api: Api) -> None:
        """A host cannot write events into a rental it does not run."""
        await host_with(api, facts("container"))
        _, rental = await rent(api, template="base")
        other = await host_with(api, facts("container"))
        await agent_says(api, progress(other, rental["id"], "pulling", "forged", datetime.now(UTC)))
        _, body = await api.as_renter("GET", f"/rentals/{rental['id']}")
        assert not any("forged" in e["cause"] for e in body["events"])

    @pytest.mark.parametrize(
        "code", ["image_pull_failed", "image_not_allowed", "image_too_large", "container_runtime_unavailable", "workload_not_isolated"]
    )
    async def test_a_failed_start_fails_the_rental_with_its_code_and_charges_nothing(self, api: Api, code: str) -> None:
        """The agent's code ends the rental failed with the reason in its events, and rating posts nothing for it."""
        host_id = await host_with(api, facts("container"))
        _, rental = await rent(api, template="base")
        command = await start_command(api, rental["id"])
        detail = "pull access denied for ubuntu: manifest unknown"
        await agent_says(api, command_result(host_id, next(_seq), command.id, ok=False, detail=detail, data={"code": code}))
        _, body = await api.as_renter("GET", f"/rentals/{rental['id']}")
        assert body["state"] == "failed" and body["failure_code"] == code
        assert body["failure_reason"] == f"{code}: {detail}" and body["started_at"] is None
        assert body["events"][-1]["to"] == "failed" and code in body["events"][-1]["cause"]
        await rate_open_rentals(api.master.db, now=datetime.now(UTC) + timedelta(hours=1), policy=RatingPolicy(min_period_s=60))
        async with api.master.db.session() as session:
            posted = (await session.scalars(select(LedgerTransaction).where(LedgerTransaction.rental_id == rental["id"]))).all()
        assert posted == []
        _, host = await api.as_provider("GET", f"/hosts/{host_id}")
        assert host["state"] == "online" and host["active_rentals"] == []

    async def test_a_code_leading_the_detail_is_read_when_data_has_none(self, api: Api) -> None:
        """An agent that only writes 'image_pull_failed: ...' in its detail still gives the rental its code."""
        host_id = await host_with(api, facts("container"))
        _, rental = await rent(api, template="base")
        command = await start_command(api, rental["id"])
        await agent_says(api, command_result(host_id, next(_seq), command.id, ok=False, detail="image_pull_failed: timeout"))
        _, body = await api.as_renter("GET", f"/rentals/{rental['id']}")
        assert body["failure_code"] == "image_pull_failed" and body["failure_reason"] == "image_pull_failed: timeout"

    async def test_a_started_container_rental_is_charged_as_usual(self, api: Api) -> None:
        """The control for the test above: the same rating pass charges a rental the agent confirmed started."""
        await host_with(api, facts("container"))
        _, rental = await rent(api, template="base")
        await api.agent_reports(rental["id"], "start_workload")
        await rate_open_rentals(api.master.db, now=datetime.now(UTC) + timedelta(hours=1), policy=RatingPolicy(min_period_s=60))
        async with api.master.db.session() as session:
            posted = (await session.scalars(select(LedgerTransaction).where(LedgerTransaction.rental_id == rental["id"]))).all()
        assert [p.kind for p in posted] == ["usage"]

    async def test_a_failed_pull_reported_as_the_workloads_end_is_a_failed_start_too(self, api: Api) -> None:
        """workload_exited while starting, with a start-failure code leading its reason: failed with that code, not charged."""
        host_id = await host_with(api, facts("container"))
        _, rental = await rent(api, template="base")
        exited = protocol.WorkloadExited(
            host_id=host_id, seq=next(_seq), ts=datetime.now(UTC),
            body=protocol.WorkloadExitedBody(rental_id=rental["id"], at=datetime.now(UTC), reason="image_pull_failed: no such host"),
        )  # fmt: skip
        async with api.master.db.session() as session:
            await hosts.handle_workload_exited(session, envelope(exited))
        _, body = await api.as_renter("GET", f"/rentals/{rental['id']}")
        assert body["state"] == "failed" and body["failure_code"] == "image_pull_failed" and body["started_at"] is None
        assert body["failure_reason"] == "image_pull_failed: no such host"

    async def test_a_workload_stopped_over_its_disk_quota_fails_as_the_renters_doing(self, api: Api) -> None:
        """An agent's exit report with reason ``disk_quota_exceeded: ...`` (not a plain exit code): failed with that code, the renter's doing."""
        host_id = await host_with(api, facts("container"))
        _, rental = await rent(api, template="base")
        await api.agent_reports(rental["id"], "start_workload")
        why = "disk_quota_exceeded: the container wrote 1.1 GiB outside /workspace, over its 1 GiB quota"
        exited = protocol.WorkloadExited(
            host_id=host_id, seq=next(_seq), ts=datetime.now(UTC),
            body=protocol.WorkloadExitedBody(rental_id=rental["id"], exit_code=-9, at=datetime.now(UTC), reason=why),
        )  # fmt: skip
        async with api.master.db.session() as session:
            await hosts.handle_workload_exited(session, envelope(exited))
        _, body = await api.as_renter("GET", f"/rentals/{rental['id']}")
        assert body["state"] == "failed" and body["failure_code"] == "disk_quota_exceeded"
        assert body["failure_reason"] == f"workload stopped by its host: {why}" and body["failure_owner"] == "renter"
