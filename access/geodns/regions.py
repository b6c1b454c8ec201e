"""Where a DNS client is, and how far regions are from each other (Sans-I/O).

``RegionMap`` maps a client address (or its EDNS Client Subnet) to a region through the
longest configured prefix, and gives the distance between two regions; the geo DNS orders
relays by it. ``parse_prefix_regions`` and ``parse_region_distance`` read the settings
(``GPUMARKET_PREFIX_REGIONS``, ``GPUMARKET_REGION_DISTANCE``).
"""

from __future__ import annotations

import ipaddress
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from shared.errors import ConfigError

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network


def parse_prefix_regions(prefix_regions: Mapping[str, str]) -> list[tuple[IPNetwork, str]]:
    """``{"10.0.0.0/8": "eu"}`` → ``[(IPv4Network("10.0.0.0/8"), "eu")]``; raises ``ConfigError`` naming the bad entry."""
    parsed: list[tuple[IPNetwork, str]] = []
    for prefix, region in prefix_regions.items():
        try:
            network = ipaddress.ip_network(prefix.strip(), strict=True)
        except ValueError as exc:
            raise ConfigError(
                f"GPUMARKET_PREFIX_REGIONS: {prefix!r} is not a CIDR prefix ({exc}); write it like \"10.0.0.0/8\""
            ) from None
        if not region:
            raise ConfigError(f"GPUMARKET_PREFIX_REGIONS: prefix {prefix!r} maps to an empty region name")
        parsed.append((network, region))
    return parsed


def parse_region_distance(region_distance: Mapping[str, float]) -> dict[tuple[str, str], float]:
    """``{"us:eu": 80}`` → ``{("us", "eu"): 80.0}``; raises ``ConfigError`` naming the bad entry."""
    parsed: dict[tuple[str, str], float] = {}
    for key, distance in region_distance.items():
        first, separator, second = key.partition(":")
        if not separator or not first or not second or ":" in second:
            raise ConfigError(
                f"GPUMARKET_REGION_DISTANCE: key {key!r} is not two region names joined by ':' (like \"us:eu\")"
            )
        if not math.isfinite(distance) or distance < 0:
            raise ConfigError(f"GPUMARKET_REGION_DISTANCE: the distance of {key!r} must be a finite number >= 0")
        parsed[(first, second)] = float(distance)
    return parsed


@dataclass(frozen=True, slots=True)
class Location:
    """Where a client is: its region, and the prefix length that decided it (the ECS scope)."""

    region: str
    scope: int


class RegionMap:
    """Client address → region (longest configured prefix wins), and distances between regions.

    ``region_distance`` is symmetric (``("us", "eu")`` also gives the distance from
    ``"eu"`` to ``"us"``); a region is at distance 0 from itself; a pair that is not
    listed is at ``unknown_distance``. An address no prefix covers is in
    ``default_region``. Lookups take one dictionary probe per distinct prefix length.
    """

    def __init__(
        self,
        prefix_regions: Iterable[tuple[IPNetwork, str]] = (),
        *,
        region_distance: Mapping[tuple[str, str], float] | None = None,
        default_region: str = "local",
        unknown_distance: float = 10_000.0,
    ) -> None:
        if not math.isfinite(unknown_distance) or unknown_distance < 0:
            raise ValueError("unknown_distance must be a finite number >= 0")
        self.default_region = default_region
        self.unknown_distance = unknown_distance
        self._prefixes: dict[int, list[tuple[IPNetwork, str]]] = {4: [], 6: []}
        # Per family: [(prefix length, {network as int >> host bits: region})], longest first.
        self._tables: dict[int, list[tuple[int, dict[int, str]]]] = {4: [], 6: []}
        seen: dict[IPNetwork, str] = {}
        for network, region in prefix_regions:
            if network in seen:
                raise ValueError(f"prefix {network} is given twice (regions {seen[network]!r} and {region!r})")
            seen[network] = region
            self._prefixes[network.version].append((network, region))
        for version, prefixes in self._prefixes.items():
            by_length: dict[int, dict[int, str]] = {}
            for network, region in prefixes:
                host_bits = network.max_prefixlen - network.prefixlen
                by_length.setdefault(network.prefixlen, {})[int(network.network_address) >> host_bits] = region
            self._tables[version] = sorted(by_length.items(), reverse=True)
        self._distances: dict[tuple[str, str], float] = {}
        for (first, second), distance in (region_distance or {}).items():
            if not math.isfinite(distance) or distance < 0:
                raise ValueError(f"distance {first!r}-{second!r} must be a finite number >= 0")
            self._distances[(first, second)] = distance
            self._distances[(second, first)] = distance

    def locate(self, address: IPAddress) -> Location:
        """The region of ``address`` and the scope: how many leading bits of it the answer depends on.

        The scope is the matched prefix length, lengthened where a more specific prefix
        of another region lies inside the matched one, so that every address sharing
        ``scope`` leading bits with ``address`` is in the same region (RFC 7871 §7.2.1).
        """
        bits = address.max_prefixlen
        value = int(address)
        matched_length, region = 0, self.default_region
        for length, table in self._tables[address.version]:
            found = table.get(value >> (bits - length))
            if found is not None:
                matched_length, region = length, found
                break
        scope = matched_length
        for network, other_region in self._prefixes[address.version]:
            if network.prefixlen <= matched_length or other_region == region:
                continue
            # The address is outside ``network`` (a longer match would have won), so the
            # bits they share end before ``network.prefixlen``.
            shared_bits = bits - (value ^ int(network.network_address)).bit_length()
            if shared_bits >= matched_length:
                scope = max(scope, shared_bits + 1)
        return Location(region, scope)

    def distance(self, first: str, second: str) -> float:
        if first == second:
            return 0.0
        return self._distances.get((first, second), self.unknown_distance)


__all__ = ["IPAddress", "IPNetwork", "Location", "RegionMap", "parse_prefix_regions", "parse_region_distance"]
