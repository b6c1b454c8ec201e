"""Elastic services, the product (REST paths ``/api/v1/services``; "endpoints" here so that the name does not
collide with this layer's, ``master.services``): replicas behind one gateway endpoint, scaled on load.

* ``core.py``: create (idempotent), read, list, scale the bounds of and delete a service; ``request.py``: the
  typed request.
* ``scaling.py``: the scaling rule; ``autoscale.py``: one autoscaler pass over every service; ``backoff.py``:
  replicas that cannot start (the wait before the next, the ``failing`` state, the renter's resume).
* ``figures.py``, ``series.py``: a service's figures and their series over time (from the gateway's stats).

Imports ``master.services.rentals`` (a replica is a rental), ``master.services.gateway`` (its figures) and what
rentals may import; never clusters or hosts.
"""

from master.services.endpoints.autoscale import AutoscalerMemory, autoscale_pass
from master.services.endpoints.backoff import FAILING
from master.services.endpoints.core import (
    create_service,
    delete_service,
    endpoint_path,
    get_service,
    list_services,
    replica_ids,
    rotate_token,
    scale_service,
    service_detail,
)
from master.services.endpoints.request import ServiceRequest
from master.services.endpoints.series import series

__all__ = [
    "FAILING",
    "AutoscalerMemory",
    "ServiceRequest",
    "autoscale_pass",
    "create_service",
    "delete_service",
    "endpoint_path",
    "get_service",
    "list_services",
    "replica_ids",
    "rotate_token",
    "scale_service",
    "series",
    "service_detail",
]
