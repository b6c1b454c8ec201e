"""Templates and isolated rentals on the master: template CRUD and roles, rentals that name a template
or an image, placement by the hosts' isolation facts, the ``isolated`` offer filter, workload
progress as rental events, and failed starts that end a rental ``failed`` with nothing charged.

Driven through the REST API on SQLite and PostgreSQL (the ``api`` fixture); agents are simulated by
applying their hello, progress and command results as the ingestor would.
"""

from __future__ import annotations

from typing import Any

import pytest

from master.models import Command, Rental
from tests.apiclient import Api, assert_error
from tests.factories import create_principal

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
        status, body = await rent(api)
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

