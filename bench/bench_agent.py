"""What the agent's GPU sampling costs: one pass over 8 GPUs, and a 1 s sampling loop's CPU and memory.

The GPUs are a replayed NVML recording (``--recording``, by default the H100 80GB HBM3 one
converted from a real nvidia-smi capture) whose one GPU is copied to ``--gpus`` GPUs (8),
each copy with its own UUID and PCI bus id, so that the agent's real NVML collection code
(``agent.gpu.nvml.read_gpu_sample`` via ``ReplayBackend``) reads 8 GPUs. One sampling pass is:

    backend.sample()  ->  [s.to_wire() for s in samples]
                      ->  TelemetryBody(gpus=[GpuSampleModel.model_validate(w) for w in wires])

Measured in the same run:

* the pass, ``--rounds`` × ``--passes`` times, interleaved with the same pass on the simulated
  backend (``sim:8xH100``, all busy), the baseline; median µs per pass and the ratio;
* a sampling loop, one pass every ``--interval`` s for ``--duration`` s, as the agent runs it:
  the process's CPU time over wall time (% of one core, ``time.process_time``) and its
  resident memory (VmRSS, VmHWM from /proc/self/status).

The replay answers each NVML call from memory. Real NVML calls go to the driver (an ioctl
each; some take milliseconds), so on a GPU host a pass costs more than here: this measures
the agent's own Python work around NVML, not NVML. Event polling is not in the pass (the
recording has no event set, so it would be a no-op).

Usage: ``python bench/bench_agent.py [--gpus N] [--passes P] [--rounds R] [--duration S] [--interval S] [--quick]``
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from agent.gpu.base import GpuBackend
from agent.gpu.replay import ReplayBackend
from agent.gpu.sim import SimulatedBackend
from shared import protocol

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import Progress, describe_machine, record

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_RECORDING = ROOT / "tests" / "fixtures" / "nvml" / "h100-80gb-hbm3.json"
WARMUP = 50
# dcgm-exporter's footprint as a user measured it (dcgm-exporter 2.0.13, Xeon Gold 5115):
# https://github.com/NVIDIA/gpu-monitoring-tools/issues/133 . Quoted, not measured here.
REFERENCE = "dcgm-exporter: 15–20% of one core, ~71 MiB RSS"
REFERENCE_SOURCE = (
    "reported by a user in NVIDIA/gpu-monitoring-tools#133 (dcgm-exporter 2.0.13), not measured here"
)


def replicate_devices(recording: dict[str, Any], count: int) -> dict[str, Any]:
    """``recording`` with its GPU 0 copied to GPUs 0..count-1, each with its own UUID and bus id."""
    copied = copy.deepcopy(recording)
    phases = [copied["calls"]["open"]] + [tick["calls"] for tick in copied["calls"]["ticks"]]
    template = {id(phase): phase.get("gpu0") for phase in phases}
    system = copied["calls"]["open"]["system"]
    system["nvmlDeviceGetCount"] = {"": {"value": count}}
    system["nvmlDeviceGetHandleByIndex"] = {str(i): {"value": {"$handle": f"gpu{i}"}} for i in range(count)}
    for phase in phases:
        gpu0 = template[id(phase)]
        if gpu0 is None:
            continue
        for index in range(count):
            gpu = copy.deepcopy(gpu0)
            uuid = gpu.get("nvmlDeviceGetUUID", {}).get("", {})
            if "value" in uuid:
                uuid["value"] = f"{uuid['value'][:-4]}{index:04x}"
            pci = gpu.get("nvmlDeviceGetPciInfo", {}).get("", {}).get("value")
            if isinstance(pci, dict) and "busId" in pci:
                pci["busId"] = f"00000000:{0x18 + 0x10 * index:02X}:00.0"
            phase[f"gpu{index}"] = gpu
    copied["source"] = {**copied.get("source", {}), "replicated_to": count}
    return copied


def sampling_pass(backend: GpuBackend) -> protocol.TelemetryBody:
    """One pass as the agent does it: read every GPU, to wire dicts, validated into a TelemetryBody."""
    wires = [sample.to_wire() for sample in backend.sample()]
    return protocol.TelemetryBody(
        sampled_at=datetime.now(UTC), gpus=[protocol.GpuSampleModel.model_validate(wire) for wire in wires]
    )


def time_per_pass(run: Callable[[], object], passes: int) -> float:
    started = time.perf_counter()
    for _ in range(passes):
        run()
    return (time.perf_counter() - started) / passes


def memory_kib() -> dict[str, int]:
    """VmRSS and VmHWM of this process, in KiB (empty where /proc is missing)."""
    values: dict[str, int] = {}
    try:
        with open("/proc/self/status", encoding="utf-8") as status:
            for line in status:
                key, _, rest = line.partition(":")
                if key in ("VmRSS", "VmHWM"):
                    values[key] = int(rest.split()[0])
    except OSError:
        pass
    return values


def sampling_loop(backend: GpuBackend, *, duration: float, interval: float) -> tuple[float, list[float], int]:
    """Sample every ``interval`` s for ``duration`` s; (CPU % of one core, CPU ms per pass, passes)."""
    pass_cpu: list[float] = []
    started_wall, started_cpu = time.monotonic(), time.process_time()
    deadline = started_wall
    progress = Progress("loop passes", int(duration / interval))
    while True:
        before = time.process_time()
        sampling_pass(backend)
        pass_cpu.append((time.process_time() - before) * 1000)
        progress.update(len(pass_cpu))
        deadline += interval
        if deadline - started_wall >= duration:
            break
        time.sleep(max(0.0, deadline - time.monotonic()))
    # Wait out the last interval too, so the CPU share is over whole intervals.
    time.sleep(max(0.0, deadline - time.monotonic()))
    progress.done()
    wall = time.monotonic() - started_wall
    return 100 * (time.process_time() - started_cpu) / wall, pass_cpu, len(pass_cpu)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--recording", type=Path, default=DEFAULT_RECORDING, help="NVML recording to replay")
    parser.add_argument("--gpus", type=int, default=8, help="GPUs on the host (default 8)")
    parser.add_argument("--passes", type=int, default=200, help="passes per measurement (default 200)")
    parser.add_argument("--rounds", type=int, default=5, help="measurements of each backend (default 5)")
    parser.add_argument("--duration", type=float, default=10.0, help="sampling loop length in s (default 10)")
    parser.add_argument("--interval", type=float, default=1.0, help="sampling loop period in s (default 1)")
    parser.add_argument("--quick", action="store_true", help="50 passes × 2 rounds, a 3 s loop (for make bench QUICK=1)")
    args = parser.parse_args()
    if args.quick:
        args.passes, args.rounds, args.duration = 50, 2, 3.0
    if not 1 <= args.gpus <= 64 or args.passes < 1 or args.rounds < 1:
        parser.error("--gpus must be 1..64 (the protocol's limit), --passes and --rounds at least 1")
    if args.interval <= 0 or args.duration < args.interval:
        parser.error("--interval must be positive and --duration at least one interval")

    print(describe_machine())
    memory_at_start = memory_kib()
    recording = json.loads(args.recording.read_text(encoding="utf-8"))
    source = recording.get("source", {})
    replay = ReplayBackend.from_recording(replicate_devices(recording, args.gpus))
    sim = SimulatedBackend(f"sim:{args.gpus}xH100", seed="bench")
    sim.set_busy([gpu.uuid for gpu in sim.gpus()], True)
    how = (
        "converted from a real nvidia-smi capture, not recorded through NVML"
        if "converted" in str(source.get("how", ""))
        else "recorded through NVML"
    )
    print(
        f"replay: {args.recording.name} ({', '.join(source.get('gpus', []))}, driver "
        f"{source.get('driver_version')}; {how}), its one GPU copied to {args.gpus} GPUs with their own "
        f"UUIDs and bus ids; its {replay.tick_count} recorded passes played in a loop"
    )
    print(f"baseline: sim:{args.gpus}xH100, all busy (one process each), same pass")
    body = sampling_pass(replay)
    frame = json.dumps(body.model_dump(mode="json"))
    print(f"one pass yields a TelemetryBody of {len(body.gpus)} GPUs, {len(frame.encode()):,} bytes as JSON")

    runs: dict[str, Callable[[], object]] = {
        "replay (NVML code)": lambda: sampling_pass(replay),
        "sim (baseline)": lambda: sampling_pass(sim),
    }
    for run in runs.values():
        time_per_pass(run, WARMUP)
    seconds: dict[str, list[float]] = {name: [] for name in runs}
    progress = Progress("passes", args.rounds * len(runs) * args.passes)
    done = 0
    for _ in range(args.rounds):
        for name, run in runs.items():
            gc.collect()
            seconds[name].append(time_per_pass(run, args.passes))
            done += args.passes
            progress.update(done)
    progress.done()
    median = {name: statistics.median(values) for name, values in seconds.items()}
    print(
        f"\none sampling pass over {args.gpus} GPUs, {args.rounds} rounds × {args.passes:,} passes, interleaved:"
    )
    print(f"  {'backend':<22} {'µs/pass':>9} {'min':>9} {'max':>9} {'µs/GPU':>8}  cost vs baseline")
    for name in runs:
        per = median[name]
        ratio = "(baseline)" if name.startswith("sim") else f"{per / median['sim (baseline)']:.1f}× sim"
        print(
            f"  {name:<22} {per * 1e6:>9.1f} {min(seconds[name]) * 1e6:>9.1f} "
            f"{max(seconds[name]) * 1e6:>9.1f} {per * 1e6 / args.gpus:>8.1f}  {ratio}"
        )

    record("agent", f"one sampling pass over {args.gpus} GPUs (NVML code on a replayed recording), incl. the telemetry body",
           median["replay (NVML code)"] * 1e6, "µs", "the same pass on the simulated backend", median["sim (baseline)"] * 1e6)  # fmt: skip

    print(f"\nsampling loop: replay, one pass every {args.interval:g} s for {args.duration:g} s")
    cpu_percent, pass_cpu, passes = sampling_loop(replay, duration=args.duration, interval=args.interval)
    memory = memory_kib()
    print(
        f"  process CPU: {cpu_percent:.2f}% of one core over the loop "
        f"({passes} passes, CPU per pass median {statistics.median(pass_cpu):.2f} ms, "
        f"max {max(pass_cpu):.2f} ms)"
    )
    if memory:
        print(
            f"  memory: VmRSS {memory['VmRSS'] / 1024:.1f} MiB, peak VmHWM {memory['VmHWM'] / 1024:.1f} MiB "
            f"(at start, after imports: {memory_at_start.get('VmRSS', 0) / 1024:.1f} MiB); this bench "
            "process (Python, pydantic, pynvml, both backends), not the whole agent"
        )
    print(f"  reference: {REFERENCE} ({REFERENCE_SOURCE})")
    record("agent", f"sampling every {args.interval:g} s, {args.gpus} GPUs (replay): CPU", cpu_percent, "% of a core",
           note=f"VmRSS {memory.get('VmRSS', 0) / 1024:.1f} MiB (this bench process); reference: {REFERENCE}")  # fmt: skip
    replay.close()
    sim.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
