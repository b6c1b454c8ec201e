"""`gpumarket keys create|list|revoke` against a real master on loopback (the ``api`` fixture, both databases): a key
made with scopes works for what they allow and is refused the rest in one line, then is revoked."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gpumarket.cli import main
from tests.apiclient import Api
from tests.test_renter_cli import Cli


def test_keys_has_help_with_examples(capsys: pytest.CaptureFixture[str]) -> None:
    for argv in (["keys", "--help"], ["keys", "create", "--help"], ["keys", "list", "--help"], ["keys", "revoke", "--help"]):
        with pytest.raises(SystemExit) as done:
            main(argv)
        assert done.value.code == 0
    out = capsys.readouterr().out
    assert "gpumarket keys create ci-runner --scope read --scope rent" in out and "--expires-in-days" in out


async def test_make_a_read_key_use_it_list_and_revoke_it(
    api: Api, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    await api.host(1)
    cli = Cli(api, capsys, monkeypatch, tmp_path / "home")
    code, out, err = await cli("keys", "create", "ci-runner", "--scope", "read", "--expires-in-days", "30", "--allow", "127.0.0.1")
    assert (code, err) == (0, ""), err
    key, note = out.splitlines()
    assert key.startswith("gmk_") and note.startswith("made ci-runner (key-") and "scopes read" in note
    assert "only from 127.0.0.1/32" in note and "not shown again" in note

    cli.env(url=cli.url, key=key)
    code, out, err = await cli("rentals")
    assert code == 0, err
    code, out, err = await cli("rent", "--gpus", "1", "--no-wait")
    assert code == 1 and out == ""
    assert err.count("\n") == 1 and "scope_missing" in err and "gpumarket keys create --scope rent" in err

    cli.env(url=cli.url, key=api.renter_key)
    code, out, err = await cli("keys", "list")
    assert code == 0 and "ci-runner" in out and key not in out and "read" in out
    key_id = next(line.split()[0] for line in out.splitlines() if "ci-runner" in line)
    code, out, err = await cli("keys", "revoke", key_id)
    assert (code, err) == (0, "") and out.startswith(f"revoked ci-runner ({key_id}")
    code, out, _ = await cli("keys", "list", "--json")
    assert key_id not in out
    code, out, _ = await cli("keys", "list", "--all", "--json")
    assert [k["state"] for k in json.loads(out) if k["id"] == key_id] == ["revoked"]
    cli.env(url=cli.url, key=key)
    code, _, err = await cli("rentals")
    assert code == 1 and "invalid_api_key" in err

    cli.env(url=cli.url, key=api.renter_key)
    code, _, err = await cli("keys", "revoke", "not-an-id")
    assert code == 2 and "KEY_ID is a key's id" in err
