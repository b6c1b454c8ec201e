"""Clusters: several rentals placed together, with a private network between their members.

* ``core.py``: create (idempotent), get, list and stop a cluster; ``request.py``: the typed request.
* ``placement.py``: choosing hosts for every member at once (by measured links); ``policy.py``: what a member's
  failure does to its cluster (replace or stop); ``queue.py``: a cluster waiting for capacity.

The cluster state machine and its network's commands are ``master.services.lifecycle.clusters`` and
``master.services.lifecycle.cluster_network``. Imports ``master.services.rentals`` and what rentals may import;
never endpoints or hosts.
"""

from master.services.clusters.core import cluster_detail, create_cluster, delete_cluster, list_clusters
from master.services.clusters.policy import replace_broken_members
from master.services.clusters.queue import expire, place_queued, position, queue_length
from master.services.clusters.request import MAX_NODES, ClusterRequest

__all__ = [
    "MAX_NODES",
    "ClusterRequest",
    "cluster_detail",
    "create_cluster",
    "delete_cluster",
    "expire",
    "list_clusters",
    "place_queued",
    "position",
    "queue_length",
    "replace_broken_members",
]
