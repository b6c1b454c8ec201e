"""The elastic services' endpoint (``/svc/{service}/...``) end to end on ``gpumarket up`` with a real container engine:
the master's gateway, the relay's renter streams, the agent, busybox containers as replicas.

One marketplace serves the module. Four container rentals (shares of one simulated GPU) each run busybox ``httpd``
on 8000 with a few CGI scripts (``echo``: what the replica saw; ``sse``: three events 0.3 s apart; ``die``: kills
its own connection unless its query names this replica) and a websocket echo on 8001; a fifth runs the
OpenAI-compatible sample server (examples/openai_cpu_server.py). Services are rows written here directly (until
``POST /api/v1/services`` exists): ``web`` over replicas A and B (ready) and C (running, not ready); ``ws`` over D on
port 8001; ``cold`` with none, until C is moved to it; ``llm`` over E, made ready once the health probe passes.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import pytest_asyncio
from sqlalchemy import select, update
from yarl import URL

from examples.openai_client import chat
from gpumarket.up import Marketplace, start_marketplace
from master.models import Rental, Service, ServiceStat
from master.services.gateway import gateway_of, percentile, probe
from master.services.gateway.stats import ServiceStats
from shared.ids import new_id, new_secret, secret_hash
from tests.helpers import eventually
from tests.test_e2e_up import MISSED, NO_RATE_LIMITS, TICK, Api, _hosts_online
from tests.test_tunnels import WS_ECHO

pytestmark = pytest.mark.asyncio(loop_scope="module")

CGI_ECHO = r"""#!/bin/sh
printf 'Content-Type: text/plain\r\nX-Replica: @RID@\r\n\r\n'
echo "method=$REQUEST_METHOD uri=$REQUEST_URI auth=$HTTP_AUTHORIZATION xff=$HTTP_X_FORWARDED_FOR rid=$HTTP_X_REQUEST_ID"
[ "$REQUEST_METHOD" = POST ] && cat
exit 0
"""
CGI_SSE = r"""#!/bin/sh
printf 'Content-Type: text/event-stream\r\nCache-Control: no-cache\r\n\r\n'
for i in 1 2 3; do printf 'data: token %s\n\n' "$i"; sleep 0.3; done
"""
CGI_DIE = r"""#!/bin/sh
case "$QUERY_STRING" in *cut=1*) printf 'Content-Type: text/plain\r\nContent-Length: 1000\r\n\r\nthe first half'; sleep 0.2; kill -9 $PPID; exit 0;; esac
case "$QUERY_STRING" in *"live=@RID@"*) ;; *) kill -9 $PPID; exit 0;; esac
printf 'Content-Type: text/plain\r\nX-Replica: @RID@\r\n\r\nalive\n'
"""
SCRIPT = (
    "mkdir -p /workspace/www/cgi-bin && cd /workspace/www && echo ok > health && "
    'echo "hello from $GPUMARKET_RENTAL_ID" > index.html && '
    'for cgi in echo sse die; do eval "printf %s \\"\\$CGI_$cgi\\"" | sed "s/@RID@/$GPUMARKET_RENTAL_ID/g" > cgi-bin/$cgi; done && '
    'chmod +x cgi-bin/* && printf "%s" "$WS_ECHO" > /workspace/ws.sh && httpd -p 8000 -h /workspace/www && '
    "(while :; do nc -l -p 8001 -e sh /workspace/ws.sh; done) & "
    "echo ready; sleep 3600"
)
# The autoscaler's first pass comes after the module is done (600 s): these tests set replicas ready and wake
# services by hand, as it would, to test the gateway alone (test_autoscale.py and test_services_e2e.py run both).
ENV = {"GPUMARKET_SERVICE_STATS_BUCKET_S": "1", "GPUMARKET_SERVICE_COLD_START_TIMEOUT_S": "30",
       "GPUMARKET_AUTOSCALE_INTERVAL": "600", **NO_RATE_LIMITS}  # fmt: skip


async def _rent(renter: Api, image: str, workload: dict[str, Any] | None = None) -> str:
    workload = workload or {"kind": "container", "image": image, "command": ["sh", "-c", SCRIPT], "ports": [8000, 8001],
                            "env": {"WS_ECHO": WS_ECHO, "CGI_echo": CGI_ECHO, "CGI_sse": CGI_SSE, "CGI_die": CGI_DIE}}

    async def placed() -> str | None:  # the share listing of the demo host comes a moment after it is online
        status, rental = await renter.call("POST", "/rentals", json={"gpu_count": 1, "gpu_milli": 250, "workload": workload})
        return str(rental["id"]) if status == 201 else None

    return await eventually(placed, timeout=30, every=0.5, what="a share rental")


async def _service(market: Marketplace, renter_id: str, name: str, port: int, replicas: dict[str, bool],
                   health_path: str = "/health") -> tuple[str, str]:  # fmt: skip
    """A service row over ``replicas`` (rental id → ready), as ``POST /services`` will make one; its id and token."""
    service_id, token = new_id("svc"), new_secret("gms")
    async with market.master.db.session() as session:
        session.add(Service(id=service_id, renter_id=renter_id, name=name, state="active", port=port, health_path=health_path,
                            min_replicas=0, max_replicas=4, desired_replicas=len(replicas), token_hash=secret_hash(token),
                            token_prefix=token[:12]))  # fmt: skip
        await session.flush()
        for rental_id, ready in replicas.items():
            await session.execute(update(Rental).where(Rental.id == rental_id)
                                  .values(service_id=service_id, ready_at=datetime.now(UTC) if ready else None))  # fmt: skip
    return service_id, token


async def _until_healthy(market: Marketplace, service_id: str, rental_id: str) -> None:
    """What the autoscaler does for a replica that started: probe it until it answers, then mark it ready."""
    async with market.master.db.session() as session:
        service, rental = await session.get(Service, service_id), await session.get(Rental, rental_id)
    assert service is not None and rental is not None

    async def healthy() -> bool:
        return await probe(market.master, service, rental) is None

    await eventually(healthy, timeout=60, every=0.2, what=f"replica {rental_id} healthy")
    async with market.master.db.session() as session:
        await session.execute(update(Rental).where(Rental.id == rental_id).values(ready_at=datetime.now(UTC)))


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def setting(tmp_path_factory: pytest.TempPathFactory, docker_image: str, openai_image: str) -> AsyncIterator[dict[str, Any]]:
    mp = pytest.MonkeyPatch()
    for name, value in ENV.items():
        mp.setenv(name, value)
    market = await start_marketplace(Path(tmp_path_factory.mktemp("gateway")) / "data", agents=1, http_port=0, relay_port=0,
                                     heartbeat_interval=TICK, telemetry_interval=TICK, missed_heartbeats_offline=MISSED)  # fmt: skip
    http = aiohttp.ClientSession()
    try:
        renter = Api(http, market.api_url, market.credentials["renter"]["api_key"])
        await eventually(lambda: _hosts_online(renter, 1), what="the host online")
        a, b, c, d, e = await asyncio.gather(*(_rent(renter, docker_image) for _ in range(4)),
                                             _rent(renter, openai_image, {"kind": "container", "image": openai_image, "ports": [8000]}))  # fmt: skip

        async def started(rental_id: str) -> bool:
            return "ready" in (await renter.get(f"/rentals/{rental_id}/logs"))["data"]

        for rental_id in (a, b, c, d):
            await eventually(lambda rental_id=rental_id: started(rental_id), timeout=60, what=f"rental {rental_id}'s servers")  # type: ignore[misc]
        renter_id = (await renter.get("/account"))["id"]
        web, web_token = await _service(market, renter_id, "web", 8000, {a: True, b: True, c: False})
        ws, ws_token = await _service(market, renter_id, "ws", 8001, {d: True})
        cold, cold_token = await _service(market, renter_id, "cold", 8000, {})
        llm, llm_token = await _service(market, renter_id, "llm", 8000, {e: False})
        await _until_healthy(market, llm, e)
        base = market.api_url.removesuffix("/api/v1")
        yield {"market": market, "http": http, "renter": renter, "renter_id": renter_id, "a": a, "b": b, "c": c, "d": d,
               "web": f"{base}/svc/{web}", "web_id": web, "web_token": web_token, "ws": f"{base}/svc/{ws}", "ws_token": ws_token,
               "cold": f"{base}/svc/{cold}", "cold_id": cold, "cold_token": cold_token, "base": base,
               "llm": f"{base}/svc/{llm}", "llm_token": llm_token, "e": e}  # fmt: skip
    finally:
        await http.close()
        await market.stop()
        mp.undo()


def _auth(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def _figures(setting: dict[str, Any]) -> ServiceStats:
    return gateway_of(setting["market"].master).stats.of(setting["web_id"])


async def _settled(figures: ServiceStats) -> ServiceStats:
    """The figures once every request is counted (a handler finishes a moment after its client read the answer)."""
    return await eventually(lambda: _ready(figures if figures.inflight == 0 else None), what="no request in flight")


async def _ready(value: ServiceStats | None) -> ServiceStats | None:
    return value


class TestBalancing:
    async def test_requests_go_to_the_ready_replicas_in_turn_and_never_to_one_not_ready(self, setting: dict[str, Any]) -> None:
        """Eight requests one after another: four to each ready replica, none to the running one that is not ready."""
        seen: list[str] = []
        for _ in range(8):
            async with setting["http"].get(f"{setting['web']}/cgi-bin/echo", headers=_auth(setting["web_token"])) as response:
                assert response.status == 200, await response.text()
                seen.append(response.headers["X-Replica"])
        assert sorted(seen) == sorted([setting["a"]] * 4 + [setting["b"]] * 4), seen


class TestAuthorization:
    async def test_the_service_token_and_the_renters_key_open_it_and_nothing_of_them_reaches_the_replica(
        self, setting: dict[str, Any]
    ) -> None:
        url = URL(f"{setting['web']}/cgi-bin/echo?x=1&y=%2F%20", encoded=True)  # passed on as the client encoded it
        for token in (setting["web_token"], setting["market"].credentials["renter"]["api_key"]):
            async with setting["http"].post(url, data=b"the body", headers={**_auth(token), "X-Request-Id": "req-1"}) as response:
                text = await response.text()
                assert response.status == 200, text
                assert response.headers["X-Request-Id"] == "req-1"
            assert "method=POST uri=/cgi-bin/echo?x=1&y=%2F%20 auth= xff=127.0.0.1 rid=req-1" in text, text
            assert text.endswith("the body"), text

    async def test_no_token_is_401_and_another_accounts_key_or_service_is_404(self, setting: dict[str, Any]) -> None:
        """Another renter's key learns nothing: the same 404 as for a service that does not exist."""
        http, url = setting["http"], f"{setting['web']}/index.html"
        cases = [
            ({}, 401, "missing_token"),
            (_auth("gmk_not-a-key"), 401, "invalid_token"),
            (_auth(setting["cold_token"]), 401, "invalid_token"),  # another service's token
            (_auth(setting["market"].credentials["provider"]["api_key"]), 404, "service_not_found"),
            (_auth(setting["market"].credentials["admin"]["api_key"]), 404, "service_not_found"),
        ]
        for headers, status, code in cases:
            async with http.get(url, headers=headers) as response:
                assert (response.status, (await response.json())["code"]) == (status, code), headers
        async with http.get(f"{setting['base']}/svc/svc-0000000000000000/", headers=_auth(setting["market"].credentials["renter"]["api_key"])) as response:
            assert (response.status, (await response.json())["code"]) == (404, "service_not_found")


class TestStreaming:
    async def test_server_sent_events_arrive_one_by_one(self, setting: dict[str, Any]) -> None:
        """Each event is read about when the replica writes it (0.3 s apart), not all at once at the end."""
        arrivals: list[tuple[float, bytes]] = []
        async with setting["http"].get(f"{setting['web']}/cgi-bin/sse", headers=_auth(setting["web_token"])) as response:
            assert response.status == 200 and response.headers["Content-Type"] == "text/event-stream"
            async for chunk in response.content.iter_any():
                arrivals.append((time.monotonic(), chunk))
        body = b"".join(chunk for _, chunk in arrivals)
        assert body == b"data: token 1\n\ndata: token 2\n\ndata: token 3\n\n"
        first_token = next(at for at, chunk in arrivals if b"token 1" in chunk)
        last_token = next(at for at, chunk in arrivals if b"token 3" in chunk)
        assert last_token - first_token > 0.4, arrivals

    async def test_a_websocket_echoes_through_the_gateway(self, setting: dict[str, Any]) -> None:
        async with setting["http"].ws_connect(f"{setting['ws']}/", headers=_auth(setting["ws_token"])) as ws:
            await ws.send_str("hello through the relay")
            message = await asyncio.wait_for(ws.receive(), 10)
            assert (message.type, message.data) == (aiohttp.WSMsgType.TEXT, "hello through the relay")


class TestModelServer:
    """The OpenAI-compatible sample server (examples/openai_cpu_server.py) as the replica, called as users will."""

    async def test_the_openai_client_completes_and_streams_through_the_endpoint(self, setting: dict[str, Any]) -> None:
        def ask(stream: bool) -> list[str]:
            return list(chat(f"{setting['llm']}/", setting["llm_token"], "hello there", stream=stream))

        assert await asyncio.to_thread(ask, False) == ["echo: hello there"]
        pieces = await asyncio.to_thread(ask, True)
        assert "".join(pieces) == "echo: hello there" and len(pieces) > 1, pieces

    async def test_a_replicas_connections_are_kept_and_reused(self, setting: dict[str, Any]) -> None:
        """Requests one after another ride one relay stream (the server keeps connections alive): five requests open at
        most one new stream. Counted as streams dialed, not streams open: one an earlier test left idle may still be
        closing (its keep-alive ran out) while these run (fresh run 15 counted it: 2 open)."""
        pool = gateway_of(setting["market"].master).pools[setting["e"]]
        before = pool.dialed
        for _ in range(5):
            async with setting["http"].get(f"{setting['llm']}/v1/models", headers=_auth(setting["llm_token"])) as response:
                assert response.status == 200 and response.headers["X-Replica"] and await response.read()
        assert pool.dialed - before <= 1 and pool.connections >= 1

    async def test_websocket_messages_and_close_codes_pass_both_ways(self, setting: dict[str, Any]) -> None:
        """Text and binary (larger than one relay message) come back as sent; the replica's close (1009: too big)
        reaches the client with its code, and the client's close reaches the replica."""
        url, headers = f"{setting['llm']}/v1/ws", _auth(setting["llm_token"])
        async with setting["http"].ws_connect(url, headers=headers, max_msg_size=0) as ws:
            await ws.send_str("héllo")
            assert (await asyncio.wait_for(ws.receive(), 10)).data == "héllo"
            big = bytes(range(256)) * 300
            await ws.send_bytes(big)
            assert (await asyncio.wait_for(ws.receive(), 10)).data == big
            await ws.close(code=4000, message=b"done")
        assert ws.close_code == 4000
        async with setting["http"].ws_connect(url, headers=headers, max_msg_size=0) as ws:
            await ws.send_bytes(b"x" * ((1 << 20) + 1))
            message = await asyncio.wait_for(ws.receive(), 10)
            assert message.type is aiohttp.WSMsgType.CLOSE and message.data == 1009, message


class TestRetries:
    async def test_an_idempotent_request_whose_replica_drops_it_is_answered_by_another(self, setting: dict[str, Any]) -> None:
        """Replica A kills the connection of every request to ``die`` (B answers): the client never sees it, whichever
        replica each request went to first; in turn, one of the two went to A first."""
        figures = await _settled(_figures(setting))
        retries, errors = figures.retries, figures.errors
        for _ in range(2):
            await _settled(figures)  # each request finds both replicas idle: the first goes to the one next in turn
            async with setting["http"].get(f"{setting['web']}/cgi-bin/die?live={setting['b']}", headers=_auth(setting["web_token"])) as response:
                assert response.status == 200, await response.text()
                assert response.headers["X-Replica"] == setting["b"]
        await _settled(figures)
        assert figures.retries == retries + 1 and figures.errors == errors

    async def test_a_post_is_not_sent_again_unless_it_carries_an_idempotency_key(self, setting: dict[str, Any]) -> None:
        figures = await _settled(_figures(setting))
        retries, errors = figures.retries, figures.errors
        async with setting["http"].post(f"{setting['web']}/cgi-bin/die?live=nobody", data=b"x", headers=_auth(setting["web_token"])) as response:
            assert response.status == 502 and (await response.json())["code"] == "upstream_failed"
        await _settled(figures)
        assert figures.retries == retries and figures.errors == errors + 1
        for _ in range(2):  # one of them goes to A first, and is sent again to B
            await _settled(figures)
            headers = {**_auth(setting["web_token"]), "Idempotency-Key": "k-1"}
            async with setting["http"].post(f"{setting['web']}/cgi-bin/die?live={setting['b']}", data=b"x", headers=headers) as response:
                assert response.status == 200 and response.headers["X-Replica"] == setting["b"]
        await _settled(figures)
        assert figures.retries == retries + 1

    async def test_an_answer_that_breaks_off_reaches_the_client_truncated(self, setting: dict[str, Any]) -> None:
        """Once the head went out nothing is sent again: the client's connection drops, its body never looks whole."""
        figures = await _settled(_figures(setting))
        errors = figures.errors
        async with setting["http"].get(f"{setting['web']}/cgi-bin/die?cut=1", headers=_auth(setting["web_token"])) as response:
            assert response.status == 200 and response.headers["Content-Length"] == "1000"
            with pytest.raises(aiohttp.ClientPayloadError):
                await response.read()
        await _settled(figures)
        assert figures.errors == errors + 1


class TestColdStart:
    async def test_a_request_to_a_service_with_no_ready_replica_wakes_it_and_waits_for_one(self, setting: dict[str, Any]) -> None:
        market: Marketplace = setting["market"]
        request = asyncio.create_task(_get_text(setting["http"], f"{setting['cold']}/index.html", setting["cold_token"]))

        async def woken() -> datetime | None:
            async with market.master.db.session() as session:
                return (await session.get(Service, setting["cold_id"], populate_existing=True)).wake_requested_at  # type: ignore[union-attr]

        await eventually(woken, timeout=10, what="wake_requested_at")
        assert not request.done()
        async with market.master.db.session() as session:  # what the autoscaler does: a replica, started and found ready
            await session.execute(update(Rental).where(Rental.id == setting["c"])
                                  .values(service_id=setting["cold_id"], ready_at=datetime.now(UTC)))  # fmt: skip
        status, text = await asyncio.wait_for(request, 10)
        assert (status, text.strip()) == (200, f"hello from {setting['c']}")


async def _get_text(http: aiohttp.ClientSession, url: str, token: str) -> tuple[int, str]:
    async with http.get(url, headers=_auth(token)) as response:
        return response.status, await response.text()


class TestProbe:
    async def test_the_health_probe_asks_the_replica_through_the_relay(self, setting: dict[str, Any]) -> None:
        market: Marketplace = setting["market"]
        async with market.master.db.session() as session:
            service = await session.get(Service, setting["web_id"])
            rental = await session.get(Rental, setting["a"])
        assert service is not None and rental is not None
        assert await probe(market.master, service, rental) is None
        service.health_path = "/missing"
        assert await probe(market.master, service, rental) is not None
        elsewhere, _ = await _service(market, setting["renter_id"], "probe", 8000, {}, health_path="/missing")
        async with market.master.db.session() as session:
            other = await session.get(Service, elsewhere)
        assert other is not None
        assert "not a running replica" in (await probe(market.master, other, rental) or "")

    async def test_a_replica_that_answers_its_probe_is_not_kept_out_for_failures_before(self, setting: dict[str, Any]) -> None:
        """Regression: probes that failed while a replica started (its port not open yet) ejected it for ``eject_s``
        after the probe that made it ready, so a new replica of a loaded service took no requests for seconds."""
        market: Marketplace = setting["market"]
        async with market.master.db.session() as session:
            service = await session.get(Service, setting["web_id"])
            rental = await session.get(Rental, setting["a"])
        assert service is not None and rental is not None
        gateway = gateway_of(market.master)
        route = await gateway.routes.get(service.id, max_age=0)
        assert route is not None
        pool = gateway.pool(route, next(r for r in route.replicas if r.rental_id == rental.id))
        pool.failed()  # as a probe of the starting replica would
        assert gateway.ejected(pool)
        assert await probe(market.master, service, rental) is None
        assert not gateway.ejected(pool)


class TestFigures:
    async def test_rows_are_written_per_bucket_and_metrics_list_the_service(self, setting: dict[str, Any]) -> None:
        market: Marketplace = setting["market"]
        served = (await _settled(_figures(setting))).requests

        async def rows() -> list[ServiceStat] | None:
            async with market.master.db.session() as session:
                found = list((await session.scalars(select(ServiceStat).where(ServiceStat.service_id == setting["web_id"]))).all())
            return found if sum(r.requests for r in found) >= served else None

        written = await eventually(rows, timeout=10, what="service_stats rows")
        assert all(r.node == market.master.instance_id and r.bucket_at.microsecond == 0 for r in written)
        assert sum(sum(r.latency_hist) for r in written) == sum(r.requests for r in written)
        assert sum(r.errors for r in written) >= 1 and sum(r.retries for r in written) >= 2
        hist = [sum(column) for column in zip(*(r.latency_hist for r in written), strict=True)]
        assert percentile(hist, 0.5) is not None
        scrape = {"Authorization": f"Bearer {market.master.settings.metrics_token}"}  # the token `up` made
        async with setting["http"].get(f"{setting['base']}/metrics", headers=scrape) as response:
            assert response.status == 200
            text = await response.text()
        assert f'gpumarket_service_requests_total{{service="{setting["web_id"]}"}}' in text
        assert f'gpumarket_service_latency_seconds_bucket{{le="+Inf",service="{setting["web_id"]}"}}' in text
