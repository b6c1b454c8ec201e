"""A cluster's private network on this host: one WireGuard tunnel per member container, and a trusted fabric's
interface where the provider declared one.

Owns: the member's tunnel and its state file (``net``: ``ClusterNetworks``, the one name the rest of the agent
uses), ``wireguard-go``'s control (``wgcontrol``: keys, UAPI requests, peer states), kernel WireGuard's (``wgkernel``:
the same requests through ``wg``), the member's ``fabric0`` on its provider's fabric (``fabric``), what the hello says
of this host's paths (``paths``), the measurements between members (``probe``), a peer reached through the relays
when no direct handshake completes (``relay``) and the programs all of it runs (``tools``). It imports ``shared``
and ``agent.runtimes`` (the member's container) only; ``agent.commands`` drives it and ``agent.reach.tunnels``
hands it the relayed peers' streams. docs/clusters.md says how it works.
"""
