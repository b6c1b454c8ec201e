"""A passkey authenticator in Python, for the API tests: what a browser and its platform authenticator answer to
``navigator.credentials.create`` and ``.get``, as the JSON of their ``PublicKeyCredential`` (``toJSON()``).

Each credential is an EC P-256 key (COSE alg -7, ES256) made with ``cryptography``; registration answers with 'none'
attestation, sign-in with an ECDSA signature over the authenticator data and the client data's hash, exactly as
WebAuthn Level 2 lays them out (section 6.1 authenticator data, 6.5.4 'none', 6.3.3 getAssertion). The server checks them
with py_webauthn, so nothing here is trusted by the code under test. The browser's part is here too: the client data
names the origin it is given, which a test may set to the wrong one.
"""

from __future__ import annotations

import hashlib
import json
import secrets
import struct
from dataclasses import dataclass, field
from typing import Any

from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import ec
from webauthn.helpers import base64url_to_bytes, bytes_to_base64url, encode_cbor

UP, UV, AT = (
    0x01,
    0x04,
    0x40,
)  # authenticator data flags: user present, user verified, attested credential data


@dataclass
class Credential:
    credential_id: bytes
    key: ec.EllipticCurvePrivateKey
    rp_id: str
    user_handle: bytes
    sign_count: int = 0


@dataclass
class Authenticator:
    """A platform authenticator holding discoverable credentials; ``counter_step`` 0 models one that keeps no counter."""

    counter_step: int = 1
    user_verified: bool = True
    credentials: list[Credential] = field(default_factory=list)

    def _flags(self, *extra: int) -> int:
        flags = UP | (UV if self.user_verified else 0)
        for flag in extra:
            flags |= flag
        return flags

    def create(self, options: dict[str, Any], origin: str, *, rp_id: str | None = None) -> dict[str, Any]:
        """The answer to ``navigator.credentials.create(options)`` at ``origin`` (the RP id of the options, unless given)."""
        rp = rp_id or options["rp"]["id"]
        credential = Credential(secrets.token_bytes(32), ec.generate_private_key(ec.SECP256R1()), rp,
                                base64url_to_bytes(options["user"]["id"]))  # fmt: skip
        numbers = credential.key.public_key().public_numbers()
        cose_key = encode_cbor(
            {1: 2, 3: -7, -1: 1, -2: numbers.x.to_bytes(32, "big"), -3: numbers.y.to_bytes(32, "big")}
        )
        attested = (
            bytes(16) + struct.pack(">H", len(credential.credential_id)) + credential.credential_id + cose_key
        )
        auth_data = (
            hashlib.sha256(rp.encode()).digest() + bytes([self._flags(AT)]) + struct.pack(">I", 0) + attested
        )
        client_data = _client_data("webauthn.create", options["challenge"], origin)
        self.credentials.append(credential)
        return {
            "id": bytes_to_base64url(credential.credential_id), "rawId": bytes_to_base64url(credential.credential_id),
            "type": "public-key", "clientExtensionResults": {}, "authenticatorAttachment": "platform",
            "response": {"clientDataJSON": bytes_to_base64url(client_data), "transports": ["internal"],
                         "attestationObject": bytes_to_base64url(encode_cbor({"fmt": "none", "attStmt": {}, "authData": auth_data}))},
        }  # fmt: skip

    def get(self, options: dict[str, Any], origin: str, *, credential: Credential | None = None, sign_count: int | None = None,
            rp_id: str | None = None) -> dict[str, Any]:  # fmt: skip
        """The answer to ``navigator.credentials.get(options)`` at ``origin`` with ``credential`` (the newest one held)."""
        chosen = credential or self.credentials[-1]
        if sign_count is None:
            chosen.sign_count += self.counter_step
            sign_count = chosen.sign_count
        rp = rp_id or options.get("rpId") or chosen.rp_id
        auth_data = (
            hashlib.sha256(rp.encode()).digest() + bytes([self._flags()]) + struct.pack(">I", sign_count)
        )
        client_data = _client_data("webauthn.get", options["challenge"], origin)
        signature = chosen.key.sign(
            auth_data + hashlib.sha256(client_data).digest(), ec.ECDSA(hashes.SHA256())
        )
        return {
            "id": bytes_to_base64url(chosen.credential_id), "rawId": bytes_to_base64url(chosen.credential_id),
            "type": "public-key", "clientExtensionResults": {}, "authenticatorAttachment": "platform",
            "response": {"clientDataJSON": bytes_to_base64url(client_data), "authenticatorData": bytes_to_base64url(auth_data),
                         "signature": bytes_to_base64url(signature), "userHandle": bytes_to_base64url(chosen.user_handle)},
        }  # fmt: skip


def _client_data(kind: str, challenge: str, origin: str) -> bytes:
    return json.dumps({"type": kind, "challenge": challenge, "origin": origin, "crossOrigin": False}).encode()
