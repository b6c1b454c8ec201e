"""The master's background loops: one module per loop, all started and stopped by ``supervisor``.

Each module owns one loop — its period, its lease, its logging, and what cancelling it does —
while the work of one pass stays in the service or telemetry module it belongs to
(``rollups.rollup``, ``rental_queue.process_queue``, ``reliability.rescore_all``, the billing jobs…).
``supervisor`` lists the loops and runs them under its written start, crash and stop policy.
May import ``billing``, ``master.services``, ``master.telemetry``, ``master.models``,
``master.db``, ``master.context`` and ``shared``; never ``master.api``, ``master.app`` or ``gpumarket``.
"""
