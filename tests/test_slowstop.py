"""``shared.slowstop``: a shutdown step that runs long is named, with what every task waits on."""

from __future__ import annotations

import asyncio
import logging

import pytest

from shared.slowstop import step


async def _stuck_on_the_queue(queue: asyncio.Queue[int]) -> int:
    return await queue.get()


async def _outer(queue: asyncio.Queue[int]) -> int:
    return await _stuck_on_the_queue(queue)


async def test_a_quick_step_says_nothing_and_returns_its_result(caplog: pytest.LogCaptureFixture) -> None:
    said: list[str] = []
    assert await step("quick", asyncio.sleep(0, result=7), progress=said.append, warn_after=1.0) == 7
    assert said == [] and not caplog.records


async def test_a_slow_step_is_named_once_and_the_log_shows_where_each_task_waits(caplog: pytest.LogCaptureFixture) -> None:
    queue: asyncio.Queue[int] = asyncio.Queue()
    blocked = asyncio.create_task(_outer(queue), name="the-blocked-one")
    said: list[str] = []
    with caplog.at_level(logging.WARNING, logger="shared.slowstop"):
        slow = asyncio.create_task(step("the relay", blocked, progress=said.append, warn_after=0.05))
        await asyncio.sleep(0.2)
        assert said == ["still stopping: the relay (over 0.05 s)"]
        queue.put_nowait(3)
        assert await slow == 3
    assert said == ["still stopping: the relay (over 0.05 s)"]  # once, not once per period
    (record,) = caplog.records
    assert "stopping the relay has taken over 0.05 s" in record.getMessage()
    message = record.getMessage()
    # The task's own stack ends at _outer; the chain goes on to the line that waits, inside the queue.
    assert "--- task the-blocked-one\n" in message
    chain = message.split("--- task the-blocked-one\n")[1].split("---")[0]
    assert [line.split(" in ")[-1] for line in chain.strip().splitlines()][:3] == ["_outer", "_stuck_on_the_queue", "get"]


async def test_cancelling_the_stop_cancels_the_step_it_waits_on() -> None:
    never: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    stopping = asyncio.create_task(step("forever", never, warn_after=10.0))
    await asyncio.sleep(0.01)
    stopping.cancel()
    with pytest.raises(asyncio.CancelledError):
        await stopping
    assert never.cancelled()


async def test_an_error_in_the_step_reaches_the_caller() -> None:
    async def fails() -> None:
        raise OSError("the socket is gone")

    with pytest.raises(OSError, match="socket is gone"):
        await step("the geo DNS", fails(), warn_after=1.0)
