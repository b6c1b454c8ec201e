"""Connect tokens: what lets a renter's connection through a relay to one port of one rental.

The master signs a token with the CA's key (ECDSA P-256, SHA-256) when the rental's renter asks
``POST /rentals/{id}/connect``; a relay verifies it with the CA certificate it already holds to
check agents, so no secret is shared with relays. A token names the renter, the rental, the host,
the kind of stream (``ssh``: the agent's SSH server for the rental; ``tcp``: a port of the
rental's; ``svc``: a port of a service's replica, for the master's gateway — a ``tcp`` stream that the
relay does not count against the per-source limit on renters' connections, since one master speaks
for every renter of its services; only masters sign them) and the port, and expires soon (the master's ``connect_token_ttl``, two minutes by
default): it opens connections, it does not keep them — an open connection outlives its token,
and ends when the rental stops (the agent resets its streams).

Form: ``gmc1.<claims>.<signature>``, both parts base64url without padding; the claims are compact
JSON with exactly the fields of ``ConnectClaims``. Verification refuses, with a ``TokenError``
whose ``code`` says why: anything over ``MAX_TOKEN_CHARS``, another prefix, bad base64 or JSON,
a wrong field set or type, a bad signature, an expired token.
"""

from __future__ import annotations

import base64
import binascii
import json
import secrets
from dataclasses import asdict, dataclass
from typing import Final

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import ec

from shared.errors import Unauthorized

PREFIX: Final = "gmc1"
MAX_TOKEN_CHARS: Final = 2048
KINDS: Final = ("ssh", "tcp", "wg", "svc")
SERVICE_KIND: Final = "svc"
"""A service gateway's stream: the agent sees a ``tcp`` one (``stream_kind``)."""


class TokenError(Unauthorized):
    """A connect token that does not open anything; ``code`` says why."""

    code = "invalid_connect_token"


@dataclass(frozen=True, slots=True)
class ConnectClaims:
    account_id: str
    rental_id: str
    host_id: str
    kind: str  # "ssh", "tcp" or "wg" (a cluster member's tunnel datagrams, from a peer's agent: agent/cluster/relay.py)
    port: int
    expires_at: float  # unix seconds
    nonce: str

    @property
    def target(self) -> str:
        return f"{self.rental_id}:{self.kind}:{self.port}"

    @property
    def stream_kind(self) -> str:
        """The kind of stream the agent is asked for: a gateway's is a port of the rental's, as ``tcp``."""
        return "tcp" if self.kind == SERVICE_KIND else self.kind


def new_claims(*, account_id: str, rental_id: str, host_id: str, kind: str, port: int, expires_at: float) -> ConnectClaims:
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}")
    return ConnectClaims(account_id, rental_id, host_id, kind, port, expires_at, secrets.token_urlsafe(9))


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _unb64(text: str) -> bytes:
    if not text or len(text) % 4 == 1:
        raise ValueError("bad length")
    return base64.b64decode(text + "=" * (-len(text) % 4), altchars=b"-_", validate=True)


def sign_connect_token(key: ec.EllipticCurvePrivateKey, claims: ConnectClaims) -> str:
    body = _b64(json.dumps(asdict(claims), separators=(",", ":"), sort_keys=True).encode())
    signed = f"{PREFIX}.{body}"
    signature = key.sign(signed.encode(), ec.ECDSA(hashes.SHA256()))
    return f"{signed}.{_b64(signature)}"


_FIELDS: Final = {"account_id": str, "rental_id": str, "host_id": str, "kind": str, "port": int, "expires_at": float, "nonce": str}


def names_service_kind(token: str) -> bool:
    """Whether the token's claims, read *without* checking its signature, say kind ``svc``: a cheap look that decides
    only whether the signature is worth checking before a relay's per-source limit (a forged token gains nothing)."""
    parts = token.split(".") if isinstance(token, str) and len(token) <= MAX_TOKEN_CHARS else []
    try:
        return len(parts) == 3 and parts[0] == PREFIX and b'"kind":"svc"' in _unb64(parts[1])
    except (ValueError, binascii.Error):
        return False


def verify_connect_token(public_key: ec.EllipticCurvePublicKey, token: str, *, now: float) -> ConnectClaims:
    """The token's claims when its signature is the CA's and it has not expired; ``TokenError`` otherwise."""
    if not isinstance(token, str) or len(token) > MAX_TOKEN_CHARS:
        raise TokenError("the connect token is too long; ask for a new one (gpumarket ssh, or Connect in the console)")
    parts = token.split(".")
    if len(parts) != 3 or parts[0] != PREFIX:
        raise TokenError("this is not a gpumarket connect token; ask for a new one")
    try:
        signature = _unb64(parts[2])
        claims_json = _unb64(parts[1])
        public_key.verify(signature, f"{parts[0]}.{parts[1]}".encode(), ec.ECDSA(hashes.SHA256()))
    except (ValueError, binascii.Error, InvalidSignature):
        raise TokenError("the connect token's signature does not check out; ask for a new one", code="forged_connect_token") from None
    try:
        raw = json.loads(claims_json)
    except (ValueError, RecursionError):
        raise TokenError("the connect token's claims are not JSON") from None
    if not isinstance(raw, dict) or set(raw) != set(_FIELDS):
        raise TokenError("the connect token's claims have the wrong fields")
    for name, kind in _FIELDS.items():
        value = raw[name]
        if kind is float and isinstance(value, int) and not isinstance(value, bool):
            raw[name] = value = float(value)
        if not isinstance(value, kind) or isinstance(value, bool):
            raise TokenError(f"the connect token's {name} has the wrong type")
    claims = ConnectClaims(**raw)
    if claims.kind not in KINDS or not 0 < claims.port < 65536:
        raise TokenError("the connect token names no port of a rental")
    if claims.expires_at <= now:
        raise TokenError("the connect token has expired; ask for a new one (they last about two minutes)", code="expired_connect_token")
    return claims
