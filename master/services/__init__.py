"""Business rules of the master. Handlers in ``master.api`` and the ingestion loop call these;
they take a session (the caller owns the transaction) or the ``Master`` context."""
