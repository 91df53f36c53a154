"""The lease loop against a fake edge: bounded concurrency, renewals, lost leases, release."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

import pytest
from prometheus_client import CollectorRegistry

from iop_worker.batch_runner import BatchRunner
from iop_worker.domain.batches import Lease, LineResult
from iop_worker.errors import EdgeLinkLost, EdgeRefused, LeaseLost
from iop_worker.metrics import WorkerMetrics

NOT_FOUND = 21  # iop.v1.ERROR_CODE_NOT_FOUND


def lease(next_line: int = 0, total_lines: int = 10, lease_id: str = "lease-1") -> Lease:
    return Lease(
        batch_id=f"batch-of-{lease_id}",
        lease_id=lease_id,
        endpoint="/v1/chat/completions",
        next_line=next_line,
        total_lines=total_lines,
    )


@dataclass
class FakeEdge:
    """An ``EdgePort`` that hands out scripted leases and records every call.

    ``line_gate`` holds every line until it is set; ``on_line`` and ``on_renew``
    let a test answer (or fail) calls as it pleases.
    """

    grants: list[Lease]
    line_gate: asyncio.Event = field(default_factory=asyncio.Event)
    status_of: Callable[[int], int] = lambda line: 200
    on_line: Callable[[int], None] = lambda line: None
    on_renew: Callable[[int], None] = lambda count: None
    lines: list[int] = field(default_factory=list)
    lines_by_lease: dict[str, list[int]] = field(default_factory=dict)
    answered: list[int] = field(default_factory=list)
    renewals: int = 0
    releases: list[tuple[str, bool]] = field(default_factory=list)
    in_flight: int = 0
    max_in_flight: int = 0
    idle: asyncio.Event = field(default_factory=asyncio.Event)  # asked with nothing left

    def __post_init__(self) -> None:
        self.line_gate.set()

    async def lease(self) -> Lease | None:
        if self.grants:
            return self.grants.pop(0)
        self.idle.set()
        return None

    async def renew(self, lease: Lease) -> None:
        self.renewals += 1
        self.on_renew(self.renewals)

    async def run_line(self, lease: Lease, line_number: int) -> LineResult:
        self.lines.append(line_number)
        self.lines_by_lease.setdefault(lease.lease_id, []).append(line_number)
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            self.on_line(line_number)
            await self.line_gate.wait()
            await asyncio.sleep(0)  # let the others pile up before anyone finishes
        finally:
            self.in_flight -= 1
        self.answered.append(line_number)
        return LineResult(line_number=line_number, status_code=self.status_of(line_number))

    async def release(self, lease: Lease, *, finished: bool) -> None:
        self.releases.append((lease.lease_id, finished))


@pytest.fixture
def registry() -> CollectorRegistry:
    return CollectorRegistry()


@pytest.fixture
def runner(registry: CollectorRegistry) -> BatchRunner:
    return BatchRunner(
        WorkerMetrics.create(registry),
        concurrency=4,
        poll_interval_s=0.01,
        renew_interval_s=0.01,
    )


def sample(registry: CollectorRegistry, name: str, **labels: str) -> float:
    value = registry.get_sample_value(name, labels)
    return 0.0 if value is None else value


@pytest.fixture
async def running() -> AsyncIterator[Callable[[BatchRunner, FakeEdge], asyncio.Task[None]]]:
    """Start ``runner.run(edge)`` as a task this fixture owns and cancels."""
    tasks: list[asyncio.Task[None]] = []

    def start(runner: BatchRunner, edge: FakeEdge) -> asyncio.Task[None]:
        task = asyncio.create_task(runner.run(edge))
        tasks.append(task)
        return task

    yield start
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


async def until_idle(edge: FakeEdge) -> None:
    """The runner came back for more: every batch before was dealt with."""
    await asyncio.wait_for(edge.idle.wait(), 5)


async def test_runs_every_line_once_from_next_line_within_the_bound(
    runner: BatchRunner, registry: CollectorRegistry, running: Callable[..., asyncio.Task[None]]
) -> None:
    edge = FakeEdge([lease(next_line=3, total_lines=40)])
    running(runner, edge)
    await until_idle(edge)

    assert sorted(edge.lines) == list(range(3, 40))
    assert len(edge.lines) == len(set(edge.lines))
    assert edge.max_in_flight == 4
    assert edge.releases == [("lease-1", True)]
    assert sample(registry, "iop_worker_lines_total", outcome="done") == 37
    assert sample(registry, "iop_worker_batches_total", outcome="finished") == 1
    assert sample(registry, "iop_worker_lines_in_flight") == 0


async def test_counts_lines_done_and_failed_by_status_code(
    runner: BatchRunner, registry: CollectorRegistry, running: Callable[..., asyncio.Task[None]]
) -> None:
    edge = FakeEdge([lease(total_lines=6)], status_of=lambda line: 200 if line % 2 else 500)
    running(runner, edge)
    await until_idle(edge)

    assert sample(registry, "iop_worker_lines_total", outcome="done") == 3
    assert sample(registry, "iop_worker_lines_total", outcome="failed") == 3
    # a failed status is still an answer: the batch is finished
    assert edge.releases == [("lease-1", True)]


async def test_renews_while_lines_are_slow(
    runner: BatchRunner, registry: CollectorRegistry, running: Callable[..., asyncio.Task[None]]
) -> None:
    edge = FakeEdge([lease(total_lines=2)])
    edge.line_gate.clear()

    def release_lines_after_three_renewals(count: int) -> None:
        if count == 3:
            edge.line_gate.set()

    edge.on_renew = release_lines_after_three_renewals
    running(runner, edge)
    await until_idle(edge)

    assert edge.renewals >= 3
    assert sample(registry, "iop_worker_lease_renewals_total") >= 3
    assert edge.releases == [("lease-1", True)]
    renewals_when_done = edge.renewals
    await asyncio.sleep(0.05)  # the renewer ended with the batch
    assert edge.renewals == renewals_when_done


async def test_lost_lease_stops_new_lines_and_lets_in_flight_ones_end(
    registry: CollectorRegistry, running: Callable[..., asyncio.Task[None]]
) -> None:
    runner = BatchRunner(
        WorkerMetrics.create(registry), concurrency=2, poll_interval_s=0.01, renew_interval_s=0.01
    )
    edge = FakeEdge([lease(total_lines=10)])
    edge.line_gate.clear()

    def lose_the_lease(count: int) -> None:
        edge.line_gate.set()  # the lines in flight end after the loss is known
        raise LeaseLost(NOT_FOUND, "batch cancelled")

    edge.on_renew = lose_the_lease
    running(runner, edge)
    await until_idle(edge)

    assert sorted(edge.lines) == [0, 1]  # only the two that were in flight
    assert sorted(edge.answered) == [0, 1]  # and they ended, not cancelled
    assert edge.releases == []
    assert sample(registry, "iop_worker_leases_lost_total") == 1
    assert sample(registry, "iop_worker_batches_total", outcome="lost") == 1
    assert sample(registry, "iop_worker_batches_total", outcome="finished") == 0


async def test_lease_refused_on_a_line_stops_the_batch(
    runner: BatchRunner, registry: CollectorRegistry, running: Callable[..., asyncio.Task[None]]
) -> None:
    def refuse_line_5(line: int) -> None:
        if line == 5:
            raise LeaseLost(NOT_FOUND, "taken over")

    edge = FakeEdge([lease(total_lines=100), lease(total_lines=1, lease_id="lease-2")])
    edge.on_line = refuse_line_5
    running(runner, edge)
    await until_idle(edge)

    first_batch = edge.lines_by_lease["lease-1"]
    assert 5 in first_batch
    assert max(first_batch) < 5 + 4  # nothing dispatched after the refusal but the in-flight
    assert edge.releases == [("lease-2", True)]  # the next batch still ran
    assert sample(registry, "iop_worker_leases_lost_total") == 1


async def test_a_line_without_a_result_leaves_the_batch_unreleased(
    runner: BatchRunner, registry: CollectorRegistry, running: Callable[..., asyncio.Task[None]]
) -> None:
    def time_out_line_2(line: int) -> None:
        if line == 2:
            raise TimeoutError

    edge = FakeEdge([lease(total_lines=50)])
    edge.on_line = time_out_line_2
    running(runner, edge)
    await until_idle(edge)

    assert max(edge.lines) < 2 + 4
    assert edge.releases == []
    assert sample(registry, "iop_worker_lines_total", outcome="failed") == 1
    assert sample(registry, "iop_worker_batches_total", outcome="lost") == 1
    assert sample(registry, "iop_worker_leases_lost_total") == 0


async def test_a_lost_link_ends_the_batch_without_release(
    runner: BatchRunner, registry: CollectorRegistry
) -> None:
    def link_drops_at_line_6(line: int) -> None:
        if line == 6:
            raise EdgeLinkLost("gone")

    edge = FakeEdge([lease(total_lines=50)])
    edge.on_line = link_drops_at_line_6
    with pytest.raises(EdgeLinkLost):
        await asyncio.wait_for(runner.run(edge), 5)

    assert edge.releases == []
    assert sample(registry, "iop_worker_batches_total", outcome="lost") == 1
    assert sample(registry, "iop_worker_lines_in_flight") == 0


async def test_nothing_to_lease_polls_again(
    runner: BatchRunner, running: Callable[..., asyncio.Task[None]]
) -> None:
    polls = 0
    edge = FakeEdge([])
    asked_three_times = asyncio.Event()

    async def nothing() -> Lease | None:
        nonlocal polls
        polls += 1
        if polls == 3:
            asked_three_times.set()
        return None

    edge.lease = nothing  # type: ignore[method-assign]
    running(runner, edge)
    await asyncio.wait_for(asked_three_times.wait(), 5)
    assert edge.lines == []


async def test_refused_or_unanswered_lease_requests_are_retried(
    runner: BatchRunner, running: Callable[..., asyncio.Task[None]]
) -> None:
    failures: list[BaseException] = [TimeoutError(), EdgeRefused(29, "busy")]
    edge = FakeEdge([lease(total_lines=1)])
    scripted = edge.lease

    async def failing_first() -> Lease | None:
        if failures:
            raise failures.pop(0)
        return await scripted()

    edge.lease = failing_first  # type: ignore[method-assign]
    running(runner, edge)
    await until_idle(edge)
    assert edge.releases == [("lease-1", True)]


async def test_a_lease_with_no_lines_left_is_released_as_finished(
    runner: BatchRunner, running: Callable[..., asyncio.Task[None]]
) -> None:
    edge = FakeEdge([lease(next_line=10, total_lines=10)])
    running(runner, edge)
    await until_idle(edge)
    assert edge.lines == []
    assert edge.releases == [("lease-1", True)]


async def test_stop_lets_in_flight_lines_end_and_releases_only_a_finished_batch(
    registry: CollectorRegistry,
) -> None:
    runner = BatchRunner(
        WorkerMetrics.create(registry), concurrency=2, poll_interval_s=0.01, renew_interval_s=60
    )
    edge = FakeEdge([lease(total_lines=10)])
    edge.line_gate.clear()
    two_in_flight = asyncio.Event()
    edge.on_line = lambda line: two_in_flight.set() if line == 1 else None
    task = asyncio.create_task(runner.run(edge))
    try:
        await asyncio.wait_for(two_in_flight.wait(), 5)
        runner.stop()
        edge.line_gate.set()
        await asyncio.wait_for(task, 5)
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    assert sorted(edge.answered) == [0, 1]
    assert edge.releases == []  # eight lines never ran: the lease expires, someone resumes
    assert sample(registry, "iop_worker_batches_total", outcome="lost") == 1


async def test_stop_with_the_last_lines_in_flight_still_releases(
    registry: CollectorRegistry,
) -> None:
    runner = BatchRunner(
        WorkerMetrics.create(registry), concurrency=2, poll_interval_s=0.01, renew_interval_s=60
    )
    edge = FakeEdge([lease(total_lines=2)])
    edge.line_gate.clear()
    both_in_flight = asyncio.Event()
    edge.on_line = lambda line: both_in_flight.set() if line == 1 else None
    task = asyncio.create_task(runner.run(edge))
    try:
        await asyncio.wait_for(both_in_flight.wait(), 5)
        runner.stop()
        edge.line_gate.set()
        await asyncio.wait_for(task, 5)
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    assert edge.releases == [("lease-1", True)]


def test_concurrency_below_one_is_refused(registry: CollectorRegistry) -> None:
    with pytest.raises(ValueError, match="concurrency"):
        BatchRunner(
            WorkerMetrics.create(registry), concurrency=0, poll_interval_s=1, renew_interval_s=1
        )
