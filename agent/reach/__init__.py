"""The renter's way into a rental on this host, through the relays: SSH served by the agent itself, SFTP and scp
in the rental's workspace, and streams to a port of the rental's container.

Owns: the streams from the relay (``tunnels``: ``TunnelServer``, per-rental limits and byte counts), the SSH
server (``sshd``: ``RentalSshServer``, per-rental host keys and authorized keys), a login's shell or command
(``sessions``) and SFTP jailed in the workspace (``sftp``). It imports ``shared`` and ``agent.runtimes`` (the
rental's workload), and ``agent.cluster`` for the relayed peers' streams; ``agent.runner`` wires it to the link.
docs/connect.md and docs/isolation.md say how it works.
"""
