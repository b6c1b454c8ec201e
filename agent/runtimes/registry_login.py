"""A start's registry login as the agent receives it: sealed to this host's key, opened only for the pull.

The master seals a ``RegistryAuth`` to the key of the host's newest certificate, bound to the host and the start's
command id (``shared.protocol.registry_auth_context``), so the bus, Redis and the relay carry only a token.
``SealedLogin`` holds that token and how to reach the host's keys; ``open`` is called by the container runtime right
before the engine's pull, and what it returns goes to that pull only. A token that opens with none of the host's keys
(``AgentState.opening_keys``) fails the start with ``registry_auth_unreadable``: the platform's fault (a login sealed
to a key this host does not hold, or altered on the way), not the renter's, so the registry is never asked without it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Final

from cryptography.hazmat.primitives.asymmetric import ec
from pydantic import ValidationError

from shared.crypto import sealed_to
from shared.errors import BadRequest, ConfigError
from shared.protocol import RegistryAuth, registry_auth_context

log = logging.getLogger(__name__)

UNREADABLE: Final = "registry_auth_unreadable"


@dataclass(frozen=True)
class SealedLogin:
    """A ``RegistryAuth`` sealed to this host for one command: nothing in it reads without the host's key."""

    token: str = field(repr=False)
    host_id: str
    command_id: str
    keys: Callable[[], Sequence[ec.EllipticCurvePrivateKey]] = field(repr=False)

    def open(self) -> RegistryAuth:
        """The login, for one pull: not kept, not logged. ``BadRequest`` (``registry_auth_unreadable``) when no key
        of this host opens it for this command."""
        context = registry_auth_context(self.host_id, self.command_id)
        try:
            keys = self.keys()
        except ConfigError as exc:
            log.error("command %s: this host's keys do not load (%s)", self.command_id, exc)
            keys = ()
        for key in keys:
            try:
                plaintext = sealed_to.open_with(key, self.token, context)
            except sealed_to.SealedToError:
                continue
            try:
                return RegistryAuth.model_validate_json(plaintext)
            except ValidationError:
                break  # it opened, so it is ours, but holds no login: the master's fault; say nothing of it
        log.error("command %s: the registry login sealed to this host opens with none of its %d key(s)", self.command_id,
                  len(keys))  # fmt: skip
        raise BadRequest(
            "the registry login the platform sent for this start does not open with this host's keys "
            "(sealed to another certificate, or altered on the way); the platform's fault, not the renter's: "
            "start the rental again",
            code=UNREADABLE,
        )
