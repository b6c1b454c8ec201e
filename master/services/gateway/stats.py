"""A gateway's figures per service: what ``/metrics`` exports and what ``service_stats`` rows hold.

Each master process counts the requests it serves itself, in memory (the event loop is single-threaded:
no locks), in two forms per service:

* **Totals** since the process started — Prometheus counters (requests, errors, retries), the in-flight
  gauge and a latency histogram with its sum — exported on ``/metrics`` (``master/telemetry/metrics.py``).
* **The current bucket** of ``service_stats_bucket_s`` seconds: the same counts, plus the in-flight
  gauge sampled once a second (sum, samples, peak). ``take_buckets`` hands them out as one row per
  service that had traffic or requests in flight, and starts the next bucket; the stats loop
  (``master/background/gateway.py``) writes them to ``service_stats``.

What counts: a request is one that passed authentication (strangers' 401s and 404s are not the
service's figures). An *error* is a request answered 5xx, by the gateway (no replica answered, none
ready in time) or by a replica, or not answered at all (the client left, the answer broke off). A
*retry* is each time a request was sent again to another replica. *Latency* is the time from the
request's arrival to its answer's head (status and headers) leaving the gateway: the whole call for
an API that answers at once, the time to the first token for one that streams, the queueing for a
replica included; a request answered with nothing has the time until it was given up.

Histograms are lists of counts, one per bucket of ``LATENCY_BOUNDS_MS`` (a request of ``ms``
milliseconds counts in the first bucket whose bound is ``>= ms``) and one more for everything above
the last bound. Rows of several masters add up bucket by bucket (``merge_histograms``);
``percentile`` reads a quantile off one.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Final

LATENCY_BOUNDS_MS: Final[tuple[float, ...]] = (
    1, 2, 5, 10, 20, 50, 100, 200, 500, 1_000, 2_000, 5_000, 10_000, 30_000, 60_000, 120_000, 300_000,
)  # fmt: skip
"""Upper bounds (ms, inclusive) of the latency buckets; a histogram has one count more, for above the last.
Fixed: stored rows are read with them, so a change needs a migration of ``service_stats.latency_hist``."""


def empty_histogram() -> list[int]:
    return [0] * (len(LATENCY_BOUNDS_MS) + 1)


def bucket_of(ms: float) -> int:
    """The index of the histogram bucket a latency of ``ms`` milliseconds counts in."""
    return bisect.bisect_left(LATENCY_BOUNDS_MS, ms)


def merge_histograms(histograms: Iterable[Sequence[int]]) -> list[int]:
    """Histograms added bucket by bucket (several masters' rows, several buckets of time)."""
    total = empty_histogram()
    for histogram in histograms:
        for index, count in enumerate(histogram[: len(total)]):
            total[index] += count
    return total


def percentile(histogram: Sequence[int], q: float) -> float | None:
    """The ``q``-quantile (0..1; 0.5 the median, 0.99 the p99) of a latency histogram, in milliseconds.

    Interpolated linearly within the bucket it falls in, as Prometheus' ``histogram_quantile`` does (the
    first bucket from 0); one in the bucket above the last bound answers that bound (a floor: nothing
    more is known). ``None`` for an empty histogram.
    """
    if not 0 <= q <= 1:
        raise ValueError(f"q must be between 0 and 1, not {q}")
    total = sum(histogram)
    if total <= 0:
        return None
    rank = q * total
    seen = 0
    for index, count in enumerate(histogram):
        if count and seen + count >= rank:
            if index >= len(LATENCY_BOUNDS_MS):
                return float(LATENCY_BOUNDS_MS[-1])
            lower = float(LATENCY_BOUNDS_MS[index - 1]) if index else 0.0
            upper = float(LATENCY_BOUNDS_MS[index])
            return lower + (upper - lower) * max(0.0, rank - seen) / count
        seen += count
    return float(LATENCY_BOUNDS_MS[-1])


@dataclass
class Bucket:
    """One service's figures over the current bucket of time (a ``service_stats`` row to be)."""

    requests: int = 0
    errors: int = 0
    retries: int = 0
    inflight_sum: float = 0.0
    inflight_samples: int = 0
    inflight_peak: int = 0
    latency_hist: list[int] = field(default_factory=empty_histogram)

    @property
    def idle(self) -> bool:
        return not (self.requests or self.retries or self.inflight_sum or self.inflight_peak)


@dataclass
class ServiceStats:
    """One service's figures in this process: totals since it started, the current bucket, requests in flight."""

    requests: int = 0
    errors: int = 0
    retries: int = 0
    inflight: int = 0
    latency_hist: list[int] = field(default_factory=empty_histogram)
    latency_sum_ms: float = 0.0
    bucket: Bucket = field(default_factory=Bucket)

    def started(self) -> None:
        """A request came in (it is in flight until ``finished``)."""
        self.inflight += 1
        self.bucket.inflight_peak = max(self.bucket.inflight_peak, self.inflight)

    def answered(self, latency_ms: float) -> None:
        """The request's answer head left (or it was given up): its latency."""
        index = bucket_of(latency_ms)
        self.latency_hist[index] += 1
        self.bucket.latency_hist[index] += 1
        self.latency_sum_ms += latency_ms

    def retried(self) -> None:
        self.retries += 1
        self.bucket.retries += 1

    def finished(self, *, error: bool) -> None:
        """The request is over: counted, an error or not, and no longer in flight."""
        self.inflight -= 1
        self.requests += 1
        self.bucket.requests += 1
        if error:
            self.errors += 1
            self.bucket.errors += 1

    def sample(self) -> None:
        """Once a second: the in-flight gauge into the bucket."""
        self.bucket.inflight_sum += self.inflight
        self.bucket.inflight_samples += 1
        self.bucket.inflight_peak = max(self.bucket.inflight_peak, self.inflight)


class GatewayStats:
    """Every service's figures in this process, by service id."""

    def __init__(self) -> None:
        self.services: dict[str, ServiceStats] = {}

    def of(self, service_id: str) -> ServiceStats:
        stats = self.services.get(service_id)
        if stats is None:
            stats = self.services[service_id] = ServiceStats()
        return stats

    def sample(self) -> None:
        """Sample every service's in-flight gauge (the stats loop calls it once a second)."""
        for stats in self.services.values():
            stats.sample()

    def take_buckets(self) -> dict[str, Bucket]:
        """The current bucket of every service that had traffic or requests in flight; each service starts a new one."""
        taken: dict[str, Bucket] = {}
        for service_id, stats in self.services.items():
            bucket, stats.bucket = stats.bucket, Bucket(inflight_peak=stats.inflight)
            if not bucket.idle:
                taken[service_id] = bucket
        return taken

    def snapshot(self) -> dict[str, ServiceStats]:
        """A copy of the totals, for ``/metrics`` (the buckets left out)."""
        return {
            service_id: ServiceStats(
                requests=stats.requests, errors=stats.errors, retries=stats.retries, inflight=stats.inflight,
                latency_hist=list(stats.latency_hist), latency_sum_ms=stats.latency_sum_ms,
            )
            for service_id, stats in self.services.items()
        }  # fmt: skip
