"""What an on-demand provider holds in memory, and how long its loads take
(docs/ARCHITECTURE.md#warm-aware-scheduling).

Ollama (and llama-swap, Lemonade) load a model at its first request and unload it after
``keep_alive`` or to make room for another. The account is fed from two sources: the
engine's own list of loaded models (Ollama's ``/api/ps``, read with each probe: the
truth, with the expiry) and the answers (Ollama's ``load_duration``: a run that loaded
the model tells how long it took, and that the model is in memory now, before the next
probe says so). Pure: the adapter owning it does the I/O.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

LOAD_SEEN_MS = 100
"""An answer's ``load_duration`` at or above this is a load: a warm Ollama reports a few
milliseconds there (it still checks the model), a load takes seconds."""


@dataclass(frozen=True, slots=True)
class LoadedModel:
    name: str
    since_ms: int = 0  # Unix ms the node first saw it loaded; 0 unknown
    expires_ms: int = 0  # Unix ms the engine unloads it if idle; 0 unknown


@dataclass(frozen=True, slots=True)
class LoadTiming:
    name: str
    last_ms: int
    mean_ms: int
    loads: int


@dataclass(frozen=True, slots=True)
class LoadState:
    """One provider's memory as the edge is told it (``pb.LoadedModels``)."""

    models: tuple[LoadedModel, ...] = ()
    timings: tuple[LoadTiming, ...] = ()
    max_loaded: int = 0  # models it holds at once; 0 unknown


class LoadAccount:
    """The loaded models and load times of one provider, kept by its adapter."""

    def __init__(self, max_loaded: int = 0) -> None:
        self._max_loaded = max_loaded
        self._loaded: dict[str, LoadedModel] = {}
        self._timings: dict[str, LoadTiming] = {}

    def limit(self, max_loaded: int) -> None:
        """How many models the engine holds at once, as it says itself (0 unknown)."""
        self._max_loaded = max_loaded

    def listed(self, entries: Iterable[tuple[str, int]], now_ms: int) -> None:
        """The engine's own list (name, expiry in Unix ms; 0 unknown): it replaces ours,
        keeping when each model was first seen loaded."""
        fresh: dict[str, LoadedModel] = {}
        for name, expires_ms in entries:
            before = self._loaded.get(name)
            since = before.since_ms if before is not None else now_ms
            fresh[name] = LoadedModel(name, since, expires_ms)
        self._loaded = fresh

    def answered(self, name: str, load_ms: int, now_ms: int) -> None:
        """A run of ``name`` ended; it waited ``load_ms`` for a load (0: none reported).
        The model is in memory now either way; on a host that holds one model at a
        time, the others are gone."""
        if load_ms >= LOAD_SEEN_MS:
            before = self._timings.get(name)
            loads = 1 if before is None else before.loads + 1
            mean = load_ms if before is None else (before.mean_ms * before.loads + load_ms) // loads
            self._timings[name] = LoadTiming(name, load_ms, mean, loads)
        if name not in self._loaded:
            if self._max_loaded == 1:
                self._loaded.clear()
            self._loaded[name] = LoadedModel(name, now_ms)

    def state(self) -> LoadState:
        return LoadState(
            tuple(self._loaded.values()), tuple(self._timings.values()), self._max_loaded
        )
