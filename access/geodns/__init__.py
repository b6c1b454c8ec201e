"""The geo DNS: an authoritative DNS server for the relay zone that answers with the nearest healthy relays.

Agents look up ``_gpumarket._tcp.<zone>`` SRV (then ``<zone>`` A/AAAA, see
``agent.discovery``). This server answers each query from the live relay list in the
``Registry`` (refreshed every ``refresh_interval``, never per query), ranked for the
asker: the client's region comes from the EDNS Client Subnet option (RFC 7871) when
the query has one, else from the source address; relays are ordered by region
distance, then by spare capacity.


Three modules, from the bottom:

- ``regions``: the client's region (a prefix → region map) and the distance between
  regions; parsing of the two settings that configure them. Sans-I/O.
- ``zone``: the relay zone's data (the live relay records) and how it answers one parsed
  query (``GeoZone``), and a response rendered into a UDP-sized message. Sans-I/O.
- ``server``: ``GeoDnsServer``, which owns the sockets (UDP and TCP on one port), the
  per-source rate limit, the message size limits, the refresh task and the counters in
  ``stats``; ``serve_dns`` runs it as ``gpumarket dns``.

Imports ``shared`` and dnspython only.
"""
