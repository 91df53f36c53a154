"""Batch jobs as data: statuses, the input file's validation, the OpenAI objects, result files.

Pure: no I/O and no clock. The service decides when things happen; this module
says what a valid input line is and what the client reads back, exactly as
OpenAI's Batch API shows it (so the official SDKs parse every object).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Final

from iop_edge.domain.drills import asks_drill
from iop_edge.domain.fleet import ApiKeyEntry, Operation
from iop_proto import json_codec

ENDPOINTS: Final[Mapping[str, Operation]] = {
    "/v1/chat/completions": Operation.CHAT_COMPLETIONS,
    "/v1/completions": Operation.COMPLETIONS,
    "/v1/embeddings": Operation.EMBEDDINGS,
}
COMPLETION_WINDOWS: Final[Mapping[str, int]] = {"24h": 24 * 3600}  # seconds
MAX_REQUESTS: Final = 50_000  # per input file, as OpenAI
MAX_REPORTED_ERRORS: Final = 1000
"""A file of a million bad lines must not make every ``GET /v1/batches/{id}`` huge."""

# Batch statuses (OpenAI's names).
VALIDATING: Final = "validating"
FAILED: Final = "failed"
IN_PROGRESS: Final = "in_progress"
FINALIZING: Final = "finalizing"
COMPLETED: Final = "completed"
EXPIRED: Final = "expired"
CANCELLING: Final = "cancelling"
CANCELLED: Final = "cancelled"
STATUSES: Final = (
    VALIDATING,
    FAILED,
    IN_PROGRESS,
    FINALIZING,
    COMPLETED,
    EXPIRED,
    CANCELLING,
    CANCELLED,
)
RUNNABLE: Final = (VALIDATING, IN_PROGRESS)
"""A worker may lease these; every other status is on its way out or over."""

# Line states.
PENDING: Final = "pending"
DONE: Final = "done"
LINE_FAILED: Final = "failed"

_UNRUN_ERRORS: Final[Mapping[str, dict[str, str]]] = {
    EXPIRED: {
        "code": "batch_expired",
        "message": "This request could not be executed before the completion window expired.",
    },
    CANCELLED: {
        "code": "batch_cancelled",
        "message": "This request was not executed because the batch was cancelled.",
    },
}


@dataclass(frozen=True, slots=True)
class FileRecord:
    """An uploaded (or generated) file without its content.

    ``owner``: the ``key_id`` of the API key that uploaded it (for a batch's output
    and error files, the batch's owner); ``None`` for a file made while the API was
    open, or stored before files had owners: only operator keys (and the open API)
    see those.
    """

    id: str
    filename: str
    purpose: str
    bytes: int
    created_at: int
    owner: str | None = None


@dataclass(frozen=True, slots=True)
class InputLine:
    """One valid request of an input file; ``index`` is its 0-based place among requests."""

    index: int
    custom_id: str
    model: str | None  # ``body.model`` when it is a string (checked when the line runs)
    body_json: str


@dataclass(frozen=True, slots=True)
class InputCheck:
    """What validating an input file found, without its requests (``input_lines`` reads
    them again): enough to make the batch and to refuse lines by model."""

    total: int  # valid requests
    errors: list[dict[str, Any]]  # OpenAI's ``errors.data`` entries; empty = valid
    models: Mapping[str, list[int]]  # request indices by ``body.model`` (when a string)
    oversize: list[int]  # request indices whose body is over the body limit
    drills: list[int] = field(default_factory=list)  # request indices asking a mock drill


@dataclass(frozen=True, slots=True)
class BatchRecord:
    """A batch as stored; counts are of lines, ``finalize_as`` is set while result files
    are being written (the batch then takes no lease and no further line result)."""

    id: str
    input_file_id: str
    endpoint: str
    completion_window: str
    metadata: dict[str, str] | None
    status: str
    created_at: int
    in_progress_at: int | None
    finalizing_at: int | None
    completed_at: int | None
    failed_at: int | None
    expired_at: int | None
    cancelling_at: int | None
    cancelled_at: int | None
    expires_at: int
    output_file_id: str | None
    error_file_id: str | None
    errors: list[dict[str, Any]] | None
    total: int
    completed: int
    failed: int
    lease_id: str | None
    lease_owner: str | None
    lease_expires_at: float | None
    finalize_as: str | None
    owner: str | None = None  # the creator's ``key_id``; None: nobody's (see ``FileRecord``)


@dataclass(frozen=True, slots=True)
class LineResult:
    """A finished line: ``response`` (a success body) or ``error`` (``{"error": {...}}``)."""

    state: str  # DONE or LINE_FAILED
    status_code: int
    response: str | None
    error: str | None
    request_id: str
    result_id: str


@dataclass(frozen=True, slots=True)
class LineRecord:
    batch_id: str
    index: int
    custom_id: str
    body_json: str
    result: LineResult | None  # None while pending


def new_batch(
    batch_id: str,
    input_file_id: str,
    endpoint: str,
    completion_window: str,
    metadata: dict[str, str] | None,
    check: InputCheck,
    now: int,
    owner: str | None = None,
) -> BatchRecord:
    """A new batch: ``validating`` with its lines, or ``failed`` (and no lines) when
    its input file broke a rule."""
    failed = bool(check.errors)
    return BatchRecord(
        id=batch_id,
        input_file_id=input_file_id,
        endpoint=endpoint,
        completion_window=completion_window,
        metadata=metadata,
        status=FAILED if failed else VALIDATING,
        created_at=now,
        in_progress_at=None,
        finalizing_at=None,
        completed_at=None,
        failed_at=now if failed else None,
        expired_at=None,
        cancelling_at=None,
        cancelled_at=None,
        expires_at=now + COMPLETION_WINDOWS[completion_window],
        output_file_id=None,
        error_file_id=None,
        errors=check.errors or None,
        total=0 if failed else check.total,
        completed=0,
        failed=0,
        lease_id=None,
        lease_owner=None,
        lease_expires_at=None,
        finalize_as=None,
        owner=owner,
    )


def new_id(prefix: str) -> str:
    return f"{prefix}{uuid.uuid4().hex}"


def owner_of(key: ApiKeyEntry | None) -> str | None:
    """Who owns what this caller creates: its ``key_id`` (nobody when the API is open)."""
    return None if key is None else key.key_id


def scope_of(key: ApiKeyEntry | None) -> str | None:
    """The one owner whose objects this caller lists; ``None``: every owner's (an
    operator key, or the open API)."""
    return None if key is None or key.operator else key.key_id


def may_see(key: ApiKeyEntry | None, owner: str | None) -> bool:
    """Whether this caller may read or act on an object of ``owner``. Every other
    caller is told the object does not exist (404, never 403)."""
    return key is None or key.operator or owner == key.key_id


def check_input(lines: Iterable[bytes], endpoint: str, max_body_bytes: int) -> InputCheck:
    """Check every physical line of a batch input file (JSONL) against OpenAI's rules.

    Reads the lines one at a time and keeps only the custom ids seen, the first
    errors and the models, never the requests (``input_lines`` produces those).
    Errors name the 1-based physical line. Blank lines (a trailing newline) are
    skipped. Whether ``body.model`` exists is not checked here: like OpenAI, an
    unknown model fails that line alone when it runs. A body over ``max_body_bytes``
    is noted in ``oversize`` (measured as stored, and only for a line longer than the
    limit: a body is smaller than its line, and one that grows when written again is
    refused when it runs, before it takes a slot).
    """
    errors: list[dict[str, Any]] = []
    more_errors = 0
    seen: set[str] = set()
    models: dict[str, list[int]] = {}
    oversize: list[int] = []
    drills: list[int] = []
    total = 0
    for number, raw in enumerate(lines, start=1):
        if not raw.strip():
            continue
        problem = _check_line(raw, endpoint, seen)
        if isinstance(problem, dict):
            if len(errors) < MAX_REPORTED_ERRORS:
                errors.append({**problem, "line": number})
            else:
                more_errors += 1
            continue
        custom_id, body = problem
        seen.add(custom_id)
        model = body.get("model")
        if isinstance(model, str):
            models.setdefault(model, []).append(total)
        if len(raw) > max_body_bytes and _utf8_size(_stored_body(body)) > max_body_bytes:
            oversize.append(total)
        if asks_drill(body):
            drills.append(total)
        total += 1
    if not total and not errors:
        errors.append(_error("empty_file", "The input file contains no requests.", None))
    elif total + len(errors) + more_errors > MAX_REQUESTS:
        errors.insert(
            0,
            _error(
                "too_many_requests",
                f"The input file has more than {MAX_REQUESTS} requests.",
                None,
            ),
        )
        if len(errors) > MAX_REPORTED_ERRORS:
            errors.pop()
            more_errors += 1
    if more_errors:
        errors.append(
            _error("too_many_errors", f"{more_errors} more errors were not listed.", None)
        )
    return InputCheck(total, errors, models, oversize, drills)


def input_lines(lines: Iterable[bytes], endpoint: str) -> Iterator[InputLine]:
    """The requests of an input file that ``check_input`` found valid, one at a time.

    Raises ``ValueError`` if a line is not valid after all (the file changed
    between the two readings: stored files never do).
    """
    seen: set[str] = set()
    index = 0
    for raw in lines:
        if not raw.strip():
            continue
        problem = _check_line(raw, endpoint, seen)
        if isinstance(problem, dict):
            raise ValueError(f"input line {index} is no longer valid: {problem['message']}")
        custom_id, body = problem
        seen.add(custom_id)
        model = body.get("model")
        yield InputLine(
            index=index,
            custom_id=custom_id,
            model=model if isinstance(model, str) else None,
            body_json=_stored_body(body),
        )
        index += 1


def _stored_body(body: dict[str, Any]) -> str:
    """A line's body as stored and sent to a node."""
    return json.dumps(body, ensure_ascii=False, separators=(",", ":"))


def _utf8_size(text: str) -> int:
    # surrogatepass: a lone surrogate (a JSON escape cut in half) still has a size
    return len(text.encode("utf-8", "surrogatepass"))


def _check_line(
    raw: bytes, endpoint: str, seen: set[str]
) -> dict[str, Any] | tuple[str, dict[str, Any]]:
    """The line's ``(custom_id, body)``, or the error to report for it."""
    try:
        # The body sits one level below the line: it gets the depth an HTTP body gets.
        request = json_codec.loads(raw, max_depth=json_codec.MAX_DEPTH + 1)
    except json_codec.JsonTooDeep:
        return _error(
            "invalid_json_line",
            f"The body of this line is nested deeper than {json_codec.MAX_DEPTH} levels.",
            "body",
        )
    except ValueError:
        return _error("invalid_json_line", "This line is not parseable as valid JSON.", None)
    if not isinstance(request, dict):
        return _error("invalid_json_line", "This line is not a JSON object.", None)
    custom_id = request.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        return _missing("custom_id")
    if custom_id in seen:
        return _error(
            "duplicate_custom_id",
            "The custom_id for this request is a duplicate of another request. "
            "The custom_id parameter must be unique for each request in a batch.",
            "custom_id",
        )
    method = request.get("method")
    if method is None:
        return _missing("method")
    if method != "POST":
        return _error("invalid_method", "The method of every request must be 'POST'.", "method")
    url = request.get("url")
    if url is None:
        return _missing("url")
    if url != endpoint:
        return _error(
            "invalid_url",
            f"The URL provided for this request does not match the batch endpoint ({endpoint}).",
            "url",
        )
    body = request.get("body")
    if body is None:
        return _missing("body")
    if not isinstance(body, dict):
        return _error("invalid_body", "The body of a request must be a JSON object.", "body")
    return custom_id, body


def _missing(param: str) -> dict[str, Any]:
    return _error("missing_required_parameter", f"Missing required parameter: '{param}'.", param)


def _error(code: str, message: str, param: str | None) -> dict[str, Any]:
    return {"code": code, "message": message, "param": param, "line": None}


def file_object(record: FileRecord) -> dict[str, Any]:
    return {
        "id": record.id,
        "object": "file",
        "bytes": record.bytes,
        "created_at": record.created_at,
        "filename": record.filename,
        "purpose": record.purpose,
        "status": "processed",
        "status_details": None,
    }


def batch_object(record: BatchRecord) -> dict[str, Any]:
    errors = {"object": "list", "data": record.errors} if record.errors else None
    return {
        "id": record.id,
        "object": "batch",
        "endpoint": record.endpoint,
        "errors": errors,
        "input_file_id": record.input_file_id,
        "completion_window": record.completion_window,
        "status": record.status,
        "output_file_id": record.output_file_id,
        "error_file_id": record.error_file_id,
        "created_at": record.created_at,
        "in_progress_at": record.in_progress_at,
        "expires_at": record.expires_at,
        "finalizing_at": record.finalizing_at,
        "completed_at": record.completed_at,
        "failed_at": record.failed_at,
        "expired_at": record.expired_at,
        "cancelling_at": record.cancelling_at,
        "cancelled_at": record.cancelled_at,
        "request_counts": {
            "total": record.total,
            "completed": record.completed,
            "failed": record.failed,
        },
        "metadata": record.metadata,
    }


def result_files(lines: Iterable[LineRecord], terminal: str) -> tuple[bytes, bytes]:
    """The output and error files (JSONL, input order) of a batch ending as ``terminal``.

    Every input line lands in exactly one of them: a success in the output, a
    failure in the error file with its HTTP status and error body, and a line
    that never ran (cancelled, expired) in the error file with OpenAI's
    ``batch_cancelled`` / ``batch_expired`` error and no response.
    """
    output: list[str] = []
    errors: list[str] = []
    unrun = _UNRUN_ERRORS.get(terminal)
    for line in lines:
        result = line.result
        if result is None:
            if unrun is not None:
                errors.append(_jsonl(new_id("batch_req_"), line.custom_id, None, unrun))
            continue
        body = result.response if result.state == DONE else result.error
        response = {
            "status_code": result.status_code,
            "request_id": result.request_id,
            "body": json.loads(body) if body else None,
        }
        target = output if result.state == DONE else errors
        target.append(_jsonl(result.result_id, line.custom_id, response, None))
    return "".join(output).encode(), "".join(errors).encode()


def _jsonl(
    result_id: str, custom_id: str, response: dict[str, Any] | None, error: dict[str, str] | None
) -> str:
    line = {"id": result_id, "custom_id": custom_id, "response": response, "error": error}
    return json.dumps(line, ensure_ascii=False, separators=(",", ":")) + "\n"
