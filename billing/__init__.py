"""Billing: metering, the double-entry ledger, invoices and payouts (Celery tasks over plain functions).

Not built yet: the billing issue adds it. Must not import agent/ or access/.
"""
