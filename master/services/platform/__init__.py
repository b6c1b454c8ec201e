"""The platform itself: whether its database and bus answer, its live relays (``views.py``), and the fleet's use
over time for the admin's charts (``fleet.py``: occupancy and hosts online per day). Imports no other part of
``master.services``.
"""

from master.services.platform.fleet import MAX_DAYS, Window, fleet_occupancy, gpu_occupancy, hosts_online
from master.services.platform.views import dependency_checks, relay_list

__all__ = [
    "MAX_DAYS",
    "Window",
    "dependency_checks",
    "fleet_occupancy",
    "gpu_occupancy",
    "hosts_online",
    "relay_list",
]
