"""The REST API under ``/api/v1``: thin handlers that parse, authorize and call ``master.services``."""
