"""Parser bombs and out-of-range times against the REST API: a 400 or 422 with a stable code, never a 500.

The reader (``master.api.jsonbody``) is tested as a pure function; then hypothesis draws bombs
(nesting 10,000 deep, integers of 5,000 digits, ``1e999``) and times with offsets
(``9999-12-31T23:59:59-23:59``) against the real app on SQLite and PostgreSQL (the ``api``
fixture): before sign-in (``/sessions``, ``/enroll``), with an API key (rentals, credits,
listings, metrics) and through a console session.
"""

from __future__ import annotations

import json
import secrets
from typing import Any

import pydantic_core
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from master.api.base import API
from master.api.jsonbody import (
    BODY_ITEMS,
    MAX_DEPTH,
    MAX_NUMBER_DIGITS,
    InvalidJson,
    decode_json_body,
    largest_body,
)
from master.models import Rental
from master.services.accounts.sessions import CSRF_HEADER
from tests import hostile
from tests.apiclient import Api, bearer
from tests.factories import create_principal

# The api fixture is built once per test and shared by its examples: every example here is refused and changes nothing.
HTTP_SETTINGS = settings(
    max_examples=25, deadline=None, derandomize=True, database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow, HealthCheck.data_too_large],
)  # fmt: skip
PURE_SETTINGS = settings(max_examples=200, deadline=None, derandomize=True, database=None,
                         suppress_health_check=[HealthCheck.data_too_large, HealthCheck.too_slow])  # fmt: skip

# A JSON value within the bounds: what a client may send.
json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(10**30), 10**30) | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(st.characters(exclude_categories=["Cs"]), max_size=20),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4),
    max_leaves=30,
)  # fmt: skip


class TestJsonBodyReader:
    @PURE_SETTINGS
    @given(value=json_values)
    def test_json_within_the_bounds_reads_as_json_does(self, value: Any) -> None:
        """Any JSON value of sane depth and numbers decodes to what json.loads makes of it."""
        text = json.dumps(value)
        assert decode_json_body(text.encode()) == json.loads(text)

    @PURE_SETTINGS
    @given(text=hostile.bomb_literals())
    def test_a_bomb_is_invalid_json_in_one_line(self, text: str) -> None:
        """Nesting, long integers and overflowing numbers are InvalidJson (code invalid_json) with a short one-line message."""
        with pytest.raises(InvalidJson) as caught:
            decode_json_body(text.encode())
        assert caught.value.code == "invalid_json" and caught.value.http_status == 400
        assert "\n" not in str(caught.value) and len(str(caught.value)) < 300

    @PURE_SETTINGS
    @given(data=st.binary(max_size=512) | st.text(max_size=200).map(lambda t: t.encode("utf-8", "surrogatepass")))
    def test_arbitrary_bytes_are_json_or_invalid_json(self, data: bytes) -> None:
        """Nothing but InvalidJson ever comes out of the reader."""
        try:
            decode_json_body(data)
        except InvalidJson:
            pass

    def test_the_bounds_are_exact(self) -> None:
        """MAX_DEPTH levels and MAX_NUMBER_DIGITS digits pass; one more of either is refused."""
        assert decode_json_body(hostile._nest(MAX_DEPTH, "mixed", "1").encode()) is not None
        assert decode_json_body(("9" * MAX_NUMBER_DIGITS).encode()) == int("9" * MAX_NUMBER_DIGITS)
        assert decode_json_body(b"1.7976931348623157e308") == 1.7976931348623157e308
        assert decode_json_body(b"1e-999") == 0.0
        for bomb in (hostile._nest(MAX_DEPTH + 1, "array", ""), "9" * (MAX_NUMBER_DIGITS + 1), "1.8e308"):
            with pytest.raises(InvalidJson):
                decode_json_body(bomb.encode())

    def test_brackets_and_digits_inside_strings_do_not_count(self) -> None:
        """A string may hold any number of brackets, digits and escaped quotes."""
        text = json.dumps({"a": "[" * 1000 + "\\\"{" + "9" * 1000 + "1e999"})
        assert decode_json_body(text.encode()) == json.loads(text)

    @pytest.mark.parametrize("item", BODY_ITEMS.values(), ids=BODY_ITEMS.keys())
    def test_a_body_of_the_largest_size_of_the_items_each_scan_likes_least_is_read(self, item: bytes) -> None:
        """A 1 MiB body of items at each scan's limit reads as the parser reads it (bench/bench_jsonbody.py times
        the same bodies against the parse alone: no scan is quadratic in a run of digits or brackets)."""
        body = largest_body(item)
        assert decode_json_body(body) == pydantic_core.from_json(body)

    def test_lone_surrogates_are_refused(self) -> None:
        """A lone surrogate escape is not text the database can store: invalid_json, not a 500 later."""
        with pytest.raises(InvalidJson):
            decode_json_body(b'{"api_key": "\\ud800"}')


async def send(api: Api, method: str, path: str, body: bytes, headers: dict[str, str] | None = None) -> tuple[int, Any]:
    headers = {"Content-Type": "application/json", **(headers or {})}
    async with api.client.request(method, API + path, data=body, headers=headers) as response:
        assert response.content_type == "application/json", await response.text()
        return response.status, await response.json()


def assert_invalid_json(status: int, body: Any) -> None:
    assert (status, body["code"]) == (400, "invalid_json"), body
    assert "\n" not in body["message"] and len(body["message"]) < 300, body


class TestParserBombs:
    """Every body-reading route answers a parser bomb with 400 invalid_json, signed in or not."""

    @HTTP_SETTINGS
    @given(body=hostile.bomb_bodies(("api_key",)))
    @example(body=b"[" * 10_000 + b"]" * 10_000)
    @example(body=b'{"api_key": ' + b"9" * 5000 + b"}")
    async def test_sign_in(self, api: Api, body: bytes) -> None:
        assert_invalid_json(*await send(api, "POST", "/sessions", body))

    @HTTP_SETTINGS
    @given(body=hostile.bomb_bodies(("token", "csr", "hostname")))
    async def test_enroll(self, api: Api, body: bytes) -> None:
        assert_invalid_json(*await send(api, "POST", "/enroll", body))

    @HTTP_SETTINGS
    @given(body=hostile.bomb_bodies(("gpu_count", "gpu_milli", "bid", "queue_timeout_s", "workload")))
    @example(body=b'{"gpu_count": 1e999}')
    async def test_rentals(self, api: Api, body: bytes) -> None:
        assert_invalid_json(*await send(api, "POST", "/rentals", body, bearer(api.renter_key)))
        assert await api.count(Rental) == 0

    @HTTP_SETTINGS
    @given(body=hostile.bomb_bodies(("amount", "account_id", "reference")))
    async def test_credits(self, api: Api, body: bytes) -> None:
        _, admin_key = await create_principal(api.master, f"admin-{secrets.token_hex(4)}", "admin")
        assert_invalid_json(*await send(api, "POST", "/account/credits", body, bearer(admin_key)))

    @HTTP_SETTINGS
    @given(body=hostile.bomb_bodies(("price_per_gpu_hour", "maintenance_windows", "available_until")))
    async def test_listings(self, api: Api, body: bytes) -> None:
        assert_invalid_json(*await send(api, "PUT", "/hosts/h-any/listing", body, bearer(api.provider_key)))

    async def test_through_a_console_session(self, api: Api) -> None:
        """The console's calls (cookie and CSRF token) read their bodies through the same reader."""
        async with api.client.post(API + "/sessions", json={"api_key": api.renter_key}) as response:
            csrf = (await response.json())["csrf_token"]
        for bomb in (b"[" * 10_000, b'{"gpu_count": ' + b"1" * 5000 + b"}", b'{"gpu_count": 1e999}'):
            assert_invalid_json(*await send(api, "POST", "/rentals", bomb, {CSRF_HEADER: csrf}))


class TestTimes:
    """Every time the API reads is range-checked once in UTC: 400 invalid_query or 422 validation_failed, never a 500."""

    @HTTP_SETTINGS
    @given(since=hostile.timestamps(), until=hostile.timestamps())
    async def test_metrics_since_and_until(self, api: Api, since: str, until: str) -> None:
        host_id = await self.host(api)
        status, body = await api.as_renter("GET", f"/hosts/{host_id}/metrics", params={"since": since, "until": until})
        if hostile.in_range(since) and hostile.in_range(until):
            assert status == 200, body
        else:
            assert (status, body["code"]) == (400, "invalid_query"), body
            assert "once in UTC" in body["message"]

    @HTTP_SETTINGS
    @given(until=hostile.timestamps())
    @example(until="9999-12-31T23:59:59-23:59")
    async def test_listing_available_until(self, api: Api, until: str) -> None:
        host_id = await self.host(api)
        status, body = await api.as_provider("PUT", f"/hosts/{host_id}/listing",
                                             json={"price_per_gpu_hour": "0.45", "available_until": until})  # fmt: skip
        self.assert_refused_only_when_out_of_range(status, body, [until], ok_codes={"invalid_available_until"})

    @HTTP_SETTINGS
    @given(start=hostile.timestamps(), end=hostile.timestamps())
    @example(start="2030-01-01T00:00:00Z", end="9999-12-31T23:59:59-23:59")
    @example(start="0001-01-01T00:00:00+23:59", end="2030-01-01T00:00:00Z")
    async def test_maintenance_windows(self, api: Api, start: str, end: str) -> None:
        host_id = await self.host(api)
        status, body = await api.as_provider("PUT", f"/hosts/{host_id}/listing",
                                             json={"price_per_gpu_hour": "0.45", "maintenance_windows": [{"start": start, "end": end}]})  # fmt: skip
        self.assert_refused_only_when_out_of_range(status, body, [start, end], ok_codes={"invalid_maintenance_window"})

    @staticmethod
    def assert_refused_only_when_out_of_range(status: int, body: Any, times: list[str], *, ok_codes: set[str]) -> None:
        if all(hostile.in_range(t) for t in times):
            # In range: the listing's own rules decide (in the past, ends before it starts, ...).
            assert status in (200, 201) or (status, body["code"]) in {(422, code) for code in ok_codes}, body
        else:
            assert (status, body["code"]) == (422, "validation_failed"), body
            assert "once in UTC" in body["message"]

    async def host(self, api: Api) -> str:
        """The provider's one host (made by the first example of a test, kept for the others)."""
        status, body = await api.as_provider("GET", "/hosts")
        assert status == 200
        if body["items"]:
            return str(body["items"][0]["id"])
        host_id, _ = await api.host(1)
        return host_id

    @pytest.mark.parametrize("naive", ["2030-01-01T00:00:00", "2030-01-01"])
    async def test_a_time_without_an_offset_is_still_refused(self, api: Api, naive: str) -> None:
        """As before: the API needs an offset on every time it reads."""
        host_id = await self.host(api)
        status, body = await api.as_renter("GET", f"/hosts/{host_id}/metrics", params={"since": naive})
        assert (status, body["code"]) == (400, "invalid_query") and "timezone" in body["message"]
        status, body = await api.as_provider("PUT", f"/hosts/{host_id}/listing", json={"price_per_gpu_hour": "0.45", "available_until": naive})
        assert (status, body["code"]) == (422, "validation_failed")
