"""Reaching a rental through the relay, end to end on ``gpumarket up`` with a real container engine:
``POST /rentals/{id}/connect``, the relay's renter websocket and web ports, the agent's streams.

One marketplace and one container rental (busybox ``httpd`` on 8000, a websocket echo written in
busybox shell on 8001) serve every check of the module, in order; the rental is stopped last.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
import socket
import ssl
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import pytest_asyncio
from aiohttp.abc import AbstractResolver, ResolveResult
from websockets.asyncio.client import connect as ws_connect
from websockets.exceptions import ConnectionClosed, InvalidStatus

from access.relay import Relay
from gpumarket.up import Marketplace, start_marketplace
from master.services import commands
from master.services.accounts import access
from shared.crypto import certificate_public_key, server_ssl_context
from shared.crypto.tokens import new_claims
from tests.helpers import eventually
from tests.test_e2e_up import MISSED, NO_RATE_LIMITS, TICK, Api, _hosts_online

# A websocket echo in busybox sh (text frames under 126 bytes, enough to show upgrades pass through).
WS_ECHO = r"""key=""
while IFS= read -r line; do
  line=$(printf '%s' "$line" | tr -d '\r')
  [ -z "$line" ] && break
  case "$line" in [Ss]ec-[Ww]eb[Ss]ocket-[Kk]ey:*) key=$(printf '%s' "${line#*:}" | tr -d ' ');; esac
done
accept=$(printf '%s' "${key}258EAFA5-E914-47DA-95CA-C5AB0DC85B11" | sha1sum | cut -c1-40 | sed 's/../\\x&/g')
accept=$(printf "$accept" | base64)
printf 'HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\nSec-WebSocket-Accept: %s\r\n\r\n' "$accept"
while :; do
  set -- $(dd bs=1 count=2 2>/dev/null | od -An -tu1)
  [ $# -eq 2 ] || exit 0
  op=$(( $1 & 15 )); len=$(( $2 & 127 ))
  [ "$op" = 8 ] && exit 0
  data=$(dd bs=1 count=$((len + 4)) 2>/dev/null | od -An -tu1 -v)
  out=$(echo $data | awk '{for(i=5;i<=NF;i++) printf "\\%03o", xor($i, $((i-5)%4+1))}')
  printf "\\$(printf %03o $((128 | op)))\\$(printf %03o $len)$out"
done
"""
SCRIPT = (
    # The shell ignores SIGTERM (the container's init forwards the engine's stop to it), so a stop ends the rental
    # only at the SIGKILL its grace later: test_stopping_the_rental_closes_its_open_streams_and_refuses_new_ones.
    "trap '' TERM; "
    'mkdir -p /workspace/www && echo "hello from the rental" > /workspace/www/index.html && '
    'printf "%s" "$WS_ECHO" > /workspace/ws.sh && '
    "httpd -p 8000 -h /workspace/www && httpd -p 127.0.0.1:8002 -h /workspace/www && "
    "(while :; do nc -l -p 8001 -e sh /workspace/ws.sh; done) & "
    "echo ready; sleep 3600"
)


pytestmark = pytest.mark.asyncio(loop_scope="module")


class _Loopback(AbstractResolver):
    """Every name to 127.0.0.1, as browsers do for *.localhost."""

    async def resolve(self, host: str, port: int = 0, family: socket.AddressFamily = socket.AF_INET) -> list[ResolveResult]:
        return [{"hostname": host, "host": "127.0.0.1", "port": port, "family": socket.AF_INET, "proto": 0, "flags": 0}]

    async def close(self) -> None:
        pass


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def setting(tmp_path_factory: pytest.TempPathFactory, docker_image: str) -> AsyncIterator[dict[str, Any]]:
    mp = pytest.MonkeyPatch()
    for name, value in NO_RATE_LIMITS.items():
        mp.setenv(name, value)
    home = Path(tmp_path_factory.mktemp("tunnels"))
    data = home / "data"
    key = home / "id_ed25519"
    await asyncio.to_thread(subprocess.run, ["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "renter@test", "-f", str(key)], check=True)
    market = await start_marketplace(data, agents=1, http_port=0, relay_port=0, heartbeat_interval=TICK,
                                     telemetry_interval=TICK, missed_heartbeats_offline=MISSED)  # fmt: skip
    http = aiohttp.ClientSession()
    try:
        renter = Api(http, market.api_url, market.credentials["renter"]["api_key"])
        await eventually(lambda: _hosts_online(renter, 1), what="the host online")
        status, _ = await renter.call("POST", "/account/ssh-keys", json={"public_key": (home / "id_ed25519.pub").read_text()})
        assert status == 201
        workload = {"kind": "container", "image": docker_image, "command": ["sh", "-c", SCRIPT],
                    "env": {"WS_ECHO": WS_ECHO}, "ports": [8000, 8001, 8002]}
        status, rental = await renter.call("POST", "/rentals", json={"gpu_count": 1, "workload": workload})
        assert status == 201, rental

        async def ready() -> bool:
            return "ready" in (await renter.get(f"/rentals/{rental['id']}/logs"))["data"]

        await eventually(ready, timeout=60, what="the rental's servers to start")
        env = {**os.environ, "GPUMARKET_API_URL": market.api_url.removesuffix("/api/v1"),
               "GPUMARKET_API_KEY": market.credentials["renter"]["api_key"], "XDG_CONFIG_HOME": str(home / "config"),
               "HOME": str(home)}
        yield {"market": market, "renter": renter, "rental": rental, "http": http, "env": env, "key": key, "home": home}
    finally:
        await http.close()
        await market.stop()
        mp.undo()


def _trusting(ca_pem: str) -> ssl.SSLContext:
    context = ssl.create_default_context(cadata=ca_pem)
    return context


async def _connect(renter: Api, rental_id: str, port: str | int) -> dict[str, Any]:
    """A connect ticket; a 409 ``host_offline`` (the host's relay registration lapsed a moment on a loaded machine, or
    it is moving to another relay) is asked again, as its message says, for up to 30 s."""

    async def ticket() -> dict[str, Any] | None:
        status, view = await renter.call("POST", f"/rentals/{rental_id}/connect", json={"port": port})
        if status == 409 and view.get("code") == "host_offline":
            return None
        assert status == 200, view
        return dict(view)

    return await eventually(ticket, timeout=30, every=0.5, what=f"a connect ticket to port {port} of {rental_id}")


async def _raw_http_through(view: dict[str, Any], token: str | None = None) -> bytes:
    """An HTTP/1.0 request to the rental's port over the relay's renter websocket."""
    headers = {"Authorization": f"Bearer {token or view['token']}"}
    async with ws_connect(view["relay_url"], ssl=_trusting(view["ca_pem"]), additional_headers=headers) as ws:
        await ws.send(b"GET /index.html HTTP/1.0\r\nHost: rental\r\n\r\n")
        answer = b""
        async for message in ws:  # until the rental's side ends the stream (close 1000)
            answer += message if isinstance(message, bytes) else message.encode()
    return answer


async def test_a_declared_port_answers_through_the_renter_websocket(setting: dict[str, Any]) -> None:
    view = await _connect(setting["renter"], setting["rental"]["id"], 8000)
    assert view["kind"] == "tcp" and view["port"] == 8000 and view["ssh"] is None
    answer = await _raw_http_through(view)
    assert answer.startswith(b"HTTP/1.") and b"hello from the rental" in answer, answer[:300]


async def _random_file(path: Path, size: int) -> None:
    """Write ``size`` random bytes to ``path`` off the event loop: the marketplace's agent and relay share this loop,
    and 200 MB of ``os.urandom`` written on it stalled their heartbeats past the host's 3 s offline threshold on a
    loaded machine (the host went offline and `gpumarket cp` was refused before the copy began)."""
    await asyncio.to_thread(lambda: path.write_bytes(os.urandom(size)))


def _cli(setting: dict[str, Any], *args: str, stdin: bytes = b"", timeout: float = 120) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run([sys.executable, "-m", "gpumarket", *args], input=stdin, capture_output=True, env=setting["env"],
                          timeout=timeout, check=False)


async def test_ssh_runs_a_command_in_the_rental_through_the_relay(setting: dict[str, Any]) -> None:
    """Debian's OpenSSH through `gpumarket ssh`: the rental's pinned host key, the renter's key, a command in its container."""
    rental_id = setting["rental"]["id"]
    done = await asyncio.to_thread(
        _cli, setting, "ssh", rental_id, "-i", str(setting["key"]), "-o", "IdentitiesOnly=yes", "--",
        "echo hello from $(id -u) in $(pwd); exit 7",
    )
    assert done.returncode == 7, done.stderr.decode()
    assert done.stdout.decode().strip() == "hello from 1000 in /workspace", done.stdout
    host_key = (await setting["renter"].get(f"/rentals/{rental_id}"))["ssh_host_key"]
    assert host_key.startswith("ssh-ed25519 ")
    pinned = (setting["home"] / "config" / "gpumarket" / "known_hosts").read_text()
    assert f"{rental_id}.gpumarket {host_key}" in pinned  # the key the agent reported, nothing learnt on first use

    async def key_used() -> str | None:  # the agent reports the login; the SSH keys page shows it
        [key] = (await setting["renter"].get("/account/ssh-keys"))["ssh_keys"]
        return str(key["last_used_at"]) if key["last_used_at"] else None

    await eventually(key_used, what="the key's last use")


async def test_ssh_forwards_a_local_port_to_the_rentals_loopback(setting: dict[str, Any]) -> None:
    """`gpumarket ssh -N -L` as a renter reaches Jupyter or VS Code's server: a port the rental serves on localhost."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        local = probe.getsockname()[1]
    ssh = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "gpumarket", "ssh", setting["rental"]["id"], "-i", str(setting["key"]), "-N",
        "-o", "ExitOnForwardFailure=yes", "-L", f"127.0.0.1:{local}:localhost:8002", env=setting["env"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
    )
    try:
        async def answer() -> str | None:
            try:
                async with setting["http"].get(f"http://127.0.0.1:{local}/index.html") as response:
                    return await response.text() if response.status == 200 else None
            except aiohttp.ClientError:
                return None

        assert "hello from the rental" in await eventually(answer, timeout=20, what="the forwarded port")
    finally:
        ssh.terminate()
        await ssh.wait()


async def test_scp_round_trips_50_mb_with_an_equal_checksum(setting: dict[str, Any]) -> None:
    home, rental_id = setting["home"], setting["rental"]["id"]
    payload = home / "payload.bin"
    await _random_file(payload, 50 << 20)
    key = ("-i", str(setting["key"]), "-q")
    up = await asyncio.to_thread(_cli, setting, "cp", *key, str(payload), f"{rental_id}:payload.bin")
    assert up.returncode == 0, up.stderr.decode()
    back = home / "back.bin"
    down = await asyncio.to_thread(_cli, setting, "cp", *key, f"{rental_id}:/workspace/payload.bin", str(back))
    assert down.returncode == 0, down.stderr.decode()
    assert hashlib.sha256(back.read_bytes()).digest() == hashlib.sha256(payload.read_bytes()).digest()
    # In the rental it is the workload's file.
    owner = await asyncio.to_thread(_cli, setting, "ssh", rental_id, "-i", str(setting["key"]), "--", "stat -c %u /workspace/payload.bin")
    assert owner.stdout.decode().strip() == "1000", owner


async def test_the_tunnel_half_closes_so_a_piped_request_gets_its_answer(setting: dict[str, Any]) -> None:
    done = await asyncio.to_thread(_cli, setting, "tunnel", setting["rental"]["id"], "--port", "8000",
                                   stdin=b"GET /index.html HTTP/1.0\r\nHost: x\r\n\r\n")
    assert done.returncode == 0, done.stderr.decode()
    assert b"hello from the rental" in done.stdout


async def test_a_port_the_rental_serves_on_its_loopback_only_answers_too(setting: dict[str, Any]) -> None:
    """As root the agent connects from inside the container's network namespace (VS Code's server, a notebook
    on 127.0.0.1); without the privilege it can only use the container's address, which such a server ignores."""
    view = await _connect(setting["renter"], setting["rental"]["id"], 8002)
    if os.geteuid() == 0:
        assert b"hello from the rental" in await _raw_http_through(view)
    else:
        with pytest.raises(ConnectionClosed) as closed:
            await _raw_http_through(view)
        assert closed.value.rcvd is not None and closed.value.rcvd.code == 4404


async def test_bytes_moved_are_counted_on_the_rental(setting: dict[str, Any]) -> None:
    view = await _connect(setting["renter"], setting["rental"]["id"], 8000)
    await _raw_http_through(view)

    async def counted() -> dict[str, int] | None:
        tunnel: dict[str, int] = (await setting["renter"].get(f"/rentals/{setting['rental']['id']}"))["tunnel"]
        return tunnel if tunnel["bytes_out"] > 0 and tunnel["bytes_in"] > 0 else None

    tunnel = await eventually(counted, what="the rental's tunnel bytes")
    assert tunnel["bytes_in"] >= len(b"GET /index.html HTTP/1.0\r\nHost: rental\r\n\r\n")


async def test_the_web_port_url_serves_http_and_websockets_to_the_renter_only(setting: dict[str, Any]) -> None:
    renter, rental_id = setting["renter"], setting["rental"]["id"]
    view = await _connect(renter, rental_id, 8000)
    url = view["web_url"]
    assert url.startswith(f"https://{rental_id}-8000.ports.localhost:"), url
    context = _trusting(view["ca_pem"])
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(resolver=_Loopback(), ssl=context)) as browser:
        async with browser.get(url, allow_redirects=False) as response:
            assert response.status == 302, await response.text()
            assert "gm_token" not in response.headers["Location"]
            assert "HttpOnly" in response.headers["Set-Cookie"] and "Secure" in response.headers["Set-Cookie"]
        async with browser.get(url.split("?")[0] + "index.html") as response:  # the cookie now
            assert response.status == 200
            assert "hello from the rental" in await response.text()
    # Without the cookie, or with another port's session: refused.
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(resolver=_Loopback(), ssl=context)) as stranger:
        async with stranger.get(url.split("?")[0]) as response:
            assert response.status == 401
            assert "console" in await response.text()
    # A websocket through the port URL (Jupyter's kernels need this): the rental's echo answers.
    ws_view = await _connect(renter, rental_id, 8001)
    ws_url = ws_view["web_url"]
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(resolver=_Loopback(), ssl=context)) as browser:
        async with browser.get(ws_url, allow_redirects=False) as response:
            assert response.status == 302
        async with browser.ws_connect(ws_url.split("?")[0].replace("https://", "wss://")) as ws:
            for text in ("hello", "ünïcode ✓"):
                await ws.send_str(text)
                message = await asyncio.wait_for(ws.receive(), 10)
                assert message.data == text


async def test_forged_expired_and_foreign_tokens_are_refused(setting: dict[str, Any]) -> None:
    market: Marketplace = setting["market"]
    renter, rental = setting["renter"], setting["rental"]
    view = await _connect(renter, rental["id"], 8000)
    context = _trusting(view["ca_pem"])
    # Forged: the claims changed (another port), the signature kept.
    prefix, claims, signature = view["token"].split(".")
    forged = ".".join((prefix, claims[:-2] + ("A" if claims[-2] != "A" else "B") + claims[-1], signature))
    expired = market.master.ca.sign_connect_token(new_claims(
        account_id="a-renter", rental_id=rental["id"], host_id=rental["host_id"] or "",
        kind="tcp", port=8000, expires_at=time.time() - 1,
    ))
    for token, words in ((forged, "signature"), (expired, "expired"), ("", "no connect token")):
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        with pytest.raises(InvalidStatus) as refused:
            async with ws_connect(view["relay_url"], ssl=context, additional_headers=headers):
                pass
        assert refused.value.response.status_code == 401
        assert words in refused.value.response.body.decode()
    # Another account (the demo provider) cannot connect to the renter's rental: it is not theirs to see.
    provider = Api(setting["http"], market.api_url, market.credentials["provider"]["api_key"])
    status, body = await provider.call("POST", f"/rentals/{rental['id']}/connect", json={"port": 8000})
    assert status == 404 and body["code"] == "rental_not_found"
    # A port the rental did not declare.
    status, body = await renter.call("POST", f"/rentals/{rental['id']}/connect", json={"port": 22})
    assert status == 422 and body["code"] == "port_not_declared"


async def test_a_key_added_while_running_works_and_once_deleted_its_open_session_is_closed(setting: dict[str, Any]) -> None:
    """Regression for "a deleted SSH key keeps working" (issue 35), through master, bus, relay and agent: a key added
    to the account while the rental runs logs in; deleting it ends its open ``gpumarket ssh`` session and refuses it
    from then on, while the renter's first key keeps working."""
    home, renter, rental_id = setting["home"], setting["renter"], setting["rental"]["id"]
    added = home / "id_added"
    await asyncio.to_thread(subprocess.run, ["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(added)], check=True)
    status, key = await renter.call("POST", "/account/ssh-keys", json={"public_key": (home / "id_added.pub").read_text()})
    assert status == 201, key
    with_added = ("-i", str(added), "-o", "IdentitiesOnly=yes", "-o", "BatchMode=yes")

    async def added_logs_in() -> bool:
        done = await asyncio.to_thread(_cli, setting, "ssh", rental_id, *with_added, "--", "echo added-works")
        return done.returncode == 0 and done.stdout.decode().strip() == "added-works"

    await eventually(added_logs_in, timeout=60, every=0.5, what="the added key to reach the running rental")
    shell = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "gpumarket", "ssh", rental_id, *with_added, "--", "echo logged-in; exec sleep 600",
        env=setting["env"], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )
    try:
        assert shell.stdout is not None
        async with asyncio.timeout(60):
            assert (await shell.stdout.readline()).strip() == b"logged-in"
        status, _ = await renter.call("DELETE", f"/account/ssh-keys/{key['id']}")
        assert status == 200
        async with asyncio.timeout(60):  # generous: the command goes out at once, the agent applies it at once
            assert await shell.wait() == 255
    finally:
        if shell.returncode is None:
            shell.kill()
            await shell.wait()
    refused = await asyncio.to_thread(_cli, setting, "ssh", rental_id, *with_added, "--", "true")
    assert refused.returncode == 255 and "Permission denied" in refused.stderr.decode(), refused.stderr.decode()
    first = await asyncio.to_thread(_cli, setting, "ssh", rental_id, "-i", str(setting["key"]), "-o", "IdentitiesOnly=yes", "--",
                                    "echo first-works")  # fmt: skip
    assert first.returncode == 0 and first.stdout.decode().strip() == "first-works", first.stderr.decode()


async def test_disabling_the_account_ends_its_open_port_streams_and_refuses_tokens_issued_before(setting: dict[str, Any]) -> None:
    """Access follows the account live (issue 35): disabling the renter's account ends an open stream to a port of its
    rental (not only SSH) and the agent refuses a connect token issued before; enabled again, the renter gets back in."""
    market: Marketplace = setting["market"]
    renter, rental_id = setting["renter"], setting["rental"]["id"]
    master = market.master
    account_id = (await renter.get("/account"))["id"]
    view = await _connect(renter, rental_id, 8001)
    earlier = await _connect(renter, rental_id, 8000)  # a token that outlives the account's access (its TTL)
    headers = {"Authorization": f"Bearer {view['token']}"}
    try:
        async with ws_connect(view["relay_url"], ssl=_trusting(view["ca_pem"]), additional_headers=headers) as ws:
            await ws.send(b"GET / HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
                          b"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n\r\n")
            assert b"101" in await asyncio.wait_for(ws.recv(), 30)  # the echo is up and the stream open
            async with master.db.session() as session:
                issued = await access.disable_account(session, account_id, now=master.clock.now())
            await commands.publish(master, issued)
            with pytest.raises(ConnectionClosed):
                async with asyncio.timeout(60):  # generous: the command goes out at once, the agent applies it at once
                    while True:
                        await ws.recv()
        with contextlib.suppress(ConnectionClosed, InvalidStatus):  # refused: the stream is reset as it opens
            answer = await _raw_http_through(earlier)
            assert b"hello from the rental" not in answer, answer[:300]
    finally:
        async with master.db.session() as session:
            issued = await access.enable_account(session, account_id, now=master.clock.now())
        await commands.publish(master, issued)

    async def served_again() -> bool:
        again = await _connect(renter, rental_id, 8000)
        with contextlib.suppress(ConnectionClosed, InvalidStatus):
            return b"hello from the rental" in await _raw_http_through(again)
        return False

    await eventually(served_again, timeout=60, every=0.5, what="the enabled account's port to answer again")


async def test_when_the_hosts_relay_dies_mid_copy_the_renter_connects_again_through_the_other(setting: dict[str, Any]) -> None:
    market: Marketplace = setting["market"]
    renter, rental_id = setting["renter"], setting["rental"]["id"]
    first = market.relay
    data_dir = Path(market.master.settings.data_dir)
    relay_files = (data_dir / "relay" / "server.crt", data_dir / "relay" / "server.key")
    second = Relay(
        relay_id="relay-second", bus=market.master.bus, registry=market.master.registry, region=first.region,
        ssl_context=server_ssl_context(*relay_files, market.master.ca.cert_path, require_client_cert=False),
        host="127.0.0.1", public_host="localhost", heartbeat_interval=TICK, telemetry_interval=TICK,
        max_connections_per_source_per_minute=100_000, connection_burst_per_source=10_000,
        token_key=certificate_public_key(market.master.ca.certificate),
    )
    await second.start()
    try:
        big = setting["home"] / "big.bin"
        await _random_file(big, 200 << 20)
        key = ("-i", str(setting["key"]), "-q")
        agent = market.agents[0]
        copy = asyncio.create_task(asyncio.to_thread(_cli, setting, "cp", *key, str(big), f"{rental_id}:big.bin"))

        async def copying() -> bool:  # the upload is under way through the first relay
            if copy.done():
                ended = copy.result()
                raise AssertionError(f"the copy ended (exit {ended.returncode}) before it was seen under way: {ended.stderr.decode()[-800:]}")
            return first.renters is not None and bool(first.renters.open_per_rental.get(rental_id)) and agent.tunnels.open_streams(rental_id) > 0

        await eventually(copying, timeout=30, what="the copy to be under way")
        await asyncio.sleep(0.3)
        await first.close()
        broken = await copy
        assert broken.returncode != 0, "the copy went through a relay that was closed under it"

        async def moved() -> dict[str, Any] | None:
            status, again = await renter.call("POST", f"/rentals/{rental_id}/connect", json={"port": "ssh"})
            return again if status == 200 and again["relay_id"] == second.relay_id else None

        await eventually(moved, timeout=30, what="the host to be on the second relay")
        again = await asyncio.to_thread(_cli, setting, "cp", *key, str(big), f"{rental_id}:big.bin")
        assert again.returncode == 0, again.stderr.decode()
        digest = await asyncio.to_thread(_cli, setting, "ssh", rental_id, *key[:2], "--", "sha1sum /workspace/big.bin")
        assert digest.stdout.decode().split()[0] == await asyncio.to_thread(lambda: hashlib.sha1(big.read_bytes()).hexdigest())
        assert b"hello from the rental" in await _raw_http_through(await _connect(renter, rental_id, 8000))
    finally:
        market.relay = second  # the marketplace closes it when it stops


async def test_stopping_the_rental_closes_its_open_streams_and_refuses_new_ones(setting: dict[str, Any]) -> None:
    renter, rental_id = setting["renter"], setting["rental"]["id"]
    view = await _connect(renter, rental_id, 8001)
    headers = {"Authorization": f"Bearer {view['token']}"}
    async with ws_connect(view["relay_url"], ssl=_trusting(view["ca_pem"]), additional_headers=headers) as ws:
        await ws.send(b"GET / HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
                      b"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n\r\n")
        first = await asyncio.wait_for(ws.recv(), 10)
        assert b"101" in first  # the echo is up and the stream open
        status, _ = await renter.call("DELETE", f"/rentals/{rental_id}")
        assert status == 202
        with pytest.raises(ConnectionClosed) as closed:
            async with asyncio.timeout(30):
                while True:
                    await ws.recv()
        closed_at = datetime.now(UTC)
        # The agent resets the streams as the stop arrives, before the workload's grace (its sh ignores SIGTERM:
        # SCRIPT's trap; it ends only at the SIGKILL 10 s later, when the rental stops). Without the trap the
        # container's init passed the stop to a shell that died of it at once, and beside a CPU hog the renter saw
        # its stream close 25 ms after the rental had stopped (2026-11-29).
        # Read by the order of events, not by how soon the state is read: a loaded machine may read it after.
        rental = await renter.get(f"/rentals/{rental_id}")
        stopped = [datetime.fromisoformat(e["at"]) for e in rental["events"] if e["to"] == "stopped"]
        assert rental["state"] == "stopping" or (rental["state"] == "stopped" and stopped and closed_at < stopped[0]), rental
    assert closed.value.rcvd is not None and closed.value.rcvd.code == 4410, closed.value
    # Nor does the token issued while it ran open a new stream during the stop's grace: it is still signed and
    # unexpired, but the agent refuses a stopping rental's ports (with its grace past, it knows the rental no more).
    with pytest.raises(ConnectionClosed) as again:
        async with ws_connect(view["relay_url"], ssl=_trusting(view["ca_pem"]), additional_headers=headers) as ws:
            await ws.send(b"GET / HTTP/1.0\r\n\r\n")
            async with asyncio.timeout(30):
                while True:
                    await ws.recv()
    if (await renter.get(f"/rentals/{rental_id}"))["state"] == "stopping":
        assert again.value.rcvd is not None and again.value.rcvd.code == 4410, again.value

    async def refused() -> dict[str, Any] | None:
        status, body = await renter.call("POST", f"/rentals/{rental_id}/connect", json={"port": 8001})
        return body if status == 409 else None

    body = await eventually(refused, what="connect to refuse the stopped rental")
    assert body["code"] == "rental_not_running"

    async def ended() -> bool:
        return bool((await renter.get(f"/rentals/{rental_id}"))["state"] == "stopped")

    await eventually(ended, timeout=120, what="the rental stopped (its grace past)")
    # And the token issued while it ran opens nothing now: the agent knows the rental no more.
    with pytest.raises((ConnectionClosed, InvalidStatus)):
        async with ws_connect(view["relay_url"], ssl=_trusting(view["ca_pem"]), additional_headers=headers) as ws:
            await ws.send(b"GET / HTTP/1.0\r\n\r\n")
            async with asyncio.timeout(10):
                await ws.recv()

