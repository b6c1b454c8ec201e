"""What this host can run isolated, decided once at start-up, and the check each start passes.

``container`` when a container engine answers (the container runtime probes it and hands its
answer in), ``process`` when each rental can run under a uid of its own (root, with
``unshare`` and ``setpriv``, proven by one real run) — or, only where the provider set
``allow_unisolated_workloads``, as the agent's own user — and ``hold`` always. The result
is the hello's ``IsolationFacts``; ``check_workload_allowed`` refuses the rest with
``workload_not_isolated`` and says what the provider can do about it.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Literal

from agent.runtimes.base import host_capacity
from agent.runtimes.netguard import DEFAULT_PROCESS_POOL, EgressPolicy, NetGuardStatus, install_guard
from agent.runtimes.procnet import NetworkCheck, RentalNetworks
from agent.runtimes.users import (
    DEFAULT_RENTALS_ROOT,
    DEFAULT_UID_MAX,
    DEFAULT_UID_MIN,
    ENV_FD,
    TRUSTED_PATH,
    IsolationTools,
    RentalUser,
    RentalUsers,
    check_uid_range,
    environment_fd,
    isolated_argv,
)
from shared.errors import BadRequest, ConfigError
from shared.protocol import ImagePolicyModel, IsolationFacts
from shared.protocol.bodies import WorkloadKindName

ROOT_HINT = "run as root for per-rental users"
UNISOLATED_HINT = "or set allow_unisolated_workloads to run them as the agent's own user"


@dataclass(frozen=True, slots=True)
class ProcessIsolation:
    """Whether ``process`` workloads can run under uids of their own here, and why (not)."""

    mode: Literal["uid", "none"]
    reason: str
    tools: IsolationTools | None = None


def process_isolation(*, euid: int, tools: IsolationTools | str) -> ProcessIsolation:
    """The decision from its inputs: the agent's effective uid and the tools found (or why not)."""
    if euid != 0:
        return ProcessIsolation("none", f"not root (uid {euid}), so it cannot switch users")
    if isinstance(tools, str):
        return ProcessIsolation("none", tools)
    return ProcessIsolation("uid", "each process rental runs under a uid of its own", tools)


def detect_process_isolation(*, probe_uid: int, timeout: float = 10.0) -> ProcessIsolation:
    """``process_isolation`` for this host, proven by running ``true`` once through the whole chain
    (a network namespace of its own, namespaces, private mounts, ``setpriv``) as ``probe_uid``.
    Blocking, up to ``timeout`` seconds."""
    found = process_isolation(euid=os.geteuid(), tools=IsolationTools.find())
    if found.tools is None:
        return found
    try:
        networks = RentalNetworks(uid_min=probe_uid - 1, uid_max=probe_uid)
    except ConfigError as exc:
        return ProcessIsolation("none", str(exc))
    user = RentalUser("probe", probe_uid, probe_uid, home=Path("/"))
    env_fd = environment_fd({"PATH": TRUSTED_PATH})
    try:
        with networks.probe(egress=False) as netns:
            # The environment goes in on stdin and the shell moves it to ENV_FD, as spawn() does with posix_spawn.
            chain = isolated_argv(user, found.tools, "/bin/true", [], netns=netns)
            argv = ["/bin/sh", "-c", f'exec {ENV_FD}<&0 0</dev/null; exec "$@"', "gpumarket-probe", *chain]
            probe = subprocess.run(
                argv, env={"PATH": TRUSTED_PATH}, cwd="/", stdin=env_fd, capture_output=True, timeout=timeout, check=False
            )
    except (OSError, BadRequest, subprocess.TimeoutExpired) as exc:
        return ProcessIsolation("none", f"uid isolation does not work here: {exc}")
    finally:
        os.close(env_fd)
    if probe.returncode != 0:
        detail = probe.stderr.decode(errors="replace").strip().splitlines()
        return ProcessIsolation("none", f"uid isolation does not work here (exit {probe.returncode}: {detail[-1] if detail else 'no message'})")
    return found


def isolation_facts(
    process: ProcessIsolation,
    *,
    container_engine: str | None,
    allow_unisolated: bool,
    image_policy: ImagePolicyModel | None = None,
    capacity: tuple[float, int] | None = None,
    network: RentalNetworkFacts | None = None,
) -> IsolationFacts:
    """What this host runs and how isolated, for the hello and for ``check_workload_allowed``.

    ``network`` is the guard and the self-test (``None``: not yet known): a host that runs renters'
    code is ``isolated`` only once its guard is in place and the test passed."""
    kinds: list[WorkloadKindName] = []
    missing: list[str] = []
    if container_engine:
        kinds.append("container")
    else:
        missing.append("container workloads are refused: no container engine answers (install docker or podman)")
    if process.mode == "uid":
        kinds.append("process")
    elif allow_unisolated:
        kinds.append("process")
        missing.append(f"process workloads run as the agent's own user (allow_unisolated_workloads): {process.reason}")
    else:
        missing.append(f"process workloads are refused: {process.reason} ({ROOT_HINT}, {UNISOLATED_HINT})")
    kinds.append("hold")
    runs_code = "container" in kinds or "process" in kinds
    if network is None:
        network_ok = False
        if runs_code:
            missing.append("the rentals' network guard is not yet in place")
    else:
        network_ok = network.proven
        if runs_code and not network_ok:
            missing.append(network.why_not)
    return IsolationFacts(
        kinds=kinds,
        isolated=(process.mode == "uid" or not allow_unisolated) and (network_ok or not runs_code),
        container_engine=container_engine,
        process_isolation=process.mode,
        reason="; ".join(missing)[:1024],
        image_policy=image_policy or ImagePolicyModel(),
        max_cpu_cores=None if capacity is None else capacity[0],
        max_memory_mib=None if capacity is None else capacity[1],
        network_guard=network is not None and network.guard.active,
        egress_allow=[] if network is None else list(network.guard.policy.allow),
        network_check="" if network is None or network.check is None else network.check.line,
    )


async def prove_rental_network(policy: EgressPolicy | None, users: RentalUsers | None) -> RentalNetworkFacts:
    """Put the network guard in place for ``policy`` and, as root, self-test it from a rental's namespace
    (``users``' networks, or a probe's where process rentals are off). Never raises: says why not instead."""
    guard = await install_guard(policy=policy)
    if not guard.active or os.geteuid() != 0:
        return RentalNetworkFacts(guard)  # not root: root's `gpumarket agent netguard` tested it (its marker)
    try:
        networks = users.networks if users is not None else RentalNetworks(uid_min=DEFAULT_UID_MAX - 1, uid_max=DEFAULT_UID_MAX)
    except ConfigError as exc:
        return RentalNetworkFacts(guard, NetworkCheck(False, f"network self-test could not run: {exc}"))
    return RentalNetworkFacts(guard, await asyncio.to_thread(networks.check))


def check_workload_allowed(kind: WorkloadKindName, facts: IsolationFacts) -> None:
    """Raise ``BadRequest`` (``workload_not_isolated``) when this host does not run ``kind`` workloads."""
    if kind in facts.kinds:
        return
    why = next((part for part in facts.reason.split("; ") if part.startswith(kind)), facts.reason)
    raise BadRequest(f"this host cannot run {kind} workloads isolated: {why}", code="workload_not_isolated")


def isolation_summary(facts: IsolationFacts, *, who: str = "this agent") -> str:
    """One line: which workloads ``who`` runs, and why the others are refused or unisolated."""
    kinds = " and ".join(facts.kinds) if len(facts.kinds) <= 2 else ", ".join(facts.kinds[:-1]) + " and " + facts.kinds[-1]
    line = f"{who} run{'s' if not who.endswith('s') else ''} {kinds} workloads"
    return f"{line}; {facts.reason}" if facts.reason else line


@dataclass(frozen=True, slots=True)
class RentalNetworkFacts:
    """The rentals' network as the agent found it: the guard (``netguard.install_guard``) and the
    self-test from a rental's namespace (``procnet.RentalNetworks.check``; ``None`` where the agent
    is not root and root's ``gpumarket agent netguard`` ran it)."""

    guard: NetGuardStatus
    check: NetworkCheck | None = None

    @property
    def proven(self) -> bool:
        return self.guard.active and (self.check is None or self.check.passed)

    @property
    def why_not(self) -> str:
        if not self.guard.active:
            return f"rentals' network guard off: {self.guard.reason}"
        return self.check.line if self.check is not None else ""


@dataclass(frozen=True, slots=True)
class HostIsolation:
    """What the agent decided at start-up: the facts it reports, and the rental users when it has them."""

    facts: IsolationFacts
    users: RentalUsers | None = None
    process: ProcessIsolation | None = None  # None: facts given as they are (tests)
    allow_unisolated: bool = False
    network: RentalNetworkFacts | None = None

    def with_container_engine(self, engine: str | None, *, note: str = "") -> HostIsolation:
        """The same decision once the container engine answered (``engine``: ``"docker 24.0.7"``, or
        ``None``); ``note`` (the network guard being off, say) joins the facts' reason."""
        if self.process is None:
            return self
        facts = isolation_facts(
            self.process, container_engine=engine, allow_unisolated=self.allow_unisolated, image_policy=self.facts.image_policy,
            capacity=None if self.facts.max_cpu_cores is None or self.facts.max_memory_mib is None
            else (self.facts.max_cpu_cores, self.facts.max_memory_mib),
            network=self.network,
        )
        if note:
            facts = facts.model_copy(update={"reason": "; ".join(filter(None, [facts.reason, note]))[:1024]})
        return replace(self, facts=facts)

    def with_network(self, network: RentalNetworkFacts) -> HostIsolation:
        """The same decision once the rentals' network guard is in place (or not) and self-tested; process
        rentals get a guarded veth from then on."""
        if self.users is not None:
            self.users.networks.egress = network.guard.active
        updated = replace(self, network=network)
        return updated.with_container_engine(self.facts.container_engine) if self.process is not None else updated


def host_isolation(
    *,
    allow_unisolated: bool,
    container_engine: str | None,
    rentals_root: Path = DEFAULT_RENTALS_ROOT,
    uid_min: int = DEFAULT_UID_MIN,
    uid_max: int = DEFAULT_UID_MAX,
    image_policy: ImagePolicyModel | None = None,
    process: ProcessIsolation | None = None,
    private_dirs: Sequence[Path] = (),
    process_pool: str = DEFAULT_PROCESS_POOL,
) -> HostIsolation:
    """Decide this host's isolation: ``process`` (default: ``detect_process_isolation``) and, when
    it allows uids, the rentals root made ready — or, if that cannot be, no uid isolation and why.
    ``private_dirs`` (the agent's data dir) may not hold the rentals root. Blocking (the probe);
    call it once at start-up."""
    check_uid_range(uid_min, uid_max)
    root = rentals_root.resolve()
    for private in private_dirs:
        if root.is_relative_to(private.resolve()):
            raise ConfigError(f"the rentals root {rentals_root} lies inside {private}, which rentals must not reach; set rentals_root elsewhere")
    if process is None:
        process = detect_process_isolation(probe_uid=uid_max)
    users = None
    if process.mode == "uid" and process.tools is not None:
        try:
            users = RentalUsers(rentals_root, process.tools, uid_min=uid_min, uid_max=uid_max, process_pool=process_pool)
            users.prepare()
        except (ConfigError, OSError) as exc:
            process, users = ProcessIsolation("none", f"process rentals cannot be set up: {exc}"), None
    facts = isolation_facts(
        process, container_engine=container_engine, allow_unisolated=allow_unisolated, image_policy=image_policy, capacity=host_capacity()
    )
    return HostIsolation(facts, users, process, allow_unisolated)
