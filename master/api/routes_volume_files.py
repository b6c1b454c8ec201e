"""A volume's files without a rental (``/volumes/{volume}/connect``): a token for its file-only session.

The rules live in ``master/services/volumes/files.py``; the agent's side in ``agent/reach/volumefiles.py``.
"""

from __future__ import annotations

from aiohttp import web
from pydantic import BaseModel, Field

from master.api.base import Route
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
)  # fmt: skip
