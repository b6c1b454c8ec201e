"""The master's ``secrets_key`` as the accounts' secrets use it (``shared.crypto.sealed``): registry credentials
must have it (``require_key``: 503 ``secrets_key_unset`` saying what to set); TOTP secrets are sealed when it is set
and kept as before (base32 in the clear) when not (``key_of``). Values are sealed for ``<purpose>:<account id>``, so
one copied to another account's row does not open.
"""

from __future__ import annotations

from shared.crypto import sealed
from shared.errors import ServiceUnavailable
from shared.settings import MasterSettings


class SecretsKeyUnset(ServiceUnavailable):
    code = "secrets_key_unset"


def key_of(settings: MasterSettings) -> bytes | None:
    return None if settings.secrets_key is None else sealed.parse_key(settings.secrets_key.get_secret_value())


def require_key(settings: MasterSettings, what: str) -> bytes:
    key = key_of(settings)
    if key is None:
        raise SecretsKeyUnset(f"this master keeps no {what}: its operator must set secrets_key (GPUMARKET_SECRETS_KEY, "
                              "32 random bytes in URL-safe base64; docs/operations.md)")  # fmt: skip
    return key


def owner(purpose: str, account_id: str) -> str:
    return f"{purpose}:{account_id}"
