"""What the agent keeps on disk: its key and certificate, its identity, and its sequence lease.

Layout of the data dir::

    key.pem        the host's private key (0600; never leaves the host)
    key.next.pem   a renewal's fresh key, until its certificate is installed (then it becomes key.pem)
    key.prev.pem   the key key.pem replaced at the last renewal, kept until the next one (see ``opening_keys``)
    cert.pem       client certificate from the master's CA (the host's identity)
    ca.pem         the CA that relays' certificates must chain to
    identity.json  host id, master URL, relay URLs
    seq.lease      the first sequence number not yet handed out, in leased blocks
    work/          one folder per rental (its output log; scratch of unisolated workloads)

Nothing here is for anyone but the agent: the folder is 0700 and every file the agent
writes 0600 (``atomic_write`` here defaults to it), so a renter's workload — which runs
under a uid of its own — can read none of it (``AgentState.secure`` also tightens the
modes an older agent left).
"""

from __future__ import annotations

import contextlib
import json
import os
import stat
from dataclasses import asdict, dataclass, field
from pathlib import Path

from cryptography.hazmat.primitives.asymmetric import ec

from shared.crypto import load_private_key
from shared.errors import ConfigError
from shared.files import atomic_write as _atomic_write

__all__ = ["AgentState", "Identity", "SequenceLease", "atomic_write"]


def atomic_write(path: Path, data: bytes, *, mode: int = 0o600) -> None:
    """``shared.files.atomic_write``, private to the agent unless told otherwise."""
    _atomic_write(path, data, mode=mode)


def make_private(folder: Path) -> None:
    """Create ``folder`` (0700) or tighten it to 0700, and its files to 0600 and sub-folders to 0700."""
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.chmod(folder, 0o700)
    for entry in os.scandir(folder):
        with contextlib.suppress(OSError):
            mode = stat.S_IMODE(entry.stat(follow_symlinks=False).st_mode)
            if entry.is_dir(follow_symlinks=False) and mode & 0o077:
                os.chmod(entry.path, 0o700)
            elif entry.is_file(follow_symlinks=False) and mode & 0o077:
                os.chmod(entry.path, 0o600)


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
        self.next_key_file = data_dir / "key.next.pem"
        self.previous_key_file = data_dir / "key.prev.pem"
        self.cert_file = data_dir / "cert.pem"
        self.ca_file = data_dir / "ca.pem"
        self.identity_file = data_dir / "identity.json"
        self.lease_file = data_dir / "seq.lease"
        self.work_dir = data_dir / "work"

    def opening_keys(self) -> list[ec.EllipticCurvePrivateKey]:
        """The private keys a secret sealed to this host may be sealed to, in the order to try them: the current
        key, a renewal's pending key (the master seals to a certificate it signed before this agent installed it),
        then the key the last renewal replaced (a delivery sealed just before the master signed the renewal).
        Read from disk each time, kept nowhere else."""
        files = (self.key_file, self.next_key_file, self.previous_key_file)
        return [load_private_key(path.read_bytes()) for path in files if path.exists()]

    def secure(self) -> None:
        """Make the data dir and the work dir the agent's alone (0700; their files 0600)."""
        make_private(self.dir)
        make_private(self.work_dir)

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
