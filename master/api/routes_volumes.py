"""Volumes (``/volumes``): a renter's disk on one host that outlives its rentals (docs/volumes.md).

Handlers parse and authorize; the rules live in ``master/services/volumes/`` (``core.py``: the host chosen, the
refusals, reading, deleting). Every route takes a volume's id or its name. Another account's volume is 404
``volume_not_found``, as one that does not exist.
"""

from __future__ import annotations

from aiohttp import web

from master.api.base import (
    BOOLEAN,
    PAGING,
    QueryParam,
    Route,
    choice_query,
    idempotency_key,
    listing,
    page,
    parse_body,
)
from master.api.keys import MASTER
from master.api.middleware import principal
from master.api.schemas_volumes import VolumeCreate
from master.services import volumes


async def create_volume(request: web.Request) -> web.Response:
    body = await parse_body(request, VolumeCreate)
    key = idempotency_key(request)
    wanted = volumes.VolumeRequest(
        name=body.name, size_gib=body.size_gib, host_id=body.host_id, region=body.region
    )
    master = request.app[MASTER]
    volume, created = await volumes.create_volume(master, principal(request), wanted, idempotency_key=key)
    async with master.db.session() as session:
        view = await volumes.volume_detail(session, principal(request), volume.id)
    return web.json_response(view, status=201 if created else 200)


async def list_volumes(request: web.Request) -> web.Response:
    limit, offset = page(request)
    include_deleted = choice_query(request, "deleted", BOOLEAN) == "true"
    async with request.app[MASTER].db.session() as session:
        items, total = await volumes.list_volumes(session, principal(request), limit=limit, offset=offset,
                                                  include_deleted=include_deleted)  # fmt: skip
    return listing(items, total, limit, offset)


async def get_volume(request: web.Request) -> web.Response:
    async with request.app[MASTER].db.session() as session:
        view = await volumes.volume_detail(session, principal(request), request.match_info["volume_id"])
    return web.json_response(view)


async def delete_volume(request: web.Request) -> web.Response:
    master = request.app[MASTER]
    volume = await volumes.delete_volume(master, principal(request), request.match_info["volume_id"])
    async with master.db.session() as session:
        view = await volumes.volume_detail(session, principal(request), volume.id)
    return web.json_response(view, status=202)


ROUTES: tuple[Route, ...] = (
    Route(
        "POST",
        "/volumes",
        create_volume,
        "Make a volume: size_gib GiB on one host's disk (host_id; else the cheapest "
        "host with room, in region if given), kept until you delete it and billed per GiB-hour meanwhile. It is "
        "creating until the host's agent has made it, then ready (200: a repeat of an Idempotency-Key).",
        verified=True,
        roles=("renter",),
        body=VolumeCreate,
        success=201,
        also_success=(200,),
        headers=("Idempotency-Key",),
        errors=(400, 404, 409, 422),
    ),
    Route(
        "GET",
        "/volumes",
        list_volumes,
        "Your volumes, newest first (deleted ones with ?deleted=true).",
        query=(*PAGING, QueryParam("deleted", "string", "true: deleted volumes too.", choices=BOOLEAN)),
    ),
    Route(
        "GET",
        "/volumes/{volume_id}",
        get_volume,
        "One volume, by id or name: its host, state, price, the rentals that mount it and its events.",
        errors=(404,),
    ),
    Route(
        "DELETE",
        "/volumes/{volume_id}",
        delete_volume,
        "Delete a volume, by id or name: billing stops now, its files go "
        "once its host's agent confirms (state deleting, then deleted). 409 volume_in_use while a rental mounts it.",
        success=202,
        errors=(404, 409),
    ),
)
