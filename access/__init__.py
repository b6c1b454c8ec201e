"""The access relay: TLS websocket front door for agents, forwarding to the master over the bus.

Stateless: everything it knows is on the bus or in the agents' certificates. Imports
``shared`` only; never ``master`` or ``agent``.
"""
