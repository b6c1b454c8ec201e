"""Passwords: the policy a new one must meet, and Argon2id hashes (argon2-cffi).

A password is hashed with Argon2id at ``password_hash_time_cost`` passes over ``password_hash_memory_kib`` (RFC 9106's
second recommended setting by default: 3 passes, 64 MiB, 4 lanes); the stored PHC string carries its parameters and
salt, so a hash made under older settings still verifies and is made again at the next sign-in. Hashing runs in a
worker thread: it takes a quarter of a second of CPU on purpose, and must not stall the event loop.

The policy (NIST SP 800-63B): at least ``password_min_length`` characters, at most ``MAX_LENGTH``, no control
characters, not one of the 30,000 most common passwords (zxcvbn's list, compared without case), and not the
account's own email address or its name part.
"""

from __future__ import annotations

import asyncio
import functools
import unicodedata

from argon2 import PasswordHasher
from argon2.exceptions import InvalidHashError, VerificationError, VerifyMismatchError
from zxcvbn.frequency_lists import FREQUENCY_LISTS

from shared.errors import ValidationFailed
from shared.settings import MasterSettings

MAX_LENGTH = 256
COMMON = frozenset(word.lower() for word in FREQUENCY_LISTS["passwords"])


class WeakPassword(ValidationFailed):
    code = "weak_password"


def check_policy(password: str, *, email: str, min_length: int) -> None:
    """Refuse (422 ``weak_password``, saying why) a password the policy does not allow."""
    if any(unicodedata.category(ch) in ("Cc", "Cf") for ch in password):
        raise WeakPassword("password: control or formatting characters are not allowed; type it again")
    if len(password) < min_length:
        raise WeakPassword(f"password: use at least {min_length} characters (a few unrelated words are easy to remember)")
    if len(password) > MAX_LENGTH:
        raise WeakPassword(f"password: use at most {MAX_LENGTH} characters")
    folded = password.lower()
    if folded in COMMON or folded.rstrip("0123456789!.") in COMMON:
        raise WeakPassword("password: this is one of the most common passwords; choose another")
    local = email.partition("@")[0]
    if folded in (email.lower(), local.lower()):
        raise WeakPassword("password: do not use your email address as your password")


@functools.lru_cache(maxsize=4)
def hasher(time_cost: int, memory_kib: int) -> PasswordHasher:
    return PasswordHasher(time_cost=time_cost, memory_cost=memory_kib, parallelism=4)


def _hasher(settings: MasterSettings) -> PasswordHasher:
    return hasher(settings.password_hash_time_cost, settings.password_hash_memory_kib)


async def hash_password(password: str, settings: MasterSettings) -> str:
    return await asyncio.to_thread(_hasher(settings).hash, password)


async def verify_password(stored: str | None, password: str, settings: MasterSettings) -> tuple[bool, str | None]:
    """Whether ``password`` matches ``stored``, and a new hash to store when ``stored`` was made under other settings.

    With no stored hash (an unknown email, an account without a password) a dummy one is checked all the same, so
    an unknown address takes as long to refuse as a wrong password: the time tells nothing."""
    current = _hasher(settings)
    target = stored if stored is not None else await _dummy(settings)

    def check() -> tuple[bool, str | None]:
        try:
            current.verify(target, password)
        except (VerifyMismatchError, VerificationError, InvalidHashError):
            return False, None
        if stored is None:
            return False, None
        return True, current.hash(password) if current.check_needs_rehash(stored) else None

    return await asyncio.to_thread(check)


_dummies: dict[tuple[int, int], str] = {}


async def _dummy(settings: MasterSettings) -> str:
    key = (settings.password_hash_time_cost, settings.password_hash_memory_kib)
    if key not in _dummies:
        _dummies[key] = await asyncio.to_thread(_hasher(settings).hash, "not a password anyone has")
    return _dummies[key]
