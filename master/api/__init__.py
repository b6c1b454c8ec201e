"""The master's HTTP API: ``/api/v1`` and the few routes outside it (metrics scrape, agent downloads).

One route table (``table.py``, from each ``routes*.py`` module's ``ROUTES``) is read by the router
(``router.py``), the middlewares (``middleware.py``: errors, rate limits, authentication, roles)
and the OpenAPI builder (``openapi.py``). Handlers parse, call one service function, respond.

May import ``billing``, ``master.services``, ``master.telemetry``, ``master.models``, ``master.db``,
``master.context`` and ``shared``; never ``master.app``, ``master.background`` or ``gpumarket``.
"""
