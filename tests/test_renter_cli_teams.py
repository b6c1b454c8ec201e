"""`gpumarket team …` and `gpumarket registry …` against a real master on loopback (the ``api`` fixture, both
databases) and a real SMTP server: an owner makes a team and invites a teammate, who joins from the mailed link,
acts for the team from then on, rents on its account, and is turned back to their own when removed."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
from sqlalchemy import select

from gpumarket.cli import main
from gpumarket.mailsink import MailSink
from master.models import Rental
from tests.apiclient import Api
from tests.test_renter_cli import Cli
from tests.test_teams import person


def test_team_and_registry_have_help_with_examples(capsys: pytest.CaptureFixture[str]) -> None:
    for argv in (["team", "--help"], ["team", "use", "--help"], ["registry", "--help"], ["registry", "login", "--help"]):
        with pytest.raises(SystemExit) as done:
            main(argv)
        assert done.value.code == 0
    out = capsys.readouterr().out
    assert "gpumarket team invite bob@example.com --role member" in out and "--password-stdin" in out


async def test_invite_join_act_for_the_team_and_be_removed(
    api: Api, sink: MailSink, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    await api.host(1)
    owner, bob = await person(api, "olga"), await person(api, "bob")
    cli = Cli(api, capsys, monkeypatch, tmp_path / "home")
    cli.env(url=cli.url, key=owner.key)
    code, out, err = await cli("team", "create", "Acme ML")
    assert (code, err) == (0, "") and out.startswith("made team Acme ML (team-") and "gpumarket team use 'Acme ML'" in out
    code, out, err = await cli("team", "invite", bob.email, "--team", "Acme ML")
    assert (code, err) == (0, "") and f"invited {bob.email} as member" in out
    mail = await sink.wait_for(bob.email)
    [link] = [link for link in mail.links() if "/#/invite/" in link]

    # Bob logs in (saved), joins from the link and acts for the team from then on.
    cli.env(url=None, key=None)
    monkeypatch.setattr("sys.stdin", io.StringIO(bob.key + "\n"))
    code, out, err = await cli("login", "--api", cli.url)
    assert code == 0, err
    code, out, err = await cli("team", "accept", link)
    assert (code, err) == (0, "") and "you joined team Acme ML" in out and "as member" in out
    code, out, err = await cli("team", "use", "Acme ML")
    assert (code, err) == (0, "") and "act for team Acme ML" in out
    code, out, err = await cli("team", "list")
    assert code == 0 and [line.split()[:2] for line in out.splitlines()[1:]] == [["*", "Acme"]], out
    code, out, err = await cli("rent", "--gpus", "1", "--no-wait", "--json")
    assert code == 0, err
    rental_id = json.loads(out)["id"]
    async with api.master.db.session() as session:
        team_id = (await session.scalar(select(Rental.renter_id).where(Rental.id == rental_id)))
    assert team_id is not None and team_id.startswith("team-")
    code, out, err = await cli("rentals", "--team", "personal")
    assert code == 0 and rental_id not in out

    # The owner sees Bob and the team's rental, then removes him.
    cli.env(url=cli.url, key=owner.key)
    code, out, err = await cli("team", "show", "--team", "Acme ML")
    assert code == 0 and "bob@example.com" in out and "member" in out
    code, out, err = await cli("rentals", "--team", team_id)
    assert code == 0 and rental_id in out
    code, out, err = await cli("team", "remove", bob.account_id, "--team", "Acme ML")
    assert (code, err) == (0, ""), err

    cli.env(url=None, key=None)
    code, out, err = await cli("rentals")
    assert code == 1 and err.count("\n") == 1 and "team_not_found" in err and "gpumarket team use personal" in err
    code, out, err = await cli("team", "use", "personal")
    assert code == 0 and "act for yourself" in out
    code, out, err = await cli("rentals")
    assert code == 0, err


async def test_registry_login_list_remove(api: Api, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    cli = Cli(api, capsys, monkeypatch, tmp_path / "home")
    monkeypatch.setattr("sys.stdin", io.StringIO("s3cret-token\n"))
    code, out, err = await cli("registry", "login", "Registry.Example.com:5000/org", "--username", "robot", "--password-stdin")
    assert (code, err) == (0, "") and "registry.example.com:5000/org/" in out and "s3cret" not in out
    code, out, err = await cli("registry", "list")
    assert code == 0 and "registry.example.com:5000/org/" in out and "robot" in out and "s3cret" not in out
    code, out, err = await cli("registry", "remove", "registry.example.com:5000/org")
    assert (code, err) == (0, ""), err
    code, out, err = await cli("registry", "list", "--json")
    assert json.loads(out) == []
    code, out, err = await cli("registry", "login", "registry.example.com/x", "--username", "robot")
    assert code == 2 and "--password-stdin" in err
