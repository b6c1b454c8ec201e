"""The master's business rules, one package per aggregate: ``accounts``, ``market`` (listings, tiers, offers,
faults and reliability, the demand forecast), ``rentals``, ``clusters``, ``endpoints`` (the elastic services
product), ``hosts`` (enrollment, views, power), ``alerts``, ``gateway`` and ``platform``; below them the state
machines every aggregate moves (``lifecycle``), and a few modules they all use: ``commands`` (the agents' command
outbox), ``host_links``, ``idempotency``, ``isolation``. The rental queue (``queue``), which interleaves rentals and
clusters, sits above both. Each package's ``__init__`` says what it owns and what it may import; the import
contracts of pyproject.toml hold the order (no cycle between them).

Callers (``master.api``, ``master.telemetry``, ``master.background``, ``billing``) pass a session
(the caller owns the transaction) or the ``Master`` context. May import ``master.scheduler``,
``master.context``, ``master.db``, ``master.models`` and ``shared``; never ``master.telemetry``,
``master.api``, ``master.background``, ``billing`` or ``gpumarket``.
"""
