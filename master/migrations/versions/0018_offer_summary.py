"""offer_summary: each host's free GPUs counted by kind, kept by triggers, for the offer search

Revision ID: 0018
Revises: 0017
Create Date: 2026-11-26 09:00:00.000000

``offer_summary`` has one row per host and kind of free GPU (a present GPU that no rental holds and
no share uses), a kind being every per-GPU value the offer search filters or groups on (model,
memory, tier, score, review flag, version keys and the version texts of its info): ``free_gpus``
counts them, and ``kinds`` says how many kinds the host has of that model (almost always one: then
the row alone is the offer, and the search needs no grouping for it). Each row repeats what the
search reads of the host (state, region, reliability, network, isolation) and of its listing (price,
verified, end date, maintenance windows), so ``GET /api/v1/offers`` is one statement over this
narrow table instead of a join of every GPU row. (This relies on READ COMMITTED, the isolation level
every session of the master uses: each statement of the recomputation sees what committed before it.)

Triggers keep it: any insert, delete or relevant update of ``gpus``, ``hosts`` or ``host_listings``
recomputes that host's rows (``DELETE`` + ``INSERT … SELECT``), whatever code path made it: the
ORM, bulk ``UPDATE``s, raw SQL. On PostgreSQL they are deferred constraint triggers that run at
commit, each under a transaction advisory lock of its host, so two transactions changing one host's
GPUs never leave that host's rows stale or doubled (the later commit's recomputation reads the
earlier one's rows and GPUs); consecutive events of one host in one firing recompute it once. On
SQLite (one writer at a time) they run at once. Filled for every host here (the backfill).
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = '0018'
down_revision = '0017'
branch_labels = None
depends_on = None

# pg_advisory_xact_lock(OFFER_LOCK_CLASS, hashtext(host_id)): serialises recomputing one host's rows.
OFFER_LOCK_CLASS = 0x6F66  # "of"

_COLUMNS = (
    "host_id, gpu_name, free_gpus, memory_total_mib, tier, score, needs_review, compute_capability_key, "
    "cuda_version_key, compute_capability, cuda_driver_version, host_state, region, reliability, download_mbps, "
    "upload_mbps, isolated, listed_price, verified, available_until, maintenance_windows, kinds"
)
# The GPU columns a kind is made of; a change to any of them, or to whether the GPU is free, moves it.
_GPU_COLUMNS = (
    "host_id", "name", "memory_total_mib", "tier", "score", "needs_review", "compute_capability_key", "cuda_version_key",
    "present", "rental_id", "milli_used",
)  # fmt: skip
_HOST_COLUMNS = ("state", "region", "reliability")
_HOST_JSON_COLUMNS = ("latest_network", "isolation")


def summary_select(dialect: str, host_filter: str) -> str:
    """``SELECT`` of the summary rows of the hosts ``host_filter`` picks (an SQL condition on ``g.host_id``)."""
    if dialect == "postgresql":
        info = "g.info->>'compute_capability' AS compute_capability, g.info->>'cuda_driver_version' AS cuda_driver_version"
        # What the search compared before (CAST(… ->> …)), for values of the JSON type the agent sends; anything
        # else is unknown (NULL) rather than a cast error that would fail the commit of a hello.
        network = ", ".join(
            f"CASE WHEN json_typeof(h.{column} -> '{key}') = '{kind}' THEN CAST((h.{column} ->> '{key}') AS {sql}) END"
            for column, key, kind, sql in (
                ("latest_network", "download_mbps", "number", "FLOAT"), ("latest_network", "upload_mbps", "number", "FLOAT"),
                ("isolation", "isolated", "boolean", "BOOLEAN"),
            )
        )
        windows = "CASE WHEN json_typeof(l.maintenance_windows) = 'array' THEN " \
                  "CASE WHEN json_array_length(l.maintenance_windows) > 0 THEN l.maintenance_windows END END"  # fmt: skip
        free = "g.present IS TRUE"
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
        free = "g.present = 1"
    kind = (
        "g.host_id, g.name, g.memory_total_mib, g.tier, g.score, g.needs_review, g.compute_capability_key, "
        "g.cuda_version_key, compute_capability, cuda_driver_version"
    )
    return (
        f"SELECT k.host_id, k.name, k.free_gpus, k.memory_total_mib, k.tier, k.score, k.needs_review, "
        f"k.compute_capability_key, k.cuda_version_key, k.compute_capability, k.cuda_driver_version, "
        f"h.state, h.region, h.reliability, {network}, l.price_per_gpu_hour, COALESCE(l.verified, {'false' if dialect == 'postgresql' else '0'}), "
        f"l.available_until, {windows}, count(*) OVER (PARTITION BY k.host_id, k.name) "
        f"FROM (SELECT g.host_id, g.name, count(*) AS free_gpus, g.memory_total_mib, g.tier, g.score, g.needs_review, "
        f"g.compute_capability_key, g.cuda_version_key, {info} FROM gpus AS g "
        f"WHERE {host_filter} AND {free} AND g.rental_id IS NULL AND g.milli_used = 0 GROUP BY {kind}) AS k "
        f"JOIN hosts AS h ON h.id = k.host_id LEFT OUTER JOIN host_listings AS l ON l.host_id = k.host_id"
    )


def _changed(columns: tuple[str, ...], json_columns: tuple[str, ...] = (), *, dialect: str) -> str:
    if dialect == "postgresql":
        plain = [f"OLD.{c} IS DISTINCT FROM NEW.{c}" for c in columns]
        as_text = [f"OLD.{c}::text IS DISTINCT FROM NEW.{c}::text" for c in json_columns]
    else:
        plain = [f"OLD.{c} IS NOT NEW.{c}" for c in (*columns, *json_columns)]
        as_text = []
    return " OR ".join(plain + as_text)


def _upgrade_postgresql() -> None:
    op.execute(
        "CREATE FUNCTION offer_summary_refresh(refreshed_host text) RETURNS void LANGUAGE plpgsql AS $$\n"
        "BEGIN\n"
        "  -- Consecutive events of one host in one firing (the GPUs of a bulk insert or update) recompute it once:\n"
        "  -- a firing runs after the statements it follows, so the first recomputation already saw them all.\n"
        "  IF current_setting('gpumarket.offer_summary_last', true) = refreshed_host || '@' || statement_timestamp()::text THEN\n"
        "    RETURN;\n"
        "  END IF;\n"
        f"  PERFORM pg_advisory_xact_lock({OFFER_LOCK_CLASS}, hashtext(refreshed_host));\n"
        "  DELETE FROM offer_summary WHERE host_id = refreshed_host;\n"
        f"  INSERT INTO offer_summary ({_COLUMNS}) {summary_select('postgresql', 'g.host_id = refreshed_host')};\n"
        "  PERFORM set_config('gpumarket.offer_summary_last', refreshed_host || '@' || statement_timestamp()::text, true);\n"
        "END $$"
    )
    for table, key in (("gpus", "host_id"), ("hosts", "id"), ("host_listings", "host_id")):
        op.execute(
            f"CREATE FUNCTION offer_summary_{table}_changed() RETURNS trigger LANGUAGE plpgsql AS $$\n"
            "BEGIN\n"
            f"  IF TG_OP <> 'INSERT' THEN PERFORM offer_summary_refresh(OLD.{key}); END IF;\n"
            f"  IF TG_OP = 'INSERT' OR (TG_OP = 'UPDATE' AND NEW.{key} IS DISTINCT FROM OLD.{key}) THEN\n"
            f"    PERFORM offer_summary_refresh(NEW.{key});\n"
            "  END IF;\n"
            "  RETURN NULL;\n"
            "END $$"
        )
    deferred = "DEFERRABLE INITIALLY DEFERRED FOR EACH ROW"
    op.execute(f"CREATE CONSTRAINT TRIGGER offer_summary_gpus_rows AFTER INSERT OR DELETE ON gpus {deferred} "
               "EXECUTE FUNCTION offer_summary_gpus_changed()")  # fmt: skip
    op.execute(f"CREATE CONSTRAINT TRIGGER offer_summary_gpus_update AFTER UPDATE ON gpus {deferred} "
               f"WHEN ({_changed(_GPU_COLUMNS, ('info',), dialect='postgresql')}) EXECUTE FUNCTION offer_summary_gpus_changed()")  # fmt: skip
    op.execute(f"CREATE CONSTRAINT TRIGGER offer_summary_hosts_update AFTER UPDATE ON hosts {deferred} "
               f"WHEN ({_changed(_HOST_COLUMNS, _HOST_JSON_COLUMNS, dialect='postgresql')}) EXECUTE FUNCTION offer_summary_hosts_changed()")  # fmt: skip
    op.execute(f"CREATE CONSTRAINT TRIGGER offer_summary_listings AFTER INSERT OR UPDATE OR DELETE ON host_listings {deferred} "
               "EXECUTE FUNCTION offer_summary_host_listings_changed()")  # fmt: skip


def _sqlite_refresh(host: str) -> str:
    return f"DELETE FROM offer_summary WHERE host_id = {host}; INSERT INTO offer_summary ({_COLUMNS}) " \
           f"{summary_select('sqlite', f'g.host_id = {host}')};"  # fmt: skip


def _upgrade_sqlite() -> None:
    triggers = {
        "offer_summary_gpus_insert": ("AFTER INSERT ON gpus", _sqlite_refresh("NEW.host_id")),
        "offer_summary_gpus_delete": ("AFTER DELETE ON gpus", _sqlite_refresh("OLD.host_id")),
        "offer_summary_gpus_update": (
            f"AFTER UPDATE ON gpus WHEN {_changed(_GPU_COLUMNS, ('info',), dialect='sqlite')}",
            _sqlite_refresh("OLD.host_id") + _sqlite_refresh("NEW.host_id"),
        ),
        "offer_summary_hosts_update": (
            f"AFTER UPDATE ON hosts WHEN {_changed(_HOST_COLUMNS, _HOST_JSON_COLUMNS, dialect='sqlite')}",
            _sqlite_refresh("NEW.id"),
        ),
        "offer_summary_listings_insert": ("AFTER INSERT ON host_listings", _sqlite_refresh("NEW.host_id")),
        "offer_summary_listings_update": ("AFTER UPDATE ON host_listings", _sqlite_refresh("OLD.host_id") + _sqlite_refresh("NEW.host_id")),
        "offer_summary_listings_delete": ("AFTER DELETE ON host_listings", _sqlite_refresh("OLD.host_id")),
    }
    for name, (when, body) in triggers.items():
        op.execute(f"CREATE TRIGGER {name} {when} BEGIN {body} END")


def upgrade() -> None:
    op.create_table('offer_summary',
    sa.Column('id', sa.BigInteger().with_variant(sa.Integer(), 'sqlite'), autoincrement=True, nullable=False),
    sa.Column('host_id', sa.String(length=40), nullable=False),
    sa.Column('gpu_name', sa.String(length=255), nullable=False),
    sa.Column('free_gpus', sa.Integer(), nullable=False),
    sa.Column('memory_total_mib', sa.Integer(), nullable=False),
    sa.Column('tier', sa.String(length=16), nullable=True),
    sa.Column('score', sa.Double(), nullable=True),
    sa.Column('needs_review', sa.Boolean(), nullable=False),
    sa.Column('compute_capability_key', sa.Integer(), nullable=True),
    sa.Column('cuda_version_key', sa.Integer(), nullable=True),
    sa.Column('compute_capability', sa.Text(), nullable=True),
    sa.Column('cuda_driver_version', sa.Text(), nullable=True),
    sa.Column('host_state', sa.String(length=16), nullable=False),
    sa.Column('region', sa.String(length=64), nullable=True),
    sa.Column('reliability', sa.Double(), nullable=True),
    sa.Column('download_mbps', sa.Double(), nullable=True),
    sa.Column('upload_mbps', sa.Double(), nullable=True),
    sa.Column('isolated', sa.Boolean(), nullable=True),
    sa.Column('listed_price', sa.Numeric(precision=12, scale=6), nullable=True),
    sa.Column('verified', sa.Boolean(), nullable=False),
    sa.Column('available_until', sa.DateTime(timezone=True), nullable=True),
    sa.Column('maintenance_windows', sa.JSON(), nullable=True),
    sa.Column('kinds', sa.Integer(), nullable=False),
    sa.ForeignKeyConstraint(['host_id'], ['hosts.id'], ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id')
    )
    with op.batch_alter_table('offer_summary') as batch:
        batch.create_index(batch.f('ix_offer_summary_host_id'), ['host_id'], unique=False)
        batch.create_index(batch.f('ix_offer_summary_gpu_name'), ['gpu_name'], unique=False)
        batch.create_index(batch.f('ix_offer_summary_region'), ['region'], unique=False)
        batch.create_index(batch.f('ix_offer_summary_tier'), ['tier'], unique=False)
        batch.create_index(batch.f('ix_offer_summary_compute_capability_key'), ['compute_capability_key'], unique=False)
        batch.create_index('ix_offer_summary_several', ['host_id', 'gpu_name'], unique=False,
                           postgresql_where=sa.text('kinds > 1'), sqlite_where=sa.text('kinds > 1'))
    dialect = op.get_bind().dialect.name
    op.execute(f"INSERT INTO offer_summary ({_COLUMNS}) {summary_select(dialect, 'g.host_id IS NOT NULL')}")
    if dialect == "postgresql":
        _upgrade_postgresql()
    else:
        _upgrade_sqlite()


def downgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        op.execute("DROP TRIGGER offer_summary_listings ON host_listings")
        op.execute("DROP TRIGGER offer_summary_hosts_update ON hosts")
        op.execute("DROP TRIGGER offer_summary_gpus_update ON gpus")
        op.execute("DROP TRIGGER offer_summary_gpus_rows ON gpus")
        for table in ("gpus", "hosts", "host_listings"):
            op.execute(f"DROP FUNCTION offer_summary_{table}_changed()")
        op.execute("DROP FUNCTION offer_summary_refresh(text)")
    else:
        for name in ("gpus_insert", "gpus_delete", "gpus_update", "hosts_update", "listings_insert", "listings_update", "listings_delete"):
            op.execute(f"DROP TRIGGER offer_summary_{name}")
    op.drop_table('offer_summary')
