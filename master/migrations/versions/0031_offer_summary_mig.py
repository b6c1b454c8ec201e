"""offer_summary: a GPU in MIG mode is not a free whole GPU; its free MIG instances are counted apart

Revision ID: 0031
Revises: 0030
Create Date: 2026-12-01 09:00:00.000000

Placement never rents a GPU in MIG mode whole (``master.scheduler.fleet.Node``: its GPUs in MIG mode have no
free milli, only MIG slots), yet 0018's summary counted one as free whenever no rental held it whole, which no
MIG claim does: the offers said ``FREE 1`` for the demo's MIG A100 and renting it answered
``insufficient_capacity``. From here a row's ``free_gpus`` counts only GPUs outside MIG mode (present, no rental,
no share), and ``mig_free`` the free MIG instances of the kind's GPUs in MIG mode (an instance the agent reports
with a uuid and a profile, that no active allocation holds: what ``allocation.HostState.node`` gives placement).
A kind with neither has no row.

Taking or giving back a MIG instance changes ``gpu_allocations`` only, so its rows get triggers too (its host is
the GPU's). The PostgreSQL refresh function and every SQLite trigger that embeds the summary's ``SELECT`` are
replaced, and the summary is recomputed for every host.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable

import sqlalchemy as sa
from alembic import op

revision = '0031'
down_revision = '0030'
branch_labels = None
depends_on = None

_PREVIOUS = importlib.import_module("master.migrations.versions.0018_offer_summary")
OFFER_LOCK_CLASS = _PREVIOUS.OFFER_LOCK_CLASS

_COLUMNS = (
    "host_id, gpu_name, free_gpus, mig_free, memory_total_mib, tier, score, needs_review, compute_capability_key, "
    "cuda_version_key, compute_capability, cuda_driver_version, host_state, region, reliability, download_mbps, "
    "upload_mbps, isolated, listed_price, verified, available_until, maintenance_windows, kinds"
)


def _mig_terms(dialect: str) -> tuple[str, str]:
    """SQL over a GPU row ``g``: whether it is in MIG mode, and how many of its MIG instances are free."""
    if dialect == "postgresql":
        mig = "COALESCE(json_typeof(g.info -> 'mig_mode') = 'boolean' AND (g.info ->> 'mig_mode') = 'true', false)"
        free = (
            "(SELECT count(*) FROM json_array_elements(CASE WHEN json_typeof(g.info -> 'mig_instances') = 'array' "
            "THEN g.info -> 'mig_instances' ELSE '[]'::json END) AS mi(v) "
            "WHERE json_typeof(mi.v) = 'object' AND COALESCE(mi.v ->> 'uuid', '') <> '' AND COALESCE(mi.v ->> 'profile', '') <> '' "
            "AND NOT EXISTS (SELECT 1 FROM gpu_allocations AS a WHERE a.active_mig = mi.v ->> 'uuid'))"
        )
    else:
        mig = "(json_extract(g.info, '$.\"mig_mode\"') IS 1)"
        free = (
            "(SELECT count(*) FROM json_each(g.info, '$.\"mig_instances\"') AS mi "
            "WHERE mi.type = 'object' AND COALESCE(json_extract(mi.value, '$.uuid'), '') <> '' "
            "AND COALESCE(json_extract(mi.value, '$.profile'), '') <> '' "
            "AND NOT EXISTS (SELECT 1 FROM gpu_allocations AS a WHERE a.active_mig = json_extract(mi.value, '$.uuid')))"
        )
    return mig, free


def summary_select(dialect: str, host_filter: str) -> str:
    """``SELECT`` of the summary rows of the hosts ``host_filter`` picks (an SQL condition on ``g.host_id``)."""
    if dialect == "postgresql":
        info = "g.info->>'compute_capability' AS compute_capability, g.info->>'cuda_driver_version' AS cuda_driver_version"
        network = ", ".join(
            f"CASE WHEN json_typeof(h.{column} -> '{key}') = '{kind}' THEN CAST((h.{column} ->> '{key}') AS {sql}) END"
            for column, key, kind, sql in (
                ("latest_network", "download_mbps", "number", "FLOAT"), ("latest_network", "upload_mbps", "number", "FLOAT"),
                ("isolation", "isolated", "boolean", "BOOLEAN"),
            )
        )
        windows = "CASE WHEN json_typeof(l.maintenance_windows) = 'array' THEN " \
                  "CASE WHEN json_array_length(l.maintenance_windows) > 0 THEN l.maintenance_windows END END"  # fmt: skip
        present, false = "g.present IS TRUE", "false"
    else:
        info = (
            "JSON_EXTRACT(g.info, '$.\"compute_capability\"') AS compute_capability, "
            "JSON_EXTRACT(g.info, '$.\"cuda_driver_version\"') AS cuda_driver_version"
        )
        network = (
            "JSON_EXTRACT(h.latest_network, '$.\"download_mbps\"'), JSON_EXTRACT(h.latest_network, '$.\"upload_mbps\"'), "
            "JSON_EXTRACT(h.isolation, '$.\"isolated\"')"
        )
        windows = "CASE WHEN json_array_length(l.maintenance_windows) > 0 THEN l.maintenance_windows END"
        present, false = "g.present = 1", "0"
    mig, mig_free = _mig_terms(dialect)
    kind = (
        "m.host_id, m.name, m.memory_total_mib, m.tier, m.score, m.needs_review, m.compute_capability_key, "
        "m.cuda_version_key, m.compute_capability, m.cuda_driver_version"
    )
    # One row per present GPU: 1 in ``whole`` when it rents whole now, its free instances in ``mig_free`` when in MIG mode.
    per_gpu = (
        f"SELECT g.host_id, g.name, g.memory_total_mib, g.tier, g.score, g.needs_review, g.compute_capability_key, "
        f"g.cuda_version_key, {info}, "
        f"CASE WHEN {mig} THEN 0 WHEN g.rental_id IS NULL AND g.milli_used = 0 THEN 1 ELSE 0 END AS whole, "
        f"CASE WHEN {mig} THEN {mig_free} ELSE 0 END AS mig_free "
        f"FROM gpus AS g WHERE {host_filter} AND {present}"
    )
    return (
        f"SELECT k.host_id, k.name, k.free_gpus, k.mig_free, k.memory_total_mib, k.tier, k.score, k.needs_review, "
        f"k.compute_capability_key, k.cuda_version_key, k.compute_capability, k.cuda_driver_version, "
        f"h.state, h.region, h.reliability, {network}, l.price_per_gpu_hour, COALESCE(l.verified, {false}), "
        f"l.available_until, {windows}, count(*) OVER (PARTITION BY k.host_id, k.name) "
        f"FROM (SELECT m.host_id, m.name, CAST(sum(m.whole) AS INTEGER) AS free_gpus, CAST(sum(m.mig_free) AS INTEGER) AS mig_free, m.memory_total_mib, m.tier, "
        f"m.score, m.needs_review, m.compute_capability_key, m.cuda_version_key, m.compute_capability, m.cuda_driver_version "
        f"FROM ({per_gpu}) AS m WHERE m.whole > 0 OR m.mig_free > 0 GROUP BY {kind}) AS k "
        f"JOIN hosts AS h ON h.id = k.host_id LEFT OUTER JOIN host_listings AS l ON l.host_id = k.host_id"
    )


def _pg_refresh_function(columns: str, select: str) -> str:
    return (
        "CREATE OR REPLACE FUNCTION offer_summary_refresh(refreshed_host text) RETURNS void LANGUAGE plpgsql AS $$\n"
        "BEGIN\n"
        "  IF current_setting('gpumarket.offer_summary_last', true) = refreshed_host || '@' || statement_timestamp()::text THEN\n"
        "    RETURN;\n"
        "  END IF;\n"
        f"  PERFORM pg_advisory_xact_lock({OFFER_LOCK_CLASS}, hashtext(refreshed_host));\n"
        "  DELETE FROM offer_summary WHERE host_id = refreshed_host;\n"
        f"  INSERT INTO offer_summary ({columns}) {select};\n"
        "  PERFORM set_config('gpumarket.offer_summary_last', refreshed_host || '@' || statement_timestamp()::text, true);\n"
        "END $$"
    )


def _sqlite_refresh(host: str, columns: str, select: str) -> str:
    return f"DELETE FROM offer_summary WHERE host_id = {host}; INSERT INTO offer_summary ({columns}) {select};"


def _sqlite_triggers(columns: str, summary: Callable[[str, str], str], *, allocations: bool) -> dict[str, tuple[str, str]]:
    """Every SQLite trigger that keeps the summary, by name: (when, body)."""

    def refresh(host: str) -> str:
        return _sqlite_refresh(host, columns, summary("sqlite", f"g.host_id = {host}"))

    gpu_changed = _PREVIOUS._changed(_PREVIOUS._GPU_COLUMNS, ("info",), dialect="sqlite")
    host_changed = _PREVIOUS._changed(_PREVIOUS._HOST_COLUMNS, _PREVIOUS._HOST_JSON_COLUMNS, dialect="sqlite")
    triggers = {
        "offer_summary_gpus_insert": ("AFTER INSERT ON gpus", refresh("NEW.host_id")),
        "offer_summary_gpus_delete": ("AFTER DELETE ON gpus", refresh("OLD.host_id")),
        "offer_summary_gpus_update": (f"AFTER UPDATE ON gpus WHEN {gpu_changed}", refresh("OLD.host_id") + refresh("NEW.host_id")),
        "offer_summary_hosts_update": (f"AFTER UPDATE ON hosts WHEN {host_changed}", refresh("NEW.id")),
        "offer_summary_listings_insert": ("AFTER INSERT ON host_listings", refresh("NEW.host_id")),
        "offer_summary_listings_update": ("AFTER UPDATE ON host_listings", refresh("OLD.host_id") + refresh("NEW.host_id")),
        "offer_summary_listings_delete": ("AFTER DELETE ON host_listings", refresh("OLD.host_id")),
    }
    if allocations:
        of = "(SELECT host_id FROM gpus WHERE id = {}.gpu_id)"
        triggers |= {
            "offer_summary_allocations_insert": ("AFTER INSERT ON gpu_allocations WHEN NEW.active_mig IS NOT NULL", refresh(of.format("NEW"))),
            "offer_summary_allocations_update": (
                "AFTER UPDATE ON gpu_allocations WHEN OLD.active_mig IS NOT NEW.active_mig", refresh(of.format("OLD")),
            ),
            "offer_summary_allocations_delete": ("AFTER DELETE ON gpu_allocations WHEN OLD.active_mig IS NOT NULL", refresh(of.format("OLD"))),
        }
    return triggers


def upgrade() -> None:
    with op.batch_alter_table('offer_summary') as batch:
        batch.add_column(sa.Column('mig_free', sa.Integer(), server_default='0', nullable=False))
    dialect = op.get_bind().dialect.name
    if dialect == "postgresql":
        op.execute(_pg_refresh_function(_COLUMNS, summary_select("postgresql", "g.host_id = refreshed_host")))
        op.execute(
            "CREATE FUNCTION offer_summary_gpu_allocations_changed() RETURNS trigger LANGUAGE plpgsql AS $$\n"
            "BEGIN\n"
            "  IF TG_OP <> 'INSERT' THEN PERFORM offer_summary_refresh(g.host_id) FROM gpus AS g WHERE g.id = OLD.gpu_id; END IF;\n"
            "  IF TG_OP <> 'DELETE' THEN PERFORM offer_summary_refresh(g.host_id) FROM gpus AS g WHERE g.id = NEW.gpu_id; END IF;\n"
            "  RETURN NULL;\n"
            "END $$"
        )
        deferred = "DEFERRABLE INITIALLY DEFERRED FOR EACH ROW"
        for name, when in (
            ("insert", "INSERT ON gpu_allocations {} WHEN (NEW.active_mig IS NOT NULL)"),
            ("update", "UPDATE ON gpu_allocations {} WHEN (OLD.active_mig IS DISTINCT FROM NEW.active_mig)"),
            ("delete", "DELETE ON gpu_allocations {} WHEN (OLD.active_mig IS NOT NULL)"),
        ):
            op.execute(f"CREATE CONSTRAINT TRIGGER offer_summary_allocations_{name} AFTER {when.format(deferred)} "
                       "EXECUTE FUNCTION offer_summary_gpu_allocations_changed()")  # fmt: skip
    else:
        for name, (when, body) in _sqlite_triggers(_COLUMNS, summary_select, allocations=True).items():
            op.execute(f"DROP TRIGGER IF EXISTS {name}")
            op.execute(f"CREATE TRIGGER {name} {when} BEGIN {body} END")
    op.execute("DELETE FROM offer_summary")
    op.execute(f"INSERT INTO offer_summary ({_COLUMNS}) {summary_select(dialect, 'g.host_id IS NOT NULL')}")


def downgrade() -> None:
    dialect = op.get_bind().dialect.name
    if dialect == "postgresql":
        for name in ("insert", "update", "delete"):
            op.execute(f"DROP TRIGGER offer_summary_allocations_{name} ON gpu_allocations")
        op.execute("DROP FUNCTION offer_summary_gpu_allocations_changed()")
        op.execute(_pg_refresh_function(_PREVIOUS._COLUMNS, _PREVIOUS.summary_select("postgresql", "g.host_id = refreshed_host")))
    else:
        for name in ("insert", "update", "delete"):
            op.execute(f"DROP TRIGGER offer_summary_allocations_{name}")
        for name, (when, body) in _sqlite_triggers(_PREVIOUS._COLUMNS, _PREVIOUS.summary_select, allocations=False).items():
            op.execute(f"DROP TRIGGER {name}")
            op.execute(f"CREATE TRIGGER {name} {when} BEGIN {body} END")
    op.execute("DELETE FROM offer_summary")
    op.execute(f"INSERT INTO offer_summary ({_PREVIOUS._COLUMNS}) {_PREVIOUS.summary_select(dialect, 'g.host_id IS NOT NULL')}")
    # In place (SQLite 3.35+ drops a column itself): batch mode's copy-and-rename of the table would fail on the
    # triggers that name offer_summary while it is gone.
    op.execute("ALTER TABLE offer_summary DROP COLUMN mig_free")
