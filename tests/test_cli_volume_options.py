"""``--volume NAME:/MOUNT[:ro]`` on ``gpumarket rent``, ``cluster create`` and ``service create``: what each sends as
the request's ``volumes`` (docs/volumes.md), and the combinations refused before anything is asked of the API."""

from __future__ import annotations

import argparse
from typing import Any

import pytest

from gpumarket.cli import build_parser
from gpumarket.renter.api import UsageError
from gpumarket.renter.clusters import cluster_body
from gpumarket.renter.renting import rental_body
from gpumarket.renter.services import service_body


def parse(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(list(argv))


def test_rent_sends_each_volume_by_name_or_id_read_only_where_asked() -> None:
    args = parse("rent", "--template", "demo", "--volume", "data:/data", "--volume", "vol-0123456789abcdef:/weights:ro")
    assert rental_body(args)["volumes"] == [
        {"name": "data", "mount": "/data"},
        {"id": "vol-0123456789abcdef", "mount": "/weights", "read_only": True},
    ]
    assert "volumes" not in rental_body(parse("rent", "--template", "demo"))


@pytest.mark.parametrize("bad", ["data", "data:", "data:relative", ":/data", "data:/data:rx"])
def test_a_malformed_volume_is_a_usage_error(bad: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        parse("rent", "--template", "demo", "--volume", bad)
    assert exited.value.code == 2 and "--volume takes NAME:/MOUNT" in capsys.readouterr().err


def test_a_hold_has_nothing_to_mount_a_volume_in() -> None:
    with pytest.raises(UsageError, match="--template or --image"):
        rental_body(parse("rent", "--volume", "data:/data"))


def test_a_cluster_names_each_members_volume_with_rank() -> None:
    args = parse("cluster", "create", "--nodes", "2", "--template", "demo", "--volume", "ckpt-{rank}:/ckpt")
    assert cluster_body(args)["volumes"] == [{"name": "ckpt-{rank}", "mount": "/ckpt"}]
    with pytest.raises(UsageError, match=r"\{rank\}"):
        cluster_body(parse("cluster", "create", "--nodes", "2", "--template", "demo", "--volume", "ckpt:/ckpt"))


async def test_a_services_volumes_are_read_only() -> None:
    base = ("service", "create", "chat", "--image", "vllm/vllm:1", "--port", "8000")
    client: Any = None  # an image's port is given: the body needs nothing from the API
    body = await service_body(parse(*base, "--volume", "weights:/models:ro"), client)
    assert body["volumes"] == [{"name": "weights", "mount": "/models", "read_only": True}]
    with pytest.raises(UsageError, match=":ro"):
        await service_body(parse(*base, "--volume", "weights:/models"), client)
