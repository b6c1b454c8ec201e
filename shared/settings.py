"""Typed settings, one object per service, filled from a TOML file and ``GPUMARKET_*``.

Precedence, highest first: explicit overrides (command-line flags) → environment
variables (``GPUMARKET_<FIELD>``) → the service's table in the TOML file
(``[master]``, ``[access]``, ``[agent]``; top-level keys apply to every service) →
defaults. Settings are built once at start-up and passed in; nothing reads them at
import time.
"""

from __future__ import annotations

import ipaddress
import tomllib
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from decimal import Decimal
from pathlib import Path
from typing import Any, ClassVar, Literal, Self

from pydantic import Field, SecretStr, ValidationError, field_validator, model_validator
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict

from shared.ceilings import (
    DEFAULT_RENTAL_DISK_GIB,
    DEFAULT_RESERVED_CPU_CORES,
    DEFAULT_RESERVED_DISK_GIB,
    DEFAULT_RESERVED_MEMORY_MIB,
    DEFAULT_RESERVED_PIDS,
)
from shared.crypto import sealed
from shared.errors import ConfigError

ENV_PREFIX = "GPUMARKET_"

_config_file: ContextVar[Path | None] = ContextVar("gpumarket_config_file", default=None)


class _TomlSection(PydanticBaseSettingsSource):
    """Reads top-level keys and the service's own table from the TOML file being loaded."""

    def get_field_value(self, field: FieldInfo, field_name: str) -> tuple[Any, str, bool]:
        return None, field_name, False  # unused: __call__ returns the whole mapping

    def __call__(self) -> dict[str, Any]:
        path = _config_file.get()
        if path is None:
            return {}
        try:
            data = tomllib.loads(path.read_text())
        except FileNotFoundError:
            raise ConfigError(f"config file {path} does not exist; pass an existing file to --config") from None
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"config file {path} is not valid TOML: {exc}") from None
        section = getattr(self.settings_cls, "section", "")
        fields = self.settings_cls.model_fields
        values = {k: v for k, v in data.items() if k in fields and not isinstance(v, dict)}
        table = data.get(section, {})
        if not isinstance(table, dict):
            raise ConfigError(f"[{section}] in {path} must be a table")
        unknown = sorted(set(table) - set(fields))
        if unknown:
            raise ConfigError(f"unknown setting(s) {', '.join(unknown)} in [{section}] of {path}")
        values.update(table)
        return values


@contextmanager
def _reading(path: Path | None) -> Iterator[None]:
    token = _config_file.set(path)
    try:
        yield
    finally:
        _config_file.reset(token)


class ServiceSettings(BaseSettings):
    """Base of every service's settings."""

    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, extra="forbid", validate_default=True)
    section: ClassVar[str] = ""

    log_level: str = Field("INFO", description="Logging level: DEBUG, INFO, WARNING, ERROR.")

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        return (init_settings, env_settings, _TomlSection(settings_cls))

    @classmethod
    def load(cls, config_file: Path | None = None, **overrides: Any) -> Self:
        """Build the settings; ``None`` overrides are ignored so unset CLI flags fall through."""
        given = {k: v for k, v in overrides.items() if v is not None}
        try:
            with _reading(config_file):
                return cls(**given)
        except ValidationError as exc:
            problems = "; ".join(
                f"{ENV_PREFIX}{'.'.join(str(p) for p in err['loc']).upper()}: {err['msg']}" for err in exc.errors()
            )
            raise ConfigError(f"invalid {cls.section or 'service'} settings: {problems}") from None

    @classmethod
    def describe(cls) -> str:
        """One line per setting: its environment variable, default and meaning (for ``--help``)."""
        lines = []
        for name, info in cls.model_fields.items():
            # A factory's value, not pydantic's placeholder for "no default" (PydanticUndefined).
            default = info.default_factory() if info.default_factory is not None else info.default  # type: ignore[call-arg]
            if default is None or default is PydanticUndefined:
                shown = ""
            else:
                shown = f" (default: {'empty' if default in ([], {}, '') else default})"
            lines.append(f"  {ENV_PREFIX}{name.upper():<34} {info.description or ''}{shown}")
        return "\n".join(lines)


def default_data_dir() -> Path:
    return Path.home() / ".local" / "share" / "gpumarket"


class MasterSettings(ServiceSettings):
    section: ClassVar[str] = "master"

    data_dir: Path = Field(default_factory=lambda: default_data_dir() / "master", description="Where the CA and the SQLite file live.")
    database_url: str | None = Field(None, description="SQLAlchemy URL; PostgreSQL in production. Default: SQLite in the data dir.")
    migrate_on_start: bool = Field(True, description="Bring the database schema to this version on start; false where `gpumarket migrate` runs first (a deployment's migration job), and then a master on an older schema refuses to start.")
    redis_url: str | None = Field(None, description="Redis URL of the bus; unset means the in-process bus (embedded mode only).")
    bus_prefix: str = Field("gpumarket:", description="Key prefix of every bus stream in Redis.")
    http_host: str = Field("127.0.0.1", description="Address the REST API and console listen on.")
    http_port: int = Field(8080, ge=0, le=65535, description="Port of the REST API and console (0 picks a free one).")
    public_url: str | None = Field(None, description="URL users reach the master at (defaults to http://HOST:PORT).")
    relay_urls: list[str] = Field(default_factory=list, description="wss:// URLs of the relays agents are told to use at enrollment (comma-separated JSON list in env).")
    agent_package: Path | None = Field(None, description="The gpumarket wheel served at GET /downloads/agent for install-agent.sh, or a folder whose newest gpumarket-*.whl is served (unset: built from the source checkout the master runs from, if it runs from one).")
    instance_id: str | None = Field(None, description="Unique name of this master process on the bus (default: hostname-pid).")
    heartbeat_interval: float = Field(10.0, gt=0, le=3600, description="Seconds between agent heartbeats.")
    telemetry_interval: float = Field(10.0, gt=0, le=3600, description="Seconds between agent telemetry samples.")
    missed_heartbeats_offline: int = Field(3, ge=1, le=100, description="Missed heartbeats after which a host is offline.")
    command_retry_interval: float = Field(15.0, gt=0, le=3600, description="Seconds before an unanswered command is sent again.")
    stale_message_idle: float = Field(30.0, gt=0, le=3600, description="Seconds a bus message may stay unacknowledged by a consumer before another master takes it over.")
    agent_cert_hours: float = Field(24.0, gt=0, le=24 * 365, description="Lifetime of agent client certificates, in hours.")
    enrollment_token_minutes: float = Field(60.0, gt=0, le=7 * 24 * 60, description="Lifetime of enrollment tokens, in minutes.")
    max_request_bytes: int = Field(1 << 20, ge=1024, le=64 << 20, description="Largest accepted REST request body.")
    rate_limits_enabled: bool = Field(True, description="Rate-limit /api/v1 per client address and per API key or console session, enrollment and sign-in more strictly (429 with Retry-After; docs/operations.md, Rate limits). Health probes are never limited.")
    trusted_proxies: list[str] = Field(default_factory=list, description='Proxies (CIDRs) whose X-Forwarded-For is believed: the client is its last hop that is not one of them (JSON list in env: ["10.0.0.0/8"]). Empty: the peer address counts, whatever the header says.')
    rate_limit_per_address: float = Field(50.0, gt=0, le=1e6, description="Sustained /api/v1 requests per second from one client address (IPv6: per /64).")
    rate_burst_per_address: int = Field(200, ge=1, le=1_000_000, description="Requests one client address may send at once above rate_limit_per_address.")
    rate_limit_per_key: float = Field(20.0, gt=0, le=1e6, description="Sustained /api/v1 requests per second with one API key or console session.")
    rate_burst_per_key: int = Field(100, ge=1, le=1_000_000, description="Requests one API key or console session may send at once above rate_limit_per_key.")
    enrollment_rate_per_minute: float = Field(10.0, gt=0, le=1e6, description="Sustained POST /enroll per minute from one client address; the same limit applies to POST /enrollment-tokens per address and per account.")
    enrollment_burst: int = Field(10, ge=1, le=1_000_000, description="Enrollments (or enrollment tokens) at once above enrollment_rate_per_minute.")
    sign_in_rate_per_minute: float = Field(10.0, gt=0, le=1e6, description="Sustained console sign-ins (POST /sessions) per minute from one client address.")
    sign_in_burst: int = Field(10, ge=1, le=1_000_000, description="Sign-ins one client address may try at once above sign_in_rate_per_minute.")
    sign_in_failure_cost: int = Field(3, ge=1, le=1000, description="Sign-in tokens a failed sign-in (unknown or revoked key) takes from its address's bucket; a successful one takes 1.")
    rate_limit_timeout: float = Field(0.25, gt=0, le=10, description="Seconds one rate-limit check may wait for Redis; past it, or with Redis down, requests pass unlimited (fail open) and a warning is logged.")
    rental_grace_period: float = Field(120.0, ge=0, le=86400, description="The heartbeat backstop: seconds an offline host (silent for missed_heartbeats_offline heartbeats, its link still looking open) keeps its rentals; a host back within it resumes them, past it they fail as host lost.")
    failover_after_s: float = Field(20.0, ge=10, le=86400, description="Seconds after a host's last agent link closed (a relay saw it: access.linkevents) before its rentals fail as host lost and those that asked are placed again, unless a rental asked for longer (or shorter, at least 10 s) with its own failover_after_s; a link back within it changes nothing (docs/reliability.md#fail-over).")
    ingest_batch: int = Field(500, ge=1, le=10_000, description="Bus messages one ingestion pass reads; telemetry and heartbeats in it are written in one transaction.")
    telemetry_max_future_s: float = Field(300.0, ge=0, le=86400, description="Telemetry sampled further than this many seconds in the future (by the master's clock) is rejected.")
    rollup_interval: float = Field(30.0, gt=0, le=3600, description="Seconds between telemetry roll-up passes (1-minute and 1-hour buckets).")
    raw_retention_hours: float = Field(48.0, gt=0, le=24 * 3650, description="Hours raw telemetry samples are kept (rolled up first).")
    rollup_1m_retention_days: float = Field(30.0, gt=0, le=3650, description="Days 1-minute roll-ups are kept.")
    rollup_1h_retention_days: float = Field(400.0, gt=0, le=3650, description="Days 1-hour roll-ups are kept.")
    fault_threshold: int = Field(3, ge=1, le=1000, description="Faults (hardware XIDs, ECC errors, failed health checks) within fault_window_minutes that make a host faulty.")
    fault_window_minutes: float = Field(60.0, gt=0, le=7 * 24 * 60, description="Window in which faults are counted towards fault_threshold.")
    reliability_interval: float = Field(300.0, gt=0, le=86400, description="Seconds between recomputations of every host's reliability score and GPU tiers.")
    alert_interval: float = Field(10.0, gt=0, le=3600, description="Seconds between alert rule evaluations.")
    alert_webhook_url: str | None = Field(None, description="URL alert changes are POSTed to as JSON (unset: alerts are only listed at /api/v1/alerts).")
    alert_webhook_timeout: float = Field(5.0, gt=0, le=120, description="Seconds one webhook delivery may take.")
    alert_webhook_max_attempts: int = Field(10, ge=1, le=1000, description="Deliveries tried (with exponential back-off) before one is given up.")
    alert_temperature_c: float = Field(85.0, gt=0, le=150, description="GPU temperature above which the temperature alert fires.")
    alert_ingestion_lag_s: float = Field(30.0, gt=0, le=86400, description="Ingestion lag (oldest unprocessed agent message) above which the lag alert fires.")
    metrics_token: str | None = Field(None, description="Bearer token GET /metrics requires (Prometheus: authorization.credentials). Unset: /metrics refuses every scrape, unless metrics_open.")
    metrics_open: bool = Field(False, description="Answer GET /metrics without a token when metrics_token is unset: only for a master whose HTTP listener a private network alone reaches (the figures name hosts, accounts' services and rentals).")
    metrics_per_gpu: bool = Field(True, description="Export per-GPU series on /metrics (about 90 % of a large fleet's scrape; turn off for very large fleets: fleet, host and pipeline figures stay).")
    metrics_cache_seconds: float = Field(5.0, ge=0, le=600, description="Seconds one fleet snapshot for /metrics and /api/v1/metrics is reused.")
    alert_event_window_minutes: float = Field(15.0, gt=0, le=7 * 24 * 60, description="An XID or ECC alert fires while such an event is this recent.")
    placer: str = Field("fgd_net", description="Placement algorithm for rentals: first_fit, best_fit, random, utilization, gpu_packing, gpu_clustering, fgd, fgd_net, fgd_plus (issue 43's candidate, docs/placement.md), pwr_fgd (power-aware, docs/power.md), or a learned one: learned_ppo, learned_ddpg, learned_ppo_trace, learned_ddpg_trace (see docs/placement.md).")
    price_tolerance: Decimal = Field(Decimal("0.05"), ge=0, le=10, description="The renter's price first: a rental, cluster or service that names no GPU model goes to the cheapest offers that meet its constraints, and the placer chooses among those priced at most this fraction above the cheapest (0.05 = 5 %); a request's own price_tolerance overrides it (docs/placement.md, \"The renter's price first\").")
    preemption_grace_s: float = Field(30.0, ge=0, le=600, description="Seconds a preempted workload has between SIGTERM and SIGKILL.")
    queue_interval: float = Field(2.0, gt=0, le=600, description="Seconds between passes over queued rentals (a release of GPUs also starts one).")
    placement_pause_after_claim_s: float = Field(0.0, ge=0, le=60, description="Fault injection for the fault suite (tests/faults), never for production: seconds every placement waits after claiming its GPUs, inside its transaction, so a test can kill the master mid-placement.")
    host_link_max_age_s: float = Field(7 * 86400.0, ge=60, le=365 * 86400, description="Seconds the network measured between two hosts by a cluster's agents (host_links) guides cluster placement; older figures count as never measured, so a pair once measured outside a cluster's bounds is tried again.")
    max_queue_timeout_s: float = Field(86400.0, gt=0, le=30 * 86400, description="Longest queue_timeout_s a rental request may ask for.")
    power_interval: float = Field(60.0, gt=0, le=3600, description="Seconds between the power-policy passes (one master at a time, under the power-policy lease): each opted-in host's off-peak window from the demand forecast, sent to its agent when it changes, and the agents' energy-saved counters folded into daily figures (docs/power.md).")
    verification_required: bool = Field(False, description="Hosts are not listed (not rentable) before every present GPU passed its verification challenge at enrollment (docs/verification.md); a failed challenge unlists the host until one passes. Off by default until the challenge image carries a CUDA build of torch (docs/verification.md, 'Not done yet'): the CPU-only image would fail every real GPU as too slow; `gpumarket up` turns it on for its simulated hosts.")
    verification_interval: float = Field(60.0, gt=0, le=86400, description="Seconds between the verification passes (one master at a time, under the gpu-verification lease): idle GPUs re-checked at random times, challenges that got no answer failed, expired verifications unmarked.")
    verification_recheck_h: float = Field(24.0, gt=0, le=24 * 365, description="Mean hours between an idle GPU's random re-checks (a pass picks an idle host with probability verification_interval / this).")
    verification_max_age_h: float = Field(7 * 24.0, gt=0, le=24 * 3650, description="Hours a passed verification counts: a host's listing is verified while every present GPU passed within this.")
    verification_failures: int = Field(2, ge=1, le=100, description="Failed verifications of one GPU in a row after which each further failure counts against the host's reliability, as a provider-caused failure (gpu_verification_failed).")
    verification_slack: float = Field(1.5, ge=1, le=100, description="The commitment's deadline allows the product this many times the time the claimed GPU model needs at its expected sustained throughput (plus the allowances of docs/verification.md for building A and B, hashing C and starting).")
    verification_answer_grace_s: float = Field(600.0, gt=0, le=86400, description="Seconds past a challenge's deadline (or past its reveal) after which a challenge that got no answer fails as no_answer.")
    autoscale_interval: float = Field(5.0, gt=0, le=600, description="Seconds between the autoscaler's passes over services (one master at a time, under the autoscaler lease): health checks, figures, scaling.")
    max_service_replicas: int = Field(32, ge=1, le=1000, description="Highest max_replicas a service may ask for.")
    service_replica_queue_s: float = Field(600.0, gt=0, le=86400, description="How long a replica waits in the rental queue for GPUs before it fails (the autoscaler then asks again).")
    service_unhealthy_after: int = Field(3, ge=1, le=100, description="Failed health checks in a row after which a ready replica stops getting requests, until one passes again.")
    service_backoff_base_s: float = Field(5.0, gt=0, le=3600, description="Seconds the autoscaler waits before it replaces a service's replica that failed to start; each further failure with the same code doubles the wait, up to service_backoff_max_s.")
    service_backoff_max_s: float = Field(300.0, gt=0, le=86400, description="The longest wait between a service's attempts to start a replica, and how often a failing service is retried when the failure is not the renter's.")
    service_failing_after: int = Field(3, ge=1, le=100, description="Replicas in a row that fail to start with the same code after which the service is failing: its endpoint answers 503 with the cause at once, and a renter's cause (an image that does not exist) is not retried until the renter sets the replicas again.")
    default_max_gpus: Decimal | None = Field(None, ge=0, description="GPUs (fractions count) an account may hold at once unless its own quota says otherwise; unset: no limit.")
    default_max_spend_per_hour: Decimal | None = Field(None, ge=0, description="USD per hour an account's active rentals may cost at once unless its own quota says otherwise; unset: no limit.")
    billing_in_process: bool = Field(True, description="Run billing's periodic jobs in the master processes (one at a time, under leases); false when Celery workers (gpumarket worker --beat) run them.")
    require_credit: bool = Field(True, description="Refuse a rental whose renter's prepaid credit does not cover its minimum billing period (402 insufficient_credit).")
    credit_stop_margin_s: float = Field(120.0, ge=0, le=86400, description="Stop a renter's rentals when its credit would last less than this many seconds at its burn rate.")
    credit_warning_s: float = Field(1800.0, ge=0, le=7 * 86400, description="Warn (an event on each rental) when a renter's credit would last less than this many seconds.")
    volume_grace_days: float = Field(3.0, gt=0, le=365, description="Days a renter's volumes are kept once its credit has run out (or its monthly spend cap is reached): credit added before then keeps them; after, they are deleted (docs/volumes.md#billing).")
    payout_interval: float = Field(86400.0, ge=60, le=31 * 86400, description="Seconds between provider payout batches.")
    payout_minimum: Decimal = Field(Decimal("10.00"), ge=0, description="Smallest payable balance (USD) paid out in a batch; less waits for the next.")
    payout_dir: Path | None = Field(None, description="Where the CSV payout exporter writes payouts-<batch>.csv (default: DATA_DIR/payouts).")
    billing_interval: float = Field(30.0, gt=0, le=3600, description="Seconds between rating passes (usage posted to the ledger).")
    billing_min_period_s: int = Field(60, ge=0, le=86400, description="Minimum billing period of a rental, seconds (not charged when it was preempted; credited back when its host was lost).")
    console_session_idle_s: float = Field(8 * 3600.0, ge=60, le=30 * 86400, description="A console sign-in ends after this many seconds without a request.")
    console_session_max_s: float = Field(7 * 86400.0, ge=60, le=90 * 86400, description="A console sign-in ends this many seconds after it began, active or not.")
    # Self-service accounts (master/services/accounts/signup.py, docs/accounts.md)
    sign_up_enabled: bool = Field(True, description="Let strangers create accounts (POST /accounts, the console's sign-up); false: only operators make them (gpumarket admin create-account).")
    smtp_url: SecretStr | None = Field(None, description="Where the master sends mail (verification and password-reset links): smtp://[user:password@]host:port, smtps:// for TLS from the start, or smtp+starttls://. Unset: nothing is sent and sign-up is refused (503 mail_unavailable).")
    secrets_key: SecretStr | None = Field(None, description="The key that seals secrets the master keeps (private registry credentials, TOTP secrets; shared.crypto.sealed): 32 random bytes in URL-safe base64 (gpumarket up makes one in its data dir). Every master of a deployment needs the same one. Unset: registry credentials are refused (503 secrets_key_unset) and TOTP secrets are stored unsealed.")
    mail_from: str = Field("gpumarket <no-reply@gpumarket.local>", description="The From: of the mail the master sends.")
    email_token_ttl_s: float = Field(86400.0, ge=60, le=30 * 86400, description="Seconds a mailed verification link works.")
    password_reset_ttl_s: float = Field(3600.0, ge=60, le=7 * 86400, description="Seconds a mailed password-reset link works.")
    password_min_length: int = Field(10, ge=8, le=128, description="Shortest password accepted at sign-up and reset (NIST SP 800-63B asks for at least 8).")
    password_hash_time_cost: int = Field(3, ge=1, le=20, description="Argon2id passes (RFC 9106's second recommended setting: 3).")
    password_hash_memory_kib: int = Field(65536, ge=1024, le=4 * 1024 * 1024, description="Argon2id memory in KiB (RFC 9106's second recommended setting: 64 MiB).")
    account_email_rate_per_hour: float = Field(20.0, gt=0, le=1e6, description="Sign-ins, password resets and verification mails per hour for one email address (besides the per-address sign-in bucket), when rate_limits_enabled.")
    account_email_burst: int = Field(10, ge=1, le=1_000_000, description="Of those, how many one address may use at once.")
    # Passkeys (WebAuthn, master/services/accounts/passkeys.py, docs/accounts.md)
    webauthn_rp_id: str | None = Field(None, max_length=253, description="Passkeys' relying party id: the console's domain name, or a parent domain of it (never an IP address). Unset: the host of public_url (http://HOST:PORT when that is unset too); a loopback address there becomes localhost, so gpumarket up's console has passkeys at http://localhost:PORT/.")
    webauthn_origins: list[str] = Field(default_factory=list, description='The origins (scheme://host[:port]) the console is served at, which a passkey\'s answer must name (JSON list in env: ["https://console.example.com"]). Empty: public_url\'s origin, with localhost for a loopback address as for webauthn_rp_id.')
    webauthn_rp_name: str = Field("gpumarket", min_length=1, max_length=64, description="The name a browser shows when it asks to make or use a passkey.")
    passkey_challenge_ttl_s: float = Field(300.0, ge=30, le=3600, description="Seconds a passkey challenge (POST /account/passkeys/options, /sessions/passkey/options) may be answered in; each is good once.")
    console_secure_cookie: bool | None = Field(None, description="Mark the console's session cookie Secure (HTTPS only); unset: when public_url or the request is https.")
    stream_poll_interval: float = Field(1.0, gt=0, le=60, description="Seconds between the database reads of a live telemetry stream (GET /hosts/{id}/metrics/stream).")
    stream_max_s: float = Field(300.0, gt=0, le=86400, description="Seconds a live telemetry stream stays open; the browser's EventSource then reconnects (and is authorized again).")
    connect_token_ttl_s: float = Field(120.0, ge=5, le=3600, description="Seconds a connect token (POST /rentals/{id}/connect) opens connections for; open connections outlive it.")
    # Elastic services' endpoint: {public_url}/svc/{service id}/... (master/services/gateway, docs/gateway.md)
    service_stats_bucket_s: float = Field(5.0, ge=1, le=3600, description="Seconds of one row of a service's gateway figures (service_stats: requests, errors, retries, in-flight, latency), written by every master process for every service it served in that time.")
    service_cold_start_timeout_s: float = Field(300.0, ge=0, le=3600, description="Seconds a request to a service with no ready replica is held while a replica starts (scale from zero); then 503 no_ready_replica.")
    gateway_connections_per_replica: int = Field(8, ge=1, le=16, description="Connections one master process keeps to one replica of a service (each a stream through the relay, reused across requests; the relay allows 16 per rental): more requests at once wait for one.")
    gateway_retry_body_max_kib: int = Field(1024, ge=0, le=64 * 1024, description="Largest request body (KiB) the gateway keeps to send again to another replica when the first fails before answering; a larger body is streamed and its request is never retried.")
    gateway_request_timeout_s: float = Field(600.0, gt=0, le=86400, description="Seconds one request through a service's endpoint may take, its streamed answer included (a model server streams for minutes); a websocket is not bounded by it.")
    gateway_auth_failures_per_minute: float = Field(30.0, gt=0, le=1e6, description="Refused bearer tokens per minute one client address may send to service endpoints (/svc/…) in the long run, when rate_limits_enabled; past gateway_auth_failure_burst the address's refused requests get 429 instead of 401/404. Every token is judged before it counts: a request with a valid token is never limited by it, whatever its address sent before.")
    gateway_auth_failure_burst: int = Field(20, ge=1, le=1_000_000, description="Refused bearer tokens one client address may send to service endpoints at once before gateway_auth_failures_per_minute holds its refused requests back (429); its valid tokens are still served.")
    gateway_max_body_mib: int = Field(100, ge=1, le=64 * 1024, description="Largest request body (MiB) a service's endpoint accepts (413 beyond it).")
    workspace_retention_hours: float = Field(24.0, ge=0, le=24 * 90, description="Hours a rental's /workspace stays reachable over SFTP after its workload exited on its own (until the renter releases it with DELETE).")
    platform_fee_rate: Decimal = Field(Decimal("0.15"), ge=0, lt=1, description="The platform's share of every charge (0.15 = 15 %); the provider earns the rest.")
    billing_discounts: dict[str, list[tuple[float, Decimal]]] = Field(default_factory=dict, description="Duration discounts per tier: {tier: [[hours, pct], ...]}, pct off every second served past hours, e.g. {\"flagship\": [[24, 5], [168, 10]]}.")
    # Self-serve credit (docs/billing.md, Adding credit)
    payments: Literal["off", "demo", "stripe"] = Field("off", description="How renters add credit themselves (POST /api/v1/account/credit): off (admins credit them), demo (credited at once, no card charged; gpumarket up) or stripe (Stripe Checkout, credited by its webhook).")
    stripe_secret_key: SecretStr | None = Field(None, description="Stripe secret API key (sk_live_... or sk_test_...); required with payments = stripe.")
    stripe_webhook_secret: SecretStr | None = Field(None, description="Signing secret (whsec_...) of the Stripe webhook endpoint POST /api/v1/payments/stripe/webhook; required with payments = stripe.")
    stripe_api_base: str | None = Field(None, description="Base URL of Stripe's API (unset: https://api.stripe.com; a stripe-mock for testing).")
    stripe_timeout: float = Field(20.0, gt=0, le=120, description="Seconds one call to Stripe's API may take.")
    topup_minimum: Decimal = Field(Decimal("5.00"), gt=0, le=Decimal("1000000"), description="Smallest self-serve top-up, USD.")
    topup_maximum: Decimal = Field(Decimal("10000.00"), gt=0, le=Decimal("1000000"), description="Largest self-serve top-up, USD.")

    @model_validator(mode="after")
    def _payments_configured(self) -> Self:
        if self.topup_minimum > self.topup_maximum:
            raise ValueError(f"topup_minimum ({self.topup_minimum}) is above topup_maximum ({self.topup_maximum})")
        if self.payments == "stripe" and (self.stripe_secret_key is None or self.stripe_webhook_secret is None):
            raise ValueError("payments = stripe needs stripe_secret_key and stripe_webhook_secret")
        return self

    @field_validator("secrets_key")
    @classmethod
    def _secrets_key_is_32_bytes(cls, key: SecretStr | None) -> SecretStr | None:
        if key is not None:
            sealed.parse_key(key.get_secret_value())  # ValueError says how to make one
        return key

    @field_validator("trusted_proxies")
    @classmethod
    def _proxies_are_networks(cls, proxies: list[str]) -> list[str]:
        networks = []
        for proxy in proxies:
            try:
                networks.append(str(ipaddress.ip_network(proxy.strip(), strict=False)))
            except ValueError:
                raise ValueError(f"{proxy!r} is not an address or a CIDR network such as 10.0.0.0/8") from None
        return networks


class AccessSettings(ServiceSettings):
    section: ClassVar[str] = "access"

    relay_id: str = Field("relay-1", pattern=r"^[A-Za-z0-9._-]{1,64}$", description="Unique relay name; names its command stream on the bus.")
    region: str = Field("local", description="Region this relay serves.")
    host: str = Field("127.0.0.1", description="Address the relay listens on.")
    port: int = Field(8443, ge=0, le=65535, description="TLS websocket port (0 picks a free one).")
    redis_url: str | None = Field(None, description="Redis URL of the bus (required for a standalone relay).")
    bus_prefix: str = Field("gpumarket:", description="Key prefix of every bus stream in Redis.")
    cert_file: Path | None = Field(None, description="Relay server certificate (PEM), issued by the master's CA.")
    key_file: Path | None = Field(None, description="Relay server private key (PEM).")
    ca_file: Path | None = Field(None, description="The master's CA certificate; agents' client certificates must chain to it.")
    max_frame: int = Field(1 << 20, ge=1024, le=64 << 20, description="Largest websocket frame accepted from an agent, in bytes.")
    open_timeout: float = Field(10.0, gt=0, le=300, description="Seconds allowed for the TLS and websocket handshakes.")
    ping_interval: float = Field(10.0, gt=0, le=600, description="Seconds between websocket pings.")
    ping_timeout: float = Field(10.0, gt=0, le=600, description="Seconds to wait for a pong before dropping the agent (a host that lost power or its network is seen as a closed link within ping_interval + ping_timeout; the master's failover_after_s counts from then).")
    max_outbound_queue: int = Field(256, ge=1, le=100_000, description="Commands queued for one agent before it counts as too slow.")
    max_connections: int = Field(10_000, ge=1, le=1_000_000, description="Agents one relay process accepts at once.")
    heartbeat_interval: float = Field(10.0, gt=0, le=3600, description="Heartbeat interval the relay asks agents for (match the master's).")
    telemetry_interval: float = Field(10.0, gt=0, le=3600, description="Telemetry interval the relay asks agents for.")
    close_timeout: float = Field(2.0, gt=0, le=60, description="Seconds to wait for an agent to answer a websocket close before dropping it.")
    drain_timeout: float = Field(5.0, gt=0, le=600, description="On shutdown, seconds allowed for telling every agent to move and for their handlers to finish.")
    max_messages_per_second: float = Field(50.0, gt=0, le=100_000, description="Sustained messages per second one agent may send; beyond it (and its burst) the agent is closed with 4004.")
    message_burst: int = Field(100, ge=1, le=1_000_000, description="Messages one agent may send at once above its per-second rate.")
    max_connections_per_source_per_minute: float = Field(30.0, gt=0, le=1_000_000, description="Sustained new agent connections per minute from one source IP; beyond it (and its burst) HTTP 429.")
    connection_burst_per_source: int = Field(10, ge=1, le=1_000_000, description="New connections one source IP may open at once above its per-minute rate.")
    max_tracked_sources: int = Field(100_000, ge=1, le=10_000_000, description="Source IPs whose connection rate is remembered; beyond it the least recently seen are forgotten.")
    public_url: str | None = Field(None, description="wss:// URL agents reach this relay at, as published in the relay registry (default: wss://PUBLIC_HOST:PUBLIC_PORT/v1/agent).")
    public_host: str | None = Field(None, description="Public name or address of this relay for the registry and DNS (default: from PUBLIC_URL, else HOST).")
    public_port: int | None = Field(None, ge=1, le=65535, description="Public port of this relay (default: from PUBLIC_URL, else the bound port).")
    register_interval: float = Field(5.0, gt=0, le=3600, description="Seconds between refreshes of this relay's registry record (it expires after three missed ones).")
    tls_read_buffer_kib: int = Field(16, ge=4, le=1024, description="Most bytes one socket read takes on a TLS connection, in KiB (CPython's asyncio default is 256); the buffer is shared by all the relay's connections once their handshake is done.")
    tls_read_limit_kib: int = Field(64, ge=4, le=4096, description="Received bytes one connection may hold not yet decrypted, in KiB (asyncio's default is 256), while its agent sends faster than the relay forwards.")
    write_limit_kib: int = Field(32, ge=1, le=4096, description="Bytes one connection may hold written but not yet sent, in KiB; beyond it an agent is no longer read until it reads its acks.")
    max_incoming_frames: int = Field(4, ge=1, le=1024, description="Frames one connection may hold received but not yet read by the relay; beyond them the relay stops reading the socket.")
    revocation_poll_interval: float = Field(2.0, gt=0, le=3600, description="Seconds between reads of the revoked-certificate list; revoked agents are closed with 4005.")
    registry_timeout: float = Field(2.0, gt=0, le=60, description="Seconds one registry call (publish, revocation read) may take before it counts as failed.")
    link_event_timeout: float = Field(2.0, gt=0, le=60, description="Seconds the bus may take to accept an agent link's open or closed event (access.linkevents); a slower one is dropped, the master's heartbeat monitor being the backstop.")
    max_streams_per_agent: int = Field(256, ge=1, le=65536, description="Renters' streams (SSH, ports) open at once on one agent's link.")
    max_streams_per_rental: int = Field(16, ge=1, le=4096, description="Renters' websocket connections open at once to one rental through this relay.")
    max_stream_buffer_per_agent_mib: int = Field(64, ge=1, le=4096, description="MiB of renters' stream data one agent's link may hold unread (the streams' receive windows summed).")
    stream_window_kib: int = Field(1024, ge=256, le=65536, description="Receive window of one renter's stream on an agent's link, in KiB, while half the link's buffer is free (the protocol's 256 after that): a download moves at most this per round trip to the agent.")
    ports_domain: str | None = Field(None, pattern=r"^[a-z0-9]([a-z0-9-]*[a-z0-9])?(\.[a-z0-9]([a-z0-9-]*[a-z0-9])?)+$", description="Domain of renters' web ports (https://<rental>-<port>.DOMAIN/): needs a wildcard DNS record and a certificate for *.DOMAIN; unset: no web ports.")
    ports_port: int = Field(8444, ge=0, le=65535, description="TLS port of renters' web ports (0 picks a free one).")
    ports_public_port: int | None = Field(None, ge=1, le=65535, description="Public port of the web ports, where it differs (behind a load balancer).")


class AgentSettings(ServiceSettings):
    section: ClassVar[str] = "agent"

    data_dir: Path = Field(default_factory=lambda: default_data_dir() / "agent", description="Agent state: key, certificate, identity, spool, workloads.")
    gpus: str = Field("nvml", description="GPU backend: 'nvml' (real GPUs), 'replay:FILE' (recorded readings) or 'sim:4xRTX4090' (explicit simulation for demos).")
    relay_url: str | None = Field(None, description="wss:// URL of the relay (default: DNS discovery in GPUMARKET_ZONE, else the relays given at enrollment).")
    zone: str | None = Field(None, description="DNS zone with the relays' SRV records (_gpumarket._tcp.ZONE), falling back to its A/AAAA records.")
    resolver: str | None = Field(None, description="DNS server address for relay discovery (default: the system's).")
    resolver_port: int = Field(53, ge=1, le=65535, description="Port of that DNS server.")
    resolver_source: str | None = Field(None, description="Local address relay-discovery DNS queries are sent from (multi-homed hosts).")
    region: str | None = Field(None, description="Region hint reported to the master.")
    sample_interval: float = Field(1.0, gt=0, le=600, description="Seconds between GPU sampling passes.")
    telemetry_interval: float = Field(10.0, gt=0, le=3600, description="Seconds between telemetry reports (the relay's welcome may override).")
    heartbeat_interval: float = Field(10.0, gt=0, le=3600, description="Seconds between heartbeats (the relay's welcome may override).")
    network_interval: float = Field(3600.0, ge=0, le=7 * 86400, description="Seconds between network measurements (±20 % jitter; 0 = only on demand).")
    network_probes: int = Field(20, ge=1, le=1000, description="Latency probes per network measurement.")
    network_max_bytes: int = Field(32 << 20, ge=1 << 16, le=1 << 30, description="Most bytes one network measurement transfers each way.")
    spool_max_messages: int = Field(100_000, ge=10, le=10_000_000, description="Unacknowledged messages kept on disk before the oldest telemetry is evicted.")
    spool_max_bytes: int = Field(256 << 20, ge=1 << 20, le=16 << 30, description="Bytes of unacknowledged messages kept on disk.")
    reconnect_max_delay: float = Field(30.0, gt=0, le=3600, description="Upper bound of the reconnect back-off, in seconds.")
    # Isolated rentals (docs/isolation.md)
    allow_unisolated_workloads: bool = Field(False, description="Where the agent can neither run containers nor switch users (not root), run process workloads as the agent's own user anyway; its offers then say the host is not isolated. Off: they are refused (workload_not_isolated).")
    rental_uid_min: int = Field(2_000_000, ge=65_536, le=2**31 - 2, description="First uid (and gid) of the range process rentals run under, one each (the agent runs as root); clear of real users.")
    rental_uid_max: int = Field(2_065_535, ge=65_536, le=2**31 - 2, description="Last uid of that range.")
    egress_allow: list[str] = Field([], max_length=64, description='Private IPv4 ranges rentals may reach (e.g. ["10.20.0.0/16"] for a dataset server on the provider\'s LAN); empty: none of RFC 1918, RFC 6598 (CGNAT) and the other special ranges. 169.254.0.0/16 (link-local metadata) is never allowed. Shown on the host page and on offers (JSON list in env).')
    process_subnet_pool: str = Field("10.214.0.0/15", description="IPv4 pool of the process rentals' network namespaces: a /31 per rental uid, so at least twice as many addresses as the uid range has uids; must not overlap the host's own networks.")
    rentals_root: Path = Field(Path("/var/lib/gpumarket/rentals"), description="Where process rentals' homes live (0711; one 0700 folder per rental, owned by its uid); outside the data dir, every folder above it passable by others.")
    docker_url: str | None = Field(None, description="Docker Engine API URL of the container engine (unix:///run/docker.sock, or Podman's compatible socket); unset: the engine's default socket.")
    challenge_image: str | None = Field(None, min_length=1, max_length=255, description="The GPU challenge's image (docs/verification.md): the master's challenges run in it, with the claimed GPUs, as a renter's container would; always allowed whatever allowed_images says. Unset: on real GPUs (gpus = nvml) gpumarket/verify-cuda, which the agent builds FROM challenge_cuda_base; on sim and replay backends gpumarket/verify:latest (`gpumarket up` builds it locally).")
    challenge_cuda_base: str = Field("pytorch/pytorch:2.11.0-cuda12.8-cudnn9-runtime@sha256:eee11b3b3872a8c838e35ef48f08b2d5def2080902c7f666831310ca1a0ef2be", pattern=r"^[^\s@]+@sha256:[0-9a-f]{64}$", max_length=255, description="The PyTorch CUDA runtime image the GPU challenge's image (gpumarket/verify-cuda) is built FROM on a real GPU host, pinned by digest (name[:tag]@sha256:...); the host's engine pulls it once.")
    challenge_simulate: dict[str, Any] | None = Field(None, description='A simulated host\'s behaviour in GPU challenges (only with gpus = sim:...; ignored on real GPUs), handed to the challenge program: e.g. {"behaviour": "wrong"} (docs/verification.md, "Simulated hosts"; JSON object in env).')
    allowed_images: list[str] = Field([], max_length=64, description='Images containers may run: registries ("registry.example.com/") or name patterns ("pytorch/*"); empty: any (JSON list in env).')
    max_image_mib: int | None = Field(None, ge=1, le=10_000_000, description="Largest image a container may run, MiB uncompressed; unset: no limit.")
    container_pids_limit: int = Field(4096, ge=16, le=4_194_304, description="Most processes a container gets when its rental names no pids_limit (less where its share of pid_max is less).")
    max_streams: int = Field(256, ge=1, le=65536, description="Renters' streams (SSH sessions, port connections) open at once on this agent's link.")
    max_streams_per_rental: int = Field(32, ge=1, le=4096, description="Renters' streams open at once to one rental; beyond it a new one is refused.")
    max_stream_buffer_mib: int = Field(64, ge=1, le=4096, description="MiB of renters' stream data this agent buffers unread at most (the streams' receive windows summed).")
    stream_window_kib: int = Field(1024, ge=256, le=65536, description="Receive window of one renter's stream on this agent's link, in KiB, while half the stream buffer is free (the protocol's 256 after that): an upload moves at most this per round trip to the relay.")
    stream_data_kib: int = Field(256, ge=64, le=256, description="Largest DATA frame of a renter's stream this agent offers its relay, KiB (the relay may agree less; 64 is protocol version 1's): larger frames cost less CPU per MB while one stream alone sends.")
    container_memory_mib: int | None = Field(None, ge=16, le=64 << 20, description="Most memory a container gets when its rental names none, MiB (less where its share of the host is less); unset: its share of the host.")
    container_shm_mib: int = Field(64, ge=1, le=1 << 20, description="Size of a container's /dev/shm, MiB, unless its rental asks for another.")
    reserved_cpu_cores: float = Field(DEFAULT_RESERVED_CPU_CORES, ge=0, le=1024, description="CPU cores kept for the host itself: rentals share the rest (each gets its GPUs' share of it when it names no cpu_cores); at most half the host's.")
    reserved_memory_mib: int = Field(DEFAULT_RESERVED_MEMORY_MIB, ge=0, le=1 << 24, description="Memory kept for the host itself, MiB: rentals share the rest (each its GPUs' share when it names no memory_mib); at most half the host's.")
    reserved_pids: int = Field(DEFAULT_RESERVED_PIDS, ge=0, le=1 << 22, description="Process ids kept for the host itself out of /proc/sys/kernel/pid_max: each rental may run its GPUs' share of the rest (its default pids limit, and the most it may ask for).")
    reserved_disk_gib: int = Field(DEFAULT_RESERVED_DISK_GIB, ge=0, le=1 << 20, description="Free disk kept for the host where the agent's data dir lies, GiB: no rental's disk quota reaches into it.")
    rental_disk_gib: int = Field(DEFAULT_RENTAL_DISK_GIB, ge=1, le=1 << 16, description="Disk quota of a rental that names no disk_gib, GiB: its /workspace (or a process rental's home), and a container's writable layer.")
    disk_quota: bool = Field(True, description="Give every rental a size-capped disk (a loop-mounted ext4 image, or the engine's --storage-opt size where its storage driver enforces it); needs root, mkfs.ext4 and loop devices. False: no disk quota, and a rental naming disk_gib is refused.")
    cluster_fabric: dict[str, Any] | None = Field(None, description='The trusted fabric: a private network between this provider\'s hosts that cluster members on two of them use unencrypted (docs/clusters.md, "Three paths"): {"name": "dc1", "parent": "eth1", "subnet": "10.200.0.0/16", "vlan": 120} (vlan optional; subnet: the addresses kept for members, not the hosts\'). Unset: none (JSON object in env).')
    cluster_tunnel_mtu: int | None = Field(None, ge=1280, le=8920, description="MTU of cluster members' WireGuard interface (cluster0). Unset: 1420, right for 1500-byte networks. A provider whose hosts reach each other over 9000-byte frames sets 8920: wireguard-go then carries ~4x more (docs/performance.md, \"Issue 42: the cluster network's paths\"); over a path that does not carry them the tunnel's packets fragment.")
    cluster_direct: bool = Field(True, description="Cluster members' tunnels go straight to other hosts where a WireGuard handshake completes, else through the relays; false: always through the relays (a host that accepts no inbound UDP).")

    @model_validator(mode="after")
    def _uid_range_in_order(self) -> Self:
        if self.rental_uid_min > self.rental_uid_max:
            raise ValueError(f"rental_uid_min ({self.rental_uid_min}) is above rental_uid_max ({self.rental_uid_max})")
        metadata = ipaddress.IPv4Network("169.254.0.0/16")
        for text in self.egress_allow:
            try:
                allowed = ipaddress.IPv4Network(text, strict=False)
            except ValueError as exc:
                raise ValueError(f"egress_allow: {text!r} is not an IPv4 network such as 10.20.0.0/16 ({exc})") from None
            if allowed.overlaps(metadata):
                raise ValueError(f"egress_allow: {text!r} overlaps 169.254.0.0/16 (link-local metadata), which rentals never reach")
        if self.cluster_fabric is not None:
            from shared.protocol.clusterpaths import FabricDeclaration

            try:
                FabricDeclaration.model_validate(self.cluster_fabric)
            except ValidationError as exc:
                raise ValueError(f"cluster_fabric: {exc.errors()[0]['msg']} (e.g. {{\"name\": \"dc1\", \"parent\": \"eth1\", \"subnet\": \"10.200.0.0/16\"}})") from None
        try:
            ipaddress.IPv4Network(self.process_subnet_pool)
        except ValueError as exc:
            raise ValueError(f"process_subnet_pool: {self.process_subnet_pool!r} is not an IPv4 network ({exc})") from None
        return self


class DnsSettings(ServiceSettings):
    section: ClassVar[str] = "dns"

    zone: str = Field("relays.gpumarket.local", max_length=253, pattern=r"^([A-Za-z0-9_-]{1,63}\.)*[A-Za-z0-9_-]{1,63}\.?$", description="DNS zone this server is authoritative for; agents look up _gpumarket._tcp.ZONE SRV, then ZONE A/AAAA.")
    host: str = Field("127.0.0.1", description="Address the geo DNS listens on, UDP and TCP.")
    port: int = Field(5353, ge=0, le=65535, description="UDP and TCP port of the geo DNS (53 behind a delegation; 0 picks a free one).")
    redis_url: str | None = Field(None, description="Redis URL of the live relay registry (required).")
    bus_prefix: str = Field("gpumarket:", description="Key prefix of the relay registry in Redis.")
    ttl: int = Field(30, ge=0, le=3600, description="TTL of every answer, and of negative answers, in seconds; short so load changes spread quickly.")
    max_answers: int = Field(4, ge=1, le=100, description="Most relays in one answer, nearest first.")
    default_region: str = Field("local", min_length=1, description="Region of a client whose address matches none of prefix_regions.")
    prefix_regions: dict[str, str] = Field({}, description='Client address prefix (CIDR, IPv4 or IPv6) → region; the longest matching prefix wins (JSON in env: {"10.0.0.0/8": "eu-west"}).')
    region_distance: dict[str, float] = Field({}, description='Distance between two regions, keyed "a:b" (symmetric; a region is at 0 from itself) (JSON in env: {"eu-west:us-east": 80}).')
    unknown_distance: float = Field(10_000.0, ge=0, le=1e9, description="Distance between two regions missing from region_distance.")
    refresh_interval: float = Field(2.0, gt=0, le=300, description="Seconds between reloads of the live relay list from the registry (answers use the cached list).")
    rate_limit: float = Field(100.0, gt=0, le=1e6, description="Queries per second one source address may send (IPv6: per /64); more are dropped (UDP) or refused (TCP).")
    rate_burst: int = Field(200, ge=1, le=1_000_000, description="Queries one source may send in a burst above rate_limit.")
    max_tcp_connections: int = Field(256, ge=1, le=100_000, description="DNS-over-TCP connections served at once; more are closed on accept.")
    tcp_idle_timeout: float = Field(10.0, gt=0, le=300, description="Seconds a DNS-over-TCP connection may wait for the next query before it is closed.")
    nameserver: str | None = Field(None, description="Name of this server in the zone's NS and SOA records (default: ns.ZONE).")
    nameserver_addresses: list[str] = Field([], description="Addresses served for the nameserver name when it lies inside the zone (JSON list in env).")
