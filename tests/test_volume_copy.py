"""A volume copied host to host, on the master (issue 41, point 3; docs/volumes.md "Data in and out"): the refusals
of ``POST /volumes/{dst}/copy``, and what the agent's progress and result become (volume events, ``GET
/volumes/{dst}/copy``, the source's keys given back). Each test runs on SQLite and PostgreSQL (the ``api`` fixture).
The copy itself, with two real agents, is ``tests/test_volume_files.py::TestHostCopy``.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from sqlalchemy import select

from master.models import Command as CommandRow
from master.models import Volume, VolumeEvent
from master.services import commands, volumes
from shared import protocol
from tests.apiclient import Api, assert_error
from tests.factories import create_principal
from tests.test_volume_attach import volume

COPY_ID = "vcp-0123456789abcdef"


async def _copy_row(api: Api, dst_host: str, dst: str, src: str) -> str:
    """A ``copy_volume`` command as ``start_copy`` writes it (its sealed login is not opened here)."""
    command = protocol.CopyVolume(copy_id=COPY_ID, volume_id=dst, source_volume_id=src, relay_url="wss://relay/connect",
                                  source_host_key="ssh-ed25519 AAAA", sealed_login="ecies:v1:a:b:c")  # fmt: skip
    async with api.master.db.session() as session:
        row = commands.new_command(session, host_id=dst_host, command=command, rental_id=None)
        await session.commit()
        return row.id


class TestStartCopy:
    async def test_refusals_before_anything_is_sent(self, api: Api) -> None:
        """Same volume 422; same host, not ready, a copy running into it 409; another renter's volume 404."""
        host_a, _ = await api.host(1)
        host_b, _ = await api.host(1)
        await volume(api, host_a, "src")
        dst = await volume(api, host_b, "dst")
        await volume(api, host_b, "beside")
        await volume(api, host_a, "young", state="creating")
        cases = (
            ({"from": "dst"}, "dst", 422, "volume_copy_same_volume"),
            ({"from": "beside"}, "dst", 409, "volume_copy_same_host"),
            ({"from": "young"}, "dst", 409, "volume_not_ready"),
            ({"from": "nope"}, "dst", 404, "volume_not_found"),
        )
        for body, target, status, code in cases:
            got, view = await api.as_renter("POST", f"/volumes/{target}/copy", json=body)
            assert_error(got, view, status, code)
        got, view = await api.as_provider("POST", "/volumes/dst/copy", json={"from": "src"})
        assert_error(got, view, 404, "volume_not_found")
        await _copy_row(api, host_b, dst, await _volume_id(api, "src"))
        got, view = await api.as_renter("POST", "/volumes/dst/copy", json={"from": "src"})
        assert_error(got, view, 409, "volume_copy_running")
        assert view["details"]["copy_id"] == COPY_ID

    async def test_a_host_with_no_certificate_gets_no_login(self, api: Api) -> None:
        """The login is sealed to the destination's certificate key: a host without one is refused (host_offline)."""
        host_a, _ = await api.host(1)
        host_b, _ = await api.host(1)
        await volume(api, host_a, "src")
        await volume(api, host_b, "dst")
        got, view = await api.as_renter("POST", "/volumes/dst/copy", json={"from": "src"})
        assert_error(got, view, 409, "host_offline")


async def _volume_id(api: Api, name: str) -> str:
    async with api.master.db.session() as session:
        return str(await session.scalar(select(Volume.id).where(Volume.name == name)))


class TestCopyEvents:
    async def test_a_long_copy_still_shows_where_it_started(self, api: Api) -> None:
        """However many progress lines a slow copy wrote, its view shows its start and the newest ones (fresh run 41:
        a loaded machine's copy wrote enough of them to push the start out)."""
        host_a, _ = await api.host(1)
        host_b, _ = await api.host(1)
        await volume(api, host_a, "src")
        dst = await volume(api, host_b, "dst")
        at = datetime.now(UTC)
        async with api.master.db.session() as session:
            session.add(VolumeEvent(volume_id=dst, at=at, from_state="ready", to_state="ready",
                                    cause=f"copy {COPY_ID} started: from src"))  # fmt: skip
            for i in range(30):
                assert await volumes.apply_copy_progress(session, host_b, dst, text=f"{COPY_ID} {i}/30 files", at=at)
            await session.commit()
        status, view = await api.as_renter("GET", "/volumes/dst/copy")
        assert status == 200 and view["state"] == "running" and view["progress"] == "29/30 files"
        phases = [e["phase"] for e in view["events"]]
        assert phases[0] == "started" and phases[1:] == ["progress"] * (len(phases) - 1) and len(phases) == 20
        assert [e["text"] for e in view["events"][1:]] == [f"{i}/30 files" for i in range(11, 30)]

    async def test_progress_and_the_result_are_the_destinations_events_and_the_source_gets_its_keys_back(
        self, api: Api
    ) -> None:
        host_a, _ = await api.host(1)
        host_b, _ = await api.host(1)
        src = await volume(api, host_a, "src")
        dst = await volume(api, host_b, "dst")
        command_id = await _copy_row(api, host_b, dst, src)
        at = datetime.now(UTC)
        status, view = await api.as_renter("GET", "/volumes/dst/copy")
        assert_error(status, view, 404, "volume_copy_not_found")
        async with api.master.db.session() as session:
            session.add(VolumeEvent(volume_id=dst, at=at, from_state="ready", to_state="ready",
                                    cause=f"copy {COPY_ID} started: from src"))  # fmt: skip
            assert await volumes.apply_copy_progress(
                session, host_b, dst, text=f"{COPY_ID} 3/12 files, 1.0 MiB", at=at
            )
            # Another host's report of it is dropped.
            assert not await volumes.apply_copy_progress(
                session, host_a, dst, text=f"{COPY_ID} 9/12 files", at=at
            )
            await session.commit()
        status, view = await api.as_renter("GET", "/volumes/dst/copy")
        assert status == 200 and (view["state"], view["progress"]) == ("running", "3/12 files, 1.0 MiB")
        async with api.master.db.session() as session:
            row = await session.get(CommandRow, command_id)
            assert row is not None
            data = {
                "copy_id": COPY_ID,
                "files": 0,
                "bytes": 0,
                "skipped": 12,
                "tree": "ab 12 34",
                "code": "volume_copy_mismatch",
            }
            await volumes.apply_copy_result(session, row, ok=False, detail="the copy does not match", data=data,
                                            at=at + timedelta(seconds=1))  # fmt: skip
            await session.commit()
        status, view = await api.as_renter("GET", f"/volumes/{dst}/copy?copy_id={COPY_ID}")
        assert status == 200 and view["state"] == "failed"
        assert view["detail"] == "volume_copy_mismatch: the copy does not match"
        assert [e["phase"] for e in view["events"]] == ["started", "progress", "failed"]
        async with api.master.db.session() as session:
            given_back = (
                await session.scalars(select(CommandRow).where(CommandRow.kind == "update_access"))
            ).all()
        assert [(c.host_id, c.args["rental_id"]) for c in given_back] == [(host_a, src)]
        assert not any(
            "gpumarket-volume-copy" in key for key in given_back[0].args.get("authorized_keys", [])
        )
        # ?copy_id= never widens: another renter naming this copy on a volume of its own learns nothing of it.
        other, other_key = await create_principal(api.master, "renter-2", "renter")
        await volume(api, host_b, "theirs", account_id=other.account_id)
        status, body = await api.call("GET", f"/volumes/theirs/copy?copy_id={COPY_ID}", other_key)
        assert status == 404 and COPY_ID not in str(body), body
        status, body = await api.call("GET", f"/volumes/{dst}/copy?copy_id={COPY_ID}", other_key)
        assert_error(status, body, 404, "volume_not_found")
