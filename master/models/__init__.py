"""Every table of the master (SQLAlchemy 2, typed declarative): one module per aggregate, one shared ``Base``
(``master/models/base.py``), whose metadata Alembic reads (``master/migrations/env.py``) once this package is imported.

Ids are text (prefixed random tokens) so they read well in logs and URLs and work
the same on SQLite and PostgreSQL. Timestamps are aware UTC on both databases.
Import a table from the package (``from master.models import Rental``): the modules are its layout, not its interface.
"""

from __future__ import annotations

from master.models.accounts import (
    Account,
    ApiKey,
    AuditEvent,
    ConsoleSession,
    DeviceCode,
    EmailToken,
    Passkey,
    PasskeyChallenge,
    RegistryCredential,
    SshKey,
    TeamInvitation,
    TeamMember,
)
from master.models.alerts import Alert, AlertNotification
from master.models.base import Base, UTCDateTime, version_key
from master.models.clusters import Cluster, ClusterEvent
from master.models.endpoints import Service, ServiceEvent, ServiceStat
from master.models.hosts import (
    Command,
    EnrollmentToken,
    Gpu,
    GpuVerification,
    Host,
    HostCertificate,
    HostEvent,
    HostLink,
    HostPowerPolicy,
    NetworkMeasurement,
    PowerSaving,
)
from master.models.ledger import LedgerAccount, LedgerEntry, LedgerTransaction, Payout
from master.models.market import HostListing, OfferSummary, Template
from master.models.platform import Lease
from master.models.rentals import GpuAllocation, Rental, RentalEvent, RentalLogChunk, TunnelUsage
from master.models.telemetry import GpuEvent, TelemetryRollup, TelemetrySample
from master.models.volumes import Volume, VolumeAttachment, VolumeEvent

__all__ = [
    "Account", "Alert", "AlertNotification", "ApiKey", "AuditEvent", "Base", "Cluster", "ClusterEvent", "Command",
    "ConsoleSession", "DeviceCode", "EmailToken", "EnrollmentToken", "Gpu", "GpuAllocation", "GpuEvent", "GpuVerification", "Host", "HostCertificate", "HostEvent",
    "HostLink", "HostListing", "HostPowerPolicy", "Lease", "LedgerAccount", "LedgerEntry", "LedgerTransaction",
    "NetworkMeasurement", "OfferSummary", "Passkey", "PasskeyChallenge", "Payout", "PowerSaving", "RegistryCredential", "Rental", "RentalEvent", "RentalLogChunk",
    "Service", "ServiceEvent", "ServiceStat", "SshKey", "TeamInvitation", "TeamMember", "TelemetryRollup", "TelemetrySample", "Template",
    "TunnelUsage", "UTCDateTime", "Volume", "VolumeAttachment", "VolumeEvent", "version_key",
]
