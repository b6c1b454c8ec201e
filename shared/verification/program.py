"""The challenge workload: ``python3 /opt/gpumarket/verify/program.py [WORKDIR]`` in the challenge image
(``gpumarket/images.py``: ``CHALLENGE_IMAGE``), run by the agent through the rental path, WORKDIR ``/workspace``
by default. Stdlib, numpy and, where the image has a CUDA build, torch; ``compute.py`` lies beside it.

Files in WORKDIR, each written whole (a temporary name, then renamed), so a reader never sees half of one:

1. ``ready.json`` (written by the program, once its imports and devices are up): ``{"backend": "torch-cuda" |
   "numpy", "devices": N}``. An agent that writes ``challenge.json`` only after it sees this starts the
   challenge's clock without the container's start; writing ``challenge.json`` before the start works too.
2. ``challenge.json`` (the agent): ``master.services.hosts.challenge.make_challenge``'s document, waited for (every 50 ms, at most
   ``GPUMARKET_VERIFY_WAIT_S`` seconds: the agent sets it to the challenge's deadline plus a margin, so a program
   whose agent died never waits long; 600 without it).
3. ``commitment.json`` (the program), once every GPU is done: ``{"challenge_id", "backend", "gpus": {uuid:
   {"root": hex, "n": n} | {"reason": "memory_short" | "workload_failed", "message"}}, "seconds": {uuid:
   {"generate", "multiply", "hash"}}}``. ``seconds`` is the host's own account, never trusted: the master times the
   commitment on its clock.
4. ``reveal.json`` (the agent, the master's reveal): ``{"challenge_id", "gpus": {uuid: {"rows": [...], "chunks":
   [...], ...}}}``,
   waited for like ``challenge.json``. Not waited for when no GPU committed a root.
5. ``openings.json`` (the program): ``{"challenge_id", "gpus": {uuid: [{"row", "chunk", "values", "chunk_proof",
   "row_proof"}]}}`` (``compute.open_chunks``); exit 0.

Exit 2: ``challenge.json`` or ``reveal.json`` unusable (the message on stderr says which); 3: one never came.

Devices: with torch and CUDA, the claimed GPUs by uuid among those the container sees (one it does not see:
``workload_failed``), all at once, one thread each; without, numpy on the CPU for every claimed uuid (the
simulated hosts), all at once too.

**Simulation** (``challenge["simulate"]``, set by a simulated agent only; the master never sends it nor trusts
what comes of it):

- ``wrong_fraction`` (0..1): the last ``wrong_fraction · n`` rows of C are left at zero (work skipped) before
  hashing: an honest-looking commitment to a wrong product.
- ``delay_s``: the host declares itself this much slower: ``commitment.json`` carries ``"simulated_delay_s"``,
  which the simulated agent adds to the clock the master's verdict is timed on (the tests' injectable clock), so
  "too slow" needs no sleeping.
- ``memory_mib``: the simulated device's real memory, in the claimed model's MiB (divided by
  ``challenge["scale"]["vram"]`` as the challenge's size is): less than A, B and C need gives ``memory_short``.
"""

from __future__ import annotations

import json
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

try:
    from shared.verification import compute
except ImportError:  # in the challenge image: compute.py lies beside this file
    import compute  # type: ignore[no-redef,import-not-found]

POLL_S = 0.05


class Unusable(ValueError):
    pass


def write_json(path: Path, document: Any) -> None:
    temporary = path.with_name(f".{path.name}.tmp")
    temporary.write_text(json.dumps(document, separators=(",", ":")))
    os.replace(temporary, path)


def wait_json(path: Path, *, wait_s: float) -> Any:
    deadline = time.monotonic() + wait_s
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} did not come within {wait_s:.0f} s")
        time.sleep(POLL_S)
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise Unusable(f"{path} is not JSON: {exc}") from exc


def cuda_devices() -> dict[str, Any] | None:
    """The CUDA devices this container sees by uuid (``GPU-…``, as NVML names them), or None without torch/CUDA."""
    try:
        import torch
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None
    return {f"GPU-{torch.cuda.get_device_properties(k).uuid}": torch.device("cuda", k) for k in range(torch.cuda.device_count())}


def run_gpu(challenge: dict[str, Any], gpu: dict[str, Any], devices: dict[str, Any] | None) -> tuple[str, Any]:
    """One GPU's work: its ``HostState``, or its failure entry."""
    uuid, n, dtype = gpu["uuid"], int(gpu["n"]), challenge["dtype"]
    simulate = challenge.get("simulate") or {}
    seed = compute.gpu_seed(bytes.fromhex(challenge["seed"]), uuid)
    limit = None
    if simulate.get("memory_mib") is not None:
        limit = int(float(simulate["memory_mib"]) / float(challenge.get("scale", {}).get("vram", 1)) * 2**20)
    try:
        if devices is None:
            state = compute.multiply_and_commit(seed, n, challenge["challenge_id"], uuid=uuid, dtype=dtype, memory_limit_bytes=limit)
        elif uuid not in devices:
            return uuid, {"reason": "workload_failed", "message": f"GPU {uuid} is not visible in the container (it sees {sorted(devices)})"}
        else:
            state = compute.multiply_and_commit(seed, n, challenge["challenge_id"], uuid=uuid, backend="torch", device=devices[uuid],
                                                dtype=dtype, memory_limit_bytes=limit)  # fmt: skip
    except compute.MemoryShort as exc:
        return uuid, {"reason": "memory_short", "message": str(exc)}
    except Exception as exc:  # reported as this GPU's failure, the others go on
        return uuid, {"reason": "workload_failed", "message": f"{type(exc).__name__}: {exc}"[:500]}
    fraction = float(simulate.get("wrong_fraction") or 0)
    if fraction > 0:
        skipped = max(1, round(fraction * n))
        state.rows[n - skipped :] = 0
        state.rehash()
    return uuid, state


def main(argv: list[str]) -> int:
    workdir = Path(argv[1] if len(argv) > 1 else "/workspace")
    wait_s = float(os.environ.get("GPUMARKET_VERIFY_WAIT_S", "600"))
    devices = cuda_devices()
    write_json(workdir / "ready.json", {"backend": "numpy" if devices is None else "torch-cuda", "devices": len(devices or {})})
    try:
        challenge = wait_json(workdir / "challenge.json", wait_s=wait_s)
        try:
            gpus = [{"uuid": str(g["uuid"]), "n": int(g["n"])} for g in challenge["gpus"]]
            if challenge["dtype"] not in compute.DTYPE_BYTES or not gpus:
                raise Unusable(f"dtype {challenge['dtype']!r} or its {len(gpus)} GPUs")
            bytes.fromhex(challenge["seed"])
        except (KeyError, TypeError, ValueError) as exc:
            raise Unusable(f"{workdir / 'challenge.json'} is not a challenge: {exc!r}") from exc
        with ThreadPoolExecutor(max_workers=len(gpus)) as pool:
            done = dict(pool.map(lambda gpu: run_gpu(challenge, gpu, devices), gpus))
        states = {uuid: s for uuid, s in done.items() if isinstance(s, compute.HostState)}
        commitment: dict[str, Any] = {
            "challenge_id": challenge["challenge_id"],
            "backend": "numpy" if devices is None else "torch-cuda",
            "gpus": {uuid: {"root": s.root.hex(), "n": s.n} if uuid in states else s for uuid, s in done.items()},
            "seconds": {uuid: s.seconds for uuid, s in states.items()},
        }
        delay = (challenge.get("simulate") or {}).get("delay_s")
        if delay is not None:
            commitment["simulated_delay_s"] = float(delay)
        write_json(workdir / "commitment.json", commitment)
        if not states:
            return 0
        reveal = wait_json(workdir / "reveal.json", wait_s=wait_s)
        if reveal.get("challenge_id") != challenge["challenge_id"]:
            raise Unusable(f"reveal.json answers challenge {reveal.get('challenge_id')!r}, not {challenge['challenge_id']!r}")
        try:
            openings = {uuid: compute.open_chunks(state, reveal["gpus"][uuid]) for uuid, state in states.items()}
        except (KeyError, TypeError, ValueError) as exc:
            raise Unusable(f"reveal.json does not name rows and chunks for every committed GPU: {exc!r}") from exc
        write_json(workdir / "openings.json", {"challenge_id": challenge["challenge_id"], "gpus": openings})
        return 0
    except Unusable as exc:
        print(f"program.py: {exc}", file=sys.stderr)
        return 2
    except TimeoutError as exc:
        print(f"program.py: {exc}", file=sys.stderr)
        return 3


if __name__ == "__main__":
    sys.exit(main(sys.argv))
