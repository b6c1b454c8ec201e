"""``shared.slowstop``: a shutdown step that runs long is named, with what every task waits on."""

from __future__ import annotations

import asyncio
import logging

import pytest

from shared.slowstop import step


async def _stuck_on_the_queue(queue: asyncio.Queue[int]) -> int:
    return await queue.get()


async def test_a_quick_step_says_nothing_and_returns_its_result(caplog: pytest.LogCaptureFixture) -> None:
    said: list[str] = []
    assert await step("quick", asyncio.sleep(0, result=7), progress=said.append, warn_after=1.0) == 7
    assert said == [] and not caplog.records


async def test_a_slow_step_is_named_once_and_the_log_shows_where_each_task_waits(caplog: pytest.LogCaptureFixture) -> None:
    queue: asyncio.Queue[int] = asyncio.Queue()
    blocked = asyncio.create_task(_stuck_on_the_queue(queue), name="the-blocked-one")
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
    assert "the-blocked-one" in record.getMessage() and "_stuck_on_the_queue" in record.getMessage()


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
