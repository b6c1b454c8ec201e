"""One node's part of a gloo all-reduce across a cluster: the torch test image's workload (``/opt/gpumarket/allreduce.py``).

Run one process per node (``python3 /opt/gpumarket/allreduce.py``). It reads torch's usual environment:

* ``MASTER_ADDR``, ``MASTER_PORT``: rank 0's address and the port of its rendezvous store (``env://``).
* The number of nodes: ``NNODES`` when set; else ``WORLD_SIZE // LOCAL_WORLD_SIZE`` when ``LOCAL_WORLD_SIZE`` is set;
  else ``WORLD_SIZE``. (A gpumarket cluster sets ``WORLD_SIZE`` = nodes × GPUs per node; this script runs one process
  per node, so a cluster's workload gives ``NNODES`` or ``LOCAL_WORLD_SIZE``.)
* This node's rank: ``NODE_RANK`` when set, else ``RANK``.
* ``ALLREDUCE_TIMEOUT``: seconds (default 120) to wait for the network and for the process group.

The cluster's network may come up a few seconds after the containers start, so every rank first waits, up to the
timeout, until ``MASTER_ADDR`` resolves, and ranks above 0 also until ``MASTER_ADDR:MASTER_PORT`` accepts a connection
(rank 0 opens that port itself). Then ``torch.distributed.init_process_group("gloo", init_method="env://")``, and
each rank contributes ``arange(4) * (rank + 1)`` to an all-reduce (sum): every rank must get ``arange(4) * n(n+1)/2``.

It prints one JSON line on stdout, ``{"rank": r, "world_size": n, "sum": [...], "expected": [...], "ok": true}``
(with ``"error"`` and ``"ok": false`` when it could not take part), and exits 0 when the sum is right, 1 otherwise.
Diagnostics go to stderr.

The interface gloo uses: ``GLOO_SOCKET_IFNAME`` when the environment names one (this script never sets it).
Otherwise gloo resolves this machine's hostname and binds to the address it resolves to, falling back to the
loopback address — which the other nodes cannot reach — when the hostname does not resolve to a local address. In a
Docker container on a bridge network the hostname (the short container id) resolves, through the ``/etc/hosts``
Docker writes, to the container's address on that network: the right one. With several networks, or a hostname that
resolves to 127.0.0.1, set ``GLOO_SOCKET_IFNAME`` (say ``eth0``); this script warns on stderr when the hostname
resolves to loopback addresses only.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time
from collections.abc import Mapping
from datetime import timedelta
from typing import Any

DEFAULT_TIMEOUT = 120.0
LENGTH = 4


def nodes_and_rank(env: Mapping[str, str]) -> tuple[int, int]:
    """``(number of nodes, this node's rank)`` from the environment (see the module's docstring)."""
    if env.get("NNODES"):
        nodes = int(env["NNODES"])
    elif env.get("LOCAL_WORLD_SIZE"):
        nodes = int(env["WORLD_SIZE"]) // int(env["LOCAL_WORLD_SIZE"])
    else:
        nodes = int(env["WORLD_SIZE"])
    rank = int(env["NODE_RANK"] if env.get("NODE_RANK") else env["RANK"])
    if nodes < 1 or not 0 <= rank < nodes:
        raise ValueError(f"rank {rank} is not one of {nodes} nodes")
    return nodes, rank


def expected_sum(nodes: int) -> list[int]:
    return [i * nodes * (nodes + 1) // 2 for i in range(LENGTH)]


def log(text: str) -> None:
    print(f"allreduce: {text}", file=sys.stderr, flush=True)


def wait_for_master(addr: str, port: int, rank: int, deadline: float) -> None:
    """Until ``addr`` resolves and, for ranks above 0, ``addr:port`` accepts a connection; ``TimeoutError`` after ``deadline``."""
    why = ""
    while True:
        try:
            infos = socket.getaddrinfo(addr, port, type=socket.SOCK_STREAM)
            if rank == 0:
                return
            for family, kind, proto, _, address in infos:
                with socket.socket(family, kind, proto) as probe:
                    probe.settimeout(max(0.1, min(2.0, deadline - time.monotonic())))
                    try:
                        probe.connect(address)
                        return
                    except OSError as exc:
                        why = f"{address[0]}:{port}: {exc}"
        except OSError as exc:
            why = f"{addr} does not resolve: {exc}"
        if time.monotonic() >= deadline:
            raise TimeoutError(f"the master is not reachable ({why})")
        time.sleep(0.25)


def warn_if_hostname_is_loopback() -> None:
    if os.environ.get("GLOO_SOCKET_IFNAME"):
        return
    hostname = socket.gethostname()
    try:
        addresses = {str(info[4][0]) for info in socket.getaddrinfo(hostname, None, type=socket.SOCK_STREAM)}
    except OSError as exc:
        log(
            f"hostname {hostname!r} does not resolve ({exc}): gloo falls back to loopback; set GLOO_SOCKET_IFNAME"
        )
        return
    if all(address.startswith("127.") or address == "::1" for address in addresses):
        log(f"hostname {hostname!r} resolves to loopback only ({sorted(addresses)}); set GLOO_SOCKET_IFNAME")


def run(env: Mapping[str, str], result: dict[str, Any]) -> None:
    """Take part in the all-reduce; fills in ``result`` as it goes."""
    nodes, rank = nodes_and_rank(env)
    result.update(rank=rank, world_size=nodes, expected=expected_sum(nodes))
    timeout = float(env.get("ALLREDUCE_TIMEOUT") or DEFAULT_TIMEOUT)
    deadline = time.monotonic() + timeout
    addr, port = env["MASTER_ADDR"], int(env["MASTER_PORT"])
    wait_for_master(addr, port, rank, deadline)
    warn_if_hostname_is_loopback()

    import torch  # type: ignore[import-not-found, unused-ignore]  # late: the waiting above needs none of it
    import torch.distributed as dist  # type: ignore[import-not-found, unused-ignore]

    dist.init_process_group(
        "gloo",
        init_method="env://",
        world_size=nodes,
        rank=rank,
        timeout=timedelta(seconds=max(1.0, deadline - time.monotonic())),
    )
    try:
        tensor = torch.arange(LENGTH, dtype=torch.int64) * (rank + 1)
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
        result["sum"] = [int(value) for value in tensor.tolist()]
    finally:
        dist.destroy_process_group()
    result["ok"] = result["sum"] == result["expected"]


def main() -> int:
    result: dict[str, Any] = {}
    try:
        run(os.environ, result)
    except Exception as exc:  # reported as one JSON line, like a result
        log(f"{type(exc).__name__}: {exc}")
        result.update(ok=False, error=f"{type(exc).__name__}: {exc}")
    keys = ("rank", "world_size", "sum", "expected", "ok", "error")
    print(json.dumps({key: result[key] for key in keys if key in result}), flush=True)
    return 0 if result.get("ok") else 1


if __name__ == "__main__":
    sys.exit(main())
