"""Failures: every code a rental can fail with, and whose failure it is — decided from the code, never its text.

A rental that ends ``failed`` carries a ``FailureCode`` (``rentals.failure_code``) and that code's ``Owner``
(``rentals.failure_owner``), both written by ``record_failure`` in the transaction that fails it:

* ``renter`` — what the renter asked for or ran: an image that does not exist, a registry that refused the
  renter's login, an image outside the provider's policy or too large for it, limits past the host's, a
  program that cannot be executed, a workload that exited non-zero (an OOM kill inside the renter's own
  memory limit is such an exit: signal 9), a workload over its disk quota;
* ``provider`` — the host: lost (silent past the grace period) or revoked, its agent failing, shutting down
  or losing track of a workload, its container engine, GPUs, disk, network or power policy;
* ``platform`` — the master: placement interrupted or impossible, a command the agent could not read, a
  GPU the master gave twice, a registry login sealed to the wrong key.

``master.services.market.reliability`` counts only the provider's failures against a host; billing
(``billing.rating``) charges the renter's like any ended rental, credits the minimum period back for the
provider's, and charges no minimum period for the platform's (docs/reliability.md has the whole table).

The table holds every code the agent can put in a failed command's result (its ``GpumarketError`` codes and the
protocol's; ``tests/test_failures.py`` scans the agent for them) and the master's own. A code missing from it is
an ``UnknownFailureCode`` from ``owner_of``; a code an agent reports that is not in it (an agent newer than its
master) is recorded as ``AGENT_FAILURE`` by ``agent_failure_code``, with the agent's own words in the reason.
"""

from __future__ import annotations

from collections.abc import Mapping
from enum import StrEnum
from types import MappingProxyType
from typing import Final

from master.models import Rental
from shared.errors import GpumarketError


class Owner(StrEnum):
    """Whose failure it is."""

    RENTER = "renter"
    PROVIDER = "provider"
    PLATFORM = "platform"


class FailureCode(StrEnum):
    """Every code a rental can fail with (``rentals.failure_code``); ``OWNERS`` says whose each is."""

    # ---- the renter's: what the rental asked for or ran ----
    IMAGE_NOT_FOUND = "image_not_found"  # the registry has no such image or tag (agent.runtimes.container)
    REGISTRY_AUTH_FAILED = "registry_auth_failed"  # the registry refused the renter's login, or wants one
    IMAGE_NOT_ALLOWED = "image_not_allowed"  # outside the provider's image policy (the issue: the renter's)
    IMAGE_TOO_LARGE = "image_too_large"  # larger than the provider allows
    BAD_WORKLOAD_SPEC = "bad_workload_spec"  # an image reference that cannot be parsed
    LIMITS_EXCEED_HOST = "limits_exceed_host"  # the workload asks for more CPU, memory, pids or disk than the host has
    PROGRAM_NOT_EXECUTABLE = "program_not_executable"  # the renter's program is missing or cannot be executed
    BAD_AUTHORIZED_KEY = "bad_authorized_key"  # an SSH key of the renter's the agent cannot use
    WORKLOAD_STOPPED = "workload_stopped"  # stopped (by its renter) while its image was being pulled
    WORKLOAD_EXITED = "workload_exited"  # ran and exited non-zero or was killed (an OOM inside its own limit: signal 9)
    DISK_QUOTA_EXCEEDED = "disk_quota_exceeded"  # the agent stopped it for writing past its disk quota
    SSH_REFUSED = "ssh_refused"  # (SSH only, never ends a rental) no home or workspace left to log into

    # ---- the provider's: the host, its agent, engine, GPUs, disk, network ----
    HOST_LOST = "host_lost"  # silent past the grace period
    HOST_REVOKED = "host_revoked"  # its certificate revoked: no longer trusted
    WORKLOAD_LOST = "workload_lost"  # ended with no exit status: the agent was not watching (it restarted or crashed)
    AGENT_FAILURE = "agent_failure"  # the agent failed the command with no code, or one this master does not know
    INTERNAL_ERROR = "internal_error"  # an error of the agent's own (GpumarketError's default code)
    AGENT_CLOSING = "agent_closing"  # the agent was shutting down
    IMAGE_PULL_FAILED = "image_pull_failed"  # the host could not fetch the image (network, engine, timeout)
    CONTAINER_RUNTIME_UNAVAILABLE = "container_runtime_unavailable"  # no container engine answering
    WORKLOAD_START_FAILED = "workload_start_failed"  # the engine, network namespace, disk quota or home setup failed
    WORKLOAD_NOT_ISOLATED = "workload_not_isolated"  # the host cannot isolate a workload
    NO_RENTAL_UID = "no_rental_uid"  # no uid left for another process rental
    GPU_NOT_FOUND = "gpu_not_found"  # a GPU the host had reported is gone
    GPU_BACKEND_UNAVAILABLE = "gpu_backend_unavailable"  # NVML (or the GPU backend) not answering
    POWER_RESTORE_FAILED = "power_restore_failed"  # the GPUs' power limits could not be restored for the start
    POWER_LIMIT_REFUSED = "power_limit_refused"
    POWER_LIMIT_NO_PERMISSION = "power_limit_no_permission"
    POWER_LIMIT_UNSUPPORTED = "power_limit_unsupported"
    POWER_LIMIT_OUT_OF_RANGE = "power_limit_out_of_range"
    POWER_POLICY_UNAVAILABLE = "power_policy_unavailable"
    CLUSTER_NETWORK_UNAVAILABLE = "cluster_network_unavailable"  # the host cannot join a cluster's private network
    NETWORK_MEASUREMENT_FAILED = "network_measurement_failed"
    RELAY_DNS_FAILED = "relay_dns_failed"  # (agent ⇄ relay, never ends a rental)
    RELAY_DNS_NOT_FOUND = "relay_dns_not_found"
    RELAY_DNS_TIMEOUT = "relay_dns_timeout"
    ENROLLMENT_REFUSED = "enrollment_refused"
    CONFIG_ERROR = "config_error"  # the agent's configuration
    UNAVAILABLE = "unavailable"
    WORKLOAD_LOG_UNREADABLE = "workload_log_unreadable"
    # (never ends a rental) a GPU failed its verification challenge (master/services/hosts/verification.py): counted
    # against the host's reliability after ``verification_failures`` failures in a row
    GPU_VERIFICATION_FAILED = "gpu_verification_failed"
    VOLUME_NO_SPACE = "volume_no_space"  # (never ends a rental) the host's disk cannot hold a volume it lends (agent/volumes.py)

    # ---- the platform's: the master, placement, what it sent ----
    PLACEMENT_INTERRUPTED = "placement_interrupted"  # the master placing it stopped before its start command was written
    QUEUE_TIMEOUT = "queue_timeout"  # never placed within its queue timeout
    PLACEMENT_FAILED = "placement_failed"  # could not be placed from the queue (the offer went, the quota shrank ...)
    REGISTRY_AUTH_UNREADABLE = "registry_auth_unreadable"  # a registry login sealed to a key the host does not hold
    GPU_IN_USE = "gpu_in_use"  # the master gave a GPU the agent sees busy
    WORKLOAD_RUNNING = "workload_running"  # a start or release out of order
    WORKLOAD_STOPPING = "workload_stopping"
    BAD_GPU_UUIDS = "bad_gpu_uuids"  # a start command the master should never have sent
    BAD_GPU_SHARE = "bad_gpu_share"
    BAD_RENTAL_ID = "bad_rental_id"
    BAD_LOG_OFFSET = "bad_log_offset"
    BAD_LOG_LIMIT = "bad_log_limit"
    WORKLOAD_LOG_NOT_FOUND = "workload_log_not_found"
    BAD_COMMAND = "bad_command"  # the protocol's refusals of a command (shared.protocol)
    UNKNOWN_COMMAND = "unknown_command"
    BAD_FRAME = "bad_frame"
    BAD_BUS_RECORD = "bad_bus_record"
    FRAME_TOO_BIG = "frame_too_big"
    IDENTITY_MISMATCH = "identity_mismatch"
    UNKNOWN_TYPE = "unknown_type"
    UNSUPPORTED_VERSION = "unsupported_version"
    PROTOCOL_ERROR = "protocol_error"
    SEQ_JUMP = "seq_jump"
    BUS_ERROR = "bus_error"
    BUS_TIMEOUT = "bus_timeout"
    BAD_REQUEST = "bad_request"  # shared.errors' generic client codes: the command was the master's
    VALIDATION_FAILED = "validation_failed"
    UNAUTHORIZED = "unauthorized"
    FORBIDDEN = "forbidden"
    NOT_FOUND = "not_found"
    CONFLICT = "conflict"
    INSUFFICIENT_CAPACITY = "insufficient_capacity"
    RATE_LIMITED = "rate_limited"
    QUOTA_EXCEEDED = "quota_exceeded"
    CHALLENGE_CANCELLED = "challenge_cancelled"  # (never ends a rental) a GPU challenge stopped for a rental or by the master
    VOLUME_NOT_FOUND = "volume_not_found"  # a start named a volume its host does not have (the master's record is wrong)
    VOLUME_UNSUPPORTED = "volume_unsupported"  # a volume sent to a host that keeps none
    # (never end a rental) a volume copy host to host (agent/volumecopy.py): it broke off (resumable), the trees differ
    # at the end, or the destination could not open its sealed login
    VOLUME_COPY_FAILED = "volume_copy_failed"
    VOLUME_COPY_MISMATCH = "volume_copy_mismatch"
    VOLUME_COPY_LOGIN_UNREADABLE = "volume_copy_login_unreadable"


_RENTER: Final = frozenset({
    FailureCode.IMAGE_NOT_FOUND, FailureCode.REGISTRY_AUTH_FAILED, FailureCode.IMAGE_NOT_ALLOWED, FailureCode.IMAGE_TOO_LARGE,
    FailureCode.BAD_WORKLOAD_SPEC, FailureCode.LIMITS_EXCEED_HOST, FailureCode.PROGRAM_NOT_EXECUTABLE,
    FailureCode.BAD_AUTHORIZED_KEY, FailureCode.WORKLOAD_STOPPED, FailureCode.WORKLOAD_EXITED, FailureCode.DISK_QUOTA_EXCEEDED,
    FailureCode.SSH_REFUSED,
})  # fmt: skip
_PROVIDER: Final = frozenset({
    FailureCode.HOST_LOST, FailureCode.HOST_REVOKED, FailureCode.WORKLOAD_LOST, FailureCode.AGENT_FAILURE,
    FailureCode.INTERNAL_ERROR, FailureCode.AGENT_CLOSING, FailureCode.IMAGE_PULL_FAILED,
    FailureCode.CONTAINER_RUNTIME_UNAVAILABLE, FailureCode.WORKLOAD_START_FAILED, FailureCode.WORKLOAD_NOT_ISOLATED,
    FailureCode.NO_RENTAL_UID, FailureCode.GPU_NOT_FOUND, FailureCode.GPU_BACKEND_UNAVAILABLE,
    FailureCode.POWER_RESTORE_FAILED, FailureCode.POWER_LIMIT_REFUSED, FailureCode.POWER_LIMIT_NO_PERMISSION, FailureCode.POWER_LIMIT_UNSUPPORTED,
    FailureCode.POWER_LIMIT_OUT_OF_RANGE, FailureCode.POWER_POLICY_UNAVAILABLE, FailureCode.CLUSTER_NETWORK_UNAVAILABLE,
    FailureCode.NETWORK_MEASUREMENT_FAILED, FailureCode.RELAY_DNS_FAILED, FailureCode.RELAY_DNS_NOT_FOUND,
    FailureCode.RELAY_DNS_TIMEOUT, FailureCode.ENROLLMENT_REFUSED, FailureCode.CONFIG_ERROR, FailureCode.UNAVAILABLE,
    FailureCode.WORKLOAD_LOG_UNREADABLE, FailureCode.GPU_VERIFICATION_FAILED, FailureCode.VOLUME_NO_SPACE,
})  # fmt: skip

# A workload its host's agent stopped for what the renter did: the exit's reason leads with one of these codes
# (``WorkloadExitedBody.reason``), and the rental's failure reason is AGENT_STOPPED_PREFIX + that reason.
AGENT_STOPPED_PREFIX: Final = "workload stopped by its host: "
AGENT_STOP_CODES: Final = frozenset({FailureCode.DISK_QUOTA_EXCEEDED})

OWNERS: Final[Mapping[FailureCode, Owner]] = MappingProxyType({
    code: Owner.RENTER if code in _RENTER else Owner.PROVIDER if code in _PROVIDER else Owner.PLATFORM for code in FailureCode
})  # fmt: skip
"""Whose each failure is: every ``FailureCode`` has exactly one owner (the platform's: every code not listed above)."""


class UnknownFailureCode(GpumarketError, ValueError):
    """A failure code that is not in ``FailureCode``: a programming error, never a guess at an owner."""

    code = "unknown_failure_code"


def owner_of(code: str) -> Owner:
    """The owner of ``code``; ``UnknownFailureCode`` if the table does not have it."""
    try:
        return OWNERS[FailureCode(code)]
    except ValueError:
        raise UnknownFailureCode(f"failure code {code[:80]!r} is not in master.services.market.failures.FailureCode") from None


def agent_failure_code(code: str | None) -> FailureCode:
    """The code of an agent's failed command: its own if the table has it, else ``AGENT_FAILURE`` (none, or unknown)."""
    if code is None:
        return FailureCode.AGENT_FAILURE
    try:
        return FailureCode(code)
    except ValueError:
        return FailureCode.AGENT_FAILURE


def record_failure(rental: Rental, code: FailureCode, reason: str) -> None:
    """Write the failure onto ``rental`` (inside the caller's transaction): its code, owner and the words shown."""
    rental.failure_code = code.value
    rental.failure_owner = OWNERS[code].value
    rental.failure_reason = reason
