"""Run the whole IOP stack as local processes in the foreground: the program behind ``make run``.

One parent owns every child so that Ctrl-C is all it takes to stop the stack and
nothing is left running: children live in their own process groups (a terminal's
Ctrl-C reaches only us), and we stop them in reverse start order, then clean up
whatever they left in their groups. Services start one at a time, each only once
the previous one says it is ready, because later services connect to earlier ones.

Every line a child writes is prefixed with its name, like ``docker compose`` or
foreman, so the interleaved logs stay readable. The processes are declared in
``SERVICES``; adding one is adding an entry. The first is not an IOP service but
node-a's provider, a real llama.cpp server (``tools/llama_server.py``).

"Up" means usable, not merely started: after every process is ready we wait until
the edge's catalog shows every provider of the fleet available, then print one
``IOP is up`` line. From then on we supervise: a service that exits is logged and
started again, after a delay that doubles while it keeps dying quickly, and the
others keep running, so the dev stack can show a pool that survives a lost node. A
service that fails while the stack comes up still stops everything: that is a setup
problem, which restarting would only hide. Ctrl-C still stops everything.

With ``--port-offset`` the control-plane is given a copy of the fleet file whose
local endpoints are shifted too, so node-a dials the shifted llama.cpp port.

With ``--vllm`` (``make run VLLM=1``) a real vLLM (``tools/vllm_server.py``, from
``make vllm``) starts after llama.cpp, and the control-plane reads
``configs/fleet-vllm.yaml``: ``smollm2:135m`` served by llama.cpp on node-a and by vLLM
on node-b, each under its own name, one public model id.

With ``--ha`` (``make run HA=1``) the edge tier is doubled: PostgreSQL, two edges sharing
it, and a balancer on the public port in front of them (``devstack_kit/ha.py``).

This file is the command line; each job is a module of ``devstack_kit/`` (its
``__init__`` says which). The names tests and tools read (``SERVICES``, ``make_plan``,
``Backoff`` ...) are importable from here as before.
"""

from __future__ import annotations

import argparse
import asyncio
import re
import signal
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import yaml

# Run as a script, or loaded from its path by the tests: tools/ holds ``devstack_kit``.
sys.path.insert(0, str(Path(__file__).resolve().parent))

from devstack_kit.fleet import fleet_providers, shift_endpoints, write_fleet
from devstack_kit.ha import ha_line
from devstack_kit.health import POLL_INTERVAL_S, describe_providers, poll_providers
from devstack_kit.plan import (
    API_PORT_ENV,
    FLEET_ENV,
    REPO,
    SERVICES,
    VLLM_FLEET,
    VLLM_MODEL,
    Options,
    Plan,
    api_root,
    control_plane,
    make_plan,
    services,
)
from devstack_kit.preflight import check_files, check_vllm, preflight
from devstack_kit.processes import Backoff, Console, wants_color
from devstack_kit.supervisor import Stack

__all__ = [
    "FLEET_ENV",
    "POLL_INTERVAL_S",
    "SERVICES",
    "VLLM_FLEET",
    "VLLM_MODEL",
    "Backoff",
    "Console",
    "Options",
    "Stack",
    "api_root",
    "check_files",
    "check_vllm",
    "control_plane",
    "describe_providers",
    "fleet_providers",
    "ha_line",
    "main",
    "make_plan",
    "poll_providers",
    "services",
    "shift_endpoints",
    "up_line",
    "write_fleet",
]

READY_TIMEOUT_S = 30.0
PROVIDERS_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 10.0
EXIT_OK, EXIT_FAILED, EXIT_PREFLIGHT = 0, 1, 2


def install_signal_handlers(stop: asyncio.Event, stack: Stack) -> None:
    """SIGINT and SIGTERM ask for a graceful stop; a second one asks to kill right away."""

    def on_signal() -> None:
        if stop.is_set():
            stack.hurry.set()
        stop.set()

    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, on_signal)


def ports_line(plans: Sequence[Plan]) -> str:
    urls = ", ".join(f"{plan.name} {plan.spec.port_role} {plan.admin_url}" for plan in plans)
    return f"ports: {urls}; Ctrl-C stops them all"


def up_line(root: str, available: int) -> str:
    """The one line that says the stack is usable: what to point a client at."""
    return (
        f"IOP is up: OpenAI API {root}/v1, catalog {root}/iop/v1/catalog/providers "
        f"({available} providers available)"
    )


async def run(
    plans: Sequence[Plan], opts: Options, console: Console, providers: frozenset[str]
) -> int:
    """Start, supervise, and always stop: the ``finally`` is what leaves nothing running."""
    stop = asyncio.Event()
    stack = Stack(console, opts)
    install_signal_handlers(stop, stack)
    failure: str | None = None
    available = 0
    root = api_root(plans, opts)
    try:
        failure = await stack.start(plans, stop)
        if failure is None and not stop.is_set():
            catalog = f"{root}/iop/v1/catalog/providers"
            console.say(f"waiting for {len(providers)} providers to be available in {catalog}")
            edge = next((p for p in plans if API_PORT_ENV in p.spec.ports), None)
            metrics = f"{edge.admin_url}/metrics" if edge is not None else None
            failure, available = await stack.wait_providers(catalog, providers, stop, metrics)
        if failure is None and not stop.is_set():
            console.say(ports_line(plans))
            if (edges := ha_line(plans)) is not None:
                console.say(edges)
            console.write(up_line(root, available))
            await stack.supervise(stop)
        if failure is not None:
            console.say(f"{failure}; stopping the rest")
    finally:
        await stack.stop_all()
    if failure is not None:
        console.error(failure)
        return EXIT_FAILED
    console.say("all stopped")
    return EXIT_OK


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="devstack", description="Run every IOP service locally; Ctrl-C stops them all."
    )
    parser.add_argument(
        "--port-offset", type=int, default=0, help="add N to every port (default 0)"
    )
    parser.add_argument(
        "--certs", type=Path, default=REPO / "certs" / "dev", help="dev certificate directory"
    )
    parser.add_argument(
        "--bin",
        type=Path,
        default=Path(sys.executable).parent,
        help="directory of the iop-* console scripts (default: this Python's)",
    )
    parser.add_argument(
        "--run-dir", type=Path, default=REPO / "var" / "run", help="where pid files go"
    )
    parser.add_argument(
        "--state-dir",
        type=Path,
        default=REPO / "var" / "dev",
        help="where services keep their state (databases)",
    )
    parser.add_argument(
        "--vllm",
        action="store_true",
        help="also run vLLM (make vllm) and serve smollm2:135m from llama.cpp and vLLM "
        f"({VLLM_FLEET.relative_to(REPO)})",
    )
    parser.add_argument(
        "--ha",
        action="store_true",
        help="two edges on one PostgreSQL behind a balancer on the API port "
        "(make run HA=1; devstack_kit/ha.py)",
    )
    parser.add_argument("--ready-timeout", type=float, default=READY_TIMEOUT_S, help="seconds")
    parser.add_argument("--stop-timeout", type=float, default=STOP_TIMEOUT_S, help="seconds")
    parser.add_argument(
        "--providers-timeout",
        type=float,
        default=PROVIDERS_TIMEOUT_S,
        help="seconds for every provider to become available once all services are ready",
    )
    return parser.parse_args(argv)


def options_from(args: argparse.Namespace) -> Options:
    return Options(
        port_offset=args.port_offset,
        certs=args.certs.absolute(),
        bin_dir=args.bin.absolute(),
        run_dir=args.run_dir.absolute(),
        state_dir=args.state_dir.absolute(),
        ready_timeout=args.ready_timeout,
        stop_timeout=args.stop_timeout,
        providers_timeout=args.providers_timeout,
        fleet=VLLM_FLEET if args.vllm else None,
    )


def issue_dev_tokens(plans: Sequence[Plan], opts: Options, console: Console) -> list[str]:
    """Give every node a token from the dev control-plane's database, once.

    The token file and the database both live in the state directory, so they
    are made and wiped together; an existing token file is kept.
    """
    cp = control_plane(plans)
    problems: list[str] = []
    for plan in plans:
        token_name = plan.spec.state.get("IOP_TOKEN_FILE")
        if token_name is None:
            continue
        token_file = opts.state_dir / token_name
        if token_file.is_file():
            continue
        token_file.parent.mkdir(parents=True, exist_ok=True)
        result = subprocess.run(
            [str(cp.program), "--config", str(cp.config), "token", "issue", "--node", plan.name],
            env=dict(cp.env),
            capture_output=True,
            text=True,
            check=False,
        )
        token = re.search(r"\biopnt_\S+", result.stdout)
        if result.returncode != 0 or token is None:
            problems.append(f"could not issue a dev token for {plan.name}: {result.stderr.strip()}")
            continue
        token_file.touch(mode=0o600)
        token_file.write_text(token.group(0) + "\n")
        console.say(f"issued a dev token for {plan.name} ({token_file})")
    return problems


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    opts = options_from(args)
    plans = [make_plan(spec, opts) for spec in services(args.vllm, args.ha)]
    console = Console([plan.name for plan in plans], color=wants_color())
    problems = preflight(plans, opts)
    if problems:
        for problem in problems:
            console.error(problem)
        console.error("nothing was started")
        return EXIT_PREFLIGHT
    try:
        fleet = write_fleet(plans, opts)
        providers = fleet_providers(fleet)
    except (OSError, ValueError, yaml.YAMLError) as exc:
        console.error(f"could not prepare the fleet file: {exc}")
        return EXIT_PREFLIGHT
    problems = issue_dev_tokens(plans, opts, console)
    if problems:
        for problem in problems:
            console.error(problem)
        return EXIT_PREFLIGHT
    return asyncio.run(run(plans, opts, console, providers))


if __name__ == "__main__":
    sys.exit(main())
