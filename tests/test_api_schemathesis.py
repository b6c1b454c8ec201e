"""The REST API against its own OpenAPI document, with schemathesis: no 500s, no response the document does not allow.

A real master (SQLite, in-process bus, no background loops) serves its app on 127.0.0.1
from its own loop thread; the cases come from the document it serves at
``GET /api/v1/openapi.json`` (built at collection by the same ``build_openapi``).
Seeded data (a host with a listing, a rental, an invoice, an alert) lets path ids resolve
half of the time. Every operation runs with the key of each role that may call it (the
route table's ``roles``; admins may call everything), with valid and invalid inputs
(schemathesis' positive and negative modes), a fixed number of examples and a
deterministic seed. Checks: not a server error, the status code is documented, the
content type is documented, the body matches its schema, and invalid input is refused.
"""

from __future__ import annotations

import secrets
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import requests
import schemathesis
from aiohttp import web
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ed25519
from hypothesis import strategies as st
from pydantic import SecretStr
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    negative_data_rejection,
    response_schema_conformance,
    status_code_conformance,
)

from billing import credits
from gpumarket.mailsink import MailSink
from master.api.base import API
from master.api.openapi import build_openapi
from master.api.table import ROUTES
from master.app import close_master, create_app, open_master
from master.context import Master
from master.models import Alert
from master.services.accounts import ssh_keys
from master.services.accounts.core import Principal
from shared.bus import InProcessBus
from shared.ids import new_id
from tests import hostile
from tests.factories import create_principal, gpu_info, master_settings, online_host
from tests.loopthread import LoopThread

MAX_EXAMPLES = 15  # per operation and role: 60 operations × 3 roles × both modes, about 70 s of CPU
CHECKS = [
    not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance,
    negative_data_rejection,
]  # fmt: skip
ROLES = ("renter", "provider", "admin")
ROUTE_OF_OPERATION = {route.handler.__name__: route for route in ROUTES}
REQUEST_TIMEOUT = 30.0


@dataclass
class LiveApi:
    """The served master: its URL, a key per role, and real ids for each path parameter."""

    base_url: str
    keys: dict[str, str]
    ids: dict[str, str]
    session: requests.Session
    principals: dict[str, Principal]
    master: Master
    thread: LoopThread


async def _seed(master: Master) -> tuple[dict[str, Principal], dict[str, str], dict[str, str]]:
    """Accounts of each role, an online host, a credit top-up (an invoice) and an alert; returns accounts, keys and ids."""
    principals, keys = {}, {}
    for role in ROLES:
        principals[role], keys[role] = await create_principal(master, f"fuzz-{role}", role)
    host_id = await online_host(master, principals["provider"], [gpu_info(0), gpu_info(1)])
    now = master.clock.now()
    renter = principals["renter"].account_id
    async with master.db.session() as session:
        await credits.top_up(session, renter, "25.00", reference="schemathesis-seed", at=now)
        alert = Alert(
            id=new_id("alert"), rule="host_offline", key=f"host_offline:{host_id}", open_key=f"host_offline:{host_id}",
            severity="warning", state="firing", host_id=host_id, summary="seeded", details={}, raised_at=now,
            last_seen_at=now,
        )  # fmt: skip
        session.add(alert)
        ssh_key = await ssh_keys.add_key(session, renter, _ssh_public_key(), now=now)
    ids = {
        "host_id": host_id,
        "account_id": renter,
        "invoice_id": f"inv-{now:%Y-%m}-{renter}",
        "alert_id": alert.id,
        "name": "base",  # a template seeded by the migrations
        "ssh_key_id": ssh_key.id,
    }
    return principals, keys, ids


@pytest.fixture(scope="module")
def live_api(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveApi]:
    tmp_path: Path = tmp_path_factory.mktemp("schemathesis")
    settings = master_settings(
        tmp_path, database_url=f"sqlite:///{tmp_path / 'api.db'}", stream_max_s=0.05, stream_poll_interval=0.01, payments="demo",
    )  # fmt: skip

    mail = MailSink()

    async def start() -> tuple[Master, web.AppRunner, int, dict[str, Principal], dict[str, str], dict[str, str]]:
        await mail.start()  # sign-up and password resets mail their links here
        settings.smtp_url = SecretStr(mail.url)
        master = await open_master(settings, bus=InProcessBus())
        principals, keys, ids = await _seed(master)
        runner = web.AppRunner(create_app(master, background=False))
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        return master, runner, port, principals, keys, ids

    async def stop(master: Master, runner: web.AppRunner) -> None:
        await runner.cleanup()
        await close_master(master)
        await mail.close()

    with LoopThread() as thread:
        master, runner, port, principals, keys, ids = thread.run(start())
        session = requests.Session()
        api = LiveApi(f"http://127.0.0.1:{port}", keys, ids, session, principals, master, thread)
        try:
            _seed_over_http(api)
            SEEDED_IDS.update(api.ids)
            yield api
        finally:
            SEEDED_IDS.clear()
            session.close()
            thread.run(stop(master, runner))


def _seed_over_http(api: LiveApi) -> None:
    """A listing on the host and a rental of one of its GPUs, made the way clients make them."""
    host_id = api.ids["host_id"]
    listed = api.session.put(
        f"{api.base_url}{API}/hosts/{host_id}/listing", json={"price_per_gpu_hour": "0.45"},
        headers=_bearer(api.keys["provider"]), timeout=REQUEST_TIMEOUT,
    )  # fmt: skip
    assert listed.status_code == 201, listed.text
    rented = api.session.post(
        f"{api.base_url}{API}/rentals", json={"gpu_count": 1}, headers=_bearer(api.keys["renter"]), timeout=REQUEST_TIMEOUT
    )
    assert rented.status_code == 201, rented.text
    api.ids["rental_id"] = rented.json()["id"]


def _ssh_public_key() -> str:
    public = ed25519.Ed25519PrivateKey.generate().public_key()
    return public.public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH).decode()


def _bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def roles_for(operation_id: str) -> Sequence[str | None]:
    """Who calls the operation: nobody signed in for public routes; else each role it allows, and admins."""
    route = ROUTE_OF_OPERATION[operation_id]
    if route.public:
        return [None]
    if not route.roles:
        return list(ROLES)
    return sorted({*route.roles, "admin"})


# The document the app serves (``test_the_served_document_is_the_one_tested`` holds them equal),
# loaded at collection so that each operation is a test of its own.
schema = schemathesis.openapi.from_dict(build_openapi(ROUTES))
schema.config.generation.update(
    modes=[schemathesis.GenerationMode.POSITIVE, schemathesis.GenerationMode.NEGATIVE],
    max_examples=MAX_EXAMPLES,
    deterministic=True,  # derandomized: the same cases on every run
    database="none",
    with_security_parameters=False,  # each case is sent with real keys (roles_for); a made-up key is only ever a 401
)
# Filled by the live_api fixture before any case is drawn.
SEEDED_IDS: dict[str, str] = {}


@schema.hook
def flatmap_path_parameters(context: schemathesis.HookContext, path_parameters: dict[str, Any] | None) -> Any:
    # Half of the cases name the seeded objects, so handlers get past their 404s.
    if not path_parameters:
        return st.just(path_parameters)
    real = {name: SEEDED_IDS.get(name, value) for name, value in path_parameters.items()}
    return st.sampled_from([path_parameters, real])


def _time_fields(document: dict[str, Any]) -> frozenset[str]:
    """The names of the body fields the document gives as date-times (with or without null)."""
    names = set()
    for component in document["components"]["schemas"].values():
        for name, field in component.get("properties", {}).items():
            if any(option.get("format") == "date-time" for option in (field, *field.get("anyOf", ()))):
                names.add(name)
    return frozenset(names)


TIME_FIELDS = _time_fields(schema.raw_schema)


def _replace_times(value: Any, stamps: Iterator[str]) -> Any:
    """``value`` with each date-time field's value taken from ``stamps`` in turn."""
    if isinstance(value, list):
        return [_replace_times(item, stamps) for item in value]
    if isinstance(value, dict):
        return {key: next(stamps) if key in TIME_FIELDS and isinstance(item, str) else _replace_times(item, stamps)
                for key, item in value.items()}  # fmt: skip
    return value


def _count_times(value: Any) -> int:
    if isinstance(value, list):
        return sum(map(_count_times, value))
    if isinstance(value, dict):
        return sum(1 if key in TIME_FIELDS and isinstance(item, str) else _count_times(item) for key, item in value.items())
    return 0


@schema.hook
def flatmap_body(context: schemathesis.HookContext, body: Any) -> Any:
    # Now and then a parser bomb in place of one of the body's values (400 invalid_json), or times with offsets
    # from year 1 to 9999 in its date-time fields (422 when out of range once in UTC): never a 500 (tests/hostile.py).
    if not isinstance(body, dict) or not body:
        return st.just(body)
    bombed = st.builds(lambda key, bomb: {**body, key: bomb}, st.sampled_from(sorted(body)), hostile.hostile_json_values())
    choices = [st.just(body), st.just(body), bombed]
    if times := _count_times(body):
        stamps = st.lists(hostile.timestamps(), min_size=times, max_size=times)
        choices.append(stamps.map(lambda drawn: _replace_times(body, iter(drawn))))
    return st.one_of(choices)


@schema.parametrize()
def test_api_conforms_to_its_openapi_document(case: schemathesis.Case[Any], live_api: LiveApi) -> None:
    """Every operation, as each role that may call it: no 500, and every response is one the document describes."""
    operation_id = case.operation.definition.raw["operationId"]
    for role in roles_for(operation_id):
        headers = _bearer(live_api.keys[role]) if role is not None else {}
        case.call_and_validate(
            base_url=live_api.base_url, session=live_api.session, headers=headers, checks=CHECKS, timeout=REQUEST_TIMEOUT
        )


def test_the_served_document_is_the_one_tested(live_api: LiveApi) -> None:
    """GET /openapi.json serves exactly the document the cases above were generated from."""
    served = live_api.session.get(f"{live_api.base_url}{API}/openapi.json", timeout=REQUEST_TIMEOUT)
    assert served.status_code == 200
    assert served.json() == build_openapi(ROUTES)


def test_every_route_is_in_the_document(live_api: LiveApi) -> None:
    """The schemathesis run covers every route of the table: each one is an operation of the served document."""
    document = live_api.session.get(f"{live_api.base_url}{API}/openapi.json", timeout=REQUEST_TIMEOUT).json()
    operations = {op["operationId"] for path in document["paths"].values() for op in path.values()}
    assert operations == set(ROUTE_OF_OPERATION)


def test_seeded_ids_resolve(live_api: LiveApi) -> None:
    """The ids the cases use half of the time name real objects (else every case would stop at a 404)."""
    paths = {
        "host_id": "/hosts/{}", "rental_id": "/rentals/{}", "invoice_id": "/invoices/{}", "alert_id": "/alerts/{}",
    }  # fmt: skip
    for name, template in paths.items():
        response = live_api.session.get(
            f"{live_api.base_url}{API}{template.format(live_api.ids[name])}", headers=_bearer(live_api.keys["admin"]),
            timeout=REQUEST_TIMEOUT,
        )  # fmt: skip
        assert response.status_code == 200, (name, response.text)



def call(live_api: LiveApi, method: str, path: str, key: str, **data: Any) -> schemathesis.Response:
    """One exact request through its operation in the document, validated by the same checks (but the negative one)."""
    case = schema[API + path][method].Case(**data)
    headers = _bearer(key)
    return case.call_and_validate(
        base_url=live_api.base_url, session=live_api.session, headers=headers, checks=CHECKS[:-1], timeout=REQUEST_TIMEOUT
    )


def fresh_renter_with_a_free_gpu(live_api: LiveApi) -> str:
    """A new renter's key, and a new listed host: the run above may have rented every GPU and set the seeded quotas to 0."""
    _, key = live_api.thread.run(create_principal(live_api.master, f"regression-{secrets.token_hex(4)}", "renter"))
    host_id = live_api.thread.run(online_host(live_api.master, live_api.principals["provider"], [gpu_info(0)]))
    listed = call(live_api, "PUT", "/hosts/{host_id}/listing", live_api.keys["provider"], path_parameters={"host_id": host_id},
                  body={"price_per_gpu_hour": "0.45"})  # fmt: skip
    assert listed.status_code == 201
    return key


class TestRegressions:
    """Each input the schemathesis run found failing, sent as it was found (after it, in the same master)."""

    def test_a_credit_of_1e100_is_refused_not_a_500(self, live_api: LiveApi) -> None:
        """Regression: amount "1e100" made ledger.cents quantize past the decimal context (InvalidOperation): a 500."""
        body = {"amount": "1e100", "account_id": live_api.ids["account_id"], "reference": "u\u00a8H8"}
        response = call(live_api, "POST", "/account/credits", live_api.keys["admin"], body=body)
        assert (response.status_code, response.json()["code"]) == (422, "invalid_amount")

    def test_a_repeated_credit_reference_is_a_documented_200(self, live_api: LiveApi) -> None:
        """Regression: the second top-up with one reference answers 200 (nothing credited), which was undocumented."""
        body = {"amount": "1.00", "account_id": live_api.ids["account_id"], "reference": "regression-repeat"}
        statuses = [call(live_api, "POST", "/account/credits", live_api.keys["admin"], body=body).status_code for _ in range(2)]
        assert statuses == [201, 200]

    def test_a_repeated_idempotency_key_is_a_documented_200_and_the_body_is_required(self, live_api: LiveApi) -> None:
        """Regression: a repeat of POST /rentals with the same Idempotency-Key answers 200, which was undocumented; and
        (issue 21) the body must name what to rent: without one it is 422 rental_target_missing, as the document says."""
        renter = fresh_renter_with_a_free_gpu(live_api)
        headers = {"Idempotency-Key": "regression-repeat"}
        empty = call(live_api, "POST", "/rentals", renter, headers=headers)
        assert (empty.status_code, empty.json()["code"]) == (422, "rental_target_missing")
        statuses = [call(live_api, "POST", "/rentals", renter, headers=headers, body={"gpu_count": 1}).status_code for _ in range(2)]
        assert statuses == [201, 200]
        operation = build_openapi(ROUTES)["paths"][f"{API}/rentals"]["post"]
        assert operation["requestBody"]["required"] is True

    def test_an_unknown_offer_is_a_documented_404(self, live_api: LiveApi) -> None:
        """Regression: a rental of an offer that does not exist answered 404 offer_not_found, undocumented."""
        response = call(live_api, "POST", "/rentals", fresh_renter_with_a_free_gpu(live_api), body={"offer_id": "\u00ee\u0099:bd", "gpu_milli": 268})
        assert (response.status_code, response.json()["code"]) == (404, "offer_not_found")

    def test_the_first_listing_of_a_host_is_a_documented_201(self, live_api: LiveApi) -> None:
        """Regression: PUT /hosts/{id}/listing answers 201 when it creates the listing; only 200 was documented."""
        host_id = live_api.thread.run(online_host(live_api.master, live_api.principals["provider"], [gpu_info(0)]))
        response = call(live_api, "PUT", "/hosts/{host_id}/listing", live_api.keys["provider"], path_parameters={"host_id": host_id},
                        body={"price_per_gpu_hour": "0.45"})  # fmt: skip
        assert response.status_code == 201

    def test_the_live_stream_is_documented_as_server_sent_events(self, live_api: LiveApi) -> None:
        """Regression: the stream answers text/event-stream, documented as JSON; ?after_seq=true is accepted as documented."""
        response = call(live_api, "GET", "/hosts/{host_id}/metrics/stream", live_api.keys["renter"],
                        path_parameters={"host_id": live_api.ids["host_id"]}, query={"after_seq": "true"})  # fmt: skip
        assert response.headers["content-type"][0].startswith("text/event-stream")
        (after_seq,) = [p for p in schema[f"{API}/hosts/{{host_id}}/metrics/stream"]["GET"].definition.raw["parameters"]
                        if p["name"] == "after_seq"]  # fmt: skip
        assert after_seq["schema"]["type"] == "string"

    @pytest.mark.parametrize(("wanted", "media_type"), [("html", "text/html"), ("", "application/json")])
    def test_an_invoice_as_html_or_with_an_empty_format_is_documented(self, live_api: LiveApi, wanted: str, media_type: str) -> None:
        """Regression: ?format=html answers text/html (documented as JSON only); ?format= is the default (json), as
        every empty query parameter is, now documented with allowEmptyValue."""
        response = call(live_api, "GET", "/invoices/{invoice_id}", live_api.keys["renter"],
                        path_parameters={"invoice_id": live_api.ids["invoice_id"]}, query={"format": wanted})  # fmt: skip
        assert (response.status_code, response.headers["content-type"][0].split(";")[0]) == (200, media_type)
        (parameter,) = schema[f"{API}/invoices/{{invoice_id}}"]["GET"].definition.raw["parameters"][1:]
        assert parameter["allowEmptyValue"] is True

    def test_an_ssh_key_is_a_documented_201_then_409_then_deleted(self, live_api: LiveApi) -> None:
        """A real key (the generated bodies are almost never one): 201 with the documented key, 409 ssh_key_exists on
        its repeat, 200 on its deletion and then 404, each conforming to the document."""
        key = live_api.keys["provider"]
        created = call(live_api, "POST", "/account/ssh-keys", key, body={"public_key": _ssh_public_key() + " fuzz"})
        assert created.status_code == 201
        again = call(live_api, "POST", "/account/ssh-keys", key, body={"public_key": created.json()["public_key"]})
        assert (again.status_code, again.json()["code"]) == (409, "ssh_key_exists")
        path = {"ssh_key_id": created.json()["id"]}
        assert call(live_api, "DELETE", "/account/ssh-keys/{ssh_key_id}", key, path_parameters=path).status_code == 200
        assert call(live_api, "DELETE", "/account/ssh-keys/{ssh_key_id}", key, path_parameters=path).status_code == 404

    def test_a_far_future_time_with_an_offset_is_a_documented_422(self, live_api: LiveApi) -> None:
        """Regression (issue 21): 9999-12-31T23:59:59-23:59 overflowed once converted to UTC: a 500 on listings."""
        body = {"price_per_gpu_hour": "0.45", "maintenance_windows": [{"start": "2030-01-01T00:00:00Z", "end": hostile.EXTREME_TIMESTAMPS[0]}]}
        response = call(live_api, "PUT", "/hosts/{host_id}/listing", live_api.keys["provider"],
                        path_parameters={"host_id": live_api.ids["host_id"]}, body=body)  # fmt: skip
        assert (response.status_code, response.json()["code"]) == (422, "validation_failed")

    def test_a_parser_bomb_is_a_documented_400(self, live_api: LiveApi) -> None:
        """Regression (issue 21): deep nesting (10,000 levels: a RecursionError) or an integer of thousands of digits was a 500."""
        for value in (hostile.nested_value(400), 10**4000):
            response = call(live_api, "POST", "/rentals", live_api.keys["renter"], body={"gpu_count": value})
            assert (response.status_code, response.json()["code"]) == (400, "invalid_json")
