"""PyTorch's gloo all-reduce across three containers of the torch test image, as a cluster's nodes would run it.

The image is built here from Debian's ``python3-torch`` (``tests/dockerengine.py``: ``torch_image``) and runs
``tests/allreduce.py``. The three containers share one user-defined bridge network on which they are ``node-0``,
``node-1`` and ``node-2`` (network aliases, resolved by Docker's DNS), and get a cluster's environment:
``MASTER_ADDR=node-0``, ``MASTER_PORT``, ``WORLD_SIZE=3`` and ``RANK``. The workers start first, so they wait for the
master. Everything is labelled with the test's owner and removed afterwards (``dockerengine.remove_owned``).
"""

from __future__ import annotations

import json
import secrets
import time
from typing import Any
from urllib.parse import quote

import pytest

from agent.runtimes.containeropts import OWNER_LABEL
from tests import dockerengine

NODES = 3
MASTER_PORT = 29500
TIMEOUT = 150.0


def call(method: str, path: str, document: dict[str, Any] | None = None, **options: Any) -> tuple[int, bytes]:
    body = None if document is None else json.dumps(document).encode()
    return dockerengine.request(
        method, path, body=body, headers={"Content-Type": "application/json"}, **options
    )


def output(container: str) -> tuple[str, str]:
    """The container's stdout and stderr (the engine multiplexes them: an 8-byte header before each frame)."""
    status, body = call("GET", f"/containers/{container}/logs?stdout=1&stderr=1")
    assert status == 200, body
    streams = {1: bytearray(), 2: bytearray()}
    while len(body) >= 8:
        kind, size = body[0], int.from_bytes(body[4:8], "big")
        streams.setdefault(kind, bytearray()).extend(body[8 : 8 + size])
        body = body[8 + size :]
    return streams[1].decode(errors="replace"), streams[2].decode(errors="replace")


@pytest.mark.timeout(600)  # the first run builds the image (seconds to a minute or two)
def test_gloo_all_reduce_across_three_containers(torch_image: str) -> None:
    owner = f"test-torch-{secrets.token_hex(4)}"
    labels = {OWNER_LABEL: owner}
    network = f"{owner}-net"
    try:
        status, body = call(
            "POST",
            "/networks/create",
            {"Name": network, "Driver": "bridge", "Labels": labels, "CheckDuplicate": True},
        )
        assert status == 201, body
        containers = []
        for rank in range(NODES):
            config = {
                "Image": torch_image,
                "Cmd": ["python3", "/opt/gpumarket/allreduce.py"],
                "Env": [
                    "MASTER_ADDR=node-0",
                    f"MASTER_PORT={MASTER_PORT}",
                    f"WORLD_SIZE={NODES}",
                    f"RANK={rank}",
                    f"ALLREDUCE_TIMEOUT={TIMEOUT - 30:g}",
                ],
                "Labels": labels,
                "HostConfig": {"NetworkMode": network},
                "NetworkingConfig": {"EndpointsConfig": {network: {"Aliases": [f"node-{rank}"]}}},
            }
            status, body = call("POST", f"/containers/create?name={quote(f'{owner}-node-{rank}')}", config)
            assert status == 201, body
            containers.append(json.loads(body)["Id"])
        for container in reversed(containers):  # the workers first: they wait for the master's port
            status, body = call("POST", f"/containers/{container}/start")
            assert status == 204, body

        deadline = time.monotonic() + TIMEOUT
        exits: list[int | str] = []
        for container in containers:
            try:
                status, body = call(
                    "POST", f"/containers/{container}/wait", timeout=max(1.0, deadline - time.monotonic())
                )
                exits.append(
                    json.loads(body)["StatusCode"] if status == 200 else f"wait answered {status}: {body!r}"
                )
            except TimeoutError:
                exits.append(f"still running after {TIMEOUT:g}s")
        outputs = [output(container) for container in containers]
        report = "\n".join(
            f"node-{rank}: exit {code}\n  stdout: {out.strip()}\n  stderr: {err.strip()[-2000:]}"
            for rank, (code, (out, err)) in enumerate(zip(exits, outputs, strict=True))
        )
        assert exits == [0] * NODES, report
        results = [json.loads(out.strip().splitlines()[-1]) for out, _ in outputs]
        expected = [i * NODES * (NODES + 1) // 2 for i in range(4)]  # each rank gave arange(4) * (rank + 1)
        assert [result["rank"] for result in results] == list(range(NODES)), report
        for result in results:
            assert result == {
                "rank": result["rank"],
                "world_size": NODES,
                "sum": expected,
                "expected": expected,
                "ok": True,
            }
        assert not any("loopback" in err for _, err in outputs), report  # gloo used the bridge, not 127.0.0.1
    finally:
        dockerengine.remove_owned(owner)
