"""The elastic services' gateway: one endpoint per service, ``{public_url}/svc/{service}/...``, served by every
master API process and balanced over the service's ready replicas through the relays.

* ``core.py``: who may call a service, which replica takes a request, waking a service with none ready,
  the per-process ``Gateway`` (``gateway_of``, ``close_gateway``) and its figures' rows.
* ``proxy.py``: forwarding one request (headers, body, retries, streamed answers, websockets).
* ``upstream.py``: a replica's pool of HTTP connections, each a stream through the relay.
* ``wstransport.py``: the asyncio transport through which aiohttp's client speaks to one such stream.
* ``routing.py``: services' routes and API keys' owners, read from the database and kept briefly.
* ``stats.py``: the figures per service (``LATENCY_BOUNDS_MS``, ``percentile``).
* ``probe.py``: the autoscaler's health probe (``probe``).

A part of ``master.services``: it imports ``master.context``, ``master.db``, ``master.models``, other services
and ``shared``, never ``master.api`` or ``master.background`` (the HTTP handler is ``master/api/routes_gateway.py``,
the stats loop ``master/background/gateway.py``).
"""

from master.services.gateway.core import Gateway, NoReadyReplica, ServiceFailing, close_gateway, gateway_of
from master.services.gateway.probe import probe
from master.services.gateway.stats import LATENCY_BOUNDS_MS, merge_histograms, percentile

__all__ = ["LATENCY_BOUNDS_MS", "Gateway", "NoReadyReplica", "ServiceFailing", "close_gateway", "gateway_of", "merge_histograms", "percentile", "probe"]

from master.services.gateway.proxy import error_response, forward
from master.services.gateway.stats import ServiceStats

__all__ = [
    "LATENCY_BOUNDS_MS",
    "ServiceStats",
    "error_response",
    "forward",
    "percentile",
]
