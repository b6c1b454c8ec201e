"""rentals: whose failure it is (renter, provider, platform), stored with its code

Revision ID: 0030
Revises: 0029
Create Date: 2026-12-01 03:00:00.000000

``rentals.failure_owner`` is written with ``failure_code`` whenever a rental fails
(``master.services.market.failures``). Reliability used to decide the owner from the failure's text; this backfill
is the last time the text is read: a failed rental with a code gets that code's owner (a code this table does not
know becomes ``agent_failure``, the provider's, as the master now records it); one without a code gets the code its
text was written for (the table's copy of 0030, ``LEGACY_REASONS``), else ``agent_failure`` on a host (counted
against it, as it was) or ``placement_failed`` without one (never placed).
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = '0030'
down_revision = '0029'
branch_labels = None
depends_on = None

# The owners as of this revision (a copy: a migration never imports the application's code, which moves on).
RENTER = ("image_not_found", "registry_auth_failed", "image_not_allowed", "image_too_large", "bad_workload_spec",
          "limits_exceed_host", "program_not_executable", "bad_authorized_key", "workload_stopped", "workload_exited",
          "disk_quota_exceeded", "ssh_refused")  # fmt: skip
PROVIDER = ("host_lost", "host_revoked", "workload_lost", "agent_failure", "internal_error", "agent_closing",
            "image_pull_failed", "container_runtime_unavailable", "workload_start_failed", "workload_not_isolated",
            "no_rental_uid", "gpu_not_found", "gpu_backend_unavailable", "power_restore_failed", "power_limit_refused",
            "power_limit_no_permission",
            "power_limit_unsupported", "power_limit_out_of_range", "power_policy_unavailable", "cluster_network_unavailable",
            "network_measurement_failed", "relay_dns_failed", "relay_dns_not_found", "relay_dns_timeout", "enrollment_refused",
            "config_error", "unavailable", "workload_log_unreadable", "gpu_verification_failed")  # fmt: skip
PLATFORM = ("placement_interrupted", "queue_timeout", "placement_failed", "registry_auth_unreadable", "gpu_in_use",
            "workload_running", "workload_stopping", "bad_gpu_uuids", "bad_gpu_share", "bad_rental_id", "bad_log_offset",
            "bad_log_limit", "workload_log_not_found", "bad_command", "unknown_command", "bad_frame", "bad_bus_record",
            "frame_too_big", "identity_mismatch", "unknown_type", "unsupported_version", "protocol_error", "seq_jump",
            "bus_error", "bus_timeout", "bad_request", "validation_failed", "unauthorized", "forbidden", "not_found",
            "conflict", "insufficient_capacity", "rate_limited", "quota_exceeded", "challenge_cancelled")  # fmt: skip
OWNERS = {**dict.fromkeys(RENTER, "renter"), **dict.fromkeys(PROVIDER, "provider"), **dict.fromkeys(PLATFORM, "platform")}

# What the master wrote as a failure's reason before it wrote a code for every failure (in the order they are tried).
LEGACY_REASONS = (
    ("workload exited with code ", "workload_exited"),
    ("workload failed to start: cannot start '", "program_not_executable"),
    ("workload ended (", "workload_lost"),
    ("host ", "host_lost"),  # "host h-… lost: silent since …"
    ("the host was revoked", "host_revoked"),
    ("placement interrupted", "placement_interrupted"),
    ("queue timeout", "queue_timeout"),
)


def legacy_failure(state: str, host_id: str | None, code: str | None, reason: str | None) -> tuple[str, str] | None:
    """``(failure_code, failure_owner)`` for a row as 0029 left it; None: not a failure (nothing to write)."""
    if code is not None:
        return (code, OWNERS[code]) if code in OWNERS else ("agent_failure", "provider")
    if state != "failed":
        return None
    for prefix, derived in LEGACY_REASONS:
        if (reason or "").startswith(prefix) and (derived != "host_lost" or " lost" in (reason or "")):
            return derived, OWNERS[derived]
    return ("agent_failure", "provider") if host_id is not None else ("placement_failed", "platform")


def upgrade() -> None:
    with op.batch_alter_table('rentals') as batch:
        batch.add_column(sa.Column('failure_owner', sa.String(length=16), nullable=True))
    rentals = sa.table(
        'rentals', sa.column('id', sa.String), sa.column('state', sa.String), sa.column('host_id', sa.String),
        sa.column('failure_code', sa.String), sa.column('failure_reason', sa.Text), sa.column('failure_owner', sa.String),
    )
    bind = op.get_bind()
    rows = bind.execute(
        sa.select(rentals.c.id, rentals.c.state, rentals.c.host_id, rentals.c.failure_code, rentals.c.failure_reason)
        .where(sa.or_(rentals.c.state == 'failed', rentals.c.failure_code.is_not(None)))
    ).all()
    updates = []
    for row in rows:
        found = legacy_failure(row.state, row.host_id, row.failure_code, row.failure_reason)
        if found is not None:
            updates.append({"row_id": row.id, "code": found[0], "owner": found[1]})
    if updates:
        bind.execute(
            rentals.update().where(rentals.c.id == sa.bindparam('row_id'))
            .values(failure_code=sa.bindparam('code'), failure_owner=sa.bindparam('owner')),
            updates,
        )


def downgrade() -> None:
    with op.batch_alter_table('rentals') as batch:
        batch.drop_column('failure_owner')
