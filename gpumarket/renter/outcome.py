"""What ``gpumarket rent`` says once it stops waiting: the rental's id and state (and each declared port's web address)
on stdout, and on stderr only next steps that work in that state — why it failed (code and owner) when it did, its
output only when there is some, no shell or logs for a hold (``tests/test_cli_hints.py`` runs each one)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from gpumarket.renter.api import Client, CliError
from gpumarket.renter.connect import declared_ports, port_lines
from gpumarket.renter.output import err, money

ENDED_STATES = ("stopped", "failed", "preempted")


def failed(rental: Mapping[str, Any]) -> bool:
    """Ended without having run to its end: failed, preempted, or stopped before it started (or with a reason)."""
    if rental["state"] == "stopped":
        return bool(rental.get("failure_reason")) or not rental.get("started_at")
    return rental["state"] in ENDED_STATES


# What to do after a failure, by whose it is (``failure_owner``: docs/reliability.md).
NEXT_AFTER_FAILURE = {
    "renter": "it is the workload's own: fix it and rent again",
    "provider": "it is the host's: rent again on another (`gpumarket offers` lists them)",
    "platform": "it is the marketplace's: rent again (`gpumarket offers` lists what is free)",
}


async def has_logs(client: Client, rental_id: str) -> bool:
    """Whether the rental's workload has written any output (``gpumarket logs`` would print something)."""
    try:
        body = await client.get(f"/rentals/{rental_id}/logs", {"offset": 0})
    except CliError:
        return False
    return bool(body.get("next_offset"))


def failure_text(rental: Mapping[str, Any]) -> str:
    """Why the rental ended without running to its end: its reason, typed code and owner (when it has them)."""
    reason = rental.get("failure_reason") or ("it was stopped before it ran" if rental["state"] == "stopped" else "no reason given")
    code, owner = rental.get("failure_code"), rental.get("failure_owner")
    return f"{reason} ({code}, {owner}'s failure)" if code and owner else f"{reason} ({code})" if code else str(reason)


async def print_rental_outcome(client: Client, rental: Mapping[str, Any]) -> None:
    """The rental's id and state on stdout (and each declared port's web address once it runs); on stderr what to do
    next: only commands that work in the state it is in (tests/test_cli_hints.py runs each)."""
    rid, rstate = rental["id"], rental["state"]
    logs = f"its output: `gpumarket logs {rid}`; " if rstate in ENDED_STATES and await has_logs(client, rid) else ""
    if failed(rental):
        print(f"{rid} {rstate}")
        owner = rental.get("failure_owner")
        next_step = NEXT_AFTER_FAILURE.get(owner or "", "`gpumarket offers` lists what is free to rent now")
        err(f"gpumarket: rental {rid} {rstate}: {failure_text(rental)}; {logs}{next_step}")
        return
    if rstate in ENDED_STATES:  # it ran, and its workload has already ended
        print(f"{rid} {rstate}")
        err(f"the workload ran and ended; {logs or 'it printed nothing; '}`gpumarket rentals --all` lists it")
        return
    gpus = f"{rental.get('gpu_count')} x {rental.get('gpu_model') or 'GPU'}"
    price = f", {money(rental['price_per_hour'], 'rate')}/h" if rental.get("price_per_hour") else ""
    print(f"{rid} {rstate}: {gpus}{price}")
    if rstate != "running":
        err(f"follow it with `gpumarket rentals`; stop it with `gpumarket stop {rid}`")
        return
    for line in await port_lines(client, rental):
        print(line)
    if (rental.get("workload") or {}).get("kind", "hold") == "hold":
        err(f"it holds the GPUs and runs nothing; stop: gpumarket stop {rid}")
        return
    hints = [f"shell: gpumarket ssh {rid}", f"files: gpumarket cp FILE {rid}:"] if rental.get("ssh_host_key") else []
    hints += [f"web: gpumarket open {rid} {number}" for number in declared_ports(rental)]
    hints += [f"logs: gpumarket logs {rid} -f", f"stop: gpumarket stop {rid}"]
    err("; ".join(hints))
