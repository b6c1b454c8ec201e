"""Accounts: who they are and how they sign in and reach their rentals.

* ``core.py``: accounts, roles and API keys, and the ``Principal`` a request acts as.
* ``sessions.py``: the console's sessions (cookie, CSRF token, expiry).
* ``ssh_keys.py``: a renter's SSH public keys (parsing, fingerprints, limits).
* ``access.py``: what a renter's keys reach: ``update_access`` commands to the hosts of the account's rentals.

The lowest of the aggregates: it imports ``master.services.lifecycle`` and ``master.services.commands`` (``access``
tells hosts) and nothing else of ``master.services``; every other aggregate may import it.
"""
