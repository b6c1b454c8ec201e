"""How an agent finds its relays: DNS discovery, latency ranking and failover order.

A provider configures a zone (``relays.example.com``); the zone publishes
``_gpumarket._tcp.relays.example.com. SRV <priority> <weight> <port> <target>``
records, one per relay. ``resolve_relays`` orders them as RFC 2782 says (priority
ascending, weighted random within a priority) and falls back to the zone's own A/AAAA
records when there is no SRV record. ``rank_candidates`` measures TCP connect times
and orders by (priority, latency), unreachable relays last. ``RelayDirectory`` keeps
the ranked list for the agent's reconnect loop and decides which URL to try next.

Imports ``shared`` and dnspython only; the reconnect loop that uses this lives in
``agent.runner``.
"""

from __future__ import annotations

import asyncio
import ipaddress
import itertools
import logging
import random
import ssl
import statistics
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Literal
from urllib.parse import urlsplit

import dns.asyncresolver
import dns.exception
import dns.name
import dns.rdatatype
import dns.resolver
from dns.rdtypes.IN.SRV import SRV

from shared.cancelling import raise_if_cancelled
from shared.errors import ConfigError

log = logging.getLogger(__name__)

SRV_SERVICE = "_gpumarket._tcp"
"""The SRV owner name is ``<SRV_SERVICE>.<zone>``."""

# The ports a wss:// or ws:// URL without an explicit port means.
_URL_DEFAULT_PORTS = {"wss": 443, "ws": 80}


@dataclass(frozen=True)
class RelayCandidate:
    """One relay an agent may connect to, as discovered."""

    url: str  # wss://host:port/path, what the agent connects to
    host: str  # DNS name or IP literal (no brackets), what a probe connects to
    port: int
    priority: int  # lower is preferred (SRV priority; 0 for A/AAAA, the list position for static URLs)
    weight: int  # SRV weight; 0 for A/AAAA and static URLs
    source: Literal["srv", "a", "static"]


Probe = Callable[[RelayCandidate], Awaitable[float | None]]
"""Measures one candidate: seconds (lower is better), or ``None`` when unreachable."""


def relay_url(host: str, port: int, path: str) -> str:
    """``wss://host:port/path``, with an IPv6 literal in brackets as RFC 3986 requires."""
    try:
        is_ipv6 = ipaddress.ip_address(host).version == 6
    except ValueError:
        is_ipv6 = False
    authority = f"[{host}]" if is_ipv6 else host
    if not path.startswith("/"):
        path = "/" + path
    return f"wss://{authority}:{port}{path}"


def static_candidates(urls: Sequence[str]) -> list[RelayCandidate]:
    """Candidates for configured URLs, kept in the given order (priority = position).

    Raises ``ConfigError`` for a URL that is not ``ws://`` or ``wss://`` with a host.
    """
    candidates = []
    for position, url in enumerate(urls):
        parts = urlsplit(url)
        try:
            port = parts.port
        except ValueError:
            port = None
            host = None
        else:
            host = parts.hostname
        if parts.scheme not in _URL_DEFAULT_PORTS or not host:
            raise ConfigError(
                f"relay URL {url!r} is not a ws:// or wss:// URL with a host and a valid port; check relay_urls"
            )
        candidates.append(
            RelayCandidate(
                url=url,
                host=host,
                port=port if port is not None else _URL_DEFAULT_PORTS[parts.scheme],
                priority=position,
                weight=0,
                source="static",
            )
        )
    return candidates


# ---- DNS ---------------------------------------------------------------------------


def order_srv(records: Sequence[SRV], rng: random.Random) -> list[SRV]:
    """``records`` in the order RFC 2782 says to try them.

    Ascending priority; within one priority, repeated weighted random selection: a
    record is picked with probability proportional to its weight, and weight-0
    records (placed first, as the RFC says) are picked only when the draw is 0,
    which gives them a small chance when heavier records exist.
    """
    ordered: list[SRV] = []
    for priority in sorted({record.priority for record in records}):
        remaining = [record for record in records if record.priority == priority]
        rng.shuffle(remaining)  # "in any order" (RFC 2782), so equal records take turns
        remaining.sort(key=lambda record: record.weight != 0)
        while remaining:
            draw = rng.randint(0, sum(record.weight for record in remaining))
            running_sum = 0
            for index, record in enumerate(remaining):
                running_sum += record.weight
                if running_sum >= draw:
                    ordered.append(remaining.pop(index))
                    break
    return ordered


def _make_resolver(resolver: str | None, resolver_port: int) -> tuple[dns.asyncresolver.Resolver, str]:
    """A resolver and words naming it for error messages."""
    if resolver is None:
        try:
            return dns.asyncresolver.Resolver(), "the system resolver (/etc/resolv.conf)"
        except dns.resolver.NoResolverConfiguration as exc:
            raise ConfigError(
                f"no system DNS resolver is configured ({exc}); fix /etc/resolv.conf or set the relay DNS resolver"
            ) from None
    configured = dns.asyncresolver.Resolver(configure=False)
    try:
        configured.nameservers = [resolver]
    except ValueError as exc:
        raise ConfigError(f"relay DNS resolver {resolver!r} is not an IP address: {exc}") from None
    configured.port = resolver_port
    return configured, f"DNS server {resolver} port {resolver_port}"


async def resolve_relays(
    zone: str,
    *,
    resolver: str | None = None,
    resolver_port: int = 53,
    timeout: float = 3.0,
    path: str = "/v1/agent",
    default_port: int = 8443,
    max_candidates: int = 32,
    rng: random.Random | None = None,
    source: str | None = None,
) -> list[RelayCandidate]:
    """The relays ``zone`` publishes, in RFC 2782 order, at most ``max_candidates``.

    Queries SRV ``_gpumarket._tcp.<zone>`` at ``resolver`` (an IP address; the system
    resolver when ``None``). Without SRV records (NXDOMAIN or no answer), falls back
    to the zone's own A and AAAA records on ``default_port`` (source ``"a"``; the URL
    holds the address). ``timeout`` bounds the whole resolution in seconds; ``rng``
    draws the weighted order (a fresh ``random.Random`` when ``None``).

    Raises ``ConfigError`` when nothing resolves (the message names the zone and the
    records tried) or when the DNS server does not answer in time ("DNS server did not
    answer"). Cancelling is safe: nothing is kept between calls.
    """
    if max_candidates < 1:
        raise ValueError("max_candidates must be at least 1")
    rng = rng if rng is not None else random.Random()
    try:
        zone_name = dns.name.from_text(zone.strip().rstrip("."), origin=dns.name.root)
        srv_name = dns.name.from_text(SRV_SERVICE, origin=zone_name)
    except dns.exception.DNSException as exc:
        raise ConfigError(f"relay zone {zone!r} is not a valid DNS name: {exc}; check relay_zone") from None
    dns_resolver, where = _make_resolver(resolver, resolver_port)
    zone_text = zone_name.to_text(omit_final_dot=True)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout

    def timed_out(name: dns.name.Name) -> ConfigError:
        return ConfigError(
            f"DNS server did not answer within {timeout:g}s for {name} (relay zone {zone_text!r}) at {where}; "
            "check that it is reachable over UDP and TCP, or configure another relay DNS resolver",
            code="relay_dns_timeout",
        )

    async def query(name: dns.name.Name, rdtype: dns.rdatatype.RdataType) -> dns.resolver.Answer | None:
        """The answer, or ``None`` for NXDOMAIN / no records of this type."""
        remaining = deadline - loop.time()
        if remaining <= 0:
            raise timed_out(name)
        try:
            answer = await dns_resolver.resolve(name, rdtype, search=False, lifetime=remaining, source=source)
        except (dns.resolver.NXDOMAIN, dns.resolver.NoAnswer):
            raise_if_cancelled()
            return None
        except dns.exception.Timeout:
            raise timed_out(name) from None
        except dns.resolver.NoNameservers as exc:
            raise ConfigError(
                f"DNS lookup of {name} {dns.rdatatype.to_text(rdtype)} (relay zone {zone_text!r}) failed at {where}: {exc}; "
                "check the zone's DNS servers",
                code="relay_dns_failed",
            ) from None
        raise_if_cancelled()  # dnspython waits with asyncio.wait_for, which can lose a cancel (shared.cancelling)
        return answer

    srv_answer = await query(srv_name, dns.rdatatype.SRV)
    if srv_answer is not None:
        records = [record for record in srv_answer if isinstance(record, SRV)]
        # A lone target of "." means "decidedly not available at this domain" (RFC 2782).
        usable = [record for record in records if record.target != dns.name.root]
        if records and not usable:
            raise ConfigError(
                f"relay zone {zone_text!r} says it has no relays: {srv_name} SRV has target '.'; "
                "check relay_zone or ask the zone's operator",
                code="relay_dns_not_found",
            )
        candidates = []
        for record in order_srv(usable, rng)[:max_candidates]:
            host = record.target.to_text(omit_final_dot=True)
            candidates.append(
                RelayCandidate(
                    url=relay_url(host, record.port, path),
                    host=host,
                    port=record.port,
                    priority=record.priority,
                    weight=record.weight,
                    source="srv",
                )
            )
        if candidates:
            return candidates

    # No SRV: the zone name itself may be a relay. Ask for both families at once; one
    # family that times out is forgiven when the other answered (resolvers that drop
    # AAAA queries exist).
    answers = await asyncio.gather(
        query(zone_name, dns.rdatatype.A), query(zone_name, dns.rdatatype.AAAA), return_exceptions=True
    )
    addresses: list[str] = []
    errors: list[ConfigError] = []
    for answer in answers:
        if isinstance(answer, ConfigError):
            errors.append(answer)
        elif isinstance(answer, BaseException):
            raise answer
        elif answer is not None:
            addresses.extend(record.to_text() for record in answer)
    if not addresses and errors:
        raise errors[0]
    if not addresses:
        raise ConfigError(
            f"no relays found for relay zone {zone_text!r}: {where} has no {srv_name} SRV record and no A or AAAA "
            f"record for {zone_text}; check relay_zone, and that the zone publishes "
            f"'{srv_name} SRV <priority> <weight> <port> <relay host>.' (or an address for {zone_text})",
            code="relay_dns_not_found",
        )
    return [
        RelayCandidate(
            url=relay_url(address, default_port, path),
            host=address,
            port=default_port,
            priority=0,
            weight=0,
            source="a",
        )
        for address in addresses[:max_candidates]
    ]


# ---- latency -----------------------------------------------------------------------


async def probe_latency(
    candidate: RelayCandidate,
    *,
    ssl_context: ssl.SSLContext | None = None,
    attempts: int = 3,
    timeout: float = 2.0,
) -> float | None:
    """The median time in seconds to connect to ``candidate`` over ``attempts`` tries; ``None`` if none connected.

    A plain TCP connect, closed at once, when ``ssl_context`` is ``None``; with a
    context the TLS handshake (to ``candidate.host``) is timed too. Each try is
    bounded by ``timeout``; tries run one after another. Cancelling is safe.
    """
    if attempts < 1:
        raise ValueError("attempts must be at least 1")
    loop = asyncio.get_running_loop()
    samples: list[float] = []
    for _ in range(attempts):
        started = loop.time()
        try:
            async with asyncio.timeout(timeout):
                _reader, writer = await asyncio.open_connection(
                    candidate.host,
                    candidate.port,
                    ssl=ssl_context,
                    server_hostname=candidate.host if ssl_context is not None else None,
                )
        except (OSError, TimeoutError, ssl.SSLError) as exc:
            log.debug("probe of %s failed: %s", candidate.url, exc)
            continue
        samples.append(loop.time() - started)
        writer.transport.abort()  # no close handshake: we only wanted the connect time
    return statistics.median(samples) if samples else None


async def rank_candidates(
    candidates: Sequence[RelayCandidate],
    *,
    probe: Probe = probe_latency,
    concurrency: int = 8,
) -> list[RelayCandidate]:
    """``candidates`` ordered by (priority, measured latency), unreachable ones last in their given order.

    Probes at most ``concurrency`` candidates at once. Ties keep the given (RFC 2782)
    order. An exception from ``probe`` other than "unreachable" (``None``) propagates.
    Cancelling is safe: it cancels the probes.
    """
    if concurrency < 1:
        raise ValueError("concurrency must be at least 1")
    slots = asyncio.Semaphore(concurrency)

    async def measure(candidate: RelayCandidate) -> float | None:
        async with slots:
            return await probe(candidate)

    async with asyncio.TaskGroup() as group:
        tasks = [group.create_task(measure(candidate)) for candidate in candidates]
    latencies = [task.result() for task in tasks]
    reachable = [
        (candidate, latency)
        for candidate, latency in zip(candidates, latencies, strict=True)
        if latency is not None
    ]
    reachable.sort(key=lambda pair: (pair[0].priority, pair[1]))
    unreachable = [
        candidate for candidate, latency in zip(candidates, latencies, strict=True) if latency is None
    ]
    return [candidate for candidate, _latency in reachable] + unreachable


# ---- the agent's view --------------------------------------------------------------


class RelayDirectory:
    """The ordered relays of one agent, and which to try next.

    With ``zone`` set, ``refresh()`` resolves it (``resolve_relays``) and ranks the
    result (``rank_candidates``); ``static_urls`` are then only the list used until
    the first successful resolution. Without a zone, ``refresh()`` ranks the static
    URLs, which keep their configured order except that unreachable ones go last.

    The reconnect loop::

        if directory.needs_refresh():
            await directory.refresh()    # ConfigError only when no relay is known at all
        url = directory.next()
        ...connect; on failure directory.mark_failed(url); on close 1001 mark_draining(url)

    ``next()`` sticks to the best candidate that has not failed within
    ``failure_cooldown`` seconds, so after a failure it moves to the next one, and it
    goes back to a better one once its cooldown is over. When every candidate has
    failed recently, it returns the one that failed longest ago, which cycles through
    the list. Failures are remembered by URL across refreshes.

    Not thread-safe; use it from the agent's event loop. ``clock`` is monotonic
    seconds (injectable for tests).
    """

    def __init__(
        self,
        *,
        zone: str | None,
        static_urls: Sequence[str],
        resolver: str | None = None,
        resolver_port: int = 53,
        source: str | None = None,  # local address DNS queries come from (multi-homed hosts, tests)
        # Timeouts and intervals (seconds)
        refresh_interval: float = 300.0,
        failed_refresh_interval: float = 5.0,  # how soon to ask again when every known relay failed
        failure_cooldown: float = 30.0,
        dns_timeout: float = 3.0,
        # What a discovered relay's URL looks like
        path: str = "/v1/agent",
        default_port: int = 8443,
        # Limits
        max_candidates: int = 32,
        probe_concurrency: int = 8,
        # Seams
        probe: Probe = probe_latency,
        rng: random.Random | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if refresh_interval <= 0 or failed_refresh_interval <= 0 or failure_cooldown < 0 or dns_timeout <= 0:
            raise ValueError(
                "refresh_interval and dns_timeout must be positive, failure_cooldown not negative"
            )
        if zone is None and not static_urls:
            raise ConfigError("no relay configured: set relay_zone (DNS discovery) or relay_urls")
        self.zone = zone
        self.resolver = resolver
        self.resolver_port = resolver_port
        self.source = source
        self.refresh_interval = refresh_interval
        self.failed_refresh_interval = failed_refresh_interval
        self.failure_cooldown = failure_cooldown
        self.dns_timeout = dns_timeout
        self.path = path
        self.default_port = default_port
        self.max_candidates = max_candidates
        self.probe_concurrency = probe_concurrency
        self._probe = probe
        self._rng = rng if rng is not None else random.Random()
        self._clock = clock
        self._static = static_candidates(static_urls)[:max_candidates]
        self._candidates: list[RelayCandidate] = list(self._static)
        self._refreshed_at: float | None = None
        # url -> (when it last failed, a sequence number ordering failures at the same clock reading)
        self._failed_at: dict[str, tuple[float, int]] = {}
        self._failures = itertools.count()

    @property
    def candidates(self) -> tuple[RelayCandidate, ...]:
        """The current list, best first."""
        return tuple(self._candidates)

    def needs_refresh(self) -> bool:
        """True before the first refresh, when ``refresh_interval`` has passed since the last one, with no
        candidates, or when every known relay failed recently and ``failed_refresh_interval`` has passed
        (a relay that died is replaced by another the DNS names: the agent must not wait minutes for it)."""
        if self._refreshed_at is None or not self._candidates:
            return True
        elapsed = self._clock() - self._refreshed_at
        if elapsed >= self.refresh_interval:
            return True
        return (self.zone is not None and elapsed >= self.failed_refresh_interval
                and all(candidate.url in self._failed_at for candidate in self._candidates))

    async def refresh(self) -> None:
        """Resolve (when a zone is set) and rank; replace the list only on success.

        When resolution fails and a list is known (an earlier result, or static URLs),
        logs a warning and keeps it. Raises ``ConfigError`` only when resolution fails
        and no relay is known at all. A failed refresh still restarts the
        ``refresh_interval``. Cancelling is safe: the list is replaced only at the end.
        """
        started = self._clock()
        if self.zone is None:
            found = self._static
        else:
            try:
                found = await resolve_relays(
                    self.zone,
                    resolver=self.resolver,
                    resolver_port=self.resolver_port,
                    source=self.source,
                    timeout=self.dns_timeout,
                    path=self.path,
                    default_port=self.default_port,
                    max_candidates=self.max_candidates,
                    rng=self._rng,
                )
            except ConfigError as exc:
                if not self._candidates:
                    raise
                self._refreshed_at = started
                log.warning(
                    "relay discovery for %s failed, keeping the %d known relays: %s",
                    self.zone,
                    len(self._candidates),
                    exc,
                )
                return
        ranked = await rank_candidates(found, probe=self._probe, concurrency=self.probe_concurrency)
        self._candidates = ranked
        self._refreshed_at = started
        self._forget_old_failures()
        log.info("relays, best first: %s", ", ".join(candidate.url for candidate in ranked))

    def next(self) -> str:
        """The URL to connect to now: the best one not failed within ``failure_cooldown``.

        When all failed recently, the one that failed longest ago. Raises
        ``ConfigError`` if no relay is known (``refresh()`` never succeeded).
        """
        if not self._candidates:
            raise ConfigError(f"no relay known for relay zone {self.zone!r}; refresh() has not succeeded yet")
        now = self._clock()
        for candidate in self._candidates:
            failure = self._failed_at.get(candidate.url)
            if failure is None or now - failure[0] >= self.failure_cooldown:
                return candidate.url
        # Every candidate failed recently, so each has a mark: the oldest failure goes first.
        return min((candidate.url for candidate in self._candidates), key=self._failed_at.__getitem__)

    def mark_failed(self, url: str) -> None:
        """Record that connecting to ``url`` failed (or its session broke); ``next()`` moves on."""
        self._failed_at[url] = (self._clock(), next(self._failures))
        self._forget_old_failures()

    def mark_draining(self, url: str) -> None:
        """Record that the relay at ``url`` asked agents to leave (close 1001); treated like a failure."""
        log.info("relay %s is draining; moving to the next one", url)
        self.mark_failed(url)

    def _forget_old_failures(self) -> None:
        """Drop failure marks past their cooldown, so the record stays bounded by recent failures."""
        now = self._clock()
        self._failed_at = {
            url: failure
            for url, failure in self._failed_at.items()
            if now - failure[0] < self.failure_cooldown
        }
