"""What the agent keeps on disk: its key and certificate, its identity, and its sequence lease.

Layout of the data dir::

    key.pem        the host's private key (0600; never leaves the host)
    cert.pem       client certificate from the master's CA (the host's identity)
    ca.pem         the CA that relays' certificates must chain to
    identity.json  host id, master URL, relay URLs
    seq.lease      the first sequence number not yet handed out, in leased blocks
    work/          one folder per rental (logs, scratch)
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from shared.errors import ConfigError
from shared.files import atomic_write

__all__ = ["AgentState", "Identity", "SequenceLease", "atomic_write"]


@dataclass
class Identity:
    host_id: str
    master_url: str
    relay_urls: list[str] = field(default_factory=list)
    gpus: str | None = None  # the backend spec it enrolled with (informational)


class AgentState:
    def __init__(self, data_dir: Path) -> None:
        self.dir = data_dir
        self.key_file = data_dir / "key.pem"
        self.cert_file = data_dir / "cert.pem"
        self.ca_file = data_dir / "ca.pem"
        self.identity_file = data_dir / "identity.json"
        self.lease_file = data_dir / "seq.lease"
        self.work_dir = data_dir / "work"

    @property
    def enrolled(self) -> bool:
        return self.identity_file.exists() and self.cert_file.exists() and self.key_file.exists()

    def identity(self) -> Identity:
        if not self.enrolled:
            raise ConfigError(
                f"this agent is not enrolled (no identity in {self.dir}); run "
                "`gpumarket agent enroll --master URL --token TOKEN` with a token from the console"
            )
        try:
            return Identity(**json.loads(self.identity_file.read_text()))
        except (ValueError, TypeError) as exc:
            raise ConfigError(f"{self.identity_file} is damaged ({exc}); enroll again with a new token") from None

    def save_identity(self, identity: Identity) -> None:
        atomic_write(self.identity_file, json.dumps(asdict(identity), indent=2).encode())


class SequenceLease:
    """Hands out sequence numbers that are never reused, even after a crash.

    The file holds an upper bound; numbers below it may have been used. On start
    we continue from that bound and lease the next ``block`` numbers by writing a
    new bound *before* using any of them. A crash loses at most a block of unused
    numbers (a gap, which is harmless), never reuses one.
    """

    def __init__(self, path: Path, *, block: int = 1000) -> None:
        self.path = path
        self.block = block
        try:
            self.start = int(path.read_text().strip() or 0)
        except FileNotFoundError:
            self.start = 0
        except ValueError:
            raise ConfigError(f"{path} is damaged; delete it only if the host is re-enrolled") from None
        self.limit = self.start
        self.reserve_through(self.start)

    def reserve_through(self, seq: int) -> None:
        """Make sure ``seq`` is covered by the lease on disk."""
        if seq < self.limit:
            return
        self.limit = seq + self.block
        atomic_write(self.path, str(self.limit).encode())
