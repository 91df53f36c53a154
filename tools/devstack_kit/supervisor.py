"""The children started so far, in start order: started one by one, kept running, stopped
in reverse."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import time
from collections.abc import Collection, Sequence
from typing import Any

import aiohttp

from .health import describe_providers, poll_health, poll_providers
from .plan import Options, Plan
from .processes import Backoff, Child, Console, describe_exit, signal_group, spawn, write_pid_file

DRAIN_TIMEOUT_S = 2.0


async def cancel_all(tasks: Sequence[asyncio.Task[Any]]) -> None:
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


def readiness(child: Child, session: aiohttp.ClientSession) -> list[asyncio.Task[Any]]:
    """What says ``child`` is ready: its ready line, or its health URL answering 200 (only
    asked of a service spoken to over HTTP: PostgreSQL says so with its line)."""
    goals: list[asyncio.Task[Any]] = [asyncio.create_task(child.ready.wait())]
    if child.plan.spec.scheme == "http":
        url = child.plan.admin_url + child.plan.spec.health_path
        goals.append(asyncio.create_task(poll_health(session, url)))
    return goals


class Stack:
    """The children started so far, in start order, and how to stop them all."""

    def __init__(self, console: Console, opts: Options) -> None:
        self.console = console
        self.opts = opts
        self.children: list[Child] = []
        self.retired: list[asyncio.Task[None]] = []  # output pumps of children since restarted
        self.hurry = asyncio.Event()  # a second Ctrl-C: stop waiting for graceful exits

    async def start(self, plans: Sequence[Plan], stop: asyncio.Event) -> str | None:
        """Start each service once the previous one is ready; return a failure or ``None``."""
        async with aiohttp.ClientSession() as session:
            for plan in plans:
                if stop.is_set():
                    return None
                failure = await self.start_one(plan, session, stop)
                if failure is not None:
                    return failure
        return None

    async def start_one(
        self, plan: Plan, session: aiohttp.ClientSession, stop: asyncio.Event
    ) -> str | None:
        self.console.say(f"starting {plan.name} ({plan.spec.port_role} {plan.admin_url})")
        try:
            child = await spawn(plan, self.console)
        except OSError as exc:
            return f"could not start {plan.name}: {exc}"
        self.children.append(child)  # from here on, stop_all() owns it
        try:
            write_pid_file(plan.pid_file, child.proc.pid)
        except OSError as exc:
            return f"could not write {plan.pid_file}: {exc}"
        failure = await self.wait_ready(child, session, stop)
        if failure is None and not stop.is_set():
            self.console.say(f"{plan.name} is ready")
        return failure

    async def race(
        self,
        goals: Sequence[asyncio.Task[Any]],
        stop: asyncio.Event,
        within_s: float | None,
        watching: Collection[Child] | None = None,
    ) -> set[asyncio.Task[Any]]:
        """Wait for the first of ``goals``, a stop request or a child's exit; cancel the rest.

        By default every child started so far is watched: while the stack comes up it
        is only as up as its weakest member. Returns what finished; empty after
        ``within_s``.
        """
        helpers = [*goals, asyncio.create_task(stop.wait())]
        exits = {c.exited for c in (self.children if watching is None else watching)}
        try:
            done, _ = await asyncio.wait(
                {*exits, *helpers}, timeout=within_s, return_when=asyncio.FIRST_COMPLETED
            )
        finally:
            await cancel_all(helpers)
        return done

    def ready_timeout(self, plan: Plan) -> float:
        """How long ``plan``'s service may take to be ready: its own bound, if it has one."""
        own = plan.spec.ready_timeout_s
        return self.opts.ready_timeout if own is None else max(own, self.opts.ready_timeout)

    async def wait_ready(
        self, child: Child, session: aiohttp.ClientSession, stop: asyncio.Event
    ) -> str | None:
        """Wait for the ready line or a healthy health URL; return why not, or ``None``.

        A stop request also returns ``None``; the caller checks ``stop`` itself.
        """
        goals = readiness(child, session)
        within = self.ready_timeout(child.plan)
        done = await self.race(goals, stop, within)
        if not done:
            return f"{child.plan.name} was not ready within {within:.0f}s"
        return self.exit_failure(done, "during start-up")

    async def wait_providers(
        self,
        catalog_url: str,
        expected: frozenset[str],
        stop: asyncio.Event,
        metrics_url: str | None = None,
    ) -> tuple[str | None, int]:
        """Wait until the catalog shows every provider available: (why not, how many)."""
        seen: dict[str, str] = {}
        async with aiohttp.ClientSession() as session:
            counting = asyncio.create_task(
                poll_providers(session, catalog_url, expected, seen, metrics_url)
            )
            done = await self.race([counting], stop, self.opts.providers_timeout)
        if counting in done:
            return None, counting.result()
        if not done:
            waiting = describe_providers(expected, seen)
            return (
                f"not every provider was available within {self.opts.providers_timeout:.0f}s "
                f"({catalog_url}): {waiting}",
                0,
            )
        return self.exit_failure(done, "while providers came up"), 0

    def exit_failure(self, done: set[asyncio.Task[Any]], when: str) -> str | None:
        """Name the first child among ``done`` exit tasks, with how it exited."""
        for child in self.children:
            if child.exited in done:
                how = describe_exit(child.exited.result())
                return f"{child.plan.name} exited unexpectedly {when} ({how})"
        return None

    async def supervise(self, stop: asyncio.Event) -> None:
        """Until a stop request, start again every service that exits; return after it.

        One loop per service, each with its own backoff, so one that keeps failing
        delays nobody else. The loops end at a stop request and never while a process
        is being started, so ``stop_all`` afterwards sees every child there is.
        """
        async with asyncio.TaskGroup() as group:
            for index in range(len(self.children)):
                group.create_task(self.keep_running(index, stop))

    async def keep_running(self, index: int, stop: asyncio.Event) -> None:
        backoff = Backoff()
        while True:
            old = self.children[index]
            await self.race([], stop, None, watching=[old])
            if stop.is_set():
                return
            name, uptime = old.plan.name, time.monotonic() - old.started
            signal_group(old.proc.pid, signal.SIGKILL)  # whatever it left in its group
            delay = backoff.after(uptime)
            self.console.say(
                f"{name} exited ({describe_exit(old.exited.result())}) after {uptime:.1f}s; "
                f"restarting it in {delay:.1f}s"
            )
            await self.race([asyncio.create_task(asyncio.sleep(delay))], stop, None, watching=())
            if stop.is_set():
                return
            try:
                child = await self.restart(index)
            except OSError as exc:
                self.console.say(f"could not restart {name}: {exc}; it stays down")
                return
            self.console.say(f"restarted {name} (pid {child.proc.pid})")
            await self.await_restarted(child, stop)

    async def restart(self, index: int) -> Child:
        """Start the service at ``index`` again, in its predecessor's place in the stop order.

        Shielded: once the process is forked it must be ours to stop, even if this
        loop is cancelled meanwhile.
        """
        spawning = asyncio.create_task(spawn(self.children[index].plan, self.console))
        try:
            return await asyncio.shield(spawning)
        except asyncio.CancelledError:
            await asyncio.wait([spawning])
            raise
        finally:
            if spawning.done() and not spawning.cancelled() and spawning.exception() is None:
                child = spawning.result()
                self.retired.append(self.children[index].pump)
                self.children[index] = child
                with contextlib.suppress(OSError):  # the file is for people; we hold the pid
                    write_pid_file(child.plan.pid_file, child.proc.pid)

    async def await_restarted(self, child: Child, stop: asyncio.Event) -> None:
        """Say when a restarted service is ready again; if it is not within
        ``--ready-timeout``, kill it, and its exit brings the next (later) restart."""
        async with aiohttp.ClientSession() as session:
            goals = readiness(child, session)
            within = self.ready_timeout(child.plan)
            done = await self.race(goals, stop, within, watching=[child])
        if stop.is_set() or child.exited in done:
            return
        if done:
            self.console.say(f"{child.plan.name} is ready again")
            return
        self.console.say(f"{child.plan.name} was not ready within {within:.0f}s; killing it")
        signal_group(child.proc.pid, signal.SIGKILL)

    async def stop_all(self) -> None:
        """Stop in reverse start order, so nothing outlives what it depends on."""
        for child in reversed(self.children):
            await self.stop_one(child)
        pumps = [*self.retired, *(child.pump for child in self.children)]
        if pumps:
            await asyncio.wait(pumps, timeout=DRAIN_TIMEOUT_S)
            await cancel_all(pumps)

    async def stop_one(self, child: Child) -> None:
        pgid, name = child.proc.pid, child.plan.name
        if not child.exited.done():
            self.console.say(f"stopping {name}")
            signal_group(pgid, signal.SIGTERM)
            if not await self.stopped_in_time(child):
                self.console.say(f"{name} did not stop in time; killing it")
                signal_group(pgid, signal.SIGKILL)
                await child.exited
        # Anything the service started in its group and left behind goes with it.
        signal_group(pgid, signal.SIGKILL)
        child.plan.pid_file.unlink(missing_ok=True)
        self.console.say(f"stopped {name} ({describe_exit(child.exited.result())})")

    async def stopped_in_time(self, child: Child) -> bool:
        """Give a child ``--stop-timeout`` seconds to exit, or less after a second Ctrl-C."""
        hurry = asyncio.create_task(self.hurry.wait())
        try:
            await asyncio.wait(
                {child.exited, hurry},
                timeout=self.opts.stop_timeout,
                return_when=asyncio.FIRST_COMPLETED,
            )
        finally:
            await cancel_all([hurry])
        return child.exited.done()
