"""Volumes (docs/volumes.md; REST ``/api/v1/volumes``): a renter's disk on one host that outlives its rentals,
which rentals mount it, what it costs to keep, and how its files move.

Below ``rentals`` (placement asks it where a rental with volumes may go, and records the attachments), above
``market`` (hosts' storage terms) and ``accounts``; never imports rentals, clusters or endpoints.

* ``lifecycle.py``: the states and their table (``transition``), deletion asked (``request_deletion``).
* ``attach.py``: rentals mount them: a request's entries (``VolumeAsk``, ``check_asks``), the volumes and hosts they
  name (``resolve``), the attachments (``attach``; released by the rentals' state machine when a rental ends).
* ``files.py``: a volume's files without a rental (``connect_volume``: a token to its file-only session).
* ``request.py``: the typed create request (``VolumeRequest``), names and their rule.
* ``core.py``: create (idempotent, the host chosen), get by id or name, list, delete, views, and the agents' results
  (``apply_result``).
* ``copy.py``: a volume copied host to host by the destination's agent (``start_copy``, ``copy_status``; the agent's
  progress and result: ``apply_copy_progress``, ``apply_copy_result``).
"""

from master.services.volumes.attach import (
    RANK,
    Resolved,
    VolumeAsk,
    asks_of,
    attach,
    check_asks,
    holders,
    hosts_down,
    resolve,
    writer,
)
from master.services.volumes.copy import KIND as COPY_KIND
from master.services.volumes.copy import apply_copy_progress, apply_copy_result, copy_status, start_copy
from master.services.volumes.core import (
    KINDS,
    apply_result,
    choose_host,
    create_volume,
    delete_volume,
    get_volume,
    list_volumes,
    mounted_by,
    volume_detail,
    volume_view,
)
from master.services.volumes.files import connect_volume
from master.services.volumes.lifecycle import LIVE, VolumeState, request_deletion, transition
from master.services.volumes.request import NAME_PATTERN, VolumeRequest, is_volume_id, name_problem

__all__ = [
    "COPY_KIND",
    "KINDS",
    "LIVE",
    "NAME_PATTERN",
    "RANK",
    "Resolved",
    "VolumeAsk",
    "VolumeRequest",
    "VolumeState",
    "apply_copy_progress",
    "apply_copy_result",
    "apply_result",
    "asks_of",
    "attach",
    "check_asks",
    "choose_host",
    "connect_volume",
    "copy_status",
    "create_volume",
    "delete_volume",
    "get_volume",
    "holders",
    "hosts_down",
    "is_volume_id",
    "list_volumes",
    "mounted_by",
    "name_problem",
    "request_deletion",
    "resolve",
    "start_copy",
    "transition",
    "volume_detail",
    "volume_view",
    "writer",
]
