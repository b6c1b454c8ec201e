"""A cluster's private network on this host: one userspace WireGuard tunnel per member container.

Owns: the member's tunnel and its state file (``net``: ``ClusterNetworks``, the one name the rest of the agent
uses), ``wireguard-go``'s control (``wgcontrol``: keys, UAPI requests, peer states), the measurements between
members (``probe``) and a peer reached through the relays when no direct handshake completes (``relay``). It
imports ``shared`` and ``agent.runtimes`` (the member's container) only; ``agent.commands`` drives it and
``agent.reach.tunnels`` hands it the relayed peers' streams. docs/clusters.md says how it works.
"""
