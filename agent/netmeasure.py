"""Measuring a provider's network against its relay: throughput both ways, latency, jitter, loss.

The client half of the speed-test protocol that ``access.speedtest`` serves on
``/v1/speedtest`` (its module docstring is the protocol's description). The agent
package must not import ``access``, so the path and the few op names are repeated here;
the tests run this client against the real relay, which keeps the two halves in step.

The statistics (``latency_stats``) and the sizing of transfer rounds
(``next_round_bytes``) are pure functions; ``measure`` does the I/O; ``next_delay``,
``first_delay`` and ``MeasurementSchedule`` say when to measure.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import math
import os
import random
import ssl
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from datetime import datetime
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import WebSocketException

from shared.clock import Clock, SystemClock
from shared.errors import ConfigError, GpumarketError

SPEEDTEST_PATH = "/v1/speedtest"

# A round that took at least this fraction of target_seconds is long enough: another,
# slightly bigger round would not make the estimate meaningfully better.
_LONG_ENOUGH = 0.75
# Floor for a measured duration, so a round faster than the clock can resolve cannot divide by zero.
_MIN_SECONDS = 1e-6


class MeasurementFailed(GpumarketError, ConnectionError):
    """The relay could not be reached, refused the test, or broke the speed-test protocol."""

    code = "network_measurement_failed"


# ---- statistics (pure) ---------------------------------------------------------------------


@dataclass(frozen=True)
class LatencyStats:
    """Statistics of one series of probes, in the unit of the RTTs given (``measure`` passes ms).

    With no probe answered, every RTT statistic is None; ``jitter_rfc3550`` also needs two.
    """

    sent: int
    answered: int
    loss: float
    mean: float | None
    minimum: float | None
    maximum: float | None
    jitter: float | None
    jitter_rfc3550: float | None


def latency_stats(rtts: Sequence[float | None]) -> LatencyStats:
    """Summarise the RTTs of probes in the order they were sent; ``None`` is a probe never answered.

    Over the k answered RTTs r₁…r_k (lost probes are skipped, order kept):

    - loss = (probes with None) / (probes sent)
    - mean = (r₁ + … + r_k) / k                          (reported as latency)
    - jitter = max(max(r) − mean, mean − min(r))         (the largest deviation from the mean)
    - jitter_rfc3550 = (|r₂ − r₁| + … + |r_k − r_{k−1}|) / (k − 1)
      the mean absolute difference of consecutive answered RTTs: RFC 3550's
      interarrival-jitter idea without its 1/16 exponential smoothing.
    """
    if not rtts:
        raise ValueError("latency_stats needs at least one probe")
    answered = [rtt for rtt in rtts if rtt is not None]
    loss = (len(rtts) - len(answered)) / len(rtts)
    if not answered:
        return LatencyStats(len(rtts), 0, loss, None, None, None, None, None)
    mean = sum(answered) / len(answered)
    minimum, maximum = min(answered), max(answered)
    jitter_rfc3550 = (
        sum(abs(b - a) for a, b in itertools.pairwise(answered)) / (len(answered) - 1)
        if len(answered) >= 2
        else None
    )
    return LatencyStats(
        sent=len(rtts),
        answered=len(answered),
        loss=loss,
        mean=mean,
        minimum=minimum,
        maximum=maximum,
        jitter=max(maximum - mean, mean - minimum),
        jitter_rfc3550=jitter_rfc3550,
    )


def next_round_bytes(
    size: int, seconds: float, *, target_seconds: float, per_request_cap: int, remaining: int
) -> int | None:
    """How many bytes the next transfer round should move, or None when the last one will do.

    Like speed-test tools: a round of ``size`` bytes took ``seconds``; the next is sized to
    take ``target_seconds`` (size × target / seconds), capped by the server's per-request
    limit and by the ``remaining`` budget of this direction. None when the round was long
    enough already (≥ 75 % of the target) or the capped next round would be no bigger.
    """
    if seconds >= target_seconds * _LONG_ENOUGH:
        return None
    scaled = size * target_seconds / max(seconds, _MIN_SECONDS)
    next_size = int(min(scaled, per_request_cap, remaining))
    return next_size if next_size > size else None


# ---- the result ----------------------------------------------------------------------------


@dataclass(frozen=True)
class NetworkMeasurement:
    """One measurement of a provider's network against a relay.

    Throughputs are those of the largest transfer round of each direction; the byte counts
    are everything moved in that direction over all rounds (never more than ``max_bytes``).
    RTT statistics are in milliseconds and None when no probe was answered (see
    ``latency_stats``); ``duration_s`` is the whole measurement, connecting included.
    """

    relay_url: str
    measured_at: datetime
    download_mbps: float
    upload_mbps: float
    download_bytes: int
    upload_bytes: int
    latency_ms: float | None
    min_rtt_ms: float | None
    max_rtt_ms: float | None
    jitter_ms: float | None
    jitter_rfc3550_ms: float | None
    loss: float
    probes_sent: int
    probes_answered: int
    duration_s: float

    def to_wire(self) -> dict[str, Any]:
        """A JSON-ready dict, the fields of ``shared.protocol.NetworkReportBody`` (less ``error``)."""
        wire = asdict(self)
        wire["measured_at"] = self.measured_at.isoformat()
        return wire


def speedtest_url(agent_url: str) -> str:
    """The speed-test URL of the relay serving ``agent_url`` (same host and port, wss only)."""
    parts = urlsplit(agent_url)
    if parts.scheme != "wss" or not parts.netloc:
        raise ConfigError(f"relay URL {agent_url!r} must be wss://host:port/…; speed tests need TLS")
    return urlunsplit(("wss", parts.netloc, SPEEDTEST_PATH, "", ""))


# ---- measuring (I/O) -----------------------------------------------------------------------


@dataclass(frozen=True)
class _Hello:
    max_frame: int
    max_bytes_per_request: int


@dataclass(frozen=True)
class _Direction:
    total_bytes: int
    round_bytes: int
    round_seconds: float

    @property
    def mbps(self) -> float:
        return self.round_bytes * 8 / max(self.round_seconds, _MIN_SECONDS) / 1e6


async def measure(
    url: str,
    *,
    ssl_context: ssl.SSLContext,
    clock: Clock | None = None,
    probes: int = 20,
    target_seconds: float = 2.0,
    # Timeouts
    open_timeout: float = 10.0,
    probe_timeout: float = 1.0,
    probe_interval: float = 0.05,
    transfer_timeout: float = 30.0,
    close_timeout: float = 2.0,
    # Limits
    max_bytes: int = 32 << 20,
    initial_bytes: int = 256 << 10,
    max_rounds: int = 3,
    upload_chunk: int = 64 << 10,
    max_frame: int = 1 << 20,
) -> NetworkMeasurement:
    """Measure the network between this host and the relay of ``url`` (its agent URL).

    Connects to the relay's ``/v1/speedtest`` with ``ssl_context`` (which must present
    the host's client certificate), then:

    1. sends ``probes`` pings one after the other, ``probe_interval`` apart; each waits up
       to ``probe_timeout`` for its pong and is lost otherwise (a pong arriving later is
       recognised by its id and ignored);
    2. downloads, then uploads, in at most ``max_rounds`` rounds per direction: the first
       moves ``initial_bytes``, each next one is sized to take ``target_seconds``
       (``next_round_bytes``); a direction never moves more than ``max_bytes`` in total,
       nor more in one round than the relay allows. Each round must finish within
       ``transfer_timeout``.

    Upload frames are at most ``upload_chunk`` bytes and never larger than the relay
    accepts; ``max_frame`` bounds the frames accepted from the relay. Durations use the
    monotonic clock of ``clock``, ``measured_at`` its UTC time at the start.

    Raises ``MeasurementFailed`` when the relay cannot be reached, refuses the test or
    breaks the protocol. Cancelling is safe: the connection is closed and nothing is kept.
    """
    if probes < 1 or max_bytes < 1 or initial_bytes < 1 or max_rounds < 1 or upload_chunk < 1:
        raise ConfigError("probes, max_bytes, initial_bytes, max_rounds and upload_chunk must be at least 1")
    if target_seconds <= 0 or probe_timeout <= 0 or probe_interval < 0:
        raise ConfigError("target_seconds and probe_timeout must be positive, probe_interval not negative")
    clock = clock or SystemClock()
    target = speedtest_url(url)
    measured_at = clock.now()
    started = clock.monotonic()
    try:
        async with connect(
            target,
            ssl=ssl_context,
            open_timeout=open_timeout,
            close_timeout=close_timeout,
            max_size=max_frame,
            compression=None,
        ) as ws:
            async with asyncio.timeout(open_timeout):
                hello = _parse_hello(await ws.recv())
            rtts = await _probe(ws, clock, probes=probes, timeout=probe_timeout, interval=probe_interval)
            per_request_cap = hello.max_bytes_per_request

            async def download(size: int) -> float:
                return await _download(ws, clock, size, timeout=transfer_timeout)

            payload = os.urandom(min(upload_chunk, hello.max_frame))

            async def upload(size: int) -> float:
                return await _upload(ws, clock, size, payload, timeout=transfer_timeout)

            ramp = _Ramp(
                initial_bytes=initial_bytes,
                per_request_cap=per_request_cap,
                max_bytes=max_bytes,
                target_seconds=target_seconds,
                max_rounds=max_rounds,
            )
            down = await ramp.run(download)
            up = await ramp.run(upload)
    except MeasurementFailed:
        raise
    except (OSError, WebSocketException) as exc:  # OSError covers TLS errors and timeouts
        raise MeasurementFailed(f"network measurement against {target} failed: {exc!r}") from exc
    stats = latency_stats(rtts)
    return NetworkMeasurement(
        relay_url=url,
        measured_at=measured_at,
        download_mbps=down.mbps,
        upload_mbps=up.mbps,
        download_bytes=down.total_bytes,
        upload_bytes=up.total_bytes,
        latency_ms=stats.mean,
        min_rtt_ms=stats.minimum,
        max_rtt_ms=stats.maximum,
        jitter_ms=stats.jitter,
        jitter_rfc3550_ms=stats.jitter_rfc3550,
        loss=stats.loss,
        probes_sent=stats.sent,
        probes_answered=stats.answered,
        duration_s=clock.monotonic() - started,
    )


@dataclass(frozen=True)
class _Ramp:
    """The rounds of one direction: growing towards target_seconds, within max_bytes in all."""

    initial_bytes: int
    per_request_cap: int
    max_bytes: int
    target_seconds: float
    max_rounds: int

    async def run(self, transfer: Callable[[int], Awaitable[float]]) -> _Direction:
        remaining = self.max_bytes
        size = min(self.initial_bytes, self.per_request_cap, remaining)
        total = 0
        best = (0, 0.0)
        for _ in range(self.max_rounds):
            seconds = await transfer(size)
            total += size
            remaining -= size
            if size >= best[0]:
                best = (size, seconds)
            next_size = next_round_bytes(
                size,
                seconds,
                target_seconds=self.target_seconds,
                per_request_cap=self.per_request_cap,
                remaining=remaining,
            )
            if next_size is None:
                break
            size = next_size
        return _Direction(total_bytes=total, round_bytes=best[0], round_seconds=best[1])


async def _probe(
    ws: ClientConnection, clock: Clock, *, probes: int, timeout: float, interval: float
) -> list[float | None]:
    """RTTs in milliseconds, None for a probe not answered within ``timeout``."""
    rtts: list[float | None] = []
    for probe_id in range(probes):
        if probe_id and interval:
            await asyncio.sleep(interval)
        sent_at = clock.monotonic()
        await ws.send(json.dumps({"op": "ping", "id": probe_id, "t": sent_at}))
        rtt: float | None = None
        try:
            async with asyncio.timeout(timeout):
                while rtt is None:
                    reply = _decode(await ws.recv(), expecting="pong")
                    if reply["op"] != "pong":
                        raise MeasurementFailed(f"expected a pong, the relay sent {reply['op']!r}")
                    if reply.get("id") == probe_id:
                        rtt = (clock.monotonic() - sent_at) * 1000
                    # Otherwise: the pong of an earlier probe, already counted lost.
        except TimeoutError:
            pass  # lost; cancelling recv() loses no frame, so a late pong is read (and skipped) later
        rtts.append(rtt)
    return rtts


async def _download(ws: ClientConnection, clock: Clock, size: int, *, timeout: float) -> float:
    started = clock.monotonic()
    await ws.send(json.dumps({"op": "download", "bytes": size}))
    received = 0
    async with asyncio.timeout(timeout):
        while True:
            data = await ws.recv()
            if isinstance(data, bytes):
                received += len(data)
                if received > size:
                    raise MeasurementFailed(f"the relay sent more than the {size} bytes asked for")
                continue
            reply = _decode(data, expecting="download_done")
            if reply["op"] == "pong":
                continue  # a late probe answer
            if reply["op"] != "download_done" or reply.get("bytes") != size or received != size:
                raise MeasurementFailed(
                    f"download of {size} bytes ended with {reply!r} after {received} bytes"
                )
            return clock.monotonic() - started


async def _upload(ws: ClientConnection, clock: Clock, size: int, payload: bytes, *, timeout: float) -> float:
    """Seconds the upload took, as the relay measured it (this side's clock if it reports none)."""
    started = clock.monotonic()
    await ws.send(json.dumps({"op": "upload", "bytes": size}))
    async with asyncio.timeout(timeout):
        sent = 0
        while sent < size:
            frame = payload if size - sent >= len(payload) else payload[: size - sent]
            await ws.send(frame)
            sent += len(frame)
        while True:
            reply = _decode(await ws.recv(), expecting="upload_done")
            if reply["op"] == "pong":
                continue  # a late probe answer
            if reply["op"] != "upload_done" or reply.get("bytes") != size:
                raise MeasurementFailed(f"upload of {size} bytes ended with {reply!r}")
            break
    seconds = reply.get("seconds")
    if (
        isinstance(seconds, int | float)
        and not isinstance(seconds, bool)
        and math.isfinite(seconds)
        and seconds > 0
    ):
        # The relay's clock starts at the command and stops at the last byte: no buffering in it.
        return float(seconds)
    return clock.monotonic() - started


def _decode(data: str | bytes, *, expecting: str) -> dict[str, Any]:
    if isinstance(data, bytes):
        raise MeasurementFailed(f"expected {expecting}, the relay sent {len(data)} binary bytes")
    try:
        obj = json.loads(data)
    except ValueError as exc:
        raise MeasurementFailed(
            f"expected {expecting}, the relay sent text that is not JSON: {exc}"
        ) from None
    if not isinstance(obj, dict) or not isinstance(obj.get("op"), str):
        raise MeasurementFailed(f"expected {expecting}, the relay sent {data[:200]!r}")
    return obj


def _parse_hello(data: str | bytes) -> _Hello:
    hello = _decode(data, expecting="hello")
    max_frame, max_bytes = hello.get("max_frame"), hello.get("max_bytes_per_request")
    if hello["op"] != "hello" or not isinstance(max_frame, int) or not isinstance(max_bytes, int):
        raise MeasurementFailed(f"expected a hello with max_frame and max_bytes_per_request, got {hello!r}")
    if max_frame < 1 or max_bytes < 1:
        raise MeasurementFailed(f"the relay announced unusable limits: {hello!r}")
    return _Hello(max_frame=max_frame, max_bytes_per_request=max_bytes)


# ---- when to measure -----------------------------------------------------------------------


def _check_schedule(interval: float, jitter: float = 0.0) -> None:
    if not (math.isfinite(interval) and interval > 0):
        raise ConfigError(f"measurement interval must be a positive number of seconds, got {interval!r}")
    if not 0 <= jitter < 1:
        raise ConfigError(f"measurement jitter must be a fraction in [0, 1), got {jitter!r}")


def first_delay(interval: float, *, rng: random.Random) -> float:
    """Seconds before the first measurement: a uniform fraction of ``interval``, so a fleet started together spreads out."""
    _check_schedule(interval)
    return rng.uniform(0.0, interval)


def next_delay(interval: float, *, jitter: float = 0.2, rng: random.Random) -> float:
    """Seconds until the next measurement: uniform in [interval × (1 − jitter), interval × (1 + jitter)]."""
    _check_schedule(interval, jitter)
    return interval * rng.uniform(1.0 - jitter, 1.0 + jitter)


@dataclass(frozen=True)
class MeasurementSchedule:
    """Periodic measurements (hourly by default), jittered so a fleet does not test at once."""

    rng: random.Random
    interval: float = 3600.0
    jitter: float = 0.2

    def __post_init__(self) -> None:
        _check_schedule(self.interval, self.jitter)

    def delays(self) -> Iterator[float]:
        """The seconds to wait before each measurement: ``first_delay``, then ``next_delay`` forever."""
        yield first_delay(self.interval, rng=self.rng)
        while True:
            yield next_delay(self.interval, jitter=self.jitter, rng=self.rng)
