"""The master: registry, host state machines, rentals, ingestion, the REST API and its loops.

Rooms, from the top (the import-linter contract in pyproject.toml holds the order):
``app`` (assembly) → ``api`` · ``background`` (and ``console``) → ``billing`` (its own package)
→ ``telemetry`` (ingest, agent messages, store, roll-ups, metrics) → ``services`` (one module per
aggregate) → ``scheduler`` (pure placement) → ``context`` → ``db`` → ``models`` → ``shared``.
A lower room never imports an upper one; what it needs from above is a small protocol handed in
at assembly (``context.CreditGate``). Never imports ``agent`` or ``access``. See docs/architecture.md.
"""
