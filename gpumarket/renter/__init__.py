"""The renter's command line: ``gpumarket login | offers | rent | rentals | logs | stop | account``,
``gpumarket ssh | ssh-config | cp | tunnel``, ``gpumarket cluster …``, ``gpumarket service …`` and ``gpumarket credit``.

It talks to the master's REST API (``/api/v1``) over HTTP only, like any other client, and to
the relays' websockets with the tickets the API hands out: it imports nothing of the master (an
import-linter contract holds it to that). ``api.py`` is the HTTP client and the saved login;
``commands.py`` the commands and their parsers; ``connect.py`` the connect tickets,
``stdio.py`` + ``tunnel.py`` the ProxyCommand, ``sshfiles.py`` the pinned known_hosts and the
ssh options, ``sshcmds.py`` the ssh, ssh-config and cp commands, ``clusters.py`` and
``services.py`` the cluster and service commands, ``credit.py`` adding credit.
"""
