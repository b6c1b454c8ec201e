"""Billing: metering, the double-entry ledger, prepaid credit, payouts (plain functions; see docs/billing.md).

Imports ``shared`` and the master's models and database (its tables are in the master's
schema); never ``agent/`` or ``access/``.
"""
