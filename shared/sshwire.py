"""The SSH transport settings both ends of gpumarket's SSH use: the agent's server (``agent.reach.sshd``), its volume
copier and the renter's ``volume copy --via-client`` (asyncssh clients), and the ``Ciphers`` line the renter's
OpenSSH gets (``gpumarket ssh``, ``cp``, ``ssh-config``).

Why AES-GCM first: asyncssh encrypts each packet in Python through ``cryptography``. AES-GCM is one call per packet
(AES-NI); ChaCha20-Poly1305 — what OpenSSH and asyncssh pick by default — is three cipher contexts and a Poly1305
per packet, and measured 4.5× slower per 32 KiB packet on this project's machines (docs/performance.md, "Issue 42:
scp, rsync and volume copies"). SSH's client picks the first of its own list that the server offers, so the server
cannot choose: the clients we configure put GCM first, and the server keeps ChaCha20 and AES-CTR for every other
client (PuTTY before 0.76 and older libraries have no GCM).

Nothing here imports asyncssh: these are plain values for its options.
"""

from __future__ import annotations

from typing import Final

# In order of preference; every name is one asyncssh and OpenSSH ≥ 6.5 both know.
CIPHERS: Final = (
    "aes128-gcm@openssh.com",
    "aes256-gcm@openssh.com",
    "chacha20-poly1305@openssh.com",
    "aes128-ctr",
    "aes192-ctr",
    "aes256-ctr",
)
# A channel's receive window and largest data packet for asyncssh's ends (asyncssh's defaults: 2 MiB and 32 KiB).
# Larger packets mean fewer per-packet costs in Python (each is encrypted, framed and parsed once); the window
# bounds what a channel may have in flight, and so what one channel may buffer at the receiver. OpenSSH caps any
# packet at 256 KiB, so a data packet stays well under it.
WINDOW: Final = 8 << 20
MAX_PACKET: Final = 128 << 10


def openssh_ciphers() -> str:
    """The ``Ciphers`` value for OpenSSH's ssh and scp (``-o Ciphers=…``): ``CIPHERS`` in order."""
    return ",".join(CIPHERS)
