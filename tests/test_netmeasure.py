"""Tests for network measurement: agent.netmeasure against a real relay's /v1/speedtest (access.speedtest) over TLS 1.3 on loopback."""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import ssl
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
from websockets.asyncio.client import ClientConnection, connect
from websockets.asyncio.server import ServerConnection, serve
from websockets.exceptions import ConnectionClosed
from websockets.frames import Close

from access import speedtest
from access.relay import SPEEDTEST_PATH, Relay
from agent.netmeasure import (
    MeasurementFailed,
    MeasurementSchedule,
    first_delay,
    latency_stats,
    measure,
    next_delay,
    next_round_bytes,
    speedtest_url,
)
from shared import protocol
from shared.bus import InProcessBus
from shared.crypto import (
    CertificateAuthority,
    client_ssl_context,
    host_id_from_der,
    server_ssl_context,
)
from shared.errors import ConfigError
from shared.outbound import OutboundWindow
from tests.factories import MS
from tests.pki import agent_client_context

# Every network step is on loopback; a wait that runs out means a bug, not a slow network.
IO_TIMEOUT = 5.0
# Smaller than the client's 64 KiB upload chunk, so uploads must follow the relay's announced limit.
MAX_FRAME = 16 << 10

# Fast settings for measure(): the transfers are sized for a few MS, never for real seconds.
FAST: dict[str, Any] = {
    "probes": 5,
    "probe_interval": 0.0,
    "probe_timeout": IO_TIMEOUT,
    "target_seconds": 20 * MS,
    "initial_bytes": 64 << 10,
    "max_bytes": 2 << 20,
    "open_timeout": IO_TIMEOUT,
    "transfer_timeout": IO_TIMEOUT,
    "close_timeout": 500 * MS,
}


# ---- certificates, relay, test-only speed-test servers ----------------------------------------


@pytest.fixture
def server_context(ca: CertificateAuthority, tmp_path: Path) -> ssl.SSLContext:
    key_file, cert_file = ca.write_server_certificate(tmp_path / "relay", ["127.0.0.1", "localhost"])
    return server_ssl_context(cert_file, key_file, ca.cert_path)


MakeAgentContext = Callable[[str], ssl.SSLContext]


@pytest.fixture
def agent_context(ca: CertificateAuthority, tmp_path: Path) -> MakeAgentContext:
    """Build a client TLS context presenting a certificate for ``host_id``."""

    def make(host_id: str) -> ssl.SSLContext:
        return agent_client_context(ca, tmp_path / "agents" / host_id, host_id)

    return make


@pytest.fixture
async def relay(server_context: ssl.SSLContext) -> AsyncIterator[Relay]:
    """A real relay on 127.0.0.1 port 0 over an in-process bus, closed afterwards."""
    bus = InProcessBus()
    relay = Relay(
        relay_id="relay-speedtest",
        bus=bus,
        ssl_context=server_context,
        host="127.0.0.1",
        port=0,
        heartbeat_interval=50 * MS,
        telemetry_interval=50 * MS,
        open_timeout=IO_TIMEOUT,
        close_timeout=500 * MS,
        max_frame=MAX_FRAME,
    )
    await relay.start()
    try:
        yield relay
    finally:
        await relay.close()
        await bus.close()


Wrap = Callable[[ServerConnection], speedtest.SpeedtestConnection]
StartServer = Callable[..., Awaitable[str]]


@pytest.fixture
async def start_speedtest_server(server_context: ssl.SSLContext) -> AsyncIterator[StartServer]:
    """Start a bare TLS websocket server running the real ``speedtest.handle`` with the given limits.

    ``wrap`` puts a test double around each server connection (to delay pongs, say).
    Returns an agent-style URL of the server; every server started is closed afterwards.
    """
    async with contextlib.AsyncExitStack() as stack:

        async def start(*, wrap: Wrap | None = None, **limits: Any) -> str:
            registry = speedtest.SpeedtestRegistry()

            async def handler(connection: ServerConnection) -> None:
                ssl_object = connection.transport.get_extra_info("ssl_object")
                host_id = host_id_from_der(ssl_object.getpeercert(binary_form=True))
                wrapped = wrap(connection) if wrap is not None else connection
                await speedtest.handle(wrapped, host_id=host_id, registry=registry, **limits)

            server = await stack.enter_async_context(
                serve(handler, "127.0.0.1", 0, ssl=server_context, compression=None, close_timeout=500 * MS)
            )
            port = server.sockets[0].getsockname()[1]
            return f"wss://127.0.0.1:{port}/v1/agent"

        yield start


class LatePongs:
    """Holds the pong of every odd probe and sends it just before the next frame: after the client gave up on it."""

    def __init__(self, inner: ServerConnection) -> None:
        self.inner = inner
        self.held: list[str] = []
        self.delayed = 0

    async def recv(self, decode: bool | None = None) -> str | bytes:
        return await self.inner.recv(decode)

    async def send(self, message: str | bytes) -> None:
        if isinstance(message, str):
            reply = json.loads(message)
            if reply["op"] == "pong" and reply["id"] % 2 == 1:
                self.held.append(message)
                self.delayed += 1
                return
        for late in self.held:
            await self.inner.send(late)
        self.held.clear()
        await self.inner.send(message)

    async def close(self, code: int = 1000, reason: str = "") -> None:
        await self.inner.close(code, reason)


# ---- raw speed-test clients ----------------------------------------------------------------


OpenSpeedtest = Callable[[str, ssl.SSLContext], Awaitable[tuple[ClientConnection, dict[str, Any]]]]


@pytest.fixture
async def open_speedtest() -> AsyncIterator[OpenSpeedtest]:
    """Open a raw speed-test websocket and read its hello; every one is closed afterwards."""
    async with contextlib.AsyncExitStack() as stack:

        async def open_one(url: str, context: ssl.SSLContext) -> tuple[ClientConnection, dict[str, Any]]:
            ws = await stack.enter_async_context(
                connect(
                    speedtest_url(url),
                    ssl=context,
                    open_timeout=IO_TIMEOUT,
                    close_timeout=500 * MS,
                    compression=None,
                )
            )
            async with asyncio.timeout(IO_TIMEOUT):
                hello: dict[str, Any] = json.loads(await ws.recv())
            assert hello["op"] == "hello"
            return ws, hello

        yield open_one


async def _closed(ws: ClientConnection) -> Close:
    """Wait for the server to close ``ws``, ignoring data frames; return the close frame it sent."""
    try:
        async with asyncio.timeout(IO_TIMEOUT):
            while True:
                await ws.recv()
    except ConnectionClosed as exc:
        assert exc.rcvd is not None, "the server dropped the connection without a close frame"
        return exc.rcvd
    raise AssertionError("unreachable")


async def _wait_for(condition: Callable[[], bool]) -> None:
    """Poll ``condition`` every few MS until it holds (bounded by IO_TIMEOUT)."""
    async with asyncio.timeout(IO_TIMEOUT):
        while True:
            if condition():
                return
            await asyncio.sleep(5 * MS)


async def _request(ws: ClientConnection, command: dict[str, Any]) -> dict[str, Any]:
    await ws.send(json.dumps(command))
    async with asyncio.timeout(IO_TIMEOUT):
        reply: dict[str, Any] = json.loads(await ws.recv())
    return reply


# ---- statistics and sizing (pure) ------------------------------------------------------------


class TestLatencyStats:
    """latency_stats turns a list of RTTs (None = lost) into mean, extremes, both jitters and loss."""

    def test_exact_values_for_a_hand_made_series_with_losses(self) -> None:
        """RTTs 10, 20, lost, 30, 12 give mean 18, jitter max(30−18, 18−10) = 12, RFC 3550 jitter 38/3, loss 1/5."""
        stats = latency_stats([10.0, 20.0, None, 30.0, 12.0])

        assert (stats.sent, stats.answered) == (5, 4)
        assert stats.loss == pytest.approx(0.2)
        assert stats.mean == pytest.approx(18.0)
        assert (stats.minimum, stats.maximum) == (10.0, 30.0)
        assert stats.jitter == pytest.approx(12.0)
        assert stats.jitter_rfc3550 == pytest.approx((10 + 10 + 18) / 3)

    def test_jitter_takes_the_larger_deviation_below_the_mean(self) -> None:
        """With one low outlier (1, 10, 10, 10 → mean 7.75) jitter is mean − min = 6.75, RFC 3550 jitter 9/3 = 3."""
        stats = latency_stats([1.0, 10.0, 10.0, 10.0])

        assert stats.jitter == pytest.approx(6.75)
        assert stats.jitter_rfc3550 == pytest.approx(3.0)
        assert stats.loss == 0.0

    def test_all_lost_gives_loss_one_and_no_rtt_statistics(self) -> None:
        """Three unanswered probes give loss 1.0 and None for every RTT statistic."""
        stats = latency_stats([None, None, None])

        assert (stats.loss, stats.answered) == (1.0, 0)
        assert stats.mean is stats.minimum is stats.maximum is stats.jitter is stats.jitter_rfc3550 is None

    def test_one_answer_has_zero_jitter_but_no_rfc3550_jitter(self) -> None:
        """A single answered probe has jitter 0 and no consecutive pair for the RFC 3550 form."""
        stats = latency_stats([None, 4.0])

        assert (stats.mean, stats.jitter, stats.jitter_rfc3550, stats.loss) == (4.0, 0.0, None, 0.5)

    def test_no_probes_is_an_error(self) -> None:
        """Statistics of zero probes are undefined and raise ValueError."""
        with pytest.raises(ValueError):
            latency_stats([])


class TestNextRoundBytes:
    """next_round_bytes sizes the next transfer to take target_seconds, within the caps."""

    def test_scales_the_round_to_the_target_duration(self) -> None:
        """1 MB in 0.1 s with a 2 s target asks for 20 MB next."""
        assert (
            next_round_bytes(1_000_000, 0.1, target_seconds=2.0, per_request_cap=1 << 30, remaining=1 << 30)
            == 20_000_000
        )

    def test_is_capped_by_the_relay_limit_and_the_remaining_budget(self) -> None:
        """The scaled size is cut to the per-request cap and to the bytes left in this direction."""
        assert next_round_bytes(1000, 0.001, target_seconds=2.0, per_request_cap=5000, remaining=9000) == 5000
        assert next_round_bytes(1000, 0.001, target_seconds=2.0, per_request_cap=9000, remaining=3000) == 3000

    def test_stops_when_the_round_was_long_enough_or_cannot_grow(self) -> None:
        """A round of ≥ 75 % of the target, or a budget no bigger than the last round, ends the ramp."""
        assert (
            next_round_bytes(1000, 1.5, target_seconds=2.0, per_request_cap=1 << 30, remaining=1 << 30)
            is None
        )
        assert (
            next_round_bytes(1000, 0.001, target_seconds=2.0, per_request_cap=1 << 30, remaining=1000) is None
        )


class TestSchedule:
    """Measurements are periodic with jitter, and a fleet's first measurements are spread over one interval."""

    def test_next_delay_stays_within_the_jitter_band(self) -> None:
        """next_delay(3600, jitter=0.2) always lies in [2880, 4320], for many seeds."""
        delays = [next_delay(3600.0, jitter=0.2, rng=random.Random(seed)) for seed in range(500)]

        assert all(2880.0 <= d <= 4320.0 for d in delays)
        assert min(delays) < 3000.0 < 4200.0 < max(delays)  # the band is actually used

    def test_next_delay_differs_across_seeds_and_repeats_for_one(self) -> None:
        """Different rng seeds give different delays; the same seed gives the same one."""
        assert next_delay(3600.0, rng=random.Random(1)) != next_delay(3600.0, rng=random.Random(2))
        assert next_delay(3600.0, rng=random.Random(7)) == next_delay(3600.0, rng=random.Random(7))

    def test_first_delay_is_a_fraction_of_one_interval(self) -> None:
        """The first measurement waits a uniform fraction of the interval, never more."""
        delays = [first_delay(3600.0, rng=random.Random(seed)) for seed in range(500)]

        assert all(0.0 <= d <= 3600.0 for d in delays)
        assert min(delays) < 360.0 and max(delays) > 3240.0

    def test_schedule_yields_a_first_delay_then_jittered_intervals(self) -> None:
        """MeasurementSchedule.delays() starts within one interval and then stays in the jitter band."""
        delays = MeasurementSchedule(rng=random.Random(3), interval=100.0, jitter=0.1).delays()

        assert 0.0 <= next(delays) <= 100.0
        assert all(90.0 <= next(delays) <= 110.0 for _ in range(100))

    @pytest.mark.parametrize(("interval", "jitter"), [(0.0, 0.2), (-1.0, 0.2), (60.0, 1.0), (60.0, -0.1)])
    def test_rejects_a_nonsensical_interval_or_jitter(self, interval: float, jitter: float) -> None:
        """A non-positive interval or a jitter outside [0, 1) is a configuration error."""
        with pytest.raises(ConfigError):
            next_delay(interval, jitter=jitter, rng=random.Random(0))


class TestSpeedtestUrl:
    """The speed-test URL is derived from the agent's relay URL."""

    def test_replaces_the_path_and_keeps_host_and_port(self) -> None:
        """wss://relay:8443/v1/agent?x=1 becomes wss://relay:8443/v1/speedtest."""
        assert (
            speedtest_url("wss://relay.example:8443/v1/agent?x=1")
            == f"wss://relay.example:8443{SPEEDTEST_PATH}"
        )

    def test_refuses_a_url_without_tls(self) -> None:
        """A ws:// URL is refused: the speed test needs the TLS client certificate."""
        with pytest.raises(ConfigError):
            speedtest_url("ws://relay.example:8080/v1/agent")


# ---- measure() against a real relay ----------------------------------------------------------


class TestMeasure:
    """measure() reports throughput, latency, jitter and loss measured against a relay."""

    async def test_returns_sane_numbers_against_the_real_relay(
        self, relay: Relay, agent_context: MakeAgentContext
    ) -> None:
        """Against the relay on loopback: positive throughputs, no loss, non-negative RTTs, bytes within the cap."""
        result = await measure(relay.url, ssl_context=agent_context("h-1"), **FAST)

        assert result.relay_url == relay.url
        assert result.measured_at.tzinfo is not None and result.measured_at.utcoffset() is not None
        assert result.download_mbps > 0 and result.upload_mbps > 0
        assert 0 < result.download_bytes <= FAST["max_bytes"]
        assert 0 < result.upload_bytes <= FAST["max_bytes"]
        assert (result.loss, result.probes_sent, result.probes_answered) == (0.0, 5, 5)
        assert (
            result.latency_ms is not None and result.min_rtt_ms is not None and result.max_rtt_ms is not None
        )
        assert 0 <= result.min_rtt_ms <= result.latency_ms <= result.max_rtt_ms
        assert result.jitter_ms is not None and result.jitter_ms >= 0
        assert result.jitter_rfc3550_ms is not None and result.jitter_rfc3550_ms >= 0
        assert result.duration_s > 0
        # The relay releases the host's slot once the test is over.
        await _wait_for(lambda: relay.speedtests.connections() == [])

    async def test_to_wire_is_a_valid_network_report_body(
        self, relay: Relay, agent_context: MakeAgentContext
    ) -> None:
        """to_wire() survives JSON and validates as shared.protocol.NetworkReportBody with the same numbers."""
        result = await measure(relay.url, ssl_context=agent_context("h-1"), **FAST)

        body = protocol.NetworkReportBody.model_validate(json.loads(json.dumps(result.to_wire())))

        assert body.measured_at == result.measured_at
        assert (body.download_bytes, body.upload_bytes, body.probes_sent) == (
            result.download_bytes,
            result.upload_bytes,
            result.probes_sent,
        )

    async def test_never_moves_more_than_max_bytes_per_direction(
        self, relay: Relay, agent_context: MakeAgentContext
    ) -> None:
        """With a 100 000-byte cap and a long target the ramp stops exactly at the cap in both directions."""
        options = FAST | {"initial_bytes": 16 << 10, "max_bytes": 100_000, "target_seconds": 10.0}

        result = await measure(relay.url, ssl_context=agent_context("h-1"), **options)

        assert result.download_bytes == result.upload_bytes == 100_000

    async def test_keeps_each_round_within_the_relays_per_request_limit(
        self, start_speedtest_server: StartServer, agent_context: MakeAgentContext
    ) -> None:
        """A server allowing 32 KiB per request gets one 32 KiB round each way: a round at the cap cannot grow."""
        url = await start_speedtest_server(max_bytes_per_request=32 << 10)
        options = FAST | {"initial_bytes": 1 << 20, "max_bytes": 100_000, "target_seconds": 10.0}

        result = await measure(url, ssl_context=agent_context("h-1"), **options)

        assert result.download_bytes == result.upload_bytes == 32 << 10

    async def test_counts_unanswered_probes_as_lost_and_ignores_late_pongs(
        self, start_speedtest_server: StartServer, agent_context: MakeAgentContext
    ) -> None:
        """A server that answers every odd probe only after the next one was sent yields loss 0.5."""
        wrappers: list[LatePongs] = []

        def late_pongs(connection: ServerConnection) -> LatePongs:
            wrappers.append(LatePongs(connection))
            return wrappers[-1]

        url = await start_speedtest_server(wrap=late_pongs)
        options = FAST | {"probes": 6, "probe_timeout": 100 * MS}

        result = await measure(url, ssl_context=agent_context("h-1"), **options)

        assert wrappers[0].delayed == 3
        # Exactly 0.5 unless a loopback answer took over 100 MS; allow one such probe.
        assert result.loss == pytest.approx(0.5, abs=1 / 6 + 1e-9)
        assert result.probes_answered <= 3 and result.probes_sent == 6
        assert result.download_mbps > 0 and result.upload_mbps > 0  # late pongs in the transfers were skipped

    async def test_a_client_without_a_certificate_cannot_reach_the_speed_test(
        self, relay: Relay, ca: CertificateAuthority
    ) -> None:
        """Without a client certificate the TLS handshake fails and measure() raises MeasurementFailed."""
        with pytest.raises(MeasurementFailed):
            await measure(relay.url, ssl_context=client_ssl_context(ca.cert_path), **FAST)

        assert relay.speedtests.connections() == []

    async def test_agent_channel_keeps_working_alongside_a_speed_test(
        self, relay: Relay, agent_context: MakeAgentContext
    ) -> None:
        """A host's agent link gets its welcome, survives a speed test of the same host and is still acked after."""
        context = agent_context("h-1")
        async with connect(relay.url, ssl=context, open_timeout=IO_TIMEOUT, close_timeout=500 * MS) as agent:
            async with asyncio.timeout(IO_TIMEOUT):
                welcome = protocol.decode_server_frame(await agent.recv())
            assert isinstance(welcome, protocol.Welcome) and welcome.body.host_id == "h-1"

            result = await measure(relay.url, ssl_context=context, **FAST)

            assert result.probes_answered == FAST["probes"]
            assert list(relay.agents) == ["h-1"]  # the speed test did not replace the agent link
            seq, frame = OutboundWindow("h-1", first_seq=0).heartbeat(
                protocol.HeartbeatBody(uptime_s=1.0)
            )
            await agent.send(frame)
            async with asyncio.timeout(IO_TIMEOUT):
                ack = protocol.decode_server_frame(await agent.recv())
            assert isinstance(ack, protocol.Ack) and ack.body.seq == seq

    async def test_refuses_a_relay_url_without_tls(self, agent_context: MakeAgentContext) -> None:
        """A ws:// relay URL is a configuration error before anything is sent."""
        with pytest.raises(ConfigError):
            await measure("ws://127.0.0.1:1/v1/agent", ssl_context=agent_context("h-1"), **FAST)


# ---- the server's bounds -----------------------------------------------------------------------


class TestSpeedtestServer:
    """The relay's speed-test endpoint answers the protocol and closes any connection that breaks a bound."""

    async def test_hello_announces_the_relay_limits_and_ping_is_echoed(
        self, relay: Relay, agent_context: MakeAgentContext, open_speedtest: OpenSpeedtest
    ) -> None:
        """The hello names the relay's frame limit and per-request cap; a ping comes back with its id and t."""
        ws, hello = await open_speedtest(relay.url, agent_context("h-1"))

        assert (hello["max_frame"], hello["max_bytes_per_request"]) == (MAX_FRAME, 64 << 20)
        assert await _request(ws, {"op": "ping", "id": 7, "t": 1.5}) == {"op": "pong", "id": 7, "t": 1.5}

    @pytest.mark.parametrize("op", ["download", "upload"])
    async def test_refuses_a_transfer_over_max_bytes_per_request(
        self, op: str, relay: Relay, agent_context: MakeAgentContext, open_speedtest: OpenSpeedtest
    ) -> None:
        """Asking to move one byte more than 64 MiB closes with 1008 and a reason naming the limit."""
        ws, _ = await open_speedtest(relay.url, agent_context("h-1"))

        await ws.send(json.dumps({"op": op, "bytes": (64 << 20) + 1}))
        close = await _closed(ws)

        assert close.code == speedtest.CLOSE_POLICY
        assert op in close.reason and str(64 << 20) in close.reason

    @pytest.mark.parametrize(
        ("frame", "hint"),
        [
            ("{not json", "JSON"),
            ("[1, 2]", "object"),
            ('{"op": "reboot"}', "op"),
            ('{"op": "ping", "id": "1"}', "id"),
            ('{"op": "ping", "id": 1, "t": NaN}', "JSON"),
            ('{"op": "download", "bytes": -5}', "bytes"),
            ('{"op": "upload", "bytes": true}', "bytes"),
            ('{"op": "ping", "id": 1, "drop": true}', "drop"),
            (b"\x00" * 10, "binary"),
        ],
    )
    async def test_closes_a_malformed_command_with_4000(
        self,
        frame: str | bytes,
        hint: str,
        relay: Relay,
        agent_context: MakeAgentContext,
        open_speedtest: OpenSpeedtest,
    ) -> None:
        """A frame that is not a valid command closes the speed test with CLOSE_BAD_FRAME and says why."""
        ws, _ = await open_speedtest(relay.url, agent_context("h-1"))

        await ws.send(frame)
        close = await _closed(ws)

        assert close.code == protocol.CLOSE_BAD_FRAME
        assert hint in close.reason

    async def test_closes_an_upload_interrupted_by_a_command(
        self, relay: Relay, agent_context: MakeAgentContext, open_speedtest: OpenSpeedtest
    ) -> None:
        """A text frame while upload bytes are still due closes with CLOSE_BAD_FRAME."""
        ws, _ = await open_speedtest(relay.url, agent_context("h-1"))

        await ws.send(json.dumps({"op": "upload", "bytes": 1000}))
        await ws.send(b"\x00" * 500)
        await ws.send(json.dumps({"op": "ping", "id": 1}))
        close = await _closed(ws)

        assert close.code == protocol.CLOSE_BAD_FRAME
        assert "500 of 1000" in close.reason

    async def test_allows_one_speed_test_per_host(
        self, relay: Relay, agent_context: MakeAgentContext, open_speedtest: OpenSpeedtest
    ) -> None:
        """A host's second concurrent speed test closes with CLOSE_RATE_LIMITED; another host's is served."""
        context = agent_context("h-1")
        first, _ = await open_speedtest(relay.url, context)

        second = await connect(
            speedtest_url(relay.url), ssl=context, open_timeout=IO_TIMEOUT, close_timeout=500 * MS
        )
        close = await _closed(second)
        other, _ = await open_speedtest(relay.url, agent_context("h-2"))

        assert close.code == protocol.CLOSE_RATE_LIMITED
        assert "h-1" in close.reason
        assert (await _request(first, {"op": "ping", "id": 1}))["op"] == "pong"
        assert (await _request(other, {"op": "ping", "id": 1}))["op"] == "pong"

    async def test_relay_close_ends_a_running_speed_test_with_1001(
        self, relay: Relay, agent_context: MakeAgentContext, open_speedtest: OpenSpeedtest
    ) -> None:
        """Shutting the relay down closes a running speed test with 1001 instead of waiting for it."""
        ws, _ = await open_speedtest(relay.url, agent_context("h-1"))

        async with asyncio.timeout(IO_TIMEOUT):
            await relay.close()
        close = await _closed(ws)

        assert close.code == protocol.CLOSE_GOING_AWAY
        assert relay.speedtests.connections() == []

    async def test_closes_after_max_requests_per_connection(
        self,
        start_speedtest_server: StartServer,
        agent_context: MakeAgentContext,
        open_speedtest: OpenSpeedtest,
    ) -> None:
        """With max_requests_per_connection=3 the fourth command closes with CLOSE_RATE_LIMITED."""
        url = await start_speedtest_server(max_requests_per_connection=3)
        ws, hello = await open_speedtest(url, agent_context("h-1"))

        for probe_id in range(3):
            assert (await _request(ws, {"op": "ping", "id": probe_id}))["id"] == probe_id
        await ws.send(json.dumps({"op": "ping", "id": 3}))
        close = await _closed(ws)

        assert hello["max_requests"] == 3
        assert close.code == protocol.CLOSE_RATE_LIMITED
        assert "3 commands" in close.reason

    async def test_closes_a_connection_that_outlives_max_connection_seconds(
        self,
        start_speedtest_server: StartServer,
        agent_context: MakeAgentContext,
        open_speedtest: OpenSpeedtest,
    ) -> None:
        """An idle speed test is closed with 1008 once its 50 MS budget has run out."""
        url = await start_speedtest_server(max_connection_seconds=50 * MS)
        ws, _ = await open_speedtest(url, agent_context("h-1"))

        close = await _closed(ws)

        assert close.code == speedtest.CLOSE_POLICY
        assert "limit" in close.reason
