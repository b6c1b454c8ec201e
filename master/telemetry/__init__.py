"""Telemetry: ingestion from the bus, the sample store, roll-ups and retention, metrics export.

Owns ``ingest`` (the bus consumer that applies agent messages), ``store`` (refusing impossible
readings, series reads), ``rollups`` (1-minute and 1-hour buckets, retention), ``snapshot``
(the fleet snapshot and its JSON) and ``metrics`` (its Prometheus exposition, cached). May
import ``master.services``, ``master.models``, ``master.db``, ``master.context`` and ``shared``;
never ``master.api``, ``billing`` or ``gpumarket``.
"""
