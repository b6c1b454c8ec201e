"""What a container workload costs the agent: start-to-running time, memory per workload, event-loop lag.

Against this machine's Docker engine, with the suite's locally built busybox image
(``tests/dockerengine.py``: imported through the Engine API, nothing pulled). Measured in
the same run:

* start-to-running of a container from a local image through ``WorkloadManager.start`` (the
  image inspected, a network, a volume (as root: a loop-mounted 10 GiB ext4 disk) and a container made, ``/workspace`` chowned, the
  container started), ``--starts`` times, interleaved with the baseline: ``docker run -d`` of
  the same image (the CLI, here only as the yardstick; it makes no network or volume). p50,
  p95 and the ratio; goal: p50 under 1.5 s;
* the agent's memory per running workload: the process's RSS after ``--workloads`` containers
  are running and followed (a log stream each), minus before, divided by their number;
* start-to-running of a ``process`` rental (as root: a uid of its own, its network namespace with a
  guarded veth, its cgroup with every ceiling, a loop-mounted home), ``--starts`` times, interleaved
  with the baseline: a bare spawn of the same program (``subprocess.Popen``); p50, p95 and the ratio;
* the event loop's lag with those ``--workloads`` running, each printing a line a second
  into its followed log: a 10 ms timer's lateness over ``--duration`` s, p50/p99/max; goal:
  p99 under 50 ms.

Usage: ``python bench/bench_workloads.py [--starts N] [--workloads N] [--duration S] [--quick]`` (root, an engine answering)
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import os
import secrets
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from agent.gpu.sim import SimulatedBackend
from agent.runtimes.containeropts import ContainerOptions
from agent.runtimes.isolation import isolation_facts, process_isolation
from agent.runtimes.manager import WorkloadManager
from agent.runtimes.users import IsolationTools, RentalUsers
from shared.protocol import ContainerWorkload, ProcessWorkload

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the test image's builder, tests/dockerengine.py
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import Progress, describe_machine, quantile, record

from tests import dockerengine

START_GOAL_S = 1.5
LAG_GOAL_MS = 50.0


def rss_kib() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def docker_run(image: str, name: str) -> float:
    started = time.perf_counter()
    subprocess.run(["docker", "run", "-d", "--name", name, image, "sleep", "600"], check=True, capture_output=True)
    return time.perf_counter() - started


def report_starts(what: str, ours: list[float], theirs: list[float], baseline: tuple[str, str], *, note: str = "") -> None:
    """Print start-to-running p50/p95 beside the baseline's from the same run, and record it."""
    p50, p95 = quantile(ours, 0.5), quantile(ours, 0.95)
    b50, b95 = quantile(theirs, 0.5), quantile(theirs, 0.95)
    print(f"{what} start-to-running, {len(ours)} starts{f' ({note})' if note else ''}:")
    print(f"  manager.start   p50 {p50 * 1000:7.1f} ms  p95 {p95 * 1000:7.1f} ms   goal p50 < {START_GOAL_S * 1000:.0f} ms: "
          f"{'met' if p50 < START_GOAL_S else 'NOT met'}")
    print(f"  {baseline[0]:<15} p50 {b50 * 1000:7.1f} ms  p95 {b95 * 1000:7.1f} ms   (baseline, same run)")
    print(f"  ratio           p50 {p50 / b50:7.2f}x    p95 {p95 / b95:7.2f}x")
    record("workloads", f"{what} start-to-running through the agent's manager, p50 of {len(ours)}", p50 * 1e3, "ms",
           baseline[1], b50 * 1e3, f"p95 {p95 * 1e3:.0f} ms; goal p50 < {START_GOAL_S * 1e3:.0f} ms")  # fmt: skip


def bare_spawn(argv: list[str]) -> float:
    started = time.perf_counter()
    process = subprocess.Popen(argv)
    elapsed = time.perf_counter() - started
    process.kill()
    process.wait()
    return elapsed


async def process_starts(args: argparse.Namespace, backend: SimulatedBackend, gpus: list[str], work: Path) -> None:
    """Start-to-running of process rentals with their namespaces, guard and ceilings, beside a bare spawn."""
    tools = IsolationTools.find()
    if os.geteuid() != 0 or isinstance(tools, str):
        print(f"process rentals: skipped ({'not root' if os.geteuid() != 0 else tools})")
        return
    os.chmod(work, 0o711)  # rental users pass through to their homes (mkdtemp made it 0700)
    users = RentalUsers(work / "rentals", tools, uid_min=3_990_000, uid_max=3_990_999)
    users.prepare()
    facts = isolation_facts(process_isolation(euid=0, tools=tools), container_engine=None, allow_unisolated=False)
    manager = WorkloadManager(work / "process-work", backend, rental_users=users, isolation=facts, stop_timeout=1.0)
    try:
        network = await manager.network_facts()  # the guard in place and self-tested, as an agent's start does
        users.networks.egress = network.guard.active
        sleeper = ProcessWorkload(argv=["/bin/sleep", "600"])
        ours: list[float] = []
        theirs: list[float] = []
        progress = Progress("process starts", args.starts)
        for i in range(args.starts):
            started = time.perf_counter()
            await manager.start(f"p{i}", [gpus[i]], sleeper)
            ours.append(time.perf_counter() - started)
            theirs.append(await asyncio.to_thread(bare_spawn, ["/bin/sleep", "600"]))
            progress.update(i + 1)
        progress.done()
        guarded = "a guarded veth" if users.networks.egress else f"loopback only: {network.why_not}"
        report_starts("process rental", ours, theirs, ("bare spawn", "a bare spawn of the same program"), note=f"uid, network namespace with {guarded}, cgroup, ceilings, home")
    finally:
        await manager.close(stop_workloads=True)


async def main(args: argparse.Namespace) -> None:
    print(describe_machine())
    print(f"engine: {dockerengine.ensure_engine()}; image {dockerengine.busybox_image()}")
    image = dockerengine.busybox_image()
    owner = f"bench-{secrets.token_hex(4)}"
    count = max(args.starts, args.workloads)
    backend = SimulatedBackend(f"sim:{count}xRTX4090", seed="bench", max_gpus=count)
    gpus = [g.uuid for g in backend.gpus()]
    work = Path(tempfile.mkdtemp(prefix="gpumarket-bench-workloads-"))
    manager = WorkloadManager(work, backend, container=ContainerOptions(owner=owner), stop_timeout=1.0)
    cli_names: list[str] = []
    try:
        # ---- start-to-running, interleaved with docker run -d ---------------------------------
        ours: list[float] = []
        theirs: list[float] = []
        sleeper = ContainerWorkload(image=image, command=["sleep", "600"])
        progress = Progress("starts", args.starts)
        await manager.start("warmup", [gpus[0]], sleeper)  # the engine session and the network guard
        await manager.stop("warmup", timeout=0)
        for i in range(args.starts):
            started = time.perf_counter()
            await manager.start(f"s{i}", [gpus[i]], sleeper)
            ours.append(time.perf_counter() - started)
            cli_names.append(f"{owner}-cli-{i}")
            theirs.append(await asyncio.to_thread(docker_run, image, cli_names[-1]))
            progress.update(i + 1)
        progress.done()
        await asyncio.gather(*(manager.stop(f"s{i}", timeout=0) for i in range(args.starts)))
        await asyncio.to_thread(subprocess.run, ["docker", "rm", "-f", *cli_names], check=False, capture_output=True)
        cli_names.clear()
        report_starts("container", ours, theirs, ("docker run -d", "docker run -d of the same image"), note="image check, network, disk, container, chown, start")

        # ---- process rentals: namespaces, guard, ceilings ------------------------------------------
        await process_starts(args, backend, gpus, work)

        # ---- memory per running workload and event-loop lag -------------------------------------
        talker = ContainerWorkload(image=image, command=["sh", "-c", "while true; do echo tick; sleep 1; done"])
        gc.collect()
        before = rss_kib()
        progress = Progress("workloads", args.workloads)
        for i in range(args.workloads):
            await manager.start(f"w{i}", [gpus[i]], talker)
            progress.update(i + 1)
        progress.done()
        await asyncio.sleep(2.0)  # every follower attached and copying
        gc.collect()
        after = rss_kib()
        print(f"agent memory with {args.workloads} running container workloads: RSS {before / 1024:.1f} -> {after / 1024:.1f} MiB, "
              f"{(after - before) / args.workloads:.0f} KiB per workload")
        record("workloads", f"agent memory per running container workload ({args.workloads}, logs followed)",
               (after - before) / args.workloads, "KiB")  # fmt: skip

        lags: list[float] = []
        loop = asyncio.get_running_loop()
        end = loop.time() + args.duration
        while loop.time() < end:
            due = loop.time() + 0.010
            await asyncio.sleep(0.010)
            lags.append(max(0.0, loop.time() - due) * 1000)
        logged = sum(manager.logs.path(f"w{i}").stat().st_size for i in range(args.workloads))
        print(f"event-loop lag with {args.workloads} container workloads running ({len(lags)} ticks of 10 ms over {args.duration:g} s, "
              f"{logged} bytes of their output followed): p50 {quantile(lags, 0.5):.1f} ms  p99 {quantile(lags, 0.99):.1f} ms  "
              f"max {max(lags):.1f} ms   goal p99 < {LAG_GOAL_MS:.0f} ms: {'met' if quantile(lags, 0.99) < LAG_GOAL_MS else 'NOT met'}")
        record("workloads", f"agent event-loop lag with {args.workloads} container workloads running, p99", quantile(lags, 0.99),
               "ms", note=f"max {max(lags):.1f} ms; goal p99 < {LAG_GOAL_MS:.0f} ms")  # fmt: skip
        started = time.perf_counter()
        await asyncio.gather(*(manager.stop(f"w{i}", timeout=0) for i in range(args.workloads)))
        print(f"stopping {args.workloads} at once: {time.perf_counter() - started:.1f} s")
    finally:
        await manager.close(stop_workloads=True)
        disks = manager.ceilings.disks
        if disks is not None:  # each rental's size-capped /workspace stays mounted until forgotten: forget them all
            for folder in work.iterdir():
                if folder.is_dir():
                    await asyncio.to_thread(disks.release, folder.name)
        if cli_names:
            await asyncio.to_thread(subprocess.run, ["docker", "rm", "-f", *cli_names], check=False, capture_output=True)
        dockerengine.remove_owned(owner)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--starts", type=int, default=20)
    parser.add_argument("--workloads", type=int, default=50)
    parser.add_argument("--duration", type=float, default=10.0)
    parser.add_argument("--quick", action="store_true", help="5 starts, 10 workloads, 3 s (for make bench QUICK=1)")
    arguments = parser.parse_args()
    if arguments.quick:
        arguments.starts, arguments.workloads, arguments.duration = 5, 10, 3.0
    asyncio.run(main(arguments))
