"""The market: what hosts offer and how renters find it.

* ``listings.py``: a host's listing (price, available until, maintenance windows) and the money grammar's helpers.
* ``tiers.py``: every GPU's tier from its model; ``placement.py``: GPU model names as renters write them, matched
  against NVML's.
* ``offers.py``, ``query.py``: the offers renters search (the summary table, the filter language);
  ``cluster_offers.py``: the offers for a cluster (hosts near each other, by measured links).
* ``faults.py``, ``reliability.py``: typed failures with their owner, and each host's reliability from those the
  provider owns.
* ``forecast.py``, ``forecast_models.py``: the demand forecast (the console's chart, the power policy's off-peak).

Imports ``master.services.accounts``, ``master.services.lifecycle`` and the top-level modules of
``master.services`` (``commands``, ``host_links``, ``isolation``); never rentals, clusters, endpoints or hosts, which
build on it.
"""
