"""The root of every error gpumarket raises.

Client errors carry a stable ``code`` (never renamed once shipped), an HTTP status
and a message that says what to do next. The REST middleware turns them into JSON
``{"code": ..., "message": ...}``; anything that is not a ``GpumarketError`` is a
logged 500. Protocol errors additionally carry a websocket close code, mapped in
one table in ``shared.protocol``.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any


class GpumarketError(Exception):
    """Base of every error raised on purpose by gpumarket code."""

    code: str = "internal_error"
    http_status: int = 500

    def __init__(self, message: str, *, code: str | None = None, details: dict[str, Any] | None = None) -> None:
        super().__init__(message)
        self.message = message
        if code is not None:
            self.code = code
        self.details = details or {}

    def to_json(self) -> dict[str, Any]:
        body: dict[str, Any] = {"code": self.code, "message": self.message}
        if self.details:
            body["details"] = self.details
        return body


class ClientError(GpumarketError):
    """The caller's mistake: a 4xx."""

    code = "bad_request"
    http_status = 400


class BadRequest(ClientError, ValueError):
    code = "bad_request"
    http_status = 400


class ValidationFailed(BadRequest):
    code = "validation_failed"
    http_status = 422


class Unauthorized(ClientError):
    code = "unauthorized"
    http_status = 401


class Forbidden(ClientError, PermissionError):
    code = "forbidden"
    http_status = 403


class NotFound(ClientError, LookupError):
    code = "not_found"
    http_status = 404


class Conflict(ClientError):
    code = "conflict"
    http_status = 409


class InsufficientCapacity(ClientError):
    """Nothing that matches the request can be placed now."""

    code = "insufficient_capacity"
    http_status = 409


class RateLimited(ClientError):
    """Too many requests: the message and ``Retry-After`` say in how many whole seconds (at least 1) to retry."""

    code = "rate_limited"
    http_status = 429

    def __init__(self, message: str, *, retry_after: int) -> None:
        super().__init__(message, details={"retry_after": retry_after})
        self.retry_after = retry_after


class QuotaExceeded(Forbidden):
    """The account's quota (GPUs held at once, spend per hour) does not allow this."""

    code = "quota_exceeded"


class ServiceUnavailable(GpumarketError):
    """A server we depend on (the mail server, …) cannot do it now: 503, the client may try again later."""

    code = "unavailable"
    http_status = 503


class ConfigError(GpumarketError, ValueError):
    """A setting is missing or invalid; the message names the setting."""

    code = "config_error"

    @classmethod
    def check_bounds(cls, what: str, bounds: Iterable[tuple[str, float, float, float]]) -> None:
        """Raise one naming the first ``(name, value, low, high)`` whose value lies outside ``[low, high]``
        (``what``: whose settings, e.g. ``"container setting"``)."""
        for name, value, low, high in bounds:
            if not low <= value <= high:
                raise cls(f"{what} {name}={value!r} must lie between {low:g} and {high:g}")


class ProtocolError(GpumarketError, ValueError):
    """A peer sent something the wire protocol does not allow.

    ``close_code`` is the websocket close code the relay uses; see
    ``shared.protocol.CLOSE_CODES``.
    """

    code = "protocol_error"
    close_code = 1008  # policy violation (the generic one)

    def __init__(self, message: str, *, code: str | None = None, close_code: int | None = None) -> None:
        super().__init__(message, code=code)
        if close_code is not None:
            self.close_code = close_code


class SequenceJump(ProtocolError):
    """A message numbered absurdly far past the newest its host sent (``shared.protocol.MAX_SEQ_JUMP``):
    the master drops it, so one forged or corrupt number cannot pin the host's state."""

    code = "seq_jump"


class BusError(GpumarketError):
    code = "bus_error"


class BusTimeout(BusError, TimeoutError):
    code = "bus_timeout"


class GpuBackendUnavailable(GpumarketError, RuntimeError):
    """The requested GPU backend cannot run on this host (for example no NVIDIA driver)."""

    code = "gpu_backend_unavailable"


class PowerLimitError(GpumarketError, ValueError):
    """A GPU's power limit could not be set: outside the board's range, not adjustable on this GPU, or the
    driver refused (setting a limit needs root on real drivers). Nothing was changed; the agent reports it
    and goes on."""

    code = "power_limit_refused"


class EnrollmentError(ClientError):
    code = "enrollment_refused"
    http_status = 403
