"""Query parameters of the ``/api/v1`` routes: a parameter a route does not declare is a 400 naming it.

The check is one middleware over the route table (``master/api/middleware.py``: ``query_middleware``);
these tests walk the table, and check that the console's own calls send only declared parameters.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from master.api.base import Route
from master.api.routes_market import FILTER_PARAMS
from master.api.table import ROUTES
from tests.apiclient import Api, assert_error

CONSOLE = Path(__file__).resolve().parent.parent / "console" / "static"


def _concrete(path: str) -> str:
    """The route's path with each ``{param}`` filled in (the check runs before any handler looks the id up)."""
    return re.sub(r"\{\w+\}", "x0", path)


def _route(method: str, path: str) -> Route:
    """The table's route that ``path`` (concrete, no query) matches."""
    for route in ROUTES:
        pattern = "^" + re.sub(r"\{\w+\}", "[^/]+", route.path) + "$"
        if route.method == method and re.match(pattern, path):
            return route
    raise AssertionError(f"no route {method} {path}")


GET_ROUTES = [route for route in ROUTES if route.method == "GET"]


class TestUnknownParameters:
    @pytest.mark.parametrize("route", GET_ROUTES, ids=[route.path for route in GET_ROUTES])
    async def test_every_get_route_refuses_an_undeclared_parameter_naming_it(self, api: Api, route: Route) -> None:
        """GET on any route with a parameter it does not declare is 400 ``unknown_parameter`` naming it and the known ones."""
        status, body = await api.as_renter("GET", f"{_concrete(route.path)}?zz_nope=1")
        assert_error(status, body, 400, "unknown_parameter")
        assert "'zz_nope'" in body["message"]
        known = [q.name for q in route.query]
        if known:
            assert body["message"].endswith(f"known: {', '.join(known)}")
        else:
            assert body["message"].endswith("this route takes none")

    async def test_declared_parameters_still_pass_and_an_unknown_one_beside_them_does_not(self, api: Api) -> None:
        """Declared parameters answer 200; adding one undeclared parameter to them makes it 400."""
        status, body = await api.as_renter("GET", "/offers?sort=price&limit=5&gpu_model=A100&isolated=true")
        assert status == 200, body
        status, body = await api.as_renter("GET", "/offers?sort=price&limit=5&gpu=A100")
        assert_error(status, body, 400, "unknown_parameter")
        assert body["message"].startswith("unknown query parameter 'gpu'; known: q, num_gpus, gpu_model,")

    async def test_the_check_comes_before_authentication(self, api: Api) -> None:
        """An unauthenticated call with an undeclared parameter is told about the parameter (no key lookup spent)."""
        status, body = await api.call("GET", "/rentals?bogus=1", None)
        assert_error(status, body, 400, "unknown_parameter")

    async def test_unknown_paths_are_still_404(self, api: Api) -> None:
        """A path no route matches is 404, whatever its query."""
        status, body = await api.as_renter("GET", "/no-such-thing?foo=1")
        assert_error(status, body, 404, "not_found")


class TestOwnClientsSendDeclaredParameters:
    def test_the_consoles_calls_use_declared_parameters(self) -> None:
        """Every ``api("GET", "/path?a=…&b=…")`` in the console's scripts names parameters its route declares."""
        calls = 0
        for script in sorted(CONSOLE.glob("*.js")):
            for match in re.finditer(r'api\("GET", [`"]([^`"?]+)\?([^`"]+)[`"]', script.read_text()):
                path = re.sub(r"\$\{[^}]+\}", "x0", match.group(1))
                declared = {q.name for q in _route("GET", path).query}
                names = {pair.split("=")[0] for pair in match.group(2).split("&")}
                assert names <= declared, f"{script.name}: {match.group(0)} sends {names - declared}"
                calls += 1
        assert calls >= 5  # the pattern still finds the console's calls

    def test_the_offers_pages_filters_are_declared(self) -> None:
        """The marketplace page's filter fields (and its sort, order and paging) are parameters of GET /offers."""
        source = (CONSOLE / "pages-renter.js").read_text()
        block = source[source.index("const inputs = {"): source.index("const form =")]
        names = set(re.findall(r'name: "(\w+)"', block)) | {"sort", "order", "limit", "offset"}
        declared = {q.name for q in _route("GET", "/offers").query}
        assert len(names) >= 8
        assert names <= declared, names - declared
        assert set(FILTER_PARAMS) <= declared
