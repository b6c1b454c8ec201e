"""Clusters: several rentals placed together, with a private network between their members.

* ``core.py``: create (idempotent), get, list and stop a cluster; ``request.py``: the typed request.
* ``placement.py``: choosing hosts for every member at once (by measured links); ``policy.py``: what a member's
  failure does to its cluster (replace or stop); ``queue.py``: a cluster waiting for capacity.

The cluster state machine and its network's commands are ``master.services.lifecycle.clusters`` and
``master.services.lifecycle.cluster_network``. Imports ``master.services.rentals`` and what rentals may import;
never endpoints or hosts.
"""
