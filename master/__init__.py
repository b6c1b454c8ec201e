"""The master: registry, host state machines, rentals, ingestion, REST API.

Owns the database (``master.models``) and everything that writes to it. Imports
``shared`` and ``console`` (for pages it serves); never imports ``agent`` or ``access``.
"""
