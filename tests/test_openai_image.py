"""The OpenAI-compatible sample server (``examples/openai_cpu_server.py``) called with the real ``openai`` client of
``examples/openai_client.py``.

Most tests start the server in this process on 127.0.0.1, port 0. ``TestImage`` runs it as a service's replica runs:
a container of the locally built image (``tests/dockerengine.py``: ``openai_image``) on a user-defined bridge
network, labelled with the test's owner and removed afterwards (``dockerengine.remove_owned``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import http.client
import io
import json
import secrets
import socket
import struct
import threading
import time
import urllib.request
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any
from urllib.error import HTTPError
from urllib.parse import quote, urlsplit

import openai
import pytest
from websockets.exceptions import ConnectionClosedError
from websockets.sync.client import connect as websocket_connect

from agent.runtimes.containeropts import OWNER_LABEL
from examples import openai_client
from examples import openai_cpu_server as server_module
from tests import dockerengine

TOKEN = "gm_test_token"  # the server takes any: the gateway in front of it checks tokens
DELAY_MS = 20
"""The tests' unit of time: the delays they ask for are a few of it."""


def get(url: str, headers: dict[str, str] | None = None) -> tuple[int, dict[str, str], bytes]:
    """A GET's status, headers and body, an error status included."""
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers or {}), timeout=10) as response:
            return response.status, dict(response.headers), response.read()
    except HTTPError as error:
        return error.code, dict(error.headers), error.read()


def post(endpoint: str, body: bytes | Iterable[bytes], headers: dict[str, str] | None = None) -> tuple[http.client.HTTPResponse, bytes]:
    """A raw POST to the chat completions route (for what the openai client would never send); an iterable body goes
    in chunks."""
    address = urlsplit(endpoint)
    connection = http.client.HTTPConnection(address.hostname or "", address.port, timeout=10)
    connection.request("POST", "/v1/chat/completions", body=body, headers=headers or {})
    response = connection.getresponse()
    return response, response.read()


def chat_body(content: Any = "hello", **fields: Any) -> bytes:
    return json.dumps({"model": server_module.DEFAULT_MODEL, "messages": [{"role": "user", "content": content}], **fields}).encode()


@contextlib.contextmanager
def serving(*, ready_delay_s: float = 0.0) -> Iterator[server_module.Server]:
    """The server on 127.0.0.1, port 0, in a thread of this process."""
    server = server_module.Server(("127.0.0.1", 0), ready_delay_s=ready_delay_s)
    thread = threading.Thread(target=server.serve_forever, args=(DELAY_MS / 1000,), name="openai-cpu-server", daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


@pytest.fixture
def endpoint() -> Iterator[str]:
    """A service endpoint: the server in this process."""
    with serving() as server:
        yield f"http://127.0.0.1:{server.server_address[1]}/"


class TestChatCompletions:
    def test_a_completion_echoes_the_last_user_message_the_same_each_time(self, endpoint: str) -> None:
        """The answer is "echo:" and the last user message's words, whatever the call."""
        replies = {"".join(openai_client.chat(endpoint, TOKEN, "hello   big\nworld")) for _ in range(3)}
        assert replies == {"echo: hello big world"}

    def test_a_stream_yields_the_same_text_a_word_a_chunk(self, endpoint: str) -> None:
        """Streamed, the same text comes as server-sent events the openai client parses, one word each."""
        pieces = list(openai_client.chat(endpoint, TOKEN, "hello big world", stream=True))
        assert pieces == ["echo:", " hello", " big", " world"]

    def test_usage_counts_words_and_a_stream_reports_it_when_asked(self, endpoint: str) -> None:
        """Tokens are words: the prompt's over all messages, the reply's; a stream's last chunk carries them."""
        client = openai_client.connect(endpoint, TOKEN)
        messages: list[Any] = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "two words"}]
        reply = client.chat.completions.create(model=server_module.DEFAULT_MODEL, messages=messages)
        assert reply.usage is not None
        assert (reply.usage.prompt_tokens, reply.usage.completion_tokens, reply.usage.total_tokens) == (4, 3, 7)
        assert reply.choices[0].finish_reason == "stop"
        chunks = list(client.chat.completions.create(
            model=server_module.DEFAULT_MODEL, messages=messages, stream=True, stream_options={"include_usage": True}
        ))
        assert chunks[0].choices[0].delta.role == "assistant"
        assert chunks[-2].choices[0].finish_reason == "stop"
        assert chunks[-1].choices == [] and chunks[-1].usage == reply.usage

    def test_max_tokens_cuts_the_reply(self, endpoint: str) -> None:
        reply = openai_client.connect(endpoint, TOKEN).chat.completions.create(
            model=server_module.DEFAULT_MODEL, messages=[{"role": "user", "content": "one two three"}], max_tokens=2
        )
        assert (reply.choices[0].message.content, reply.choices[0].finish_reason) == ("echo: one", "length")

    def test_the_model_is_the_one_listed(self, endpoint: str) -> None:
        client = openai_client.connect(endpoint, TOKEN)
        assert [model.id for model in client.models.list()] == [server_module.DEFAULT_MODEL]
        with pytest.raises(openai.NotFoundError, match="does not exist"):
            client.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "hi"}])

    def test_a_bad_request_raises_bad_request_error(self, endpoint: str) -> None:
        """No messages is a 400 with an OpenAI error body, which the client raises as ``BadRequestError``."""
        with pytest.raises(openai.BadRequestError) as raised:
            openai_client.connect(endpoint, TOKEN).chat.completions.create(model=server_module.DEFAULT_MODEL, messages=[])
        assert raised.value.code == "invalid_messages"

    @pytest.mark.parametrize(("body", "code"), [
        (b"{not json", "invalid_json"),
        (b"[]", "invalid_json"),
        (json.dumps({"messages": [{"role": "user", "content": "hi"}]}).encode(), "missing_model"),
        (chat_body(max_tokens=0), "invalid_max_tokens"),
        (json.dumps({"model": server_module.DEFAULT_MODEL, "messages": [{"role": "system", "content": "x"}]}).encode(),
         "invalid_messages"),
        (chat_body(content=42), "invalid_content"),
    ])
    def test_malformed_requests_are_400_with_an_openai_error(self, endpoint: str, body: bytes, code: str) -> None:
        response, data = post(endpoint, body)
        error = json.loads(data)["error"]
        assert (response.status, error["type"], error["code"], error["param"]) == (400, "invalid_request_error", code, None)
        assert error["message"]

    def test_a_body_over_the_cap_is_413_and_closes_the_connection(self, endpoint: str) -> None:
        response, data = post(endpoint, b"x" * (server_module.MAX_BODY + 1))
        assert (response.status, json.loads(data)["error"]["code"]) == (413, "body_too_large")
        assert response.getheader("Connection") == "close"

    def test_a_chunked_body_is_read(self, endpoint: str) -> None:
        """A proxy may forward a body in chunks."""
        response, data = post(endpoint, iter([chat_body("in"), b" "]))
        assert response.status == 200
        assert json.loads(data)["choices"][0]["message"]["content"] == "echo: in"


class TestHttp:
    def test_one_connection_serves_requests_one_after_another_naming_the_replica(self, endpoint: str) -> None:
        """HTTP/1.1 keep-alive: answers carry Content-Length (or chunks) and ``X-Replica``, the host's name."""
        address = urlsplit(endpoint)
        connection = http.client.HTTPConnection(address.hostname or "", address.port, timeout=10)
        connection.connect()
        first = connection.sock
        for path in ("/health", "/v1/models", "/health"):
            connection.request("GET", path)
            response = connection.getresponse()
            response.read()
            assert (response.status, response.version) == (200, 11)
            assert response.getheader("X-Replica") == socket.gethostname()
        for stream in (False, True):
            connection.request("POST", "/v1/chat/completions", body=chat_body(stream=stream))
            response = connection.getresponse()
            assert response.status == 200 and response.read()
        assert connection.sock is first

    def test_health_answers_503_until_ready(self) -> None:
        """Until ``READY_DELAY_S`` has passed (here: until the test says so), /health is 503."""
        with serving(ready_delay_s=3600) as server:
            status, _, body = get(f"http://127.0.0.1:{server.server_address[1]}/health")
            assert (status, json.loads(body)) == (503, {"status": "starting"})
            server.ready_at = time.monotonic()
            status, _, body = get(f"http://127.0.0.1:{server.server_address[1]}/health")
            assert (status, json.loads(body)) == (200, {"status": "ok"})

    def test_delay_headers_hold_the_answer_and_the_chunks(self, endpoint: str) -> None:
        started = time.monotonic()
        assert get(f"{endpoint}health", {"X-Delay-Ms": str(3 * DELAY_MS)})[0] == 200
        assert time.monotonic() - started >= 3 * DELAY_MS / 1000
        started = time.monotonic()
        response, _ = post(endpoint, chat_body("a b", stream=True), {"X-Chunk-Delay-Ms": str(DELAY_MS)})
        assert response.status == 200
        assert time.monotonic() - started >= 5 * DELAY_MS / 1000  # role, 3 words, finish, [DONE]: 5 gaps

    @pytest.mark.parametrize("value", ["-1", "soon", str(server_module.MAX_DELAY_MS + 1)])
    def test_a_bad_delay_is_400(self, endpoint: str, value: str) -> None:
        status, _, body = get(f"{endpoint}health", {"X-Delay-Ms": value})
        assert (status, json.loads(body)["error"]["code"]) == (400, "invalid_delay")

    def test_unknown_routes_and_methods(self, endpoint: str) -> None:
        assert get(f"{endpoint}v1/completions")[0] == 404
        assert get(f"{endpoint}v1/chat/completions")[0] == 405


class TestWebSocket:
    def test_messages_come_back_as_sent(self, endpoint: str) -> None:
        """Text, binary (of 64 KiB and more: 8-byte lengths), fragmented messages and pings are answered."""
        with websocket_connect(f"ws{endpoint.removeprefix('http')}v1/ws") as websocket:
            websocket.send("héllo")
            assert websocket.recv() == "héllo"
            websocket.send(bytes(range(256)) * 300)
            assert websocket.recv() == bytes(range(256)) * 300
            websocket.send(["frag", "mented"])
            assert websocket.recv() == "fragmented"
            assert websocket.ping(b"are you there").wait(timeout=5)
        assert websocket.close_code == 1000

    def test_a_message_over_the_cap_closes_with_1009(self, endpoint: str) -> None:
        with websocket_connect(f"ws{endpoint.removeprefix('http')}v1/ws") as websocket:
            websocket.send(b"x" * (server_module.MAX_BODY + 1))
            with pytest.raises(ConnectionClosedError) as closed:
                websocket.recv()
        assert closed.value.rcvd is not None and closed.value.rcvd.code == 1009

    def test_a_plain_get_is_400_and_another_version_426(self, endpoint: str) -> None:
        status, _, body = get(f"{endpoint}v1/ws")
        assert (status, json.loads(body)["error"]["code"]) == (400, "not_a_websocket")
        upgrade = {"Upgrade": "websocket", "Connection": "Upgrade", "Sec-WebSocket-Key": "dGhlIHNhbXBsZSBub25jZQ=="}
        status, headers, _ = get(f"{endpoint}v1/ws", {**upgrade, "Sec-WebSocket-Version": "8"})
        assert (status, headers["Sec-WebSocket-Version"]) == (426, "13")

    def test_the_accept_key_is_rfc_6455s(self) -> None:
        """RFC 6455 section 1.3's example."""
        assert server_module.websocket_accept("dGhlIHNhbXBsZSBub25jZQ==") == "s3pPLMBiTxaQ9kYGzzhZRbK+xOo="

    def test_an_unmasked_client_frame_is_a_protocol_error(self) -> None:
        sent = io.BytesIO()
        server_module.echo_messages(io.BytesIO(struct.pack("!BB", 0x81, 2) + b"hi").read, sent.write)
        assert sent.getvalue()[:4] == struct.pack("!BBH", 0x88, len(sent.getvalue()) - 2, 1002)


class TestClientCommand:
    def test_it_prints_a_completion_and_a_stream(self, endpoint: str, capsys: pytest.CaptureFixture[str]) -> None:
        assert openai_client.main(["--endpoint", endpoint, "--token", TOKEN, "--prompt", "hi there"]) == 0
        assert capsys.readouterr().out == "completion: echo: hi there\nstreamed:   echo: hi there\n"

    def test_it_says_what_is_missing(self, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
        monkeypatch.delenv("GPUMARKET_SERVICE_URL", raising=False)
        with pytest.raises(SystemExit) as exited:
            openai_client.main(["--token", TOKEN])
        assert exited.value.code == 2 and "GPUMARKET_SERVICE_URL" in capsys.readouterr().err

    def test_an_error_is_one_line(self, endpoint: str, capsys: pytest.CaptureFixture[str]) -> None:
        assert openai_client.main(["--endpoint", endpoint, "--token", TOKEN, "--model", "nope"]) == 1
        said = [line for line in capsys.readouterr().err.splitlines() if not line.startswith("127.0.0.1 - - ")]  # the server's log
        assert len(said) == 1 and said[0].startswith("openai_client: ") and "does not exist" in said[0]


def engine(method: str, path: str, document: dict[str, Any] | None = None) -> Any:
    """An Engine API call that must succeed; its JSON answer (``None`` when empty)."""
    body = None if document is None else json.dumps(document).encode()
    status, answer = dockerengine.request(method, path, body=body, headers={"Content-Type": "application/json"})
    assert status in (200, 201, 204), f"{method} {path}: {status} {answer[-300:]!r}"
    return json.loads(answer) if answer else None


class TestImage:
    def test_its_hash_follows_the_server_file(self, tmp_path: Path) -> None:
        """Another server file makes another image; the same one, the same (then nothing is built again)."""
        source = dockerengine.OPENAI_IMAGE.files[dockerengine.OPENAI_SERVER_PATH]
        copy, changed = tmp_path / "same.py", tmp_path / "changed.py"
        copy.write_bytes(source.read_bytes())
        changed.write_bytes(source.read_bytes() + b"# changed\n")
        digests = [
            dockerengine._PackageRootfs(
                dataclasses.replace(dockerengine.OPENAI_IMAGE, files={dockerengine.OPENAI_SERVER_PATH: file})
            ).digest
            for file in (source, copy, changed)
        ]
        assert digests[0] == digests[1] != digests[2]

    @pytest.mark.timeout(300)  # the first run builds the image (a second or two)
    def test_a_container_serves_the_openai_api_on_a_bridge_network(self, openai_image: str) -> None:
        """The image's own command serves on port 8000: not ready for READY_DELAY_S, then plain and streamed
        completions, a 400, a websocket echo, ``X-Replica`` naming the container; SIGTERM stops it at once."""
        owner = f"test-openai-{secrets.token_hex(4)}"
        labels = {OWNER_LABEL: owner}
        try:
            engine("POST", "/networks/create", {"Name": f"{owner}-net", "Driver": "bridge", "Labels": labels})
            container = engine("POST", f"/containers/create?name={quote(f'{owner}-replica')}", {
                "Image": openai_image, "Hostname": "replica-0", "Env": ["READY_DELAY_S=1"], "Labels": labels,
                "HostConfig": {"NetworkMode": f"{owner}-net"},
            })["Id"]
            engine("POST", f"/containers/{container}/start")
            address = engine("GET", f"/containers/{container}/json")["NetworkSettings"]["Networks"][f"{owner}-net"]["IPAddress"]
            endpoint = f"http://{address}:8000/"

            health: list[int] = []
            deadline = time.monotonic() + 30
            while health[-1:] != [200] and time.monotonic() < deadline:
                try:
                    status, headers, _ = get(f"{endpoint}health")
                except OSError:  # not listening yet
                    time.sleep(DELAY_MS / 1000)
                    continue
                health.append(status)
                assert headers["X-Replica"] == "replica-0"
                time.sleep(DELAY_MS / 1000)
            assert health[0] == 503 and health[-1] == 200, health

            plain = "".join(openai_client.chat(endpoint, TOKEN, "from a container"))
            assert plain == "echo: from a container"
            pieces = list(openai_client.chat(endpoint, TOKEN, "from a container", stream=True))
            assert len(pieces) == 4 and "".join(pieces) == plain
            with pytest.raises(openai.BadRequestError):
                openai_client.connect(endpoint, TOKEN).chat.completions.create(model=server_module.DEFAULT_MODEL, messages=[])
            with websocket_connect(f"ws://{address}:8000/v1/ws") as websocket:
                websocket.send("through the bridge")
                assert websocket.recv() == "through the bridge"

            started = time.monotonic()
            engine("POST", f"/containers/{container}/stop?t=10")
            assert time.monotonic() - started < 5, "SIGTERM did not stop the server"
            assert engine("GET", f"/containers/{container}/json")["State"]["ExitCode"] == 0
            assert dockerengine.openai_image() == openai_image  # built already
        finally:
            dockerengine.remove_owned(owner)
