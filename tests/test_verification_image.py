"""The challenge image (``gpumarket/images.py``: ``CHALLENGE_IMAGE``) runs ``shared/verification/program.py`` end to
end in a container built with the engine here: challenge.json in, commitment.json, reveal.json in, openings.json
out, and ``protocol.verify`` passes an honest run and names each simulated dishonest one's fault."""

from __future__ import annotations

import json
import random
import secrets
import time
from pathlib import Path
from typing import Any
from urllib.parse import quote

import pytest

from agent.runtimes.containeropts import OWNER_LABEL
from gpumarket import images
from master.services.hosts import challenge as protocol
from master.services.hosts.challenge import Reason
from shared.verification import program
from tests import dockerengine


@pytest.fixture(scope="module")
def challenge_image(docker_image: str) -> str:
    """The challenge image, built unless the engine has it (``docker_image``: an engine answers)."""
    try:
        return images.challenge_image()
    except images.ImageBuildError as exc:
        pytest.fail(str(exc))


engine = dockerengine.engine_json


def wait_for(path: Path, container: str, *, timeout: float = 120.0) -> Any:
    """``path``'s JSON once the program wrote it; fails at once with the container's logs if it ended first."""
    deadline = time.monotonic() + timeout
    while not path.exists():
        state = engine("GET", f"/containers/{container}/json")["State"]
        assert state["Running"], f"the program ended ({state['ExitCode']}) before writing {path.name}: {logs(container)}"
        assert time.monotonic() < deadline, f"{path.name} did not come within {timeout:.0f} s: {logs(container)}"
        time.sleep(0.05)
    return json.loads(path.read_text())


def logs(container: str) -> str:
    _, body = dockerengine.request("GET", f"/containers/{container}/logs?stdout=1&stderr=1")
    return body.decode(errors="replace")[-2000:]


def write_whole(path: Path, document: Any) -> None:
    """As the agent writes: a temporary name, then renamed, so the program never reads half a file."""
    temporary = path.with_name(f".{path.name}.tmp")
    temporary.write_text(json.dumps(document))
    temporary.replace(path)


def run_challenge(image: str, workdir: Path, challenge: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any], int]:
    """The program in a container as a rental runs it (a non-root user), ``workdir`` as its /workspace: the
    commitment, the reveal, the openings (empty when it committed no root) and its exit code."""
    owner = f"test-verify-{secrets.token_hex(4)}"
    workdir.mkdir()
    workdir.chmod(0o777)
    spec = {"Image": image, "User": "1000", "Labels": {OWNER_LABEL: owner}, "HostConfig": {"Binds": [f"{workdir}:/workspace"]}}
    try:
        container: str = engine("POST", f"/containers/create?name={quote(owner)}", spec)["Id"]
        engine("POST", f"/containers/{container}/start")
        assert wait_for(workdir / "ready.json", container) == {"backend": "numpy", "devices": 0}
        write_whole(workdir / "challenge.json", challenge)
        commitment = wait_for(workdir / "commitment.json", container)
        reveal = protocol.choose_reveal(random.Random(11), challenge)
        openings: dict[str, Any] = {}
        if any("root" in entry for entry in commitment["gpus"].values()):
            write_whole(workdir / "reveal.json", reveal)
            openings = wait_for(workdir / "openings.json", container)
        code = engine("POST", f"/containers/{container}/wait")["StatusCode"]
        return commitment, reveal, openings, code
    finally:
        dockerengine.remove_owned(owner)


def simulated(challenge_id: str, simulate: dict[str, Any] | None = None) -> dict[str, Any]:
    challenge = protocol.make_challenge(challenge_id=challenge_id, seed=secrets.token_bytes(32), dtype="bf16", simulation=True,
                                        gpus=[{"uuid": f"GPU-{k}", "model_key": "rtx-4090", "vram_mib": 24564} for k in range(2)])  # fmt: skip
    if simulate is not None:
        challenge["simulate"] = simulate
    return challenge


@pytest.mark.timeout(240)
def test_an_honest_run_passes_and_each_dishonest_one_is_caught(challenge_image: str, tmp_path: Path) -> None:
    honest = simulated("ch-honest")
    commitment, reveal, openings, code = run_challenge(challenge_image, tmp_path / "honest", honest)
    assert code == 0 and commitment["challenge_id"] == "ch-honest" and commitment["backend"] == "numpy"
    assert "simulated_delay_s" not in commitment
    verdicts = protocol.verify(honest, commitment, reveal, openings, committed_after_s=5.0)
    assert {uuid: v.reason for uuid, v in verdicts.items()} == {"GPU-0": Reason.PASSED, "GPU-1": Reason.PASSED}
    seen = {entry["root"] for entry in commitment["gpus"].values()}

    wrong = simulated("ch-wrong", {"wrong_fraction": 0.5})
    commitment, reveal, openings, code = run_challenge(challenge_image, tmp_path / "wrong", wrong)
    verdicts = protocol.verify(wrong, commitment, reveal, openings, committed_after_s=5.0)
    assert code == 0 and {v.reason for v in verdicts.values()} == {Reason.WRONG_RESULT}

    slow = simulated("ch-slow", {"delay_s": 1000.0})
    commitment, reveal, openings, code = run_challenge(challenge_image, tmp_path / "slow", slow)
    clock = 5.0 + commitment["simulated_delay_s"]  # the simulated agent's clock
    verdicts = protocol.verify(slow, commitment, reveal, openings, committed_after_s=clock)
    assert code == 0 and {v.reason for v in verdicts.values()} == {Reason.TOO_SLOW}

    # the agent faked NVML: it claims a 4090 (24 GiB) on a 3060 (12 GiB)
    small = simulated("ch-small", {"memory_mib": 12288})
    commitment, reveal, openings, code = run_challenge(challenge_image, tmp_path / "small", small)
    verdicts = protocol.verify(small, commitment, reveal, openings, committed_after_s=5.0)
    assert code == 0 and openings == {} and {v.reason for v in verdicts.values()} == {Reason.MEMORY_SHORT}
    assert "the device has" in verdicts["GPU-0"].message

    replayed = {**simulated("ch-replay"), "seed": honest["seed"]}
    commitment, reveal, openings, code = run_challenge(challenge_image, tmp_path / "replay", replayed)
    verdicts = protocol.verify(replayed, commitment, reveal, openings, committed_after_s=5.0, seen_roots=seen)
    assert code == 0 and {v.reason for v in verdicts.values()} == {Reason.PASSED}, "the same seed, a new id: new roots"


# ---- the program's own answers, in this process ------------------------------------------------------


def test_the_program_says_why_it_stops(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """No challenge.json within GPUMARKET_VERIFY_WAIT_S: exit 3; one that is not a challenge: exit 2; every GPU
    short of memory: commitment.json with the reasons, exit 0 without waiting for a reveal."""
    monkeypatch.setenv("GPUMARKET_VERIFY_WAIT_S", "0.2")
    assert program.main(["program.py", str(tmp_path)]) == 3
    assert json.loads((tmp_path / "ready.json").read_text()) == {"backend": "numpy", "devices": 0}
    assert "challenge.json did not come" in capsys.readouterr().err
    (tmp_path / "challenge.json").write_text(json.dumps({"challenge_id": "x", "gpus": []}))
    assert program.main(["program.py", str(tmp_path)]) == 2
    assert "is not a challenge" in capsys.readouterr().err
    small = simulated("ch-small", {"memory_mib": 1024})
    (tmp_path / "challenge.json").write_text(json.dumps(small))
    assert program.main(["program.py", str(tmp_path)]) == 0
    commitment = json.loads((tmp_path / "commitment.json").read_text())
    assert {entry["reason"] for entry in commitment["gpus"].values()} == {"memory_short"}
    assert not (tmp_path / "openings.json").exists()
