"""A volume's files without a rental (``/volumes/{volume}/connect``): a token for its file-only session; and a
volume copied host to host by the destination's agent (``/volumes/{volume}/copy``).

The rules live in ``master/services/volumes/files.py`` and ``copy.py``; the agent's side in
``agent/reach/volumefiles.py`` and ``agent/volumecopy.py``.
"""

from __future__ import annotations

from aiohttp import web
from pydantic import BaseModel, ConfigDict, Field

from master.api.base import QueryParam, Route, parse_body
from master.api.keys import MASTER
from master.api.middleware import principal
from master.api.responses import SshEndpoint
from master.services import volumes


class VolumeConnectView(BaseModel):
    volume_id: str
    name: str
    kind: str = Field(
        description='Always "ssh": the volume\'s file-only session (SFTP, scp, rsync; no shell).'
    )
    port: int
    relay_id: str
    relay_url: str = Field(description="wss:// URL: open a websocket with 'Authorization: Bearer <token>'; binary messages "
                           "carry the SSH connection's bytes both ways.")  # fmt: skip
    token: str = Field(description="Opens connections until expires_at; connections outlive it.")
    expires_at: str
    ca_pem: str = Field(description="The CA the relay's TLS certificate chains to.")
    ssh: SshEndpoint


class VolumeCopyCreate(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    source: str = Field(alias="from", min_length=1, max_length=64,
                        description="The volume to copy from (yours, ready, on another host), by id or name.")  # fmt: skip


class VolumeCopyEvent(BaseModel):
    at: str
    phase: str = Field(description="started, progress, succeeded or failed.")
    text: str


class VolumeCopyView(BaseModel):
    copy_id: str
    volume_id: str
    state: str = Field(description="running, succeeded or failed.")
    progress: str = Field("", description="The newest progress line (files, bytes, MiB/s).")
    detail: str = Field(
        "", description="How it ended: the figures and the tree's SHA-256, or the failure's code and why."
    )
    events: list[VolumeCopyEvent] = Field(default_factory=list)


async def start_copy(request: web.Request) -> web.Response:
    body = await parse_body(request, VolumeCopyCreate)
    view = await volumes.start_copy(
        request.app[MASTER], principal(request), request.match_info["volume"], body.source
    )
    return web.json_response(view, status=202)


async def copy_status(request: web.Request) -> web.Response:
    copy_id = request.query.get("copy_id") or None
    view = await volumes.copy_status(
        request.app[MASTER], principal(request), request.match_info["volume"], copy_id
    )
    return web.json_response(view)


async def connect_volume(request: web.Request) -> web.Response:
    view = await volumes.connect_volume(request.app[MASTER], principal(request), request.match_info["volume"])
    return web.json_response(view)


ROUTES: tuple[Route, ...] = (
    Route("POST", "/volumes/{volume}/connect", connect_volume,
          "Open your ready volume's files without a rental (by id or name): a token (about two minutes) for the relay "
          "its host is on, to a file-only SSH session (SFTP, scp, rsync; no shell) jailed in the volume, with your SSH "
          "keys and the pinned host key. Costs nothing beyond the storage. 404 volume_not_found; 409 volume_not_ready, "
          "host_offline, volume_opening (try again) or volume_unsupported.",
          response=VolumeConnectView, errors=(404, 409)),
    Route("POST", "/volumes/{volume}/copy", start_copy,
          "Copy another of your volumes (`from`, on another host) into this one, host to host: this volume's host pulls "
          "the files through the relays (resumable: files already complete here are skipped), reports progress, and "
          "compares both trees' SHA-256 at the end (GET this path to follow it). 404 volume_not_found; 422 "
          "volume_copy_same_volume; 409 volume_not_ready, volume_copy_same_host, volume_in_use, volume_copy_running, "
          "host_offline, volume_opening.",
          body=VolumeCopyCreate, success=202, errors=(404, 409, 422)),
    Route("GET", "/volumes/{volume}/copy", copy_status,
          "The latest copy into this volume (or `?copy_id=`): running, succeeded or failed, its newest progress and "
          "its events. 404 volume_not_found, volume_copy_not_found.",
          response=VolumeCopyView, errors=(404,), query=(QueryParam("copy_id", "string", "One copy (vcp-…) rather than the latest."),)),
)  # fmt: skip
