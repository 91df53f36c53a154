"""The edge's stores, opened where the settings say: SQLite files beside this edge, or the
PostgreSQL store every edge of a fleet shares (docs/ARCHITECTURE.md#shared-state).

One function so the composition root names each store once and the choice of
backend is made in one place; each store is closed by the exit stack it is given.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import asyncpg
from loguru import logger

from iop_edge.adapters.batch_store import SqliteBatchStore
from iop_edge.adapters.pg_batch_store import PostgresBatchStore
from iop_edge.adapters.pg_key_rates import PostgresKeyRates
from iop_edge.adapters.pg_key_slots import PostgresKeyConcurrency
from iop_edge.adapters.pg_qualifications import PostgresQualifications
from iop_edge.adapters.postgres_responses import PostgresResponseStore
from iop_edge.adapters.postgres_runlog import PostgresRunLog
from iop_edge.adapters.sqlite_qualifications import SqliteQualifications
from iop_edge.adapters.sqlite_responses import ResponseLimits, SqliteResponseStore
from iop_edge.adapters.sqlite_runlog import SqliteRunLog
from iop_edge.batch_ports import BatchStore
from iop_edge.ports import KeyConcurrency, KeyRateStore, ResponseStore, RunLog
from iop_edge.qualification_ports import QualificationStore
from iop_edge.service.memory_key_rates import MemoryKeyRates
from iop_edge.settings import EdgeSettings
from iop_proto.postgres import open_pool


@dataclass(frozen=True, slots=True)
class EdgeStores:
    runlog: RunLog
    responses: ResponseStore
    batches: BatchStore
    pool: asyncpg.Pool | None  # the shared store's pool; None on SQLite
    # API keys' slots in the shared store, so a key's limit holds across edges; None on
    # SQLite: each edge counts its own (KeySlots)
    key_slots: KeyConcurrency | None
    # API keys' rates and budgets: in the shared store, so they hold across edges; in
    # this edge's memory on SQLite (docs/ARCHITECTURE.md#limits-per-key)
    key_rates: KeyRateStore
    qualifications: QualificationStore  # iopctl qualify's reports


async def open_stores(settings: EdgeSettings, stack: contextlib.AsyncExitStack) -> EdgeStores:
    pool: asyncpg.Pool | None = None
    if settings.postgres is not None:
        pool = await open_pool(settings.postgres)
        stack.push_async_callback(pool.close)
        logger.info(
            "shared store: PostgreSQL (pool of at most {})", settings.postgres.max_connections
        )
    storage = settings.storage
    limits = ResponseLimits(
        ttl_s=storage.responses_ttl_s,
        quota_bytes=storage.responses_quota_bytes,
        max_depth=storage.max_conversation_turns,
        sweep_interval_s=storage.sweep_interval_s,
    )
    runlog: RunLog
    responses: ResponseStore
    if pool is not None:
        shared_runlog = await PostgresRunLog.open(pool)
        stack.push_async_callback(shared_runlog.aclose)
        shared_responses = await PostgresResponseStore.open(pool, limits=limits)
        stack.push_async_callback(shared_responses.aclose)
        runlog, responses = shared_runlog, shared_responses
    else:
        sqlite_runlog = await SqliteRunLog.open(settings.history_db)
        stack.push_async_callback(sqlite_runlog.aclose)
        sqlite_responses = await SqliteResponseStore.open(settings.responses_db, limits=limits)
        stack.push_async_callback(sqlite_responses.aclose)
        runlog, responses = sqlite_runlog, sqlite_responses
    batches: BatchStore
    if pool is not None:
        batches = await PostgresBatchStore.open(
            pool,
            file_ttl_s=storage.files_ttl_s,
            sweep_interval_s=storage.sweep_interval_s,
            edge_id=settings.service_id,
        )
    else:
        batches = await SqliteBatchStore.open(
            settings.batch_db,
            file_ttl_s=storage.files_ttl_s,
            sweep_interval_s=storage.sweep_interval_s,
        )
    stack.push_async_callback(batches.aclose)  # before the pool's close: it runs first
    key_slots: KeyConcurrency | None = None
    if pool is not None:
        shared = await PostgresKeyConcurrency.open(
            pool, settings.service_id, settings.key_slot_ttl_s
        )
        stack.push_async_callback(shared.aclose)
        key_slots = shared
    key_rates: KeyRateStore = MemoryKeyRates()
    if pool is not None:
        shared_rates = await PostgresKeyRates.open(pool, settings.service_id)
        stack.push_async_callback(shared_rates.aclose)
        key_rates = shared_rates
    qualifications: QualificationStore
    if pool is not None:
        qualifications = await PostgresQualifications.open(pool)
    else:
        local = await SqliteQualifications.open(settings.qualifications_path)
        stack.push_async_callback(local.aclose)
        qualifications = local
    return EdgeStores(runlog, responses, batches, pool, key_slots, key_rates, qualifications)
