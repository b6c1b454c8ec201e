"""The state machines of hosts, rentals and clusters: one explicit transition table each.

* ``hosts.py``: a host's states (enrolling, online, rented, offline, ...), each change with its cause.
* ``rentals.py``: a rental's states; a change of a cluster member's state names its cluster (``clusters.py``).
* ``clusters.py``: a cluster's state, derived from its members' at each flush, and its events.
* ``cluster_network.py``: the commands that build a cluster's private network as its members start.

They sit below every aggregate because every aggregate moves them: a host's fault fails its rentals (market), a
member rental moves its cluster, a replica's state its service. Imports ``master.services.commands`` and
``master.services.host_links`` only. Unlike the aggregates' packages, whose modules only they import, its public names
are these modules: each machine has its own ``transition``, so the others import ``lifecycle.hosts`` and the like.
"""
