"""Run docs/deploy-bare-metal.md's own commands on the test hosts of ``netns``.

The guide marks each shell block it wants run with a comment just above the fence::

    <!-- test: host=2 step=first -->            run on host 2 as part of step "first"
    <!-- test: host=all step=first run=no ... --> shown, counted, not run (installs)
    <!-- test: host=2 step=first run=background -->  a long-running program (a provider)
    <!-- test: vars -->                          HOST1..HOST4: the test sets its own

``host=all`` is every IOP host (1 to 3); host 4 runs only Debian's PostgreSQL and HAProxy
(the last section), whose units ``debian_units`` stands in for.

A step is run block by block, in the guide's order. Only what a real host has and a test
host has not is rewritten (the guide's last section lists it): the hosts share one file
system, so ``/etc/iop``, ``/var/lib/iop``, ``/etc/postgresql``, ``/etc/haproxy`` and
``/etc/systemd/system`` become a directory per host and ``/opt/iop`` the virtualenv
running the tests; the test runs as
root and creates no user, so ``sudo`` / ``sudo -u iop`` go and the owner ``iop`` is root
(``sudo -u postgres`` becomes ``runuser -u postgres --``: that account exists, and the
database server accepts its commands only as it);
``systemctl`` and ``scp`` lines are carried out here (the unit's ExecStart in the host's
namespace; a copy to the host of the address). Everything else is run as written, by
bash in the host's namespace, from a checkout of the repository (one per host).
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import shlex
import signal
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from debian_units import DebianPostgres, Haproxy
from netns import Host, Network
from unit_files import read_unit

from iop_proto.testing import RunningService, running_service, stop_service

ROOT = Path(__file__).resolve().parents[2]
GUIDE = ROOT / "docs" / "deploy-bare-metal.md"
_CHECKOUT = ("tools", "deploy", "proto", "services", "configs")
_TAG = re.compile(r"<!-- test: (?P<tag>[^>]*?)\s*-->\s*\n```(?:sh|bash)\n(?P<body>.*?)\n```", re.S)
_HEREDOC = re.compile(r"<<-?\s*'?(\w+)'?")
_ONLY = re.compile(r"#\s*hosts?\s+([\d, ]+)\s*$")  # "# host 1", "# hosts 2, 3": who runs it
_SUDO = re.compile(r"\bsudo (?:-u \S+ )?")
_SUDO_POSTGRES = re.compile(r"\bsudo -u postgres ")
# Where a host keeps what the guide writes (each a directory of the host's own)
_HOST_PATHS = ("/etc/systemd/system", "/etc/iop", "/var/lib/iop", "/etc/postgresql", "/etc/haproxy")
_ALL = (1, 2, 3)  # host=all: the IOP hosts
_VAR = re.compile(r"^(HOST\d)=\S+", re.M)
# A host's own directory where a settings file names it (not inside a path already rewritten)
_HOST_DIR = re.compile(r"(?<![\w.-])(/etc/iop|/var/lib/iop)(?=/|\b)")


class GuideError(AssertionError):
    """A command of the guide failed on its test host."""


@dataclass(frozen=True)
class Command:
    """One command as an operator types it (continuation lines and a heredoc included)."""

    text: str
    hosts: tuple[int, ...]  # the hosts that run it (a block's, or its "# host N" comment's)


@dataclass(frozen=True)
class Block:
    hosts: tuple[int, ...]
    step: str
    mode: str  # "run", "no" (shown, counted, not run), "background"
    commands: tuple[Command, ...]


def _commands(body: str, hosts: tuple[int, ...]) -> tuple[Command, ...]:
    lines = body.splitlines()
    out: list[Command] = []
    i = 0
    while i < len(lines):
        start = i
        while lines[i].endswith("\\") and i + 1 < len(lines):
            i += 1
        logical = "\n".join(lines[start : i + 1])
        if heredoc := _HEREDOC.search(logical):
            while i + 1 < len(lines) and lines[i].strip() != heredoc.group(1):
                i += 1
        text = "\n".join(lines[start : i + 1])
        i += 1
        if not text.strip():
            continue
        only = _ONLY.search(logical.splitlines()[0])
        runs = tuple(int(n) for n in re.findall(r"\d+", only.group(1))) if only else hosts
        out.append(Command(text, runs))
    return tuple(out)


def parse(text: str) -> tuple[list[Block], list[str]]:
    """The guide's tagged blocks and the variables its ``vars`` block defines."""
    blocks: list[Block] = []
    variables: list[str] = []
    for match in _TAG.finditer(text):
        fields = dict(part.split("=", 1) for part in match["tag"].split() if "=" in part)
        if match["tag"].split()[0] == "vars":
            variables = _VAR.findall(match["body"])
            continue
        host = fields["host"]
        hosts = _ALL if host == "all" else (int(host),)
        mode = fields.get("run", "run")
        blocks.append(Block(hosts, fields["step"], mode, _commands(match["body"], hosts)))
    return blocks, variables


@dataclass
class HostFiles:
    """What stands in for one host's own file system."""

    host: Host
    root: Path

    def rewrite(self, text: str) -> str:
        for path in _HOST_PATHS:
            text = text.replace(path, str(self.root) + path)
        text = text.replace("/opt/iop", sys.prefix)
        text = _SUDO_POSTGRES.sub("runuser -u postgres -- ", text)
        text = _SUDO.sub("", text)
        return text.replace("-o iop -g iop ", "").replace("iop:iop", "root:root")

    def rewrite_settings(self, text: str) -> str:
        """A settings file copied here: the paths it names, on this host (a path the
        sending host's commands wrote as its own included: a real host's are the same)."""
        sender = re.compile(re.escape(str(self.root.parent)) + r"/host\d+(?=/etc/iop|/var/lib/iop)")
        text = sender.sub(str(self.root), text)
        return _HOST_DIR.sub(lambda m: str(self.root) + m.group(1), text)

    @property
    def checkout(self) -> Path:
        return self.root / "checkout"


@dataclass
class Guide:
    """The guide's steps, run on ``network``'s hosts; owns every process it starts."""

    network: Network
    base: Path
    environment: Mapping[str, str]
    blocks: list[Block] = field(default_factory=list)
    services: dict[tuple[int, str], RunningService] = field(default_factory=dict)
    durations: dict[str, float] = field(default_factory=dict)
    exits: dict[tuple[int, str], int | None] = field(default_factory=dict)  # units stopped
    _stacks: dict[tuple[int, str], contextlib.AsyncExitStack] = field(default_factory=dict)
    _background: list[asyncio.subprocess.Process] = field(default_factory=list)
    _files: dict[int, HostFiles] = field(default_factory=dict)
    _postgres: dict[int, DebianPostgres] = field(default_factory=dict)
    _haproxy: dict[int, Haproxy] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.blocks, variables = parse(GUIDE.read_text())
        hosts = [f"HOST{h.number}" for h in self.network.hosts]
        assert variables == hosts, f"the guide's vars block defines {variables}, not {hosts}"
        for host in self.network.hosts:
            files = HostFiles(host, self.base / f"host{host.number}")
            files.checkout.mkdir(parents=True)
            (files.root / "etc/systemd/system").mkdir(parents=True)  # as on any host
            for name in _CHECKOUT:
                (files.checkout / name).symlink_to(ROOT / name)
            self._files[host.number] = files
            self._postgres[host.number] = DebianPostgres(host, files.root)

    @property
    def variables(self) -> dict[str, str]:
        return {f"HOST{h.number}": h.address for h in self.network.hosts}

    def files(self, number: int) -> HostFiles:
        return self._files[number]

    def steps(self, step: str) -> list[Block]:
        found = [block for block in self.blocks if block.step == step]
        assert found, f"the guide has no block of step {step!r}"
        return found

    def manual_commands(self, *steps: str, installs: bool = True) -> int:
        """What an operator types for ``steps``: each command once per host that runs it
        (``installs=False``: leaving out the blocks the test does not run)."""
        return sum(
            len(c.hosts)
            for s in steps
            for b in self.steps(s)
            if installs or b.mode != "no"
            for c in b.commands
        )

    async def run(self, step: str) -> str:
        """Run every block of ``step`` in order; returns what its commands printed."""
        started = time.monotonic()
        printed: list[str] = []
        for block in self.steps(step):
            if block.mode == "no":
                await self._installed(block)
                continue
            for command in block.commands:
                for number in command.hosts:
                    printed.append(await self._one(block, command, number))
        self.durations[step] = time.monotonic() - started
        return "".join(printed)

    async def _installed(self, block: Block) -> None:
        """What a Debian package the block installs leaves on the host: PostgreSQL's
        cluster, started; HAProxy's /etc/haproxy (the IOP packages leave nothing the
        checkout's virtualenv lacks)."""
        for command in block.commands:
            packages = command.text.split("apt-get install", 1)[-1].split()
            for number in command.hosts if "apt-get install" in command.text else ():
                if "haproxy" in packages:
                    (self.files(number).root / "etc/haproxy").mkdir(parents=True, exist_ok=True)
                if "postgresql" in packages:
                    await self._postgres[number].install()

    async def _one(self, block: Block, command: Command, number: int) -> str:
        files = self.files(number)
        if block.mode == "background":
            await self._start_background(files, files.rewrite(command.text))
            return ""
        first = _SUDO.sub("", command.text).split(None, 1)[0]
        if first == "systemctl":
            words = shlex.split(_SUDO.sub("", command.text), comments=True)
            await self._systemctl(files, words[1:])
            return ""
        if first == "scp":
            await self._scp(files, command.text)
            return ""
        return await self._bash(files, files.rewrite(command.text))

    async def _bash(self, files: HostFiles, script: str) -> str:
        process = await asyncio.create_subprocess_exec(
            *files.host.wrapper,
            "bash",
            "-euo",
            "pipefail",
            "-c",
            script,
            cwd=files.checkout,
            env={**self.environment, **self.variables, **self._postgres[files.host.number].env},
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        out, err = await asyncio.wait_for(process.communicate(), 120)
        if process.returncode != 0:
            raise GuideError(
                f"on host {files.host.number}, exit {process.returncode}:\n{script}\n"
                f"--- stdout\n{out.decode()}\n--- stderr\n{err.decode()}"
            )
        return out.decode()

    async def _start_background(self, files: HostFiles, command: str) -> None:
        process = await asyncio.create_subprocess_exec(
            *files.host.wrapper,
            "bash",
            "-c",
            f"exec {command}",
            cwd=files.checkout,
            env={**self.environment, **self.variables},
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
        )
        self._background.append(process)
        assert process.stdout is not None
        seen: list[str] = []
        async with asyncio.timeout(180):
            while line := (await process.stdout.readline()).decode():
                seen.append(line)
                if line.startswith("ready:"):
                    return
        raise GuideError(f"{command} exited before it was ready:\n{''.join(seen)}")

    async def _systemctl(self, files: HostFiles, words: list[str]) -> None:
        action, units = words[0], [w for w in words[1:] if not w.startswith("-")]
        now = "--now" in words
        if action == "daemon-reload":
            return
        for unit in units:
            key = (files.host.number, unit.removesuffix(".service"))
            if key[1] in ("postgresql", "haproxy"):
                await self._debian_unit(files, key[1], action, now)
            elif action in ("start", "restart") or (action == "enable" and now):
                if action == "restart":
                    await self.stop(*key)
                await self._start_unit(files, key[1])
            elif action in ("stop", "disable"):
                await self.stop(*key)
            else:
                raise GuideError(f"the test cannot carry out 'systemctl {' '.join(words)}'")

    async def _debian_unit(self, files: HostFiles, unit: str, action: str, now: bool) -> None:
        number = files.host.number
        if action == "enable" and now:
            action = "start"
        if action not in ("start", "stop", "restart"):
            raise GuideError(f"the test cannot carry out 'systemctl {action} {unit}'")
        if unit == "postgresql":
            await self._postgres[number].control(action)
            return
        running = self._haproxy.pop(number, None)
        if running is not None:
            await running.stop()
        if action != "stop":
            self._haproxy[number] = Haproxy(files.host, files.root / "etc/haproxy/haproxy.cfg")
            await self._haproxy[number].start()

    def haproxy_log(self, number: int) -> str:
        """What host ``number``'s HAProxy printed (its checks' verdicts, a line a connection)."""
        running = self._haproxy.get(number)
        return "".join(running.log) if running is not None else ""

    async def kill(self, number: int, unit: str) -> int | None:
        """SIGKILL a unit the guide started on host ``number`` (a host's sudden death, as
        far as that service goes); its exit code."""
        service = self.services.pop((number, unit))
        code = await stop_service(service, signal.SIGKILL)
        await self._stacks.pop((number, unit)).aclose()
        self.exits[(number, unit)] = code
        return code

    async def _start_unit(self, files: HostFiles, unit: str) -> None:
        script, config, env = read_unit(files.root, files.rewrite, unit)
        stack = contextlib.AsyncExitStack()
        service = running_service(
            script, config, env=env, ready_timeout=60, wrapper=files.host.wrapper
        )
        self.services[(files.host.number, unit)] = await stack.enter_async_context(service)
        self._stacks[(files.host.number, unit)] = stack

    async def stop(self, number: int, unit: str) -> int | None:
        """SIGTERM a unit the guide started on host ``number``; its exit code."""
        service = self.services.pop((number, unit), None)
        stack = self._stacks.pop((number, unit))
        code = await stop_service(service) if service is not None else None
        await stack.aclose()
        self.exits[(number, unit)] = code
        return code

    async def shell(self, number: int, script: str) -> str:
        """The test's own command on host ``number`` (not the guide's: nothing rewritten)."""
        return await self._bash(self.files(number), script)

    async def _scp(self, files: HostFiles, text: str) -> None:
        expand = f"printf '%s\\0' {text.split(None, 1)[1]}"
        listed = await self._bash(files, expand.replace("\\\n", " "))
        *sources, target = listed.rstrip("\0").split("\0")
        address, _, path = target.split("@", 1)[-1].partition(":")
        (receiver,) = [f for f in self._files.values() if f.host.address == address]
        for source in sources:
            into = _copy(files.checkout, Path(files.rewrite(source)), receiver.rewrite(path))
            if into.suffix in (".yaml", ".env"):
                into.write_text(receiver.rewrite_settings(into.read_text()))

    async def close(self) -> None:
        for haproxy in self._haproxy.values():
            with contextlib.suppress(Exception):
                await haproxy.stop()
        for number, unit in reversed(list(self._stacks)):
            with contextlib.suppress(Exception):
                await self.stop(number, unit)
        for postgres in self._postgres.values():
            if postgres.installed:
                with contextlib.suppress(Exception):
                    await postgres.control("stop")
        for process in self._background:
            if process.returncode is None:
                process.kill()
            await process.wait()


def _copy(cwd: Path, source: Path, target: str) -> Path:
    """scp's copy: into a directory when the target ends with '/', keeping the mode; the
    file written."""
    source = source if source.is_absolute() else cwd / source
    into = Path(target) / source.name if target.endswith("/") else Path(target)
    into.parent.mkdir(parents=True, exist_ok=True)
    into.write_bytes(source.read_bytes())
    into.chmod(source.stat().st_mode & 0o777)
    return into
