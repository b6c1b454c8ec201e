"""Clusters: gang placement's speed at 10,000 hosts, and its effect on the Alibaba trace, each beside a baseline.

Speed: a synthetic fleet of ``--hosts`` hosts (8 GPUs each, four models, ``--regions`` regions, every host
with a random number of its GPUs already taken, seeded) in a ``Fleet`` kept across decisions. ``--decisions``
cluster requests (2–4 nodes of 1, 2 or 4 whole GPUs each, seeded) are placed with ``place_gang`` (the
``--algorithm`` placer, a region and model per cluster, no RTTs); beside them, in the same run and on the
same fleet, the baseline: as many single-node placements of the same member requests by the plain
placer (``Placer.place``, its scores kept across decisions). Each decision is timed alone
(``perf_counter_ns``); what it chose is applied and then released, so the fleet changes as a master's
does but stays at its starting fill. Figures: decisions per second (decisions / their summed time) and
the p50 and p99 of one decision, with the ratio gang / baseline.

Trace: ``master.scheduler.gang_simulate`` on the trace's 1,213 GPU hosts in 4 regions: the tasks asking
for an even number ≥ 2 of whole GPUs become 2-node clusters, replayed to 100 % arrived demand with
``place_gang`` (gang) and with the nodes placed one at a time and rolled back (the baseline), per
``--traces`` × ``--algorithms`` × ``--seeds``: clusters placed (% of those arrived), clusters split
across regions, GPU allocation % and fragmentation % (FGD's amount), means over the seeds. Skipped,
saying so, when the trace is not beside the checkout (``--trace-dir``).

Tunnel: throughput between two members of a cluster through their private network (``agent.cluster.net``:
userspace WireGuard, ``wireguard-go``), beside a direct TCP copy between the same two network namespaces in the
same run. Two busybox containers (the suite's local image, ``tests/dockerengine.py``), each on a Docker network of
its own as the agent gives each rental, both also on one shared bridge network for the baseline, joined to one
cluster by ``ClusterNetworks`` (phase 1, then the peers member after member). The copy is the same code for both
paths: a socket made inside member B's namespace listens, a socket made inside member A's namespace connects
(``agent.runtimes.netns.socket_in_namespace``, from this process) to B's tunnel address or to B's address on the
shared bridge, and ``--tunnel-mib`` MiB go A → B, timed from the first byte sent until B has said (with a token:
a connection that succeeds proves nothing on a network with a transparent proxy) that it has them all;
``--tunnel-runs`` runs per path, interleaved, after a 1 MiB warm-up each. Figures: the median run's MB/s (10^6
bytes) for both and the ratio. Needs root, ``wireguard-go`` and a Docker engine; without them it prints "not
measured (why)" and records nothing. ``--quick`` leaves it out unless ``--tunnel``.

Links: gang placement of a 4-node cluster (1 GPU per node) over one group of ``--link-groups`` free
hosts (one region and model) with measured links between them (``host_links.placement_rtt``, as
``cluster_placement`` hands them to ``place_gang``): 1 % of the pairs measured, then every pair, each
without bounds and with ``max_latency_ms`` 5, beside the same group with no link known (no RTT work).
Round trips are uniform in 0.1–10 ms (seeded); the mean of 3 decisions.

Usage: ``python bench/bench_clusters.py [--hosts 10000] [--decisions 2000] [--algorithm fgd_net]
[--traces default,multigpu50] [--algorithms fgd_net,best_fit] [--seeds 42-46] [--skip-trace]
[--skip-speed] [--link-groups 100,300,1000] [--skip-links] [--skip-tunnel] [--tunnel] [--tunnel-mib 64] [--tunnel-runs 3] [--quick]``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import re
import secrets
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any
from urllib.parse import quote

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import describe_machine, parse_seeds, quantile, record

from master.scheduler import MILLI, Fleet, Gpu, Node, Request, get_placer
from master.scheduler.gang import place_gang
from master.scheduler.gang_simulate import MODES, ClusterResult, simulate_clusters
from master.scheduler.trace import load_nodes, load_pods
from master.services import host_links

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # the test image's builder, tests/dockerengine.py (the tunnel part)
TRACE_DIR = REPO.parent / "shared" / "alibaba-gpu-v2023" / "csv"
MODELS = ("A100", "H100", "L40S", "RTX4090")
GPUS_PER_HOST = 8


# ---- speed -----------------------------------------------------------------------------------------


def build_fleet(hosts: int, *, regions: int, seed: int) -> Fleet:
    """``hosts`` hosts of 8 GPUs, each with a random number (0–8) of its GPUs taken, spread over models and regions."""
    rng = random.Random(seed)
    nodes = []
    for i in range(hosts):
        free = rng.randint(0, GPUS_PER_HOST)
        gpus = [Gpu(g, uuid=f"h{i}-g{g}", milli_free=MILLI if g < free else 0) for g in range(GPUS_PER_HOST)]
        nodes.append(
            Node(
                f"host-{i:05d}", rng.choice(MODELS), gpus, cpu_milli=128_000, memory_mib=1_048_576,
                cpu_milli_free=128_000 * free // GPUS_PER_HOST, memory_mib_free=1_048_576 * free // GPUS_PER_HOST,
                region=f"r{rng.randrange(regions)}",
            )
        )  # fmt: skip
    return Fleet(nodes)


def cluster_requests(decisions: int, *, seed: int) -> list[tuple[Request, int]]:
    """(member request, node count) per decision: 2–4 nodes of 1, 2 or 4 GPUs of one model."""
    rng = random.Random(seed + 1)
    requests = []
    for _ in range(decisions):
        gpus = rng.choice((1, 2, 4))
        member = Request(
            num_gpu=gpus,
            cpu_milli=8_000 * gpus,
            memory_mib=65_536 * gpus,
            gpu_models=frozenset({rng.choice(MODELS)}),
        )
        requests.append((member, rng.randint(2, 4)))
    return requests


def time_decisions(
    fleet: Fleet, requests: list[tuple[Request, int]], algorithm: str, *, gang: bool
) -> dict[str, float]:
    """Time one decision per request (gang: the cluster; else one node of it), each applied then released."""
    placer = get_placer(algorithm, seed=1)
    times: list[int] = []
    placed = 0
    for member, count in requests:
        started = time.perf_counter_ns()
        if gang:
            placements = place_gang(member, count, fleet, placer=placer) or []
        else:
            single = placer.place(member, fleet)
            placements = [] if single is None else [single]
        times.append(time.perf_counter_ns() - started)
        placed += bool(placements)
        for placement in placements:
            fleet.apply(placement)
        for placement in placements:
            fleet.release(placement)
    total_s = sum(times) / 1e9
    return {
        "per_s": len(times) / total_s if total_s else 0.0,
        "p50_ms": quantile(times, 0.5) / 1e6,
        "p99_ms": quantile(times, 0.99) / 1e6,
        "placed": placed,
    }


def run_speed(hosts: int, decisions: int, algorithm: str, regions: int) -> None:
    fleet = build_fleet(hosts, regions=regions, seed=7)
    requests = cluster_requests(decisions, seed=7)
    free = sum(node.full for node in fleet)
    print(f"\nSpeed: {hosts:,} hosts ({hosts * GPUS_PER_HOST:,} GPUs, {free:,} free), {regions} regions, "
          f"{decisions:,} decisions, {algorithm}")  # fmt: skip
    baseline = time_decisions(fleet, requests, algorithm, gang=False)
    gang = time_decisions(fleet, requests, algorithm, gang=True)
    print(f"  {'':34} {'decisions/s':>12} {'p50 ms':>9} {'p99 ms':>9} {'placed':>8}")
    for name, figures in (
        ("gang placement (place_gang)", gang),
        ("single-node placement (baseline)", baseline),
    ):
        print(f"  {name:34} {figures['per_s']:12,.0f} {figures['p50_ms']:9.3f} {figures['p99_ms']:9.3f} "
              f"{figures['placed']:8,.0f}")  # fmt: skip
    ratio = gang["per_s"] / baseline["per_s"] if baseline["per_s"] else float("nan")
    print(f"  ratio gang / baseline: {ratio:.3f}× the decisions per second, "
          f"p99 {gang['p99_ms'] / baseline['p99_ms']:.1f}× as long")  # fmt: skip
    fleet_name = f"{hosts:,} hosts"
    record("clusters", f"gang placement decisions at {fleet_name} ({algorithm})", round(gang["per_s"], 1),
           "decisions/s", "single-node placements, same placer and fleet", round(baseline["per_s"], 1))  # fmt: skip
    record("clusters", f"gang placement p99 decision at {fleet_name} ({algorithm})", round(gang["p99_ms"], 3), "ms",
           "single-node placement p99", round(baseline["p99_ms"], 3))  # fmt: skip


# ---- links ------------------------------------------------------------------------------------------


def run_links(sizes: Sequence[int], algorithm: str, *, repeats: int = 3) -> None:
    """Time gang decisions over one group of free hosts whose pairs are partly or wholly measured."""
    print(f"\nLinks: a 4-node cluster over one group of free hosts with measured round trips, {algorithm}, mean of {repeats}")
    print(f"  {'hosts':>6} {'measured':>9} {'links':>8} {'no links ms':>12} {'no bounds ms':>13} {'≤ 5 ms ms':>10}")
    member = Request(num_gpu=1, cpu_milli=8_000, memory_mib=65_536, gpu_models=frozenset({MODELS[0]}))
    for size in sizes:
        fleet = Fleet([
            Node(f"h-{i:05d}", MODELS[0], [Gpu(g, uuid=f"h{i}-g{g}", milli_free=MILLI) for g in range(GPUS_PER_HOST)],
                 cpu_milli=128_000, memory_mib=1_048_576, cpu_milli_free=128_000, memory_mib_free=1_048_576, region="r0")
            for i in range(size)
        ])  # fmt: skip
        ids = [node.node_id for node in fleet]
        for share in (0.01, 1.0):
            rng = random.Random(size)
            links = {
                (a, b): host_links.Figures(rtt_ms=round(rng.uniform(0.1, 10), 3))
                for i, a in enumerate(ids) for b in ids[i + 1 :] if rng.random() < share
            }  # fmt: skip
            timings = []
            for bounds, known in ((host_links.NetworkBounds(), {}), (host_links.NetworkBounds(), links),
                                  (host_links.NetworkBounds(max_latency_ms=5), links)):  # fmt: skip
                rtt_ms, max_rtt_ms = host_links.placement_rtt(known, bounds, str)
                started = time.perf_counter_ns()
                for _ in range(repeats):
                    placements = place_gang(member, 4, fleet, placer=get_placer(algorithm, seed=1), rtt_ms=rtt_ms, max_rtt_ms=max_rtt_ms)
                    assert placements is not None
                timings.append((time.perf_counter_ns() - started) / repeats / 1e6)
            print(f"  {size:6,} {share:9.0%} {len(links):8,} {timings[0]:12.1f} {timings[1]:13.1f} {timings[2]:10.1f}")


# ---- trace -----------------------------------------------------------------------------------------


def run_trace(
    trace_dir: Path, traces: Sequence[str], algorithms: Sequence[str], seeds: Sequence[int]
) -> None:
    node_file = trace_dir / "openb_node_list_gpu_node.csv"
    if not node_file.exists():
        print(f"\nTrace: skipped, no {node_file} (--trace-dir)")
        return
    nodes = load_nodes(node_file)
    print(f"\nTrace: {len(nodes):,} GPU hosts in 4 regions, clusters = the tasks asking an even number ≥ 2 of "
          f"whole GPUs, as 2 nodes of half; 100 % arrived demand; means over seeds {seeds[0]}–{seeds[-1]}")  # fmt: skip
    header = f"  {'trace':12} {'algorithm':10} {'mode':14} {'clusters':>9} {'placed %':>9} {'split':>7} " \
             f"{'alloc %':>8} {'frag %':>7}"  # fmt: skip
    print(header)
    for trace in traces:
        pods = [pod.request for pod in load_pods(trace_dir / f"openb_pod_list_{trace}.csv")]
        for algorithm in algorithms:
            means: dict[str, dict[str, float]] = {}
            for mode in MODES:
                runs: list[ClusterResult] = [
                    simulate_clusters(nodes, pods, algorithm=algorithm, mode=mode, seed=seed)
                    for seed in seeds
                ]
                means[mode] = {
                    "clusters": statistics.fmean(r.clusters for r in runs),
                    "placed": statistics.fmean(100 * r.clusters_placed / max(r.clusters, 1) for r in runs),
                    "split": statistics.fmean(r.clusters_split for r in runs),
                    "alloc": statistics.fmean(r.allocated_pct for r in runs),
                    "frag": statistics.fmean(r.fragmented_pct for r in runs),
                }
                m = means[mode]
                print(f"  {trace:12} {algorithm:10} {mode:14} {m['clusters']:9.1f} {m['placed']:9.2f} "
                      f"{m['split']:7.1f} {m['alloc']:8.2f} {m['frag']:7.2f}")  # fmt: skip
            gang, base = means["gang"], means["one_at_a_time"]
            print(f"  {'':12} {'':10} {'gang − base':14} {'':9} {gang['placed'] - base['placed']:+9.2f} "
                  f"{gang['split'] - base['split']:+7.1f} {gang['alloc'] - base['alloc']:+8.2f} "
                  f"{gang['frag'] - base['frag']:+7.2f}")  # fmt: skip
            record("clusters", f"{trace} trace, {algorithm}: clusters placed", round(gang["placed"], 2), "%",
                   "nodes one at a time, rolled back", round(base["placed"], 2))  # fmt: skip
            record("clusters", f"{trace} trace, {algorithm}: GPU allocation at 100 % arrived", round(gang["alloc"], 2),
                   "%", "nodes one at a time, rolled back", round(base["alloc"], 2))  # fmt: skip


# ---- tunnel -----------------------------------------------------------------------------------------

TUNNEL_PORT = 29600
JUMBO_MTU = 8920  # a 9000-byte frame less WireGuard's 80 bytes
CHUNK = 1 << 20


def tunnel_unavailable() -> str | None:
    """Why the tunnel part cannot run on this machine; ``None``: it can."""
    if os.geteuid() != 0:
        return "not root: wireguard-go makes a TUN device and the copy enters the containers' namespaces"
    if shutil.which("wireguard-go") is None:
        return "wireguard-go is not installed (make docker, or apt-get install wireguard-go)"
    if not os.path.exists("/dev/net/tun"):
        return "no /dev/net/tun"
    from tests import dockerengine

    why = dockerengine.ping()
    return None if why is None else f"no Docker engine answers ({why})"


def _engine(method: str, path: str, payload: dict[str, Any] | None = None) -> Any:
    from tests import dockerengine

    body = json.dumps(payload).encode() if payload is not None else None
    status, answer = dockerengine.request(method, path, body=body, headers={"Content-Type": "application/json"})
    if status >= 300:
        raise RuntimeError(f"{method} {path}: the engine answered {status}: {answer[:300]!r}")
    return json.loads(answer) if answer.strip() else None


def _start_member(name: str, shared: str, image: str, owner: str) -> None:
    """A container on a network of its own (as the agent gives each rental), connected to ``shared`` too."""
    labels = {"gpumarket.owner": owner}
    _engine("POST", "/networks/create", {"Name": name, "Driver": "bridge", "Labels": labels})
    _engine("POST", f"/containers/create?name={quote(name)}",
            {"Image": image, "Cmd": ["sleep", "100000"], "Labels": labels, "HostConfig": {"NetworkMode": name}})  # fmt: skip
    _engine("POST", f"/networks/{quote(shared)}/connect", {"Container": name})
    _engine("POST", f"/containers/{quote(name)}/start")


def _timed_copy(sender: socket.socket, listener: socket.socket, size: int) -> float:
    """Seconds from the first of ``size`` bytes sent on ``sender`` until the one connection ``listener`` accepts has
    answered that it read them all (with a token of this run: the answer is our receiver's, not a proxy's)."""
    token = secrets.token_bytes(16)
    answer: list[bytes] = []

    def receive() -> None:
        connection, _ = listener.accept()
        with connection:
            connection.settimeout(120)
            buffer = bytearray(CHUNK)
            got = 0
            while read := connection.recv_into(buffer):
                got += read
            connection.sendall(token + got.to_bytes(8, "big"))
            answer.append(b"sent")

    receiver = threading.Thread(target=receive, name="tunnel-bench-receiver", daemon=True)
    receiver.start()
    chunk = memoryview(bytes(CHUNK))
    started = time.perf_counter()
    sent = 0
    while sent < size:
        sent += sender.send(chunk[: min(CHUNK, size - sent)])
    sender.shutdown(socket.SHUT_WR)
    reply = b""
    while len(reply) < 24 and (part := sender.recv(24 - len(reply))):
        reply += part
    elapsed = time.perf_counter() - started
    receiver.join(timeout=30)
    if reply != token + size.to_bytes(8, "big") or not answer:
        raise RuntimeError(f"the receiver did not confirm {size:,} bytes (answer {reply!r}): the copy did not reach it")
    return elapsed


async def _copy_once(pid_a: int, pid_b: int, address: str, size: int) -> float:
    """One copy of ``size`` bytes from a socket in ``pid_a``'s namespace to a listener in ``pid_b``'s, via ``address``."""
    from agent.runtimes.netns import socket_in_namespace

    def listen() -> socket.socket:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("0.0.0.0", TUNNEL_PORT))
        sock.listen(1)
        return sock

    listener = await socket_in_namespace(pid_b, listen, name="bench-listen")
    try:
        listener.setblocking(True)
        listener.settimeout(60)
        sender = await socket_in_namespace(pid_a, lambda: socket.create_connection((address, TUNNEL_PORT), timeout=15), name="bench-send")
        with sender:
            sender.setblocking(True)
            sender.settimeout(120)
            return await asyncio.to_thread(_timed_copy, sender, listener, size)
    finally:
        listener.close()


async def measure_tunnel(mib: int, runs: int) -> dict[str, list[float]]:
    """MB/s of each run through the tunnel and directly, between two members' namespaces (see the module's docstring)."""
    from agent.cluster.net import ClusterNetworks, device_name
    from shared import protocol
    from tests import dockerengine

    image = await asyncio.to_thread(dockerengine.busybox_image)
    tag = secrets.token_hex(3)
    owner = f"bench-cnet-{tag}"
    shared = f"gm-bench-cnet-{tag}-shared"
    members = [f"gm-bench-cnet-{tag}-a", f"gm-bench-cnet-{tag}-b"]

    async def namespace(rental_id: str) -> tuple[int, Path] | None:
        info = await asyncio.to_thread(_engine, "GET", f"/containers/{quote(rental_id)}/json")
        return (info["State"]["Pid"], Path(info["HostsPath"])) if info["State"].get("Running") else None

    work = Path(tempfile.mkdtemp(prefix="gpumarket-bench-clusternet-"))
    bridge = f"gmbfab{tag}"  # the "fabric": a bridge (a veth in it for its carrier), as a provider's private network
    octet = 16 + secrets.randbelow(200)
    fabric = protocol.FabricDeclaration(name="bench-fabric", parent=bridge, subnet=f"10.251.{octet}.0/24")
    networks = ClusterNetworks(work, namespace, lambda: "127.0.0.1", fabric=fabric)
    try:
        for ip_args in (("add", bridge, "type", "bridge"), ("add", f"{bridge}c", "type", "veth", "peer", "name", f"{bridge}p"),
                     ("set", f"{bridge}p", "master", bridge), ("set", bridge, "up"), ("set", f"{bridge}p", "up"), ("set", f"{bridge}c", "up")):
            await asyncio.to_thread(subprocess.run, ["ip", "link", *ip_args], check=True, capture_output=True, timeout=10)
        await asyncio.to_thread(_engine, "POST", "/networks/create", {"Name": shared, "Driver": "bridge", "Labels": {"gpumarket.owner": owner}})
        for name in members:
            await asyncio.to_thread(_start_member, name, shared, image, owner)
        subnet = f"10.{64 + secrets.randbelow(64)}.{secrets.randbelow(256)}.0/24"

        fabric_addresses = [f"10.251.{octet}.{10 + rank}" for rank in range(2)]

        def create(rank: int, joined: list[protocol.ClusterJoined] | None = None, *, on_fabric: bool = False) -> protocol.CreateCluster:
            peers = [protocol.ClusterPeer(rank=1 - rank, public_key=joined[1 - rank].public_key, endpoint=joined[1 - rank].endpoints[0],
                                          fabric_address=fabric_addresses[1 - rank] if on_fabric else None)] if joined else []  # fmt: skip
            return protocol.CreateCluster(cluster_id=f"c-bench-{tag}", rental_id=members[rank], rank=rank, node_count=2, subnet=subnet, peers=peers,
                                          fabric=protocol.FabricJoin(name=fabric.name, address=fabric_addresses[rank]))  # fmt: skip

        joined = [await networks.create(create(rank)) for rank in range(2)]
        for rank in range(2):  # member after member: handshakes that cross are slow to settle (agent.cluster.net)
            await networks.create(create(rank, joined))
        infos = [await asyncio.to_thread(_engine, "GET", f"/containers/{quote(name)}/json") for name in members]
        pid_a, pid_b = (info["State"]["Pid"] for info in infos)
        paths = {"tunnel": joined[1].address, "direct": infos[1]["NetworkSettings"]["Networks"][shared]["IPAddress"]}
        for address in paths.values():
            await _copy_once(pid_a, pid_b, address, CHUNK)  # warm-up (the tunnel's handshake, the ARP and route caches)
        rates: dict[str, list[float]] = {"tunnel": [], "direct": [], f"tunnel-{JUMBO_MTU}": [], "fabric": []}
        size = mib << 20
        for _ in range(runs):
            for path, address in paths.items():
                rates[path].append(size / await _copy_once(pid_a, pid_b, address, size) / 1e6)
        # wireguard-go tuned: cluster0's MTU for a network that carries 9000-byte frames (``cluster_tunnel_mtu``).
        for pid in (pid_a, pid_b):
            await asyncio.to_thread(subprocess.run, ["nsenter", f"--net=/proc/{pid}/ns/net", "ip", "link", "set", "cluster0", "mtu", str(JUMBO_MTU)],
                                    check=True, capture_output=True, timeout=10)  # fmt: skip
        await _copy_once(pid_a, pid_b, paths["tunnel"], CHUNK)
        for _ in range(runs):
            for path, address in paths.items():
                rates[path if path == "direct" else f"tunnel-{JUMBO_MTU}"].append(size / await _copy_once(pid_a, pid_b, address, size) / 1e6)
        # The same pair on the fabric (each member told the other's fabric address): node-1's address is now routed
        # through fabric0, unencrypted; interleaved with the direct copy again.
        for rank in range(2):
            await networks.create(create(rank, joined, on_fabric=True))
        paths = {"fabric": joined[1].address, "direct": paths["direct"]}
        await _copy_once(pid_a, pid_b, paths["fabric"], CHUNK)
        for _ in range(runs):
            for path, address in paths.items():
                rates[path].append(size / await _copy_once(pid_a, pid_b, address, size) / 1e6)
        return rates
    finally:
        for name in members:
            with contextlib.suppress(Exception):
                await networks.forget_rental(name)
        await networks.close()
        devices = {device_name(name).encode() for name in members}
        for entry in Path("/proc").iterdir():  # whatever a failure left running
            with contextlib.suppress(OSError):
                argv = (entry / "cmdline").read_bytes().split(b"\0")
                if entry.name.isdigit() and argv[0].endswith(b"wireguard-go") and devices & set(argv):
                    os.kill(int(entry.name), signal.SIGKILL)
        await asyncio.to_thread(dockerengine.remove_owned, owner)
        for link in (f"{bridge}c", bridge):
            await asyncio.to_thread(subprocess.run, ["ip", "link", "del", link], capture_output=True, timeout=10, check=False)
        shutil.rmtree(work, ignore_errors=True)


def run_tunnel(mib: int, runs: int) -> None:
    title = "\nTunnel throughput between a cluster's nodes"
    why = tunnel_unavailable()
    if why is not None:
        print(f"{title}: not measured ({why})")
        return
    version = subprocess.run(["wireguard-go", "--version"], capture_output=True, text=True, check=False).stdout
    found = re.search(r"v[\d.]+", version)
    print(f"{title}: two members' namespaces on this host, {runs} × {mib} MiB A → B per path, interleaved, "
          f"wireguard-go {found[0] if found else '(version unknown)'}; MB/s = 10^6 bytes/s")  # fmt: skip
    rates = asyncio.run(measure_tunnel(mib, runs))
    medians = {path: statistics.median(values) for path, values in rates.items()}
    names = {"tunnel": "tunnel (wireguard-go, MTU 1420)", f"tunnel-{JUMBO_MTU}": f"tunnel (wireguard-go, MTU {JUMBO_MTU})",
             "fabric": "fabric (fabric0, macvlan)", "direct": "direct TCP (a shared bridge)"}
    print(f"  {'':32} {'runs, MB/s':>48} {'median':>9}")
    for path, values in rates.items():
        print(f"  {names[path]:32} {' '.join(f'{v:7.1f}' for v in values):>48} {medians[path]:9.1f}")
    runs_text = "runs, MB/s: " + "; ".join(f"{path} {', '.join(f'{v:.1f}' for v in values)}" for path, values in rates.items())
    for path in ("tunnel", f"tunnel-{JUMBO_MTU}", "fabric"):
        ratio = medians[path] / medians["direct"]
        print(f"  ratio {path} / direct: {ratio:.3f}× the throughput")
    record("clusters", f"tunnel throughput between two members' namespaces ({runs} × {mib} MiB, wireguard-go)",
           round(medians["tunnel"], 1), "MB/s", "direct TCP between the same two namespaces (a shared bridge)",
           round(medians["direct"], 1), runs_text)  # fmt: skip
    record("clusters", f"tunnel throughput between two members' namespaces ({runs} × {mib} MiB, wireguard-go, cluster0 MTU {JUMBO_MTU})",
           round(medians[f"tunnel-{JUMBO_MTU}"], 1), "MB/s", "direct TCP between the same two namespaces (a shared bridge)",
           round(medians["direct"], 1), runs_text)  # fmt: skip
    record("clusters", f"fabric path throughput between two members' namespaces ({runs} × {mib} MiB, macvlan on a bridge parent)",
           round(medians["fabric"], 1), "MB/s", "direct TCP between the same two namespaces (a shared bridge)",
           round(medians["direct"], 1), runs_text)  # fmt: skip


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--hosts", type=int, help="default 10,000 (--quick: 1,000)")
    parser.add_argument("--decisions", type=int, help="default 2,000 (--quick: 200)")
    parser.add_argument("--regions", type=int, default=8)
    parser.add_argument("--algorithm", default="fgd_net", help="the placer of the speed runs")
    parser.add_argument("--trace-dir", type=Path, default=TRACE_DIR)
    parser.add_argument("--traces", help="default default,multigpu50 (--quick: default)")
    parser.add_argument(
        "--algorithms", help="the placers of the trace runs; default fgd_net,best_fit (--quick: fgd_net)"
    )
    parser.add_argument("--seeds", help="default 42-46 (--quick: 42)")
    parser.add_argument("--skip-trace", action="store_true")
    parser.add_argument("--skip-speed", action="store_true")
    parser.add_argument("--skip-tunnel", action="store_true")
    parser.add_argument("--tunnel", action="store_true", help="measure the tunnel under --quick too")
    parser.add_argument("--tunnel-mib", type=int, default=64, help="MiB per copy (default 64)")
    parser.add_argument("--tunnel-runs", type=int, default=3, help="copies per path (default 3)")
    parser.add_argument("--link-groups", help="hosts per group of the links runs; default 100,300,1000 (--quick: 100)")
    parser.add_argument("--skip-links", action="store_true")
    parser.add_argument(
        "--quick",
        action="store_true",
        help="smaller defaults: 1,000 hosts, 200 decisions, one trace, one seed; no tunnel (unless --tunnel)",
    )
    args = parser.parse_args(argv)
    quick = args.quick
    hosts = args.hosts or (1_000 if quick else 10_000)
    decisions = args.decisions or (200 if quick else 2_000)
    traces = args.traces or ("default" if quick else "default,multigpu50")
    algorithms = args.algorithms or ("fgd_net" if quick else "fgd_net,best_fit")
    seeds = args.seeds or ("42" if quick else "42-46")
    print(describe_machine())
    started = time.monotonic()
    if not args.skip_speed:
        run_speed(hosts, decisions, args.algorithm, args.regions)
    if not args.skip_links:
        run_links([int(n) for n in (args.link_groups or ("100" if quick else "100,300,1000")).split(",")], args.algorithm)
    if not args.skip_trace:
        run_trace(args.trace_dir, traces.split(","), algorithms.split(","), parse_seeds(seeds))
    if args.skip_tunnel:
        print("\nTunnel throughput between a cluster's nodes: not measured (--skip-tunnel)")
    elif quick and not args.tunnel:
        print("\nTunnel throughput between a cluster's nodes: not measured yet (--quick leaves it out; add --tunnel)")
    else:
        run_tunnel(args.tunnel_mib, args.tunnel_runs)
    print(f"\n{time.monotonic() - started:.1f} s in all")


if __name__ == "__main__":
    main()
