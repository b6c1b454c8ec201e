"""Rentals: a renter's GPUs on one host, from the request to the release.

* ``core.py``: create (idempotent), read, list and stop a rental, its logs and its view; ``request.py``: the typed
  request.
* ``placement.py``: choosing the GPUs (quotas, fair use, the placer), ``allocation.py``: holding them (GPU
  allocations, shares); ``quotas.py``: an admin's quota and fair-share writes.
* ``lifecycle.py``: what happens to rentals when their host goes silent, comes back or fails.
* ``connect.py``: the renter's way in (connect tokens for SSH, ports, web ports).
* ``templates.py``: the workload templates a rental may name.

The rental state machine itself is ``master.services.lifecycle.rentals`` (every aggregate moves it). Imports
``master.services.accounts``, ``master.services.market``, ``master.services.lifecycle`` and the top-level modules;
never clusters, endpoints or hosts, which build on it.
"""
