"""The agent's command lanes: which worker runs each kind, and a full lane dropping (the master resends)."""

from __future__ import annotations

from agent.commands import CommandLanes
from shared import protocol


def command(kind: str, n: int = 0) -> protocol.CommandBody:
    return protocol.CommandBody(command_id=f"cmd-{kind}-{n}", kind=kind, args={})


def test_each_kind_goes_to_its_lane_and_keeps_its_order() -> None:
    lanes = CommandLanes(8)
    kinds = ["start_workload", "update_access", "start_challenge", "copy_volume", "open_volume", "reveal_challenge", "stop_workload"]
    for n, kind in enumerate(kinds):
        lanes.put(command(kind, n))
    got = {lane: [queue.get_nowait().kind for _ in range(queue.qsize())] for lane, queue in lanes.queues.items()}
    assert got == {
        "commands": ["start_workload", "stop_workload"],
        "access": ["update_access", "open_volume"],
        "challenges": ["start_challenge", "reveal_challenge"],
        "copies": ["copy_volume"],
    }


def test_a_full_lane_drops_the_command_and_leaves_the_others_alone() -> None:
    lanes = CommandLanes(1)
    lanes.put(command("start_workload", 1))
    lanes.put(command("start_workload", 2))  # dropped: the master resends a command without a result
    lanes.put(command("update_access", 3))
    assert [lanes.queues["commands"].get_nowait().command_id] == ["cmd-start_workload-1"]
    assert lanes.queues["commands"].empty()
    assert lanes.queues["access"].get_nowait().command_id == "cmd-update_access-3"
