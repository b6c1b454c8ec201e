"""Connect tokens (``shared/crypto/tokens.py``): what the CA signs opens exactly that, nothing else opens anything."""

from __future__ import annotations

import base64
import json
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shared.crypto import generate_private_key
from shared.crypto.tokens import (
    MAX_TOKEN_CHARS,
    TokenError,
    new_claims,
    sign_connect_token,
    verify_connect_token,
)

KEY = generate_private_key()
OTHER_KEY = generate_private_key()
NOW = time.time()


def claims(**changes: object) -> object:
    base = {"account_id": "acct-1", "rental_id": "r-0123456789abcdef", "host_id": "h-1", "kind": "tcp", "port": 8888,
            "expires_at": NOW + 60}
    base.update(changes)
    return new_claims(**base)  # type: ignore[arg-type]


def b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def test_a_signed_token_verifies_to_its_claims() -> None:
    original = claims()
    assert verify_connect_token(KEY.public_key(), sign_connect_token(KEY, original), now=NOW) == original  # type: ignore[arg-type]


def test_another_key_an_expired_token_and_changed_claims_are_refused() -> None:
    token = sign_connect_token(OTHER_KEY, claims())  # type: ignore[arg-type]
    with pytest.raises(TokenError) as caught:
        verify_connect_token(KEY.public_key(), token, now=NOW)
    assert caught.value.code == "forged_connect_token" and caught.value.http_status == 401
    with pytest.raises(TokenError) as caught:
        verify_connect_token(KEY.public_key(), sign_connect_token(KEY, claims(expires_at=NOW - 1)), now=NOW)  # type: ignore[arg-type]
    assert caught.value.code == "expired_connect_token"
    prefix, body, signature = sign_connect_token(KEY, claims()).split(".")  # type: ignore[arg-type]
    raised = json.loads(base64.urlsafe_b64decode(body + "=" * (-len(body) % 4)))
    raised["port"] = 22  # the same signature over other claims
    with pytest.raises(TokenError, match="signature"):
        verify_connect_token(KEY.public_key(), ".".join((prefix, b64(json.dumps(raised).encode()), signature)), now=NOW)


@pytest.mark.parametrize("fields", [
    {"port": True}, {"port": "22"}, {"port": 0}, {"port": 65536}, {"kind": "udp"}, {"extra": 1}, {"rental_id": None},
])
def test_well_signed_but_malformed_claims_are_refused(fields: dict[str, object]) -> None:
    raw = {"account_id": "a", "rental_id": "r", "host_id": "h", "kind": "tcp", "port": 1, "expires_at": NOW + 60, "nonce": "n"}
    raw.update(fields)
    signed = f"gmc1.{b64(json.dumps(raw).encode())}"
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.asymmetric import ec

    token = f"{signed}.{b64(KEY.sign(signed.encode(), ec.ECDSA(hashes.SHA256())))}"
    with pytest.raises(TokenError):
        verify_connect_token(KEY.public_key(), token, now=NOW)


def test_an_oversized_token_is_refused_before_any_work() -> None:
    with pytest.raises(TokenError, match="too long"):
        verify_connect_token(KEY.public_key(), "gmc1." + "A" * MAX_TOKEN_CHARS, now=NOW)


@settings(max_examples=300, deadline=None)
@given(st.text(max_size=300) | st.builds(lambda a, b, c: f"{a}.{b}.{c}", st.text(max_size=80), st.text(max_size=80), st.text(max_size=80)))
def test_anything_else_is_a_token_error_never_a_crash(text: str) -> None:
    with pytest.raises(TokenError):
        verify_connect_token(KEY.public_key(), text, now=NOW)
