"""The stack's processes, in start order, and exactly what each will run with (``Plan``)."""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
HOST = "127.0.0.1"


@dataclass(frozen=True, slots=True)
class ServiceSpec:
    """One process of the stack; its place in ``SERVICES`` is its start order."""

    name: str
    script: str  # console script in --bin; with ``argv``, a program file under the repository
    config: str | None  # settings file, relative to the repository root; None: it has none
    admin_port: int  # its readiness port (admin HTTP for IOP services), before --port-offset
    tls: bool = True  # gets the certificate files named after ``name`` from --certs
    health_path: str = "/healthz"
    # Further listening ports: settings override (env name) -> port before --port-offset.
    ports: Mapping[str, int] = field(default_factory=dict)
    # State files: settings override (env name) -> file name under the state directory.
    state: Mapping[str, str] = field(default_factory=dict)
    # Ports of earlier services this one dials: env name -> base port (shifted too).
    dials: Mapping[str, int] = field(default_factory=dict)
    # A program that is not an IOP console script: its command line, each part formatted
    # with {python} (this interpreter), {script} (``script`` made absolute), {host} and
    # {port} (``admin_port`` shifted). Empty: ``<--bin>/<script> --config <config>``.
    argv: tuple[str, ...] = ()
    port_role: str = "admin"  # what ``admin_port`` serves, for messages
    scheme: str = "http"  # how ``admin_port`` is spoken to (postgresql: not polled over HTTP)
    # Settings overrides that name dialled ports inside a value (a DSN): env name ->
    # template formatted with {host} and the shifted ports of ``dials`` by their env names.
    env_templates: Mapping[str, str] = field(default_factory=dict)
    public_api: bool = False  # where clients point (the balancer of --ha); else the edge's
    ready_timeout_s: float | None = None  # its own bound on start-up; None: --ready-timeout

    def all_ports(self) -> dict[str, int]:
        """Every port this service listens on, keyed by what it is for."""
        return {f"{self.port_role} port": self.admin_port} | {
            f"{env.removeprefix('IOP_').lower().replace('__', '.')}": port
            for env, port in self.ports.items()
        }


SERVICES: tuple[ServiceSpec, ...] = (
    # node-a's provider (configs/fleet.yaml: node-a-llamacpp at 127.0.0.1:8091), so it
    # starts first and stops last. One thread: a 2-core machine runs the stack beside it.
    ServiceSpec(
        "llamacpp",
        "tools/llama_server.py",
        None,
        8091,
        tls=False,
        health_path="/health",
        argv=(
            "{python}",
            "{script}",
            *("--host", "{host}", "--port", "{port}", "--threads", "1"),
            *("--ctx", "8192", "--parallel", "1", "--alias", "smollm2:135m"),
        ),
        port_role="API",
    ),
    ServiceSpec(
        "control-plane",
        "iop-control-plane",
        "configs/dev/control-plane.yaml",
        9100,
        ports={"IOP_LISTEN__PORT": 7100},
        state={"IOP_DATABASE": "control-plane.db", "IOP_PID_FILE": "control-plane.server.pid"},
    ),
    ServiceSpec(
        "edge",
        "iop-edge",
        "configs/dev/edge.yaml",
        9101,
        ports={"IOP_HTTP__PORT": 8080, "IOP_NODE_LISTENER__PORT": 7000},
        state={
            "IOP_CONFIG_CACHE": "edge-fleet-config.pb",
            "IOP_HISTORY_DB": "edge-runs.db",
            "IOP_BATCH_DB": "edge-batches.db",
            "IOP_RESPONSES_DB": "edge-responses.db",
        },
        dials={"IOP_CONTROL_PLANE__PORT": 7100},
    ),
    ServiceSpec(
        "node-a",
        "iop-node",
        "configs/dev/node-a.yaml",
        9102,
        state={"IOP_TOKEN_FILE": "node-a.token", "IOP_HISTORY_DB": "node-a-history.db"},
        dials={"IOP_EDGE__PORT": 7000},
    ),
    ServiceSpec(
        "node-b",
        "iop-node",
        "configs/dev/node-b.yaml",
        9103,
        state={"IOP_TOKEN_FILE": "node-b.token", "IOP_HISTORY_DB": "node-b-history.db"},
        dials={"IOP_EDGE__PORT": 7000},
    ),
    ServiceSpec(
        "worker",
        "iop-worker",
        "configs/dev/worker.yaml",
        9104,
        dials={"IOP_EDGE__PORT": 7000},  # workers dial the edge's node listener
    ),
)

# node-b's second provider with --vllm (configs/fleet-vllm.yaml: node-b-vllm at
# 127.0.0.1:8092), started right after llama.cpp. vLLM takes 45-50 s to start on 2 cores
# (more beside other work): it has a start-up bound of its own.
VLLM_SERVICE = ServiceSpec(
    "vllm",
    "tools/vllm_server.py",
    None,
    8092,
    tls=False,
    health_path="/health",
    argv=(
        "{python}",
        "{script}",
        *("--host", "{host}", "--port", "{port}", "--served-model-name", "smollm2-135m-vllm"),
        *("--max-model-len", "1024", "--max-num-seqs", "4", "--stop-timeout", "8"),
    ),
    port_role="API",
    ready_timeout_s=300.0,
)
VLLM_FLEET = REPO / "configs" / "fleet-vllm.yaml"
VLLM_MODEL = "var/vllm/smollm2-135m-instruct"  # what `make vllm` converts (the launcher's default)


def services(vllm: bool, ha: bool = False) -> tuple[ServiceSpec, ...]:
    """The stack's processes in start order; with vLLM, it comes right after llama.cpp;
    with ``ha``, the fleet of ``devstack_kit.ha`` (PostgreSQL, two edges, a balancer)."""
    chosen = (*SERVICES[:1], VLLM_SERVICE, *SERVICES[1:]) if vllm else SERVICES
    if ha:
        from .ha import ha_services  # it builds on this module's specs

        chosen = ha_services(chosen)
    return chosen


CONTROL_PLANE = "iop-control-plane"
FLEET_ENV = "IOP_FLEET_FILE"  # the control-plane's fleet_file setting
FLEET_COPY = "fleet.yaml"  # under --state-dir, written only with a port offset
API_PORT_ENV = "IOP_HTTP__PORT"  # the edge's OpenAI API port


@dataclass(frozen=True, slots=True)
class Options:
    port_offset: int
    certs: Path
    bin_dir: Path
    run_dir: Path
    state_dir: Path
    ready_timeout: float
    stop_timeout: float
    providers_timeout: float
    fleet: Path | None = None  # the fleet file instead of the dev control-plane's (--vllm)


@dataclass(frozen=True, slots=True)
class Plan:
    """A service resolved against the options: exactly what will run, and where."""

    spec: ServiceSpec
    port: int
    program: Path  # the executable (console script) or program file that must exist
    config: Path | None
    argv: tuple[str, ...]
    env: Mapping[str, str]
    pid_file: Path

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def admin_url(self) -> str:
        return f"{self.spec.scheme}://{HOST}:{self.port}"


def cert_files(certs: Path, name: str) -> dict[str, Path]:
    """The settings keys a certificate directory fills in, as ``tools/devcerts.py`` names them."""
    return {
        "CA_FILE": certs / "ca.pem",
        "CERT_FILE": certs / f"{name}.pem",
        "KEY_FILE": certs / f"{name}.key",
    }


def child_env(spec: ServiceSpec, opts: Options) -> dict[str, str]:
    """Our environment plus overrides, so the dev settings files never need editing."""
    certs = opts.certs
    env = dict(os.environ)
    env["PYTHONUNBUFFERED"] = "1"  # lines should reach us as they are written
    if spec.config is not None:  # IOP settings overrides; other programs get argv instead
        env["IOP_ADMIN__HOST"] = HOST  # the address whose ports the preflight checked
        env["IOP_ADMIN__PORT"] = str(spec.admin_port + opts.port_offset)
    if spec.script == CONTROL_PLANE and opts.port_offset:
        env[FLEET_ENV] = str(opts.state_dir / FLEET_COPY)  # see write_fleet()
    elif spec.script == CONTROL_PLANE and opts.fleet is not None:
        env[FLEET_ENV] = str(opts.fleet)
    for name, port in {**spec.ports, **spec.dials}.items():
        env[name] = str(port + opts.port_offset)
    for name, file_name in spec.state.items():
        env[name] = str(opts.state_dir / file_name)
    for name, template in spec.env_templates.items():
        env[name] = template.format(**format_fields(spec, opts))
    if spec.tls:
        for key, path in cert_files(certs, spec.name).items():
            env[f"IOP_TLS__{key}"] = str(path)
    return env


def format_fields(spec: ServiceSpec, opts: Options) -> dict[str, object]:
    """What ``argv`` and ``env_templates`` parts may name: {python}, {script}, {host},
    {port}, {state} (the state directory) and each of ``dials`` by its env name, shifted."""
    dials = {name: port + opts.port_offset for name, port in spec.dials.items()}
    return {
        "python": sys.executable,
        "script": REPO / spec.script,
        "host": HOST,
        "port": spec.admin_port + opts.port_offset,
        "state": opts.state_dir,
        **dials,
    }


def make_plan(spec: ServiceSpec, opts: Options) -> Plan:
    port = spec.admin_port + opts.port_offset
    config = None if spec.config is None else REPO / spec.config
    if spec.argv:
        program = REPO / spec.script
        argv = tuple(part.format(**format_fields(spec, opts)) for part in spec.argv)
    else:
        program = opts.bin_dir / spec.script
        argv = (str(program), "--config", str(config))
    return Plan(
        spec=spec,
        port=port,
        program=program,
        config=config,
        argv=argv,
        env=child_env(spec, opts),
        pid_file=opts.run_dir / f"{spec.name}.pid",
    )


def control_plane(plans: Sequence[Plan]) -> Plan:
    return next(plan for plan in plans if plan.spec.script == CONTROL_PLANE)


def api_root(plans: Sequence[Plan], opts: Options) -> str:
    """Where clients reach the OpenAI API and the catalog: the edge, or the balancer in
    front of the edges (``--ha``)."""
    public = next((p for p in plans if p.spec.public_api), None)
    if public is not None:
        return public.admin_url
    port = next(p.spec.ports[API_PORT_ENV] for p in plans if API_PORT_ENV in p.spec.ports)
    return f"http://{HOST}:{port + opts.port_offset}"
