"""The master's business rules, one module per aggregate (rentals, hosts' state, enrollment, listings,
offers, accounts, alerts, ...).

Callers (``master.api``, ``master.telemetry``, ``master.background``, ``billing``) pass a session
(the caller owns the transaction) or the ``Master`` context. May import ``master.scheduler``,
``master.context``, ``master.db``, ``master.models`` and ``shared``; never ``master.telemetry``,
``master.api``, ``master.background``, ``billing`` or ``gpumarket``.
"""
