"""Hosts and their GPUs: enrollment, certificates, events, power, the commands sent to agents, the links and network measured between hosts."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    CheckConstraint,
    ForeignKey,
    Index,
    Integer,
    String,
    Text,
    UniqueConstraint,
)
from sqlalchemy.orm import Mapped, mapped_column

from master.models.base import Base, _now, version_key


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
    # The agent's link as the relays report it (master.telemetry.links): the current connection, when it opened,
    # and since when it is closed with no newer one open (None: open, or never reported).
    link_connection_id: Mapped[str | None] = mapped_column(String(64), default=None)
    link_opened_at: Mapped[datetime | None] = mapped_column(default=None)
    link_down_since: Mapped[datetime | None] = mapped_column(default=None)
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
    # The certificate's public key (SubjectPublicKeyInfo PEM): what a start's registry login is sealed to
    # (master/services/accounts/registries.py). NULL for a certificate signed before it was recorded.
    public_key: Mapped[str | None] = mapped_column(Text, default=None)


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
    # Classification (master/services/market/tiers.py), refreshed when the host reports or is re-scored.
    tier: Mapped[str | None] = mapped_column(String(16), default=None, index=True)
    score: Mapped[float | None] = mapped_column(default=None)
    model_key: Mapped[str | None] = mapped_column(String(64), default=None)
    needs_review: Mapped[bool] = mapped_column(default=False)
    classification: Mapped[dict[str, Any] | None] = mapped_column(JSON, default=None)
    # The allocation, claimed with conditional UPDATEs so one GPU is never given twice: a whole-GPU
    # rental sets ``rental_id`` (WHERE rental_id IS NULL AND milli_used = 0); fractional shares add to
    # ``milli_used``/``memory_used_mib`` (WHERE the sums stay within the GPU). MIG slices are rows of
    # gpu_allocations whose ``active_mig`` is unique. See master/services/rentals/allocation.py.
    rental_id: Mapped[str | None] = mapped_column(ForeignKey("rentals.id"), default=None, index=True)
    milli_used: Mapped[int] = mapped_column(default=0, server_default="0")
    memory_used_mib: Mapped[int] = mapped_column(default=0, server_default="0")
    # ``major * 1000 + minor`` of info's compute_capability and cuda_driver_version (set with info; NULL when
    # unknown): plain integer columns the offer search filters on, instead of reading every GPU's JSON.
    compute_capability_key: Mapped[int | None] = mapped_column(default=None, index=True)
    cuda_version_key: Mapped[int | None] = mapped_column(default=None, index=True)

    # What the GPU proved by computation (issue 40, docs/verification.md): the newest finished challenge's outcome
    # (``passed`` | ``failed``), its reason code when failed, when it passed last, the throughput it measured
    # (TFLOP/s in the challenge's precision) and the memory it proved; ``verification_failures`` counts failures in a
    # row (a pass resets it). NULL: never challenged.
    verified_at: Mapped[datetime | None] = mapped_column(default=None)
    verified_tflops: Mapped[float | None] = mapped_column(default=None)
    verified_vram_mib: Mapped[int | None] = mapped_column(default=None)
    verification_outcome: Mapped[str | None] = mapped_column(String(16), default=None)
    verification_reason: Mapped[str | None] = mapped_column(String(64), default=None)
    verification_failures: Mapped[int] = mapped_column(default=0, server_default="0")

    def set_info(self, info: dict[str, Any]) -> None:
        self.info = info
        self.compute_capability_key = version_key(info.get("compute_capability"))
        self.cuda_version_key = version_key(info.get("cuda_driver_version"))


class HostPowerPolicy(Base):
    """A provider's off-peak power policy for one host (master/services/hosts/power.py, docs/power.md): the cap its idle GPUs
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


class GpuVerification(Base):
    """One challenge put to a host's GPUs (docs/verification.md): the secret seed and size chosen from what the GPUs
    claim, the deadline, the host's commitment (a Merkle root per GPU), what the master then revealed (rows and
    columns to open), and the verdict per GPU. ``trigger``: ``enrollment`` (before the host is first listed), ``idle``
    (at a random time while no rental holds the GPUs) or ``admin`` (on demand). ``state``: ``issued`` → ``committed`` →
    ``revealed`` → ``passed`` | ``failed`` (or ``cancelled`` when a rental or the host's loss comes first)."""

    __tablename__ = "gpu_verifications"
    __table_args__ = (Index("ix_gpu_verifications_host_created", "host_id", "created_at"),)

    id: Mapped[str] = mapped_column(String(40), primary_key=True)
    host_id: Mapped[str] = mapped_column(ForeignKey("hosts.id", ondelete="CASCADE"))
    trigger: Mapped[str] = mapped_column(String(16))
    state: Mapped[str] = mapped_column(String(16), index=True)
    gpu_uuids: Mapped[list[str]] = mapped_column(JSON)
    seed: Mapped[str] = mapped_column(String(64))  # hex; secret until the challenge is sent
    size: Mapped[int]  # n: A and B are n × n
    dtype: Mapped[str] = mapped_column(String(16))  # the precision the tier is sold in (bf16, fp16, fp32)
    deadline_at: Mapped[datetime | None] = mapped_column(default=None)  # the commitment's, set when sent
    created_at: Mapped[datetime] = mapped_column(default=_now)
    sent_at: Mapped[datetime | None] = mapped_column(default=None)
    committed_at: Mapped[datetime | None] = mapped_column(default=None)
    finished_at: Mapped[datetime | None] = mapped_column(default=None)
    command_id: Mapped[str | None] = mapped_column(String(40), default=None)
    commitment: Mapped[dict[str, Any] | None] = mapped_column(JSON, default=None)
    reveal: Mapped[dict[str, Any] | None] = mapped_column(JSON, default=None)
    result: Mapped[dict[str, Any] | None] = mapped_column(JSON, default=None)  # per GPU uuid: outcome, reason, figures
    reason_code: Mapped[str | None] = mapped_column(String(64), default=None)
    reason: Mapped[str | None] = mapped_column(Text, default=None)
    requested_by: Mapped[str | None] = mapped_column(String(40), default=None)  # the admin's account, for ``admin``
