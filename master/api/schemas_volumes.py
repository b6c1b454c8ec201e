"""Request bodies of the volumes' routes (``master/api/routes_volumes.py``; docs/volumes.md)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from shared.protocol import MAX_VOLUME_GIB


class VolumeCreate(BaseModel):
    """A volume: ``size_gib`` GiB named ``name``, on ``host_id`` or on the cheapest host with room (in ``region``)."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(
        min_length=1,
        max_length=64,
        description="1 to 64 of a-z, 0-9, '-', '_' and '.', starting with a "
        "letter or digit, unique among your live volumes; routes take it or the volume's id.",
    )
    size_gib: int = Field(
        ge=1,
        le=MAX_VOLUME_GIB,
        description="The volume's size in GiB: a hard limit (ENOSPC past it), "
        "billed per GiB-hour whether a rental mounts it or not.",
    )
    host_id: str | None = Field(
        None,
        min_length=1,
        max_length=64,
        description="The host it lives on (GET /offers shows "
        "each host's storage price and volume_gib_free). Excludes region.",
    )
    region: str | None = Field(
        None,
        min_length=1,
        max_length=64,
        description="Without host_id: the cheapest host with "
        "room in this region; without either, the cheapest anywhere.",
    )
