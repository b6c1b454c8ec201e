"""Helpers for tests that run a real agent: an enrolled state without a master, fast timings,
and a spool wrapper that remembers what the agent wrote."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

from agent.state import AgentState, Identity, atomic_write
from agent.timings import AgentTimings
from shared.crypto import CertificateAuthority
from shared.outbound import FrameStore
from tests.factories import MS
from tests.pki import write_agent_certificate

FAST = AgentTimings(
    sample_interval=20 * MS, telemetry_interval=50 * MS, heartbeat_interval=50 * MS, network_interval=0,
    log_ship_interval=20 * MS, reconnect_base_delay=10 * MS, reconnect_max_delay=50 * MS, open_timeout=2, welcome_timeout=2,
)


def fast_timings() -> AgentTimings:
    """A fresh copy (agents change their timings when a relay welcomes them)."""
    return AgentTimings(**vars(FAST))


def enrolled_state(ca: CertificateAuthority, folder: Path, host_id: str) -> AgentState:
    """An agent data dir as enrollment leaves it: key, certificate from ``ca``, CA, identity."""
    state = AgentState(folder)
    key_file, cert_file = write_agent_certificate(ca, folder, host_id)
    key_file.rename(state.key_file)
    cert_file.rename(state.cert_file)
    atomic_write(state.ca_file, ca.cert_pem)
    state.save_identity(Identity(host_id=host_id, master_url="http://unused"))
    return state


class RecordingStore:
    """Wraps the agent's spool to remember the kind of every frame it was given."""

    def __init__(self, inner: FrameStore) -> None:
        self.inner = inner
        self.added: dict[int, str] = {}

    def add(self, seq: int, kind: str, frame: str) -> None:
        self.added[seq] = kind
        self.inner.add(seq, kind, frame)

    def ack(self, seq: int) -> bool:
        return self.inner.ack(seq)

    def discard_kind(self, kind: str) -> int:
        return self.inner.discard_kind(kind)

    def pending(self) -> Iterator[tuple[int, str]]:
        return self.inner.pending()

    def __len__(self) -> int:
        return len(self.inner)

    @property
    def evicted(self) -> dict[str, int]:
        return self.inner.evicted
