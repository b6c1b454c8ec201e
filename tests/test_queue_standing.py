"""What a queued rental tells its renter: what it waits for, its place in the queue, when it gives up.

The ``queue`` field of a rental's view (``master/services/queue.py``: ``queue_standing``), on
``GET /rentals/{id}``, ``GET /rentals`` and ``POST /rentals``; and the line ``gpumarket rent`` prints.
"""

from __future__ import annotations

import time
from typing import Any

from gpumarket.renter.renting import _progress_line
from master.services import queue as rental_queue
from tests.apiclient import RTX, Api


async def rent(api: Api, **body: Any) -> dict[str, Any]:
    status, rental = await api.as_renter("POST", "/rentals", json={"gpu_count": 1, **body})
    assert status == 201, rental
    return dict(rental)


class TestQueueStanding:
    async def test_two_queued_rentals_say_what_they_wait_for_and_their_place(self, api: Api) -> None:
        """Behind a full host, the older queued rental is 1 of 2 and the newer 2 of 2, each naming the GPUs it waits for;
        once the first is placed it has no standing and the second moves up to 1 of 1."""
        await api.host(2, name=RTX)
        blocker = await rent(api, gpu_model="RTX 4090", gpu_count=2)
        assert blocker["queue"] is None  # placed at once: not queued
        first = await rent(api, gpu_model="RTX 4090", queue=True, queue_timeout_s=600)
        second = await rent(api, gpu_count=2, queue=True, queue_timeout_s=600)

        assert first["queue"]["position"] == 1  # POST's answer already says it
        _, one = await api.as_renter("GET", f"/rentals/{first['id']}")
        _, two = await api.as_renter("GET", f"/rentals/{second['id']}")
        assert (one["queue"]["position"], one["queue"]["length"]) == (1, 2)
        assert (two["queue"]["position"], two["queue"]["length"]) == (2, 2)
        assert one["queue"]["message"].startswith(f"queued: will start when 1 × {one['gpu_model']} is free; position 1 of 2")
        assert two["queue"]["message"].startswith(
            "queued: will start when 2 × GPU(s) matching your request are free; position 2 of 2"
        )
        assert "gives up at" in two["queue"]["message"]
        _, listing = await api.as_renter("GET", "/rentals")
        by_id = {item["id"]: item["queue"] for item in listing["items"]}
        assert by_id[first["id"]] == one["queue"] and by_id[second["id"]] == two["queue"] and by_id[blocker["id"]] is None

        await api.as_renter("DELETE", f"/rentals/{blocker['id']}")
        await api.agent_reports(blocker["id"], "stop_workload")
        assert await rental_queue.process_queue(api.master) == 1  # the first takes one freed GPU; the second needs both
        _, one = await api.as_renter("GET", f"/rentals/{first['id']}")
        _, two = await api.as_renter("GET", f"/rentals/{second['id']}")
        assert one["queue"] is None and one["state"] == "starting"
        assert (two["queue"]["position"], two["queue"]["length"]) == (1, 1)
        assert "position 1 of 1" in two["queue"]["message"]

    def test_rents_progress_line_carries_the_queue_message(self) -> None:
        """`gpumarket rent`'s progress line for a queued rental is the API's message, not a generic one."""
        message = "queued: will start when 2 × A100 are free; position 3 of 5"
        view = {"id": "r-1", "queued": True, "queue": {"position": 3, "length": 5, "message": message}}
        line = _progress_line(view, "pending", None, time.monotonic())
        assert line.endswith(f"r-1: pending ({message})")
