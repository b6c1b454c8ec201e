"""The renter's command line: ``gpumarket login | offers | rent | rentals | logs | stop | account``.

It talks to the master's REST API (``/api/v1``) over HTTP only, like any other client: it
imports nothing of the master (an import-linter contract holds it to that).
``api.py`` is the HTTP client and the saved login; ``commands.py`` the commands and their parsers.
"""
