"""The node's application core (``NodeCore``): its providers, their probes, and the runs in flight.

The edge link calls ``start_run``/``cancel`` and reads ``states()``; it never
touches adapters or gates directly. Config updates (``apply_config``) add,
change and retire providers without dropping runs in flight: a changed adapter
serves new runs while old runs finish on the adapter they started with.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from loguru import logger

from iop_node.domain.admission import AdmissionGate
from iop_node.domain.cache_account import DEFAULT_CACHE_PREFIXES, CacheAccount, CacheView
from iop_node.domain.events import Failed
from iop_node.domain.health import Health, HealthTracker, ProbeResult
from iop_node.domain.model_load import LoadState
from iop_node.domain.provider import ProviderConfig
from iop_node.domain.runs import RunOrder
from iop_node.errors import ConfigError, RunFailure
from iop_node.metrics import NodeMetrics
from iop_node.ports import (
    AdapterContext,
    AdapterFactory,
    EngineInfo,
    LifecycleFlags,
    LoadReporter,
    RunChannel,
    RunHistory,
)
from iop_node.runtime import ProviderRuntime
from iop_node.service.engine_probe import describe
from iop_node.service.run_check import resolve
from iop_node.service.runs import RunExecutor
from iop_proto.tracing import Tracing


@dataclass(frozen=True, slots=True)
class ProbeSettings:
    interval_s: float = 5.0
    timeout_s: float = 2.0
    rise: int = 1
    fall: int = 2


def _cache_lost(result: ProbeResult, models_before: tuple[str, ...]) -> bool:
    """Whether a probe shows the engine's prompt cache gone: it did not answer (an engine
    restarted between two probes fails one, which the health's hysteresis lets pass), or
    it lists other models than before (restarted with them, or loaded them instead)."""
    return not result.ok or (bool(models_before) and result.models != models_before)


@dataclass(frozen=True, slots=True)
class ProviderStatus:
    """What the edge is told about one provider (converted to the wire by ``entrypoints.wire``)."""

    config: ProviderConfig
    health: Health
    in_flight: int
    queued: int
    models: tuple[str, ...]
    capabilities: LifecycleFlags
    last_probe_unix_ms: int
    detail: str
    cache: CacheView = field(default_factory=CacheView)
    engine: EngineInfo | None = None  # None until the engine was asked (engine_probe)
    listed_models: int = 0  # how many models the last probe listed (0: none, config's names)
    loaded: LoadState | None = None  # None: every model always loaded


class NodeCore:
    """Providers and runs of one node; every task it starts it also stops."""

    def __init__(
        self,
        node_id: str,
        factories: Mapping[str, AdapterFactory],
        context: AdapterContext,
        history: RunHistory,
        metrics: NodeMetrics,
        probes: ProbeSettings,
        cache_prefixes: int = DEFAULT_CACHE_PREFIXES,
        tracing: Tracing | None = None,
    ) -> None:
        self.node_id = node_id
        self._factories = factories
        self._context = context
        self._metrics = metrics
        self._probes = probes
        self._cache_prefixes = cache_prefixes
        self.providers: dict[str, ProviderRuntime] = {}
        self._probe_tasks: dict[str, asyncio.Task[None]] = {}
        self._last_probe_ms: dict[str, int] = {}
        self._engines: dict[str, EngineInfo] = {}  # asked when a provider becomes available
        self._runs: dict[tuple[str, str], asyncio.Task[None]] = {}  # by (link, run id)
        self._retiring: set[asyncio.Task[None]] = set()
        self._listeners: list[Callable[[], None]] = []
        self._executor = RunExecutor(
            history, metrics, self._changed, node_id=node_id, tracing=tracing
        )

    # ------------------------------------------------------------ change notification

    def on_change(self, listener: Callable[[], None]) -> None:
        """Called (synchronously, cheaply) whenever a provider's state may have changed."""
        self._listeners.append(listener)

    def off_change(self, listener: Callable[[], None]) -> None:
        """Stop calling ``listener`` (a link that ended)."""
        with contextlib.suppress(ValueError):
            self._listeners.remove(listener)

    def _changed(self) -> None:
        for listener in self._listeners:
            listener()

    # ------------------------------------------------------------ configuration

    async def apply_config(self, configs: list[ProviderConfig]) -> None:
        """Make the providers match ``configs``; runs in flight are never dropped."""
        wanted = {config.id: config for config in configs}
        for provider_id in list(self.providers):
            if provider_id not in wanted:
                self._retire(self.providers.pop(provider_id))
        for config in configs:
            current = self.providers.get(config.id)
            try:
                if current is None:
                    self.providers[config.id] = self._build(config)
                    self._start_probe(config.id)
                elif current.config != config:
                    await self._update(current, config)
            except ConfigError as exc:
                logger.error("provider {} not applied: {}", config.id, exc)
        self._changed()

    def _build(self, config: ProviderConfig) -> ProviderRuntime:
        factory = self._factories.get(config.type)
        if factory is None:
            raise ConfigError(f"no adapter for provider type {config.type!r}")
        runtime = ProviderRuntime(
            config=config,
            adapter=factory(config, self._context),
            gate=AdmissionGate(config.id, config.capacity, config.max_queue),
            health=HealthTracker(self._probes.rise, self._probes.fall),
            cache=CacheAccount(self._cache_prefixes),
        )
        runtime.gate.hold(config.control_state)
        runtime.publish(self._metrics)
        logger.info(
            "provider {} ({}) configured, capacity {}", config.id, config.type, config.capacity
        )
        return runtime

    async def _update(self, runtime: ProviderRuntime, config: ProviderConfig) -> None:
        """Apply a changed config to a provider that stays.

        A new type or settings means a new upstream: a new adapter and a fresh health.
        New served names (``models``) keep the upstream and its health, but the adapter
        is made again too, since adapters that have no upstream list (mock, cli) report
        their config's names in each probe; and the names of the last probe are dropped,
        so the next snapshot (and the edge's catalog) names the new ones, not the old.
        """
        old = runtime.config
        upstream_changed = (old.type, dict(old.settings)) != (config.type, dict(config.settings))
        if upstream_changed or old.models != config.models:
            factory = self._factories.get(config.type)
            if factory is None:
                raise ConfigError(f"no adapter for provider type {config.type!r}")
            old_adapter, runtime.adapter = runtime.adapter, factory(config, self._context)
            if upstream_changed:
                runtime.health = HealthTracker(self._probes.rise, self._probes.fall)
                runtime.cache.forget()  # another engine: what the old one held is not here
            else:
                runtime.health.models = ()
            self._close_when_idle(runtime, old_adapter)
        runtime.gate.resize(config.capacity, config.max_queue)
        runtime.gate.hold(config.control_state)
        runtime.config = config
        runtime.publish(self._metrics)
        logger.info("provider {} updated", config.id)

    def _retire(self, runtime: ProviderRuntime) -> None:
        runtime.retired = True
        self._stop_probe(runtime.config.id)
        self._close_when_idle(runtime, runtime.adapter)
        self._metrics.forget(runtime.config.id)
        logger.info("provider {} removed (its runs in flight finish first)", runtime.config.id)

    def _close_when_idle(self, runtime: ProviderRuntime, adapter: object) -> None:
        """Close an adapter no new run will use, once the runs in flight now are done."""
        runs = [task for task in self._runs.values() if not task.done()]

        async def close_later() -> None:
            if runs:
                await asyncio.wait(runs)
            aclose = getattr(adapter, "aclose", None)
            if aclose is not None:
                await aclose()

        task = asyncio.create_task(close_later(), name=f"retire:{runtime.config.id}")
        self._retiring.add(task)
        task.add_done_callback(self._retiring.discard)

    # ------------------------------------------------------------ probes

    def _start_probe(self, provider_id: str) -> None:
        self._probe_tasks[provider_id] = asyncio.create_task(
            self._probe_loop(provider_id), name=f"probe:{provider_id}"
        )

    def _stop_probe(self, provider_id: str) -> None:
        task = self._probe_tasks.pop(provider_id, None)
        self._engines.pop(provider_id, None)  # a provider probed again is asked again
        if task is not None:
            task.cancel()

    async def probe_once(self, provider_id: str) -> bool:
        """Probe one provider now; returns True when its health changed."""
        runtime = self.providers[provider_id]
        try:
            async with asyncio.timeout(self._probes.timeout_s):
                result = await runtime.adapter.probe()
        except TimeoutError:
            result = ProbeResult(
                ok=False, detail=f"probe timed out after {self._probes.timeout_s}s"
            )
        except Exception as exc:
            result = ProbeResult(ok=False, detail=f"probe failed: {exc}")
        self._last_probe_ms[provider_id] = int(time.time() * 1000)
        models_before = runtime.health.models
        changed = runtime.health.observe(result)
        if _cache_lost(result, models_before):
            runtime.cache.forget()
        if not changed and runtime.health.models != models_before:
            self._changed()  # the upstream lists other names: the edge's catalog follows
        if result.ok and (changed or provider_id not in self._engines):
            # at start and after it was down (an upgrade restarts the engine): once, not per probe
            self._engines[provider_id] = await describe(runtime.adapter, runtime.config.type)
            if not changed:
                self._changed()  # the edge's catalog learns the engine
        if changed:
            logger.info(
                "provider {} is {}{}",
                provider_id,
                runtime.health.state.value,
                f" ({result.detail})" if result.detail else "",
            )
            runtime.publish(self._metrics)
            self._changed()
        return changed

    async def _probe_loop(self, provider_id: str) -> None:
        while provider_id in self.providers:
            try:
                await self.probe_once(provider_id)
            except Exception:
                logger.exception("probing {} failed", provider_id)
            await asyncio.sleep(self._probes.interval_s)

    # ------------------------------------------------------------ runs

    def start_run(self, order: RunOrder, channel: RunChannel, link: str = "") -> bool:
        """Start a run in its own task; an order that cannot run fails on its channel.

        ``link``: the edge link it came on. Runs are known by link and run id, so two
        edges' ids never meet, and an edge can cancel only its own runs.
        """
        run_id = order.run_id
        key = (link, run_id)
        if key in self._runs:
            logger.warning("duplicate run id {} ignored", run_id)
            return False
        runtime = self.providers.get(order.provider_id)
        loop = asyncio.get_running_loop()
        try:
            spec = resolve(
                order,
                None if runtime is None else runtime.config,
                loop_now=loop.time(),
                unix_now_ms=time.time_ns() // 1_000_000,
            )
        except RunFailure as failure:
            refusal = Failed(failure.code, failure.message, failure.provider_status)
            task = loop.create_task(channel.failed(refusal))
        else:
            assert runtime is not None  # resolve refuses a provider this node lacks
            task = loop.create_task(
                self._executor.execute_run(runtime, spec, channel), name=f"run:{run_id}"
            )
        self._runs[key] = task
        task.add_done_callback(lambda _: self._runs.pop(key, None))
        return True

    def cancel(self, run_id: str, reason: str = "cancelled", link: str = "") -> bool:
        """Cancel one run of ``link``; its history records ``reason``."""
        task = self._runs.get((link, run_id))
        if task is None:
            return False
        task.cancel(reason)
        return True

    async def cancel_all(self, reason: str = "cancelled", link: str | None = None) -> None:
        """Cancel every run (of ``link`` only, when given: that edge connection is gone)
        and wait until they let go; another link's runs are not touched.

        Each is recorded ``cancelled`` with ``reason``: the same record a run gets that
        found the connection gone itself while sending, when the link passes the
        channel's reason (``EDGE_GONE``).
        """
        tasks = [task for (of, _), task in self._runs.items() if link is None or of == link]
        for task in tasks:
            task.cancel(reason)
        await asyncio.gather(*tasks, return_exceptions=True)

    @property
    def runs_in_flight(self) -> int:
        return len(self._runs)

    def runs_of(self, link: str) -> int:
        """Runs in flight that came on ``link``."""
        return sum(1 for of, _ in self._runs if of == link)

    async def wait_for_runs(self, timeout_s: float) -> int:
        """Wait until no run is left (runs started meanwhile included) or ``timeout_s``
        passed; returns how many still run."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while self._runs and (remaining := deadline - loop.time()) > 0:
            await asyncio.wait(list(self._runs.values()), timeout=remaining)
        return len(self._runs)

    # ------------------------------------------------------------ state

    def states(self) -> list[ProviderStatus]:
        return [
            ProviderStatus(
                config=rt.config,
                health=rt.health.state,
                in_flight=rt.gate.in_flight,
                queued=rt.gate.queued,
                models=rt.health.models or rt.config.models,
                capabilities=rt.adapter.capabilities(),
                last_probe_unix_ms=self._last_probe_ms.get(pid, 0),
                detail=rt.health.detail,
                cache=rt.cache.view,
                engine=self._engines.get(pid),
                listed_models=len(rt.health.models),
                loaded=rt.adapter.load_state() if isinstance(rt.adapter, LoadReporter) else None,
            )
            for pid, rt in self.providers.items()
        ]

    async def aclose(self) -> None:
        """Cancel runs and probes, then close every adapter."""
        await self.cancel_all()
        probes = list(self._probe_tasks.values())
        for provider_id in list(self._probe_tasks):
            self._stop_probe(provider_id)
        await asyncio.gather(*probes, return_exceptions=True)
        for task in list(self._retiring):
            task.cancel()
        await asyncio.gather(*self._retiring, return_exceptions=True)
        for runtime in self.providers.values():
            with contextlib.suppress(Exception):
                await runtime.adapter.aclose()
        self.providers.clear()
