"""Parser bombs, out-of-range times and malformed text against the REST API: a 400 or 422 with a stable code, never a 500.

The reader (``master.api.jsonbody``) is tested as a pure function; then hypothesis draws bombs
(nesting 10,000 deep, integers of 5,000 digits, ``1e999``) and times with offsets
(``9999-12-31T23:59:59-23:59``) against the real app on SQLite and PostgreSQL (the ``api``
fixture): before sign-in (``/sessions``, ``/enroll``), with an API key (rentals, credits,
listings, metrics) and through a console session. Then malformed text (issue 39), on both databases:
control characters in every route's path and query parameters and in bodies, a trailing line feed past
a validating pattern (and a lint that keeps ``re.match`` with ``$`` out), duplicate keys, times outside
the one RFC 3339 grammar.
"""

from __future__ import annotations

import ast
import json
import re
import secrets
from pathlib import Path
from typing import Any
from urllib.parse import urlencode

import pydantic_core
import pytest
import sqlalchemy as sa
from aiohttp import web
from aiohttp.test_utils import make_mocked_request
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from pydantic import TypeAdapter, ValidationError
from yarl import URL

from master.api.base import API
from master.api.characters import InvalidCharacter
from master.api.jsonbody import (
    BODY_ITEMS,
    MAX_DEPTH,
    MAX_NUMBER_DIGITS,
    DuplicateKey,
    InvalidJson,
    decode_json_body,
    largest_body,
)
from master.api.middleware import errors_middleware
from master.api.table import ROUTES
from master.models import Rental
from master.services.accounts.sessions import CSRF_HEADER
from shared.imageref import parse_image_reference
from shared.protocol import Env
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

# Control characters a body's string may not hold (master.api.characters): all of C0 but tab, line feed and return; DEL.
REFUSED_IN_TEXT = "".join(chr(c) for c in [*range(0x09), 0x0B, 0x0C, *range(0x0E, 0x20), 0x7F])
TEXT = st.characters(exclude_categories=["Cs"], exclude_characters=REFUSED_IN_TEXT)
# A JSON value within the bounds: what a client may send.
json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(10**30), 10**30) | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(TEXT, max_size=20),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(TEXT, max_size=8), children, max_size=4),
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
    @given(value=json_values, control=st.sampled_from(REFUSED_IN_TEXT), as_key=st.booleans())
    def test_a_control_character_anywhere_is_invalid_character(self, value: Any, control: str, as_key: bool) -> None:
        """A refused control character in any string, key or value, beside any value, is InvalidCharacter naming it."""
        text = f"x{control}"
        body = {"ok": value, text: 1} if as_key else {"ok": value, "bad": [text]}
        with pytest.raises(InvalidCharacter) as caught:
            decode_json_body(json.dumps(body).encode())
        assert caught.value.code == "invalid_character" and f"U+{ord(control):04X}" in str(caught.value)

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


def raw_url(path: str, query: str = "") -> URL:
    """``/api/v1`` + ``path`` (and ``?query``) sent as written: percent escapes such as ``%00`` are not re-encoded."""
    return URL(API + path + (f"?{query}" if query else ""), encoded=True)


async def call_raw(api: Api, method: str, url: URL, key: str | None) -> tuple[int, Any]:
    async with api.client.request(method, url, headers=bearer(key) if key else {}) as response:
        assert response.content_type == "application/json", await response.text()
        return response.status, await response.json()


def assert_invalid_character(status: int, body: Any, field: str) -> None:
    assert (status, body["code"]) == (400, "invalid_character"), body
    assert field in body["message"] and "\n" not in body["message"], body


_PARAMETER = re.compile(r"\{([A-Za-z_][A-Za-z0-9_]*)(?::[^}]*)?\}")
CONTROL_ESCAPES = ("%00", "%0A", "%1B", "%7F")
"""NUL (PostgreSQL cannot store it: a 500 before issue 39), a line feed, ESC and DEL."""


class TestControlCharacters:
    """NUL and the other control characters are 400 ``invalid_character`` naming the field, in a path, a query or a body,
    on both databases, before any handler or database sees them (issue 39: on PostgreSQL each was a 500)."""

    @pytest.mark.parametrize("escape", CONTROL_ESCAPES)
    async def test_every_path_parameter_of_every_route(self, api: Api, escape: str) -> None:
        """Each route of the table, with the control character in each of its path parameters in turn."""
        _, admin_key = await create_principal(api.master, f"admin-{secrets.token_hex(4)}", "admin")
        checked = 0
        for route in ROUTES:
            names = _PARAMETER.findall(route.path)
            for name in names:
                path = _PARAMETER.sub(lambda m, name=name: f"x{escape}y" if m.group(1) == name else "p-1", route.path)  # type: ignore[misc]
                status, body = await call_raw(api, route.method, raw_url(path), admin_key)
                assert_invalid_character(status, body, f"path parameter {name!r}")
                checked += 1
        assert checked >= 40  # every id in every path: hosts, rentals, clusters, services, keys, teams, ...

    @pytest.mark.parametrize("escape", CONTROL_ESCAPES)
    async def test_every_declared_query_parameter_of_every_route(self, api: Api, escape: str) -> None:
        """Each route of the table, with the control character in the value of each query parameter it declares."""
        _, admin_key = await create_principal(api.master, f"admin-{secrets.token_hex(4)}", "admin")
        checked = 0
        for route in ROUTES:
            path = _PARAMETER.sub("p-1", route.path)
            for parameter in route.query:
                status, body = await call_raw(api, route.method, raw_url(path, f"{parameter.name}=1{escape}"), admin_key)
                assert_invalid_character(status, body, f"query parameter {parameter.name!r}")
                checked += 1
        assert checked >= 30

    @pytest.mark.parametrize(
        ("method", "path", "query", "field"),
        [
            ("GET", "/offers", "q=region%3Deu%00", "query parameter 'q'"),
            ("GET", "/offers", "region=eu%00", "query parameter 'region'"),
            ("GET", "/offers", "reg%00ion=eu", "query parameter name"),
            ("GET", "/rentals/r-%00", "", "path parameter"),
            ("GET", "/hosts/h%00", "", "path parameter"),
            ("GET", "/hosts/h%00/metrics", "since=2030-01-01T00:00:00Z", "path parameter"),
        ],
    )
    async def test_the_cases_of_the_report(self, api: Api, method: str, path: str, query: str, field: str) -> None:
        """The hostile suite's round 3: each a 500 on PostgreSQL before."""
        assert_invalid_character(*await call_raw(api, method, raw_url(path, query), api.renter_key), field)

    @pytest.mark.parametrize(
        ("body", "field"),
        [
            ({"requirements": "region=eu\u0000"}, "'requirements'"),
            ({"offer_id": "h-x\u0000:y"}, "'offer_id'"),
            ({"gpu_model": "RTX\u001b[2J"}, "'gpu_model'"),
            ({"workload": {"kind": "container", "image": "busybox", "env": {"A": "1\u0000"}}}, "'workload.env.A'"),
            ({"workload": {"kind": "container", "image": "busybox", "args": ["ok", "x\u007f"]}}, "'workload.args[1]'"),
            ({"workload": {"kind": "container", "image": "busybox", "env": {"A\u0000": "1"}}}, "body key"),
        ],
    )
    async def test_a_control_character_in_a_rental_body(self, api: Api, body: dict[str, Any], field: str) -> None:
        """Anywhere in the body, at any depth, key or value: 400 naming the field; nothing rented."""
        status, answer = await api.as_renter("POST", "/rentals", json=body)
        assert_invalid_character(status, answer, field)
        assert await api.count(Rental) == 0

    async def test_a_services_endpoint_forwards_its_renters_paths_and_queries_as_they_are(self, api: Api) -> None:
        """``/svc/…`` is outside the table: a line feed in its path or query is its renter's server's to judge, so the
        app answers as for any request (here: no such service; this app may serve no gateway), not ``invalid_character``."""
        async with api.client.get(URL("/svc/s-none/a%0Ab?q=x%0Ay", encoded=True), headers=bearer(api.renter_key)) as response:
            assert (response.status, (await response.json())["code"]) in {(404, "service_not_found"), (404, "not_found")}

    async def test_a_nul_in_an_admin_credits_account_id(self, api: Api) -> None:
        """The report's admin credit: a 500 on PostgreSQL before."""
        _, admin_key = await create_principal(api.master, "admin-credits", "admin")
        status, body = await api.call("POST", "/account/credits", admin_key,
                                      json={"account_id": "acct\u0000", "amount": "1.00", "reference": "nul-1"})  # fmt: skip
        assert_invalid_character(status, body, "'account_id'")

    async def test_a_console_sessions_body_is_read_the_same(self, api: Api) -> None:
        """The console's calls (cookie and CSRF token) go through the same reader."""
        async with api.client.post(API + "/sessions", json={"api_key": api.renter_key}) as response:
            csrf = (await response.json())["csrf_token"]
        status, body = await send(api, "POST", "/rentals", b'{"requirements": "region=eu\\u0000"}', {CSRF_HEADER: csrf})
        assert_invalid_character(status, body, "'requirements'")

    async def test_tabs_and_line_breaks_stay_for_multi_line_fields(self, api: Api) -> None:
        """A body's tab, line feed and carriage return are not refused by the reader: a field's own grammar decides
        (a single-line field refuses them with 422; here, a key's name)."""
        status, body = await api.as_renter("POST", "/api-keys", json={"name": "ci\nrunner"})
        assert (status, body["code"]) == (422, "validation_failed"), body
        assert body["details"]["problems"][0]["field"] == "name"

    async def test_text_the_database_cannot_store_is_400_not_500(self, api: Api) -> None:
        """The errors middleware's safety net: PostgreSQL refusing NUL in text (CharacterNotInRepertoireError) or
        ``\\u0000`` in JSON (UntranslatableCharacterError), from whatever got past the checks, is 400
        ``invalid_character``; on SQLite, which stores both, the handler answers."""

        async def handler(request: web.Request) -> web.StreamResponse:
            async with api.master.db.session() as session:
                await session.execute(sa.text(request.query["sql"]), {"value": request.query["value"]})
            return web.json_response({"stored": True})

        for sql, value in (("SELECT CAST(:value AS TEXT)", "a\x00b"), ("SELECT CAST(:value AS JSONB)", '"\\u0000"')):
            if api.master.db.is_sqlite:
                sql = sql.replace("JSONB", "TEXT")
            request = make_mocked_request("GET", "/any?" + urlencode({"sql": sql, "value": value}))
            response = await errors_middleware(request, handler)
            assert isinstance(response, web.Response) and response.text is not None
            if api.master.db.is_sqlite:
                assert response.status == 200, response.text
            else:
                assert (response.status, json.loads(response.text)["code"]) == (400, "invalid_character"), response.text


class TestFullMatch:
    """A validating pattern matches the whole text: a trailing line feed is refused (issue 39: Python's ``$`` matches
    before a final newline, so ``re.match`` with ``$`` let ``busybox:latest\\n`` through)."""

    @pytest.mark.parametrize(
        "workload",
        [
            {"kind": "container", "image": "busybox:latest\n"},
            {"kind": "container", "image": "busybox", "env": {"MY_VARIABLE\n": "1"}},
            {"kind": "container", "image": "busybox", "env": {"NVIDIA_VISIBLE_DEVICES\n": "1"}},
        ],
    )
    async def test_a_trailing_line_feed_is_422(self, api: Api, workload: dict[str, Any]) -> None:
        status, body = await api.as_renter("POST", "/rentals", json={"workload": workload})
        assert (status, body["code"]) == (422, "validation_failed"), body
        assert body["details"]["problems"][0]["field"].startswith("workload")
        assert await api.count(Rental) == 0

    def test_the_validators_themselves(self) -> None:
        """The shared validators refuse a trailing line feed as the API does, for the agent and the relay too."""
        assert parse_image_reference("busybox:latest") is not None
        for bad in ("busybox:latest\n", "busybox\n"):
            with pytest.raises(ValueError):
                parse_image_reference(bad)
        with pytest.raises(ValidationError):
            TypeAdapter(Env).validate_python({"MY_VARIABLE\n": "1"})

    def test_no_dollar_anchored_pattern_is_used_with_match_or_search(self) -> None:
        """A lint: every ``re.compile``d pattern (or ``re.match``/``re.search`` pattern) that starts with ``^`` and ends
        with ``$`` in the project's packages is used with ``fullmatch`` (or ends in ``\\Z``), never ``match``/``search``."""
        assert dollar_anchored_matches(PACKAGES) == []

    def test_the_lint_finds_what_it_is_for(self, tmp_path: Path) -> None:
        """It fails on the pattern of the bug, through a constant of another module too, and passes the fixed forms."""
        package = tmp_path / "pkg"
        package.mkdir()
        (package / "names.py").write_text('NAME_PATTERN = r"^[a-z]+$"\n')
        (package / "bad.py").write_text(
            "import re\nfrom pkg.names import NAME_PATTERN\n"
            '_A = re.compile(r"^[a-z]+$")\n_B = re.compile(NAME_PATTERN)\n'
            'def f(s):\n    return _A.match(s) or _B.search(s) or re.match(r"^x$", s)\n'
        )
        (package / "good.py").write_text(
            'import re\n_A = re.compile(r"^[a-z]+$")\n_Z = re.compile(r"^[a-z]+\\Z")\n_P = re.compile(r"[a-z]+")\n'
            "def f(s):\n    return _A.fullmatch(s) or _Z.match(s) or _P.match(s) or re.fullmatch(r\"^x$\", s)\n"
        )
        found = dollar_anchored_matches([package])
        assert [(Path(path).name, name) for path, _, name in found] == [("bad.py", "_A"), ("bad.py", "_B"), ("bad.py", "re.match")]


PACKAGES = [Path(__file__).resolve().parent.parent / name for name in ("master", "shared", "agent", "access", "billing", "gpumarket", "console")]


def dollar_anchored_matches(packages: list[Path]) -> list[tuple[str, int, str]]:
    """``(file, line, name)`` of each ``.match``/``.search`` on a pattern anchored with ``^`` … ``$``."""
    files = [path for package in packages if package.exists() for path in sorted(package.rglob("*.py"))]
    trees = {path: ast.parse(path.read_text(), str(path)) for path in files}
    constants: dict[str, str] = {}  # module-level string constants of every module, by name (e.g. RENTAL_ID_PATTERN)
    for tree in trees.values():
        for node in tree.body:
            if isinstance(node, ast.Assign | ast.AnnAssign) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
                for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                    if isinstance(target, ast.Name):
                        constants[target.id] = node.value.value

    def anchored(pattern: ast.expr) -> bool:
        text: str | None = None
        if isinstance(pattern, ast.Constant) and isinstance(pattern.value, str | bytes):
            text = pattern.value.decode("latin-1") if isinstance(pattern.value, bytes) else pattern.value
        elif isinstance(pattern, ast.Name):
            text = constants.get(pattern.id)
        elif isinstance(pattern, ast.JoinedStr) and pattern.values:
            first, last = pattern.values[0], pattern.values[-1]
            if isinstance(first, ast.Constant) and isinstance(last, ast.Constant):
                text = str(first.value) + str(last.value)
        return text is not None and text.startswith("^") and text.endswith("$") and not text.endswith("\\$")

    def is_re(call: ast.expr, *names: str) -> bool:
        return (isinstance(call, ast.Attribute) and call.attr in names and isinstance(call.value, ast.Name)
                and call.value.id == "re")  # fmt: skip

    found: list[tuple[str, int, str]] = []
    for path, tree in trees.items():
        compiled = {
            target.id
            for node in ast.walk(tree)
            if isinstance(node, ast.Assign | ast.AnnAssign) and isinstance(node.value, ast.Call)
            and is_re(node.value.func, "compile") and node.value.args and anchored(node.value.args[0])
            for target in (node.targets if isinstance(node, ast.Assign) else [node.target])
            if isinstance(target, ast.Name)
        }  # fmt: skip
        for call in ast.walk(tree):
            if not isinstance(call, ast.Call) or not isinstance(call.func, ast.Attribute):
                continue
            if is_re(call.func, "match", "search") and call.args and anchored(call.args[0]):
                found.append((str(path), call.lineno, f"re.{call.func.attr}"))
            elif call.func.attr in ("match", "search") and isinstance(call.func.value, ast.Name) and call.func.value.id in compiled:
                found.append((str(path), call.lineno, call.func.value.id))
    return sorted(found)


class TestDuplicateKeys:
    """An object naming a key twice is 400 ``duplicate_key`` naming it, at any depth (issue 39: the last one won)."""

    @pytest.mark.parametrize(
        ("body", "key"),
        [
            (b'{"gpu_count": 1, "gpu_count": 64}', "gpu_count"),
            (b'{"workload": {"kind": "container", "image": "busybox", "env": {"A": "1", "A": "2"}}}', "A"),
            (b'{"network": [{"x": {"y": 1, "y": 2}}]}', "y"),
        ],
    )
    async def test_a_repeated_key_is_400_naming_it(self, api: Api, body: bytes, key: str) -> None:
        status, answer = await send(api, "POST", "/rentals", body, bearer(api.renter_key))
        assert (status, answer["code"]) == (400, "duplicate_key"), answer
        assert repr(key) in answer["message"]
        assert await api.count(Rental) == 0

    def test_the_reader_refuses_it_and_keeps_equal_keys_in_different_objects(self) -> None:
        with pytest.raises(DuplicateKey):
            decode_json_body(b'[{"a": 1}, {"b": {"c": 1, "c": 1}}]')
        assert decode_json_body(b'[{"a": 1}, {"a": {"a": 2}}]') == [{"a": 1}, {"a": {"a": 2}}]
        assert decode_json_body(b'{"a": "{\\"a\\": 1, \\"a\\": 2}"}') == {"a": '{"a": 1, "a": 2}'}


class TestTimeGrammar:
    """Bodies read times in the query parameters' strict RFC 3339 grammar (issue 39: ``1700000000`` and
    ``2032-01-01t00:00:00z`` were accepted in a body, refused in a query)."""

    OUTSIDE = ("1700000000", "2032-01-01t00:00:00z", "2032-01-01T00:00:00z", "2032-01-01 00:00:00Z", "20320101T000000Z",
               "2032-W01-1T00:00:00Z", "2032-01-01T00:00Z", "2032-01-01T00:00:00Z\n", "2032-01-01T00:00:00.1234567Z")  # fmt: skip

    @pytest.mark.parametrize("text", OUTSIDE)
    async def test_refused_in_a_query_and_in_each_body(self, api: Api, text: str) -> None:
        host_id = await TestTimes().host(api)
        status, body = await api.as_renter("GET", f"/hosts/{host_id}/metrics", params={"since": text})
        if "\n" in text:  # a query refuses every control character first, whatever the parameter
            assert (status, body["code"]) == (400, "invalid_character"), body
        else:
            assert (status, body["code"]) == (400, "invalid_query"), body
            assert "RFC 3339" in body["message"]
        for method, path, payload, field in (
            ("PUT", f"/hosts/{host_id}/listing", {"price_per_gpu_hour": "0.45", "available_until": text}, "available_until"),
            ("PUT", f"/hosts/{host_id}/listing", {"price_per_gpu_hour": "0.45",
                                                  "maintenance_windows": [{"start": text, "end": "2040-01-01T00:00:00Z"}]}, "maintenance_windows.0.start"),
            ("POST", f"/hosts/{host_id}/maintenance-windows", {"start": "2040-01-01T00:00:00Z", "end": text}, "end"),
        ):  # fmt: skip
            status, body = await api.as_provider(method, path, json=payload)
            assert (status, body["code"]) == (422, "validation_failed"), (path, body)
            assert body["details"]["problems"][0]["field"] == field and "RFC 3339" in body["message"], body
        status, body = await api.as_renter("POST", "/api-keys", json={"name": "ci", "expires_at": text})
        assert (status, body["code"], body["details"]["problems"][0]["field"]) == (422, "validation_failed", "expires_at"), body

    @pytest.mark.parametrize("text", ["2040-01-01T00:00:00Z", "2040-01-01T02:00:00+02:00", "2040-01-01T00:00:00.123Z"])
    async def test_the_grammar_is_read_in_a_body(self, api: Api, text: str) -> None:
        """RFC 3339 as clients write it (``toISOString``, ``isoformat``) is read, in UTC."""
        status, body = await api.as_renter("POST", "/api-keys", json={"name": "ci", "expires_at": text})
        assert status == 201, body
        assert body["expires_at"].startswith("2040-01-01T00:00:00")
