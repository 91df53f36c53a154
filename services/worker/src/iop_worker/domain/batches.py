"""A leased batch and the progress this worker made on it: no I/O, no protobuf.

"Finished" is decided here, in one place: every line of the lease answered by a
result (whatever its status), and the batch never halted. Anything less is left
to the lease expiry, after which the edge resumes from the first unfinished line.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Lease:
    """What the edge granted: lines ``next_line .. total_lines - 1`` of one batch."""

    batch_id: str
    lease_id: str
    endpoint: str
    next_line: int
    total_lines: int
    expires_at_unix_ms: int = 0

    @property
    def remaining(self) -> int:
        return max(0, self.total_lines - self.next_line)


@dataclass(frozen=True, slots=True)
class LineResult:
    """The edge's answer for one line (the edge stored the body; we only count it)."""

    line_number: int
    status_code: int
    custom_id: str = ""

    @property
    def ok(self) -> bool:
        return 200 <= self.status_code < 300


@dataclass(slots=True)
class BatchProgress:
    """Counts of one lease's lines, and why dispatching stopped early (if it did)."""

    lease: Lease
    done: int = 0
    failed: int = 0
    unanswered: int = 0
    lease_lost: bool = False
    halt_reason: str | None = None

    @property
    def halted(self) -> bool:
        return self.halt_reason is not None

    @property
    def answered(self) -> int:
        return self.done + self.failed

    @property
    def finished(self) -> bool:
        """Every line got a result: only then may the lease be released as finished."""
        return not self.halted and self.answered == self.lease.remaining

    def record(self, result: LineResult) -> None:
        if result.ok:
            self.done += 1
        else:
            self.failed += 1

    def halt(self, reason: str) -> None:
        """Stop taking new lines; the first reason is the one worth reporting."""
        if self.halt_reason is None:
            self.halt_reason = reason

    def lose_lease(self, reason: str) -> bool:
        """Mark the lease as lost; ``True`` the first time (so it is counted once)."""
        self.halt(reason)
        first = not self.lease_lost
        self.lease_lost = True
        return first

    def give_up_line(self, reason: str) -> None:
        """A line got no result (timeout or error frame): the batch cannot finish here.

        Dispatching past the hole would only make the edge run those lines twice
        when it resumes from the first unfinished one, so the batch halts.
        """
        self.unanswered += 1
        self.halt(reason)
