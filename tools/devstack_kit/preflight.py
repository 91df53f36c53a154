"""Preflight: everything that can be wrong is found before anything starts."""

from __future__ import annotations

import os
import socket
from collections.abc import Sequence
from pathlib import Path

from iop_proto.testing_postgres import why_postgres_cannot_run

from .plan import HOST, REPO, VLLM_MODEL, VLLM_SERVICE, Options, Plan, cert_files


def port_is_free(port: int) -> bool:
    """Bind and listen as the services will (aiohttp sets SO_REUSEADDR), then let go."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((HOST, port))
            sock.listen()
        except OSError:
            return False
    return True


def check_ports(plans: Sequence[Plan], opts: Options) -> list[str]:
    problems: list[str] = []
    for plan in plans:
        for purpose, base in plan.spec.all_ports().items():
            port = base + opts.port_offset
            if not 0 < port < 65536:
                problems.append(f"{plan.name} {purpose} {port} is out of range (--port-offset?)")
            elif not port_is_free(port):
                problems.append(
                    f"port {port} on {HOST} ({purpose} of {plan.name}) is already in use; "
                    "stop whatever holds it or choose another --port-offset"
                )
    return problems


def check_files(plans: Sequence[Plan], opts: Options) -> list[str]:
    problems: list[str] = []
    for plan in plans:
        program, config = plan.program, plan.config
        if plan.spec.argv:
            if not program.is_file():
                problems.append(f"{plan.name}: {program} does not exist")
        elif not os.access(program, os.X_OK):
            problems.append(f"{plan.name}: {program} is missing or not executable (make install?)")
        if config is not None and not config.is_file():
            problems.append(f"{plan.name}: settings file {config} does not exist")
        if plan.spec.tls:
            missing = [p for p in cert_files(opts.certs, plan.name).values() if not p.is_file()]
            problems += [f"{plan.name}: {p} does not exist (make certs?)" for p in missing]
    return problems


def process_exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's process, but it exists
    return True


def runs_script(pid: int, script: str) -> bool:
    """Guard against a recycled pid where /proc lets us look; elsewhere trust the pid."""
    if not Path("/proc/self").exists():
        return True
    try:
        return script in Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
    except OSError:
        return False


def live_pid(plan: Plan) -> int | None:
    """The process a pid file names if it is still ours and running; ``None`` if stale."""
    try:
        pid = int(plan.pid_file.read_text().strip())
    except (OSError, ValueError):
        return None
    if pid > 0 and process_exists(pid) and runs_script(pid, plan.spec.script):
        return pid
    return None


def check_pid_files(plans: Sequence[Plan]) -> list[str]:
    """Refuse to run a second copy over a live one; a stale pid file is just removed."""
    problems: list[str] = []
    for plan in plans:
        if not plan.pid_file.exists():
            continue
        pid = live_pid(plan)
        if pid is None:
            plan.pid_file.unlink(missing_ok=True)
        else:
            problems.append(
                f"{plan.name} is already running as pid {pid} ({plan.pid_file}); "
                f"stop it first (kill -TERM -{pid}) or use another --run-dir"
            )
    return problems


def preflight(plans: Sequence[Plan], opts: Options) -> list[str]:
    return (
        check_ports(plans, opts)
        + check_files(plans, opts)
        + check_pid_files(plans)
        + check_vllm(plans)
        + check_postgres(plans)
    )


def check_postgres(plans: Sequence[Plan]) -> list[str]:
    """Debian's PostgreSQL server for --ha (``make run HA=1`` installs it where apt can)."""
    if not any(plan.spec.scheme == "postgresql" for plan in plans):
        return []
    reason = why_postgres_cannot_run()
    return [] if reason is None else [f"postgres: {reason}"]


def check_vllm(plans: Sequence[Plan]) -> list[str]:
    """vLLM's venv and converted model, which ``make vllm`` makes (the launcher checks
    them too, but only once it runs, a minute into the stack's start)."""
    if not any(plan.spec is VLLM_SERVICE for plan in plans):
        return []
    needed = (REPO / ".venv-vllm" / "bin" / "python", REPO / VLLM_MODEL / "config.json")
    return [f"vllm: {path} does not exist (make vllm)" for path in needed if not path.exists()]
