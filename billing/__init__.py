"""Billing: metering, the double-entry ledger, prepaid credit, payouts, invoices, and the money in the
API's views (plain functions; the Celery tasks are thin wrappers; see docs/billing.md).

Sits above the master's services and below its API: imports ``master.telemetry``,
``master.services``, ``master.context``, ``master.db``, ``master.models`` (its tables are in the
master's schema) and ``shared``; never ``master.api``, ``master.app``, ``master.background``,
``agent`` or ``access``. Placement asks it for credit through ``master.context.CreditGate``
(``enforce.PrepaidCreditGate``), handed in at assembly.
"""
