"""Every table of the master, in one module (SQLAlchemy 2, typed declarative).

Ids are text (prefixed random tokens) so they read well in logs and URLs and work
the same on SQLite and PostgreSQL. Timestamps are aware UTC on both databases.
"""

from __future__ import annotations

from datetime import UTC, datetime
from decimal import Decimal
from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    CheckConstraint,
    DateTime,
    ForeignKey,
    Index,
    Integer,
    Numeric,
    String,
    Text,
    TypeDecorator,
    UniqueConstraint,
    text,
)
from sqlalchemy.engine import Dialect
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column


class UTCDateTime(TypeDecorator[datetime]):
    """A timestamp that is always aware UTC in Python, whatever the database keeps."""

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            raise ValueError("naive datetime given to a UTC column; use datetime.now(UTC)")
        return value.astimezone(UTC)

    def process_result_value(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        return value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)


def _now() -> datetime:
    return datetime.now(UTC)


def version_key(text: object) -> int | None:
    """``"8.9"`` → 8009 (``major * 1000 + minor``); None for anything that is not such a version."""
    if not isinstance(text, str):
        return None
    major, _, rest = text.strip().partition(".")
    minor = rest.split(".", 1)[0] if rest else "0"
    if not (major.isdigit() and minor.isdigit()) or len(major) > 6 or len(minor) > 3:
        return None
    return int(major) * 1000 + int(minor)


class Base(DeclarativeBase):
    type_annotation_map = {datetime: UTCDateTime, dict[str, Any]: JSON, list[Any]: JSON}


class Account(Base):
    __tablename__ = "accounts"
    __table_args__ = (CheckConstraint("fair_share_weight > 0", name="ck_accounts_fair_share_weight_positive"),)

    id: Mapped[str] = mapped_column(String(40), primary_key=True)
    name: Mapped[str] = mapped_column(String(128), unique=True)
    role: Mapped[str] = mapped_column(String(16))  # renter | provider | admin
    created_at: Mapped[datetime] = mapped_column(default=_now)
    # Quotas enforced at placement (NULL: the master's default_max_* settings apply).
    max_gpus: Mapped[Decimal | None] = mapped_column(Numeric(10, 3), default=None)
    max_spend_per_hour: Mapped[Decimal | None] = mapped_column(Numeric(14, 6), default=None)
    # The renter's own hard cap on what its rentals may charge in a calendar month (UTC); NULL: none.
    monthly_spend_cap: Mapped[Decimal | None] = mapped_column(Numeric(14, 2), default=None)
    # The account's weight in the queue's fair share (master/scheduler/fairshare.py): relative, > 0; set by an admin.
    fair_share_weight: Mapped[int] = mapped_column(default=1, server_default="1")
    # Counts the changes to who may log into the account's rentals (SSH keys, disabling): master/services/access.py.
    access_version: Mapped[int] = mapped_column(BigInteger, default=0, server_default="0")
    # When an operator disabled the account: its API keys, console sessions and rentals' SSH keys stop working.
    disabled_at: Mapped[datetime | None] = mapped_column(default=None)


class ApiKey(Base):
    __tablename__ = "api_keys"

    id: Mapped[str] = mapped_column(String(40), primary_key=True)
    account_id: Mapped[str] = mapped_column(ForeignKey("accounts.id", ondelete="CASCADE"), index=True)
    key_hash: Mapped[str] = mapped_column(String(64), unique=True)  # sha256 hex of the whole key
    key_prefix: Mapped[str] = mapped_column(String(16))  # shown to users to tell keys apart
    created_at: Mapped[datetime] = mapped_column(default=_now)
    revoked_at: Mapped[datetime | None] = mapped_column(default=None)


class ConsoleSession(Base):
    """A web console sign-in (master/services/sessions.py): the browser holds only a random token in an
    HTTP-only cookie; the row holds its hash. Revoking the API key it was opened with ends it too."""

    __tablename__ = "console_sessions"

    id: Mapped[str] = mapped_column(String(40), primary_key=True)
    token_hash: Mapped[str] = mapped_column(String(64), unique=True)  # sha256 hex of the cookie's value
    account_id: Mapped[str] = mapped_column(ForeignKey("accounts.id", ondelete="CASCADE"), index=True)
    api_key_id: Mapped[str] = mapped_column(ForeignKey("api_keys.id", ondelete="CASCADE"), index=True)
    csrf_token: Mapped[str] = mapped_column(String(64))  # sent back in X-CSRF-Token on every state-changing call
    created_at: Mapped[datetime] = mapped_column(default=_now)
    last_seen_at: Mapped[datetime] = mapped_column(default=_now)
    expires_at: Mapped[datetime]  # absolute end, whatever the activity
    ended_at: Mapped[datetime | None] = mapped_column(default=None)  # signed out


class SshKey(Base):
    """A renter's SSH public key (``master/services/ssh_keys.py``): the agent's SSH server authorises it
    for the account's rentals. ``public_key`` is canonical OpenSSH (``type base64``, no comment);
    ``fingerprint`` is as ``ssh-keygen -lf`` prints it (``SHA256:`` and unpadded base64)."""

    __tablename__ = "ssh_keys"
    __table_args__ = (UniqueConstraint("account_id", "fingerprint", name="uq_ssh_keys_account_fingerprint"),)

    id: Mapped[str] = mapped_column(String(40), primary_key=True)
    account_id: Mapped[str] = mapped_column(ForeignKey("accounts.id", ondelete="CASCADE"), index=True)
    name: Mapped[str] = mapped_column(String(100))
    algorithm: Mapped[str] = mapped_column(String(40))
    public_key: Mapped[str] = mapped_column(Text)
    fingerprint: Mapped[str] = mapped_column(String(60))
    created_at: Mapped[datetime] = mapped_column(default=_now)
    last_used_at: Mapped[datetime | None] = mapped_column(default=None)


class EnrollmentToken(Base):
    __tablename__ = "enrollment_tokens"

    id: Mapped[str] = mapped_column(String(40), primary_key=True)
    account_id: Mapped[str] = mapped_column(ForeignKey("accounts.id", ondelete="CASCADE"), index=True)
    token_hash: Mapped[str] = mapped_column(String(64), unique=True)
    created_at: Mapped[datetime] = mapped_column(default=_now)
    expires_at: Mapped[datetime]
    used_at: Mapped[datetime | None] = mapped_column(default=None)
    host_id: Mapped[str | None] = mapped_column(String(40), default=None)


class Host(Base):
    __tablename__ = "hosts"

    id: Mapped[str] = mapped_column(String(40), primary_key=True)
    owner_id: Mapped[str] = mapped_column(ForeignKey("accounts.id"), index=True)
    name: Mapped[str] = mapped_column(String(255), default="")
    state: Mapped[str] = mapped_column(String(16), index=True)
    state_changed_at: Mapped[datetime] = mapped_column(default=_now)
    region: Mapped[str | None] = mapped_column(String(64), default=None)
    relay_id: Mapped[str | None] = mapped_column(String(64), default=None)
    cert_serial: Mapped[str | None] = mapped_column(String(64), default=None)
    cert_not_after: Mapped[datetime | None] = mapped_column(default=None)
    agent_version: Mapped[str | None] = mapped_column(String(64), default=None)
    gpu_backend: Mapped[str | None] = mapped_column(String(16), default=None)
    facts: Mapped[dict[str, Any]] = mapped_column(default=dict)
    last_seen_at: Mapped[datetime | None] = mapped_column(default=None)
    last_seq: Mapped[int] = mapped_column(BigInteger, default=-1)
    latest_telemetry: Mapped[dict[str, Any] | None] = mapped_column(JSON, default=None)
    latest_telemetry_seq: Mapped[int] = mapped_column(BigInteger, default=-1)
    latest_telemetry_at: Mapped[datetime | None] = mapped_column(default=None)
    last_hello_seq: Mapped[int] = mapped_column(BigInteger, default=-1)
    last_renewal_seq: Mapped[int] = mapped_column(BigInteger, default=-1)
    revoked_at: Mapped[datetime | None] = mapped_column(default=None)
    latest_network: Mapped[dict[str, Any] | None] = mapped_column(JSON, default=None)
    spool_stats: Mapped[dict[str, Any] | None] = mapped_column(JSON, default=None)
    created_at: Mapped[datetime] = mapped_column(default=_now)
    # Reliability in 0..1 from the host's history, with the inputs it was computed from.
    reliability: Mapped[float | None] = mapped_column(default=None)
    reliability_inputs: Mapped[dict[str, Any] | None] = mapped_column(JSON, default=None)
    reliability_at: Mapped[datetime | None] = mapped_column(default=None)
    # Faults (hardware XIDs, ECC errors, vanished GPUs, failed health checks) count from here;
    # a passed health check moves it forward.
    faults_since: Mapped[datetime | None] = mapped_column(default=None)
    # Telemetry fields the master refused from this host (field name → count).
    rejected_fields: Mapped[dict[str, Any]] = mapped_column(default=dict)
    # How the host isolates workloads, from its newest hello (``shared.protocol.IsolationFacts`` as JSON:
    # kinds, isolated, container_engine, process_isolation, reason, image_policy). NULL: an agent older
    # than container workloads, which keeps the placement it always had.
    isolation: Mapped[dict[str, Any] | None] = mapped_column(JSON, default=None)


class HostCertificate(Base):
    """Every client certificate the CA signed for a host (enrollment and each renewal), so that all
    of them can be refused: ``revoked_at`` is set when the host is revoked, or for an older
    certificate once the host connected with a newer one. ``hosts.cert_serial`` is the newest."""

    __tablename__ = "host_certificates"

    serial: Mapped[str] = mapped_column(String(64), primary_key=True)  # hex, as relays and the registry write it
    host_id: Mapped[str] = mapped_column(ForeignKey("hosts.id", ondelete="CASCADE"), index=True)
    issued_at: Mapped[datetime] = mapped_column(default=_now)
    not_after: Mapped[datetime]
    revoked_at: Mapped[datetime | None] = mapped_column(default=None, index=True)


class HostEvent(Base):
    __tablename__ = "host_events"

    id: Mapped[int] = mapped_column(BigInteger().with_variant(Integer, "sqlite"), primary_key=True, autoincrement=True)
    host_id: Mapped[str] = mapped_column(ForeignKey("hosts.id", ondelete="CASCADE"), index=True)
    at: Mapped[datetime] = mapped_column(default=_now)
    from_state: Mapped[str | None] = mapped_column(String(16))
    to_state: Mapped[str] = mapped_column(String(16))
    cause: Mapped[str] = mapped_column(Text)
    actor: Mapped[str] = mapped_column(String(64))


class Gpu(Base):
    __tablename__ = "gpus"
    # Not unique: GPUs can swap indices between boots, and absent GPUs keep their last one.
    __table_args__ = (Index("ix_gpus_host_index", "host_id", "index"),)

    id: Mapped[str] = mapped_column(String(40), primary_key=True)
    host_id: Mapped[str] = mapped_column(ForeignKey("hosts.id", ondelete="CASCADE"), index=True)
    index: Mapped[int]
    uuid: Mapped[str] = mapped_column(String(128), unique=True)
    name: Mapped[str] = mapped_column(String(255))
    memory_total_mib: Mapped[int]
    info: Mapped[dict[str, Any]] = mapped_column(default=dict)
    present: Mapped[bool] = mapped_column(default=True)
    # Classification (master/services/tiers.py), refreshed when the host reports or is re-scored.
    tier: Mapped[str | None] = mapped_column(String(16), default=None, index=True)
    score: Mapped[float | None] = mapped_column(default=None)
    model_key: Mapped[str | None] = mapped_column(String(64), default=None)
    needs_review: Mapped[bool] = mapped_column(default=False)
    classification: Mapped[dict[str, Any] | None] = mapped_column(JSON, default=None)
    # The allocation, claimed with conditional UPDATEs so one GPU is never given twice: a whole-GPU
    # rental sets ``rental_id`` (WHERE rental_id IS NULL AND milli_used = 0); fractional shares add to
    # ``milli_used``/``memory_used_mib`` (WHERE the sums stay within the GPU). MIG slices are rows of
    # gpu_allocations whose ``active_mig`` is unique. See master/services/allocation.py.
    rental_id: Mapped[str | None] = mapped_column(ForeignKey("rentals.id"), default=None, index=True)
    milli_used: Mapped[int] = mapped_column(default=0, server_default="0")
    memory_used_mib: Mapped[int] = mapped_column(default=0, server_default="0")
    # ``major * 1000 + minor`` of info's compute_capability and cuda_driver_version (set with info; NULL when
    # unknown): plain integer columns the offer search filters on, instead of reading every GPU's JSON.
    compute_capability_key: Mapped[int | None] = mapped_column(default=None, index=True)
    cuda_version_key: Mapped[int | None] = mapped_column(default=None, index=True)

    def set_info(self, info: dict[str, Any]) -> None:
        self.info = info
        self.compute_capability_key = version_key(info.get("compute_capability"))
        self.cuda_version_key = version_key(info.get("cuda_driver_version"))


class HostPowerPolicy(Base):
    """A provider's off-peak power policy for one host (master/services/power.py, docs/power.md): the cap its idle GPUs
    are lowered to off-peak, in watts or as a fraction of each GPU's default limit, and what its agent was last sent."""

    __tablename__ = "host_power_policies"

    host_id: Mapped[str] = mapped_column(ForeignKey("hosts.id", ondelete="CASCADE"), primary_key=True)
    enabled: Mapped[bool] = mapped_column(default=True)
    cap_watts: Mapped[float | None] = mapped_column(default=None)  # one of these two is set
    cap_fraction: Mapped[float | None] = mapped_column(default=None)
    # An hour is off-peak when the forecast demand for the host's GPU model and region is below this share of its peak.
    off_peak_threshold: Mapped[float] = mapped_column(default=0.5)
    updated_at: Mapped[datetime] = mapped_column(default=_now)
    # The policy last sent to the agent ({"targets": {uuid: watts}, "off_peak_until": ISO | None}), when, and its command.
    sent: Mapped[dict[str, Any] | None] = mapped_column(JSON, default=None)
    sent_at: Mapped[datetime | None] = mapped_column(default=None)
    command_id: Mapped[str | None] = mapped_column(String(40), default=None)


class PowerSaving(Base):
    """Energy a host's power policy saved on one GPU in one UTC day, Wh, folded from the agent's cumulative counter
    (``counter_wh``: the counter when last folded; a smaller one later means the agent started counting again)."""

    __tablename__ = "power_savings"

    host_id: Mapped[str] = mapped_column(ForeignKey("hosts.id", ondelete="CASCADE"), primary_key=True)
    gpu_uuid: Mapped[str] = mapped_column(String(128), primary_key=True)
    day: Mapped[str] = mapped_column(String(10), primary_key=True)  # YYYY-MM-DD, UTC
    saved_wh: Mapped[float] = mapped_column(default=0.0)
    counter_wh: Mapped[float] = mapped_column(default=0.0)
    updated_at: Mapped[datetime] = mapped_column(default=_now)


class HostListing(Base):
    """A provider's terms for one host on the marketplace (``master/services/listings.py``).

    Prices are USD per GPU-hour, exact decimals with six places. ``maintenance_windows`` is a
    list of ``{"start", "end"}`` UTC times written as ``YYYY-MM-DDTHH:MM:SSZ``: that fixed
    form sorts as text, so the offer search can compare it in SQL on both databases.
    """

    __tablename__ = "host_listings"

    host_id: Mapped[str] = mapped_column(ForeignKey("hosts.id", ondelete="CASCADE"), primary_key=True)
    price_per_gpu_hour: Mapped[Decimal] = mapped_column(Numeric(12, 6))
    min_bid_per_gpu_hour: Mapped[Decimal | None] = mapped_column(Numeric(12, 6), default=None)
    smallest_unit: Mapped[str] = mapped_column(String(32), default="gpu")  # gpu | mig:<profile> | milli:<n>
    available_until: Mapped[datetime | None] = mapped_column(default=None)
    maintenance_windows: Mapped[list[Any]] = mapped_column(default=list)
    verified: Mapped[bool] = mapped_column(default=False)  # set by an admin, never by the provider
    created_at: Mapped[datetime] = mapped_column(default=_now)
    updated_at: Mapped[datetime] = mapped_column(default=_now)


class OfferSummary(Base):
    """A host's free GPUs of one kind (every per-GPU value the offer search reads), with its host's and listing's
    searched values: what ``GET /api/v1/offers`` reads. Written only by the database's triggers (migration 0018)."""

    __tablename__ = "offer_summary"
    # The rows the search groups (a host's model of several kinds): few, found without a scan.
    __table_args__ = (
        Index("ix_offer_summary_several", "host_id", "gpu_name", postgresql_where=text("kinds > 1"), sqlite_where=text("kinds > 1")),
    )

    id: Mapped[int] = mapped_column(BigInteger().with_variant(Integer, "sqlite"), primary_key=True, autoincrement=True)
    host_id: Mapped[str] = mapped_column(ForeignKey("hosts.id", ondelete="CASCADE"), index=True)
    gpu_name: Mapped[str] = mapped_column(String(255), index=True)
    free_gpus: Mapped[int]
    memory_total_mib: Mapped[int]
    tier: Mapped[str | None] = mapped_column(String(16), index=True)
    score: Mapped[float | None]
    needs_review: Mapped[bool]
    compute_capability_key: Mapped[int | None] = mapped_column(index=True)
    cuda_version_key: Mapped[int | None]
    compute_capability: Mapped[str | None] = mapped_column(Text)  # the GPUs' info texts
    cuda_driver_version: Mapped[str | None] = mapped_column(Text)
    host_state: Mapped[str] = mapped_column(String(16))
    region: Mapped[str | None] = mapped_column(String(64), index=True)
    reliability: Mapped[float | None]
    download_mbps: Mapped[float | None]
    upload_mbps: Mapped[float | None]
    isolated: Mapped[bool | None]
    listed_price: Mapped[Decimal | None] = mapped_column(Numeric(12, 6))  # NULL: not listed
    verified: Mapped[bool]
    available_until: Mapped[datetime | None]
    maintenance_windows: Mapped[list[Any] | None] = mapped_column(JSON)  # NULL: none
    kinds: Mapped[int]  # rows of this host and model: 1 (the usual case) makes this row the whole offer


class Rental(Base):
    __tablename__ = "rentals"
    __table_args__ = (UniqueConstraint("renter_id", "idempotency_key", name="uq_rentals_idempotency"),)

    id: Mapped[str] = mapped_column(String(40), primary_key=True)
    renter_id: Mapped[str] = mapped_column(ForeignKey("accounts.id"), index=True)
    host_id: Mapped[str | None] = mapped_column(ForeignKey("hosts.id"), index=True)  # NULL while queued
    gpu_model: Mapped[str | None] = mapped_column(String(255), default=None)
    gpu_count: Mapped[int]
    gpu_uuids: Mapped[list[Any]] = mapped_column(default=list)
    state: Mapped[str] = mapped_column(String(16), index=True)
    kind: Mapped[str] = mapped_column(String(16), default="on_demand", server_default="on_demand")  # | interruptible
    # Thousandths of each GPU (1000: whole GPUs; a MIG slice counts its compute share) and GPU memory per share.
    gpu_milli: Mapped[int] = mapped_column(default=1000, server_default="1000")
    gpu_memory_mib: Mapped[int] = mapped_column(default=0, server_default="0")
    mig_profile: Mapped[str | None] = mapped_column(String(32), default=None)
    bid_per_gpu_hour: Mapped[Decimal | None] = mapped_column(Numeric(12, 6), default=None)
    # What one whole GPU-hour costs the renter on the chosen host (the bid, for interruptible rentals).
    price_per_gpu_hour: Mapped[Decimal | None] = mapped_column(Numeric(12, 6), default=None)
    # The request as placement reads it again (offer, requirements, network limits): for the queue and re-placement.
    spec: Mapped[dict[str, Any]] = mapped_column(default=dict)
    queue_until: Mapped[datetime | None] = mapped_column(default=None)
    preempted_by_id: Mapped[str | None] = mapped_column(ForeignKey("rentals.id", name="fk_rentals_preempted_by_id"), default=None)
    # Billing (billing/rating.py): usage is posted to the ledger up to here; NULL: nothing rated yet.
    rated_until: Mapped[datetime | None] = mapped_column(default=None)
    billed_seconds: Mapped[int] = mapped_column(default=0, server_default="0")
    workload: Mapped[dict[str, Any]] = mapped_column(default=dict)
    idempotency_key: Mapped[str | None] = mapped_column(String(255), default=None)
    request_fingerprint: Mapped[str | None] = mapped_column(String(64), default=None)
    failure_reason: Mapped[str | None] = mapped_column(Text, default=None)
    # The agent's stable code for a start that failed (image_pull_failed, image_not_allowed, ...); NULL otherwise.
    failure_code: Mapped[str | None] = mapped_column(String(64), default=None)
    # The agent's SSH host key for this rental (OpenSSH one-line form): pinned in what connect returns.
    ssh_host_key: Mapped[str | None] = mapped_column(Text, default=None)
    # Until when the ended rental's /workspace stays reachable over SFTP (its workload exited on its own);
    # NULL: not (still running, stopped by request, or released).
    workspace_until: Mapped[datetime | None] = mapped_column(default=None)
    # Bytes renters moved through the relays: to the rental (in) and from it (out), summed from tunnel_usage.
    tunnel_bytes_in: Mapped[int] = mapped_column(BigInteger, default=0, server_default="0")
    tunnel_bytes_out: Mapped[int] = mapped_column(BigInteger, default=0, server_default="0")
    created_at: Mapped[datetime] = mapped_column(default=_now)
    started_at: Mapped[datetime | None] = mapped_column(default=None)
    stopped_at: Mapped[datetime | None] = mapped_column(default=None)
    # When the host was last heard from before it went silent for longer than the grace period.
    host_lost_at: Mapped[datetime | None] = mapped_column(default=None)
    # Re-place the rental on another host if its host is lost (the new rental names this one).
    restart_on_failure: Mapped[bool] = mapped_column(default=False)
    replaces_id: Mapped[str | None] = mapped_column(ForeignKey("rentals.id", name="fk_rentals_replaces_id"), default=None)
    # A member of a cluster (master/services/clusters.py): the cluster and the member's rank, 0 to node_count - 1.
    cluster_id: Mapped[str | None] = mapped_column(ForeignKey("clusters.id", name="fk_rentals_cluster_id"), default=None, index=True)
    node_rank: Mapped[int | None] = mapped_column(default=None)
    # A replica of an elastic service (master/services/elastic.py), and when its health check first passed
    # (the gateway balances over replicas with ready_at set; created_at is when the autoscaler decided on it).
    service_id: Mapped[str | None] = mapped_column(ForeignKey("services.id", name="fk_rentals_service_id"), default=None, index=True)
    ready_at: Mapped[datetime | None] = mapped_column(default=None)


class Cluster(Base):
    """One rental spanning several hosts: ``node_count`` member rentals (``rentals.cluster_id``), one per host.

    Its state is derived from its members' (``master/services/clusterstate.py``); placement, commands,
    telemetry and billing work per member.
    """

    __tablename__ = "clusters"
    __table_args__ = (UniqueConstraint("renter_id", "idempotency_key", name="uq_clusters_idempotency"),)

    id: Mapped[str] = mapped_column(String(40), primary_key=True)
    renter_id: Mapped[str] = mapped_column(ForeignKey("accounts.id"), index=True)
    state: Mapped[str] = mapped_column(String(16), index=True)
    node_count: Mapped[int]
    gpus_per_node: Mapped[int]
    gpu_model: Mapped[str | None] = mapped_column(String(255), default=None)  # model words as asked (None: any)
    allow_mixed: Mapped[bool] = mapped_column(default=False)  # False: every member gets the same GPU model
    workload: Mapped[dict[str, Any]] = mapped_column(default=dict)  # before the per-member environment
    template: Mapped[str | None] = mapped_column(String(40), default=None)
    # Bounds between nodes ({"max_latency_ms", "max_loss_pct", "min_mbit_s"}): placement keeps host pairs measured
    # outside them apart (host_links); once the private network is up its figures are checked against them.
    network: Mapped[dict[str, Any] | None] = mapped_column(JSON, default=None)
    # The private network between members (master/services/cluster_network.py): its /24 and what the agents said.
    subnet: Mapped[str | None] = mapped_column(String(18), default=None)
    private_network: Mapped[dict[str, Any] | None] = mapped_column(JSON, default=None)
    kind: Mapped[str] = mapped_column(String(16), default="on_demand")  # | interruptible
    bid_per_gpu_hour: Mapped[Decimal | None] = mapped_column(Numeric(12, 6), default=None)
    restart_policy: Mapped[str] = mapped_column(String(16), default="stop")  # | replace
    idempotency_key: Mapped[str | None] = mapped_column(String(255), default=None)
    request_fingerprint: Mapped[str | None] = mapped_column(String(64), default=None)
    failure_reason: Mapped[str | None] = mapped_column(Text, default=None)
    created_at: Mapped[datetime] = mapped_column(default=_now)
    started_at: Mapped[datetime | None] = mapped_column(default=None)
    stopped_at: Mapped[datetime | None] = mapped_column(default=None)


class Service(Base):
    """An elastic service: replicas of one container workload behind one endpoint, scaled between bounds.

    Each replica is a rental (``rentals.service_id``); ``desired_replicas`` is what the autoscaler last chose
    (``master/services/scaling.py``), ``wake_requested_at`` a request that found no ready replica (scale from zero).
    """

    __tablename__ = "services"
    __table_args__ = (
        UniqueConstraint("renter_id", "idempotency_key", name="uq_services_idempotency"),
        CheckConstraint("min_replicas >= 0 AND max_replicas >= min_replicas", name="ck_services_replica_bounds"),
    )

    id: Mapped[str] = mapped_column(String(40), primary_key=True)
    renter_id: Mapped[str] = mapped_column(ForeignKey("accounts.id"), index=True)
    name: Mapped[str] = mapped_column(String(63))
    state: Mapped[str] = mapped_column(String(16), index=True)  # active | deleted
    workload: Mapped[dict[str, Any]] = mapped_column(default=dict)  # the container workload every replica runs
    template: Mapped[str | None] = mapped_column(String(40), default=None)
    port: Mapped[int]  # the port the workload serves the API on
    health_path: Mapped[str] = mapped_column(String(255), default="/health")
    gpu_count: Mapped[int] = mapped_column(default=1)  # per replica
    gpu_model: Mapped[str | None] = mapped_column(String(255), default=None)
    query: Mapped[str] = mapped_column(Text, default="")  # requirements every replica's host meets (offer query language)
    kind: Mapped[str] = mapped_column(String(16), default="on_demand")  # | interruptible
    bid_per_gpu_hour: Mapped[Decimal | None] = mapped_column(Numeric(12, 6), default=None)
    min_replicas: Mapped[int]
    max_replicas: Mapped[int]
    desired_replicas: Mapped[int]
    # {"metric": "inflight", "target": 4} or {"metric": "gpu_util", "threshold_pct": 80, "period_s": 300},
    # with "scale_up_cooldown_s" and "scale_down_cooldown_s".
    scaling: Mapped[dict[str, Any]] = mapped_column(default=dict)
    token_hash: Mapped[str] = mapped_column(String(64), index=True)  # SHA-256 of the service token, hex
    token_prefix: Mapped[str] = mapped_column(String(16))  # its first characters, to tell tokens apart
    idempotency_key: Mapped[str | None] = mapped_column(String(255), default=None)
    request_fingerprint: Mapped[str | None] = mapped_column(String(64), default=None)
    created_at: Mapped[datetime] = mapped_column(default=_now)
    deleted_at: Mapped[datetime | None] = mapped_column(default=None)
    last_scale_up_at: Mapped[datetime | None] = mapped_column(default=None)
    last_scale_down_at: Mapped[datetime | None] = mapped_column(default=None)
    wake_requested_at: Mapped[datetime | None] = mapped_column(default=None)


class ServiceEvent(Base):
    """What happened to a service: created, scaled (with the figures that decided it), a replica replaced, deleted."""

    __tablename__ = "service_events"

    id: Mapped[int] = mapped_column(BigInteger().with_variant(Integer, "sqlite"), primary_key=True, autoincrement=True)
    service_id: Mapped[str] = mapped_column(ForeignKey("services.id", ondelete="CASCADE"), index=True)
    at: Mapped[datetime] = mapped_column(default=_now)
    kind: Mapped[str] = mapped_column(String(16))  # created | scale_up | scale_down | replaced | ready | cold_start | deleted
    replicas: Mapped[int]  # desired replicas after it
    cause: Mapped[str] = mapped_column(Text)


class ServiceStat(Base):
    """One gateway process's figures for one service over one bucket of ``service_stats_bucket_s`` seconds.

    Several master processes serve a service's endpoint: each writes its own rows (``node``), and readers
    sum them. ``latency_hist`` counts requests per bucket of ``master/services/gateway/stats.py``'s bounds.
    """

    __tablename__ = "service_stats"
    __table_args__ = (UniqueConstraint("service_id", "bucket_at", "node", name="uq_service_stats_bucket"),)

    id: Mapped[int] = mapped_column(BigInteger().with_variant(Integer, "sqlite"), primary_key=True, autoincrement=True)
    service_id: Mapped[str] = mapped_column(ForeignKey("services.id", ondelete="CASCADE"), index=True)
    bucket_at: Mapped[datetime]
    node: Mapped[str] = mapped_column(String(64))
    requests: Mapped[int] = mapped_column(default=0)
    errors: Mapped[int] = mapped_column(default=0)  # answered 5xx by the gateway or a replica, or not answered
    retries: Mapped[int] = mapped_column(default=0)  # requests sent again to another replica
    inflight_sum: Mapped[float] = mapped_column(default=0.0)  # requests in flight, summed over samples
    inflight_samples: Mapped[int] = mapped_column(default=0)
    inflight_peak: Mapped[int] = mapped_column(default=0)
    latency_hist: Mapped[list[int]] = mapped_column(JSON, default=list)


class ClusterEvent(Base):
    __tablename__ = "cluster_events"

    id: Mapped[int] = mapped_column(BigInteger().with_variant(Integer, "sqlite"), primary_key=True, autoincrement=True)
    cluster_id: Mapped[str] = mapped_column(ForeignKey("clusters.id", ondelete="CASCADE"), index=True)
    at: Mapped[datetime] = mapped_column(default=_now)
    from_state: Mapped[str | None] = mapped_column(String(16))
    to_state: Mapped[str] = mapped_column(String(16))
    cause: Mapped[str] = mapped_column(Text)


class HostLink(Base):
    """The network between two hosts as a cluster's agents last measured it through its private network
    (``master/services/host_links.py``): one row per pair, ``host_a < host_b``, the latest figures winning.

    ``reachable`` false: the tunnel carried nothing between them (``error`` says what the agent saw; the
    figures are NULL). ``loss_pct`` is NULL where the agents do not measure it; ``mbit_s`` where they
    measured no throughput. ``cluster_id``: the cluster whose members measured it.
    """

    __tablename__ = "host_links"
    __table_args__ = (CheckConstraint("host_a < host_b", name="ck_host_links_ordered"),)

    host_a: Mapped[str] = mapped_column(ForeignKey("hosts.id", ondelete="CASCADE"), primary_key=True)
    host_b: Mapped[str] = mapped_column(ForeignKey("hosts.id", ondelete="CASCADE"), primary_key=True, index=True)
    reachable: Mapped[bool] = mapped_column(default=True)
    rtt_ms: Mapped[float | None] = mapped_column(default=None)
    mbit_s: Mapped[float | None] = mapped_column(default=None)
    loss_pct: Mapped[float | None] = mapped_column(default=None)
    error: Mapped[str | None] = mapped_column(String(300), default=None)
    path: Mapped[str | None] = mapped_column(String(8), default=None)  # direct | relay: how the tunnel reached the peer
    measured_at: Mapped[datetime]
    cluster_id: Mapped[str | None] = mapped_column(ForeignKey("clusters.id", ondelete="SET NULL"), default=None)


class GpuAllocation(Base):
    """What one rental holds of one GPU: all of it, a share (milli + memory) or one MIG instance.

    ``released_at`` is set once, when the rental lets go (the GPU's counters are given back in
    the same transaction). ``active_mig`` equals ``mig_uuid`` while held and is NULL after:
    its unique constraint is what keeps a MIG instance from being handed out twice.
    """

    __tablename__ = "gpu_allocations"
    __table_args__ = (UniqueConstraint("active_mig", name="uq_gpu_allocations_active_mig"),)

    id: Mapped[int] = mapped_column(BigInteger().with_variant(Integer, "sqlite"), primary_key=True, autoincrement=True)
    rental_id: Mapped[str] = mapped_column(ForeignKey("rentals.id", ondelete="CASCADE"), index=True)
    gpu_id: Mapped[str] = mapped_column(ForeignKey("gpus.id", ondelete="CASCADE"), index=True)
    milli: Mapped[int]
    memory_mib: Mapped[int] = mapped_column(default=0)
    whole: Mapped[bool] = mapped_column(default=False)
    mig_uuid: Mapped[str | None] = mapped_column(String(128), default=None)
    active_mig: Mapped[str | None] = mapped_column(String(128), default=None)
    created_at: Mapped[datetime] = mapped_column(default=_now)
    released_at: Mapped[datetime | None] = mapped_column(default=None)


class Template(Base):
    """A named container workload renters can start by name (``master/services/templates.py``).

    ``workload`` is a ``shared.protocol.ContainerWorkload`` as JSON (kind, image, command, args, env,
    ports, shm_mib, limits); a rental copies it when it is created, so editing a template never
    changes a rental that already exists.
    """

    __tablename__ = "templates"

    name: Mapped[str] = mapped_column(String(40), primary_key=True)
    description: Mapped[str] = mapped_column(Text, default="")
    workload: Mapped[dict[str, Any]] = mapped_column(default=dict)
    created_at: Mapped[datetime] = mapped_column(default=_now)
    updated_at: Mapped[datetime] = mapped_column(default=_now)


class RentalEvent(Base):
    __tablename__ = "rental_events"

    id: Mapped[int] = mapped_column(BigInteger().with_variant(Integer, "sqlite"), primary_key=True, autoincrement=True)
    rental_id: Mapped[str] = mapped_column(ForeignKey("rentals.id", ondelete="CASCADE"), index=True)
    at: Mapped[datetime] = mapped_column(default=_now)
    from_state: Mapped[str | None] = mapped_column(String(16))
    to_state: Mapped[str] = mapped_column(String(16))
    cause: Mapped[str] = mapped_column(Text)


class Command(Base):
    __tablename__ = "commands"
    __table_args__ = (Index("ix_commands_host_state", "host_id", "state"),)

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    host_id: Mapped[str] = mapped_column(ForeignKey("hosts.id", ondelete="CASCADE"))
    rental_id: Mapped[str | None] = mapped_column(ForeignKey("rentals.id"), default=None, index=True)
    kind: Mapped[str] = mapped_column(String(32))
    args: Mapped[dict[str, Any]] = mapped_column(default=dict)
    state: Mapped[str] = mapped_column(String(16))  # pending | sent | succeeded | failed
    created_at: Mapped[datetime] = mapped_column(default=_now)
    last_sent_at: Mapped[datetime | None] = mapped_column(default=None)
    send_count: Mapped[int] = mapped_column(default=0)
    completed_at: Mapped[datetime | None] = mapped_column(default=None)
    result: Mapped[dict[str, Any] | None] = mapped_column(JSON, default=None)


class TelemetrySample(Base):
    __tablename__ = "telemetry"
    __table_args__ = (
        UniqueConstraint("host_id", "seq", name="uq_telemetry_host_seq"),
        Index("ix_telemetry_host_sampled", "host_id", "sampled_at"),
    )

    id: Mapped[int] = mapped_column(BigInteger().with_variant(Integer, "sqlite"), primary_key=True, autoincrement=True)
    host_id: Mapped[str] = mapped_column(ForeignKey("hosts.id", ondelete="CASCADE"))
    seq: Mapped[int] = mapped_column(BigInteger)
    sampled_at: Mapped[datetime]
    received_at: Mapped[datetime] = mapped_column(default=_now)
    relay_id: Mapped[str | None] = mapped_column(String(64), default=None)
    gpus: Mapped[list[Any]] = mapped_column(default=list)
    window_s: Mapped[float | None] = mapped_column(default=None)
    aggregates: Mapped[list[Any]] = mapped_column(default=list)
    # Folded into telemetry_rollups yet? The roll-up pass flips it in the same transaction.
    rolled: Mapped[bool] = mapped_column(default=False, index=True)


class TelemetryRollup(Base):
    """One GPU's telemetry over one bucket (60 s or 3600 s): counts, sums and maxima.

    Sums and counts (not averages) so a late sample folds in exactly: avg = sum / n.
    """

    __tablename__ = "telemetry_rollups"
    __table_args__ = (
        UniqueConstraint("host_id", "resolution", "bucket_start", "gpu_uuid", name="uq_rollups_bucket"),
        Index("ix_rollups_resolution_bucket", "resolution", "bucket_start"),
    )

    id: Mapped[int] = mapped_column(BigInteger().with_variant(Integer, "sqlite"), primary_key=True, autoincrement=True)
    host_id: Mapped[str] = mapped_column(ForeignKey("hosts.id", ondelete="CASCADE"))
    resolution: Mapped[int]  # bucket length in seconds
    bucket_start: Mapped[datetime]
    gpu_uuid: Mapped[str] = mapped_column(String(128))
    gpu_index: Mapped[int]
    samples: Mapped[int] = mapped_column(default=0)
    util_n: Mapped[int] = mapped_column(default=0)
    util_sum: Mapped[float] = mapped_column(default=0.0)
    util_max: Mapped[float | None] = mapped_column(default=None)
    mem_n: Mapped[int] = mapped_column(default=0)
    mem_sum: Mapped[float] = mapped_column(default=0.0)
    mem_max: Mapped[float | None] = mapped_column(default=None)
    temp_n: Mapped[int] = mapped_column(default=0)
    temp_sum: Mapped[float] = mapped_column(default=0.0)
    temp_max: Mapped[float | None] = mapped_column(default=None)
    power_n: Mapped[int] = mapped_column(default=0)
    power_sum: Mapped[float] = mapped_column(default=0.0)
    power_max: Mapped[float | None] = mapped_column(default=None)


class GpuEvent(Base):
    """XID errors and ECC events as the agent reported them (one row per event)."""

    __tablename__ = "gpu_events"
    __table_args__ = (
        UniqueConstraint("host_id", "seq", "position", name="uq_gpu_events_host_seq_pos"),
        Index("ix_gpu_events_received", "received_at"),  # fault counting and the alert window
    )

    id: Mapped[int] = mapped_column(BigInteger().with_variant(Integer, "sqlite"), primary_key=True, autoincrement=True)
    host_id: Mapped[str] = mapped_column(ForeignKey("hosts.id", ondelete="CASCADE"), index=True)
    seq: Mapped[int] = mapped_column(BigInteger)
    position: Mapped[int]
    gpu_uuid: Mapped[str] = mapped_column(String(128))
    kind: Mapped[str] = mapped_column(String(64))
    code: Mapped[int | None] = mapped_column(default=None)
    at: Mapped[datetime]
    received_at: Mapped[datetime] = mapped_column(default=_now)


class TunnelUsage(Base):
    """One agent report of the bytes renters moved to and from one rental; (host, seq, rental) once."""

    __tablename__ = "tunnel_usage"

    host_id: Mapped[str] = mapped_column(ForeignKey("hosts.id", ondelete="CASCADE"), primary_key=True)
    seq: Mapped[int] = mapped_column(BigInteger, primary_key=True)
    rental_id: Mapped[str] = mapped_column(ForeignKey("rentals.id", ondelete="CASCADE"), primary_key=True, index=True)
    bytes_in: Mapped[int] = mapped_column(BigInteger)
    bytes_out: Mapped[int] = mapped_column(BigInteger)
    at: Mapped[datetime] = mapped_column()


class NetworkMeasurement(Base):
    __tablename__ = "network_measurements"
    __table_args__ = (
        UniqueConstraint("host_id", "seq", name="uq_network_host_seq"),
        Index("ix_network_host_measured", "host_id", "measured_at"),
    )

    id: Mapped[int] = mapped_column(BigInteger().with_variant(Integer, "sqlite"), primary_key=True, autoincrement=True)
    host_id: Mapped[str] = mapped_column(ForeignKey("hosts.id", ondelete="CASCADE"))
    seq: Mapped[int] = mapped_column(BigInteger)
    measured_at: Mapped[datetime]
    relay_url: Mapped[str] = mapped_column(String(512))
    download_mbps: Mapped[float | None] = mapped_column(default=None)
    upload_mbps: Mapped[float | None] = mapped_column(default=None)
    latency_ms: Mapped[float | None] = mapped_column(default=None)
    jitter_ms: Mapped[float | None] = mapped_column(default=None)
    loss: Mapped[float] = mapped_column(default=0.0)
    data: Mapped[dict[str, Any]] = mapped_column(default=dict)


class RentalLogChunk(Base):
    """A slice of a workload's output as the agent shipped it; ``offset`` is the byte offset in the log."""

    __tablename__ = "rental_logs"
    __table_args__ = (UniqueConstraint("rental_id", "offset", name="uq_rental_logs_offset"),)

    id: Mapped[int] = mapped_column(BigInteger().with_variant(Integer, "sqlite"), primary_key=True, autoincrement=True)
    rental_id: Mapped[str] = mapped_column(ForeignKey("rentals.id", ondelete="CASCADE"), index=True)
    offset: Mapped[int] = mapped_column(BigInteger)
    length: Mapped[int]
    data: Mapped[str] = mapped_column(Text)
    received_at: Mapped[datetime] = mapped_column(default=_now)


class Lease(Base):
    """A named, expiring lock held by one master process (for work only one may do at a time)."""

    __tablename__ = "leases"

    name: Mapped[str] = mapped_column(String(64), primary_key=True)
    holder: Mapped[str] = mapped_column(String(128))
    expires_at: Mapped[datetime]


class Alert(Base):
    """One occurrence of an alert condition, from raised to resolved.

    ``open_key`` equals ``key`` while the alert fires and is NULL once resolved; its unique
    constraint keeps one open alert per condition (NULLs never collide), which is the dedupe.
    """

    __tablename__ = "alerts"
    __table_args__ = (Index("ix_alerts_state_raised", "state", "raised_at"),)

    id: Mapped[str] = mapped_column(String(40), primary_key=True)
    rule: Mapped[str] = mapped_column(String(32), index=True)
    key: Mapped[str] = mapped_column(String(255), index=True)
    open_key: Mapped[str | None] = mapped_column(String(255), unique=True, default=None)
    severity: Mapped[str] = mapped_column(String(16))  # critical | warning | info
    state: Mapped[str] = mapped_column(String(16))  # firing | resolved
    host_id: Mapped[str | None] = mapped_column(ForeignKey("hosts.id", ondelete="CASCADE"), default=None, index=True)
    relay_id: Mapped[str | None] = mapped_column(String(64), default=None)
    summary: Mapped[str] = mapped_column(Text)
    details: Mapped[dict[str, Any]] = mapped_column(default=dict)
    raised_at: Mapped[datetime] = mapped_column(default=_now)
    last_seen_at: Mapped[datetime] = mapped_column(default=_now)
    resolved_at: Mapped[datetime | None] = mapped_column(default=None)
    occurrences: Mapped[int] = mapped_column(default=1)


class AlertNotification(Base):
    """An outbox row: one alert state change to deliver to the webhook, retried with back-off."""

    __tablename__ = "alert_notifications"
    __table_args__ = (Index("ix_alert_notifications_due", "delivered_at", "next_attempt_at"),)

    id: Mapped[int] = mapped_column(BigInteger().with_variant(Integer, "sqlite"), primary_key=True, autoincrement=True)
    alert_id: Mapped[str] = mapped_column(ForeignKey("alerts.id", ondelete="CASCADE"), index=True)
    event: Mapped[str] = mapped_column(String(16))  # firing | resolved
    payload: Mapped[dict[str, Any]] = mapped_column(default=dict)
    created_at: Mapped[datetime] = mapped_column(default=_now)
    attempts: Mapped[int] = mapped_column(default=0)
    next_attempt_at: Mapped[datetime] = mapped_column(default=_now)
    delivered_at: Mapped[datetime | None] = mapped_column(default=None)
    gave_up_at: Mapped[datetime | None] = mapped_column(default=None)
    last_error: Mapped[str | None] = mapped_column(Text, default=None)


class LedgerAccount(Base):
    """One account of the double-entry ledger (billing/ledger.py): ``renter:<id>:credit``,
    ``provider:<id>:payable``, ``platform:fees``, ``platform:cash``."""

    __tablename__ = "ledger_accounts"

    code: Mapped[str] = mapped_column(String(96), primary_key=True)
    kind: Mapped[str] = mapped_column(String(16))  # asset | liability | revenue
    owner_id: Mapped[str | None] = mapped_column(ForeignKey("accounts.id"), default=None, index=True)
    created_at: Mapped[datetime] = mapped_column(default=_now)


class LedgerTransaction(Base):
    """A balanced posting: its entries sum to zero. ``key`` (unique) says what it records, so it is posted once."""

    __tablename__ = "ledger_transactions"

    id: Mapped[int] = mapped_column(BigInteger().with_variant(Integer, "sqlite"), primary_key=True, autoincrement=True)
    key: Mapped[str] = mapped_column(String(255), unique=True)
    kind: Mapped[str] = mapped_column(String(32), index=True)  # top_up | usage | minimum | downtime_credit | payout
    memo: Mapped[str] = mapped_column(Text, default="")
    rental_id: Mapped[str | None] = mapped_column(ForeignKey("rentals.id"), default=None, index=True)
    period_start: Mapped[datetime | None] = mapped_column(default=None)
    period_end: Mapped[datetime | None] = mapped_column(default=None)
    created_at: Mapped[datetime] = mapped_column(default=_now, index=True)


class LedgerEntry(Base):
    """One leg of a posting: ``amount`` > 0 debits the account, < 0 credits it (USD, six places)."""

    __tablename__ = "ledger_entries"

    id: Mapped[int] = mapped_column(BigInteger().with_variant(Integer, "sqlite"), primary_key=True, autoincrement=True)
    transaction_id: Mapped[int] = mapped_column(ForeignKey("ledger_transactions.id", ondelete="CASCADE"), index=True)
    account: Mapped[str] = mapped_column(ForeignKey("ledger_accounts.code"), index=True)
    amount: Mapped[Decimal] = mapped_column(Numeric(20, 6))


class Payout(Base):
    """Money paid out to a provider from its payable balance (billing/payouts.py); posted with ``ledger_key``."""

    __tablename__ = "payouts"

    id: Mapped[str] = mapped_column(String(40), primary_key=True)
    provider_id: Mapped[str] = mapped_column(ForeignKey("accounts.id"), index=True)
    amount: Mapped[Decimal] = mapped_column(Numeric(14, 2))
    currency: Mapped[str] = mapped_column(String(3), default="USD")
    batch: Mapped[str] = mapped_column(String(32), index=True)
    ledger_key: Mapped[str] = mapped_column(String(255), unique=True)
    state: Mapped[str] = mapped_column(String(16), default="pending")  # pending | exported
    export_ref: Mapped[str | None] = mapped_column(String(512), default=None)  # where the payout provider put it
    created_at: Mapped[datetime] = mapped_column(default=_now)
    exported_at: Mapped[datetime | None] = mapped_column(default=None)
