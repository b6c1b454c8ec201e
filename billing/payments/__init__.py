"""Self-serve credit: a renter adds prepaid credit through a payment provider, no admin involved.

``base`` is the seam (``PaymentProvider``) and what the API calls (``add_credit``, ``credit_paid``);
``demo`` credits at once (no card, ``gpumarket up``); ``stripe`` sends the renter to Stripe Checkout
and credits from its signed webhook. Chosen by ``MasterSettings.payments`` (``provider_for``).
Every credit goes through ``billing.credits.top_up``, whose reference makes it idempotent.

Imports ``billing``, ``master.context``, ``master.models`` and ``shared``; never ``master.api``.
"""
