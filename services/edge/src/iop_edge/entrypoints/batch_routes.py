"""``/v1/files`` and ``/v1/batches``: the OpenAI Batch API over ``BatchService``.

Same keys as the rest of the API; errors leave through the app's error
boundary as OpenAI error objects. Every object belongs to the key that made
it: the key is passed to the service, which answers another key's object as
not found. An upload is streamed to storage part by part and refused as soon as
it passes the size limit, never buffered whole (aiohttp's ``client_max_size``
does not apply to a streamed multipart body); a download is streamed back the
same way.
"""

from __future__ import annotations

from typing import Any, Final

from aiohttp import BodyPartReader, web

from iop_edge.entrypoints.api_auth import authenticate
from iop_edge.entrypoints.inference_request import read_json_body
from iop_edge.errors import InvalidRequest
from iop_edge.ports import KeyRing
from iop_edge.service.batch_file_io import CHUNK_BYTES, Upload
from iop_edge.service.batches import BatchService

LIST_DEFAULT_LIMIT: Final = 20
LIST_MAX_LIMIT: Final = 100
FILES_LIST_MAX_LIMIT: Final = 10_000  # OpenAI's default and maximum for ``GET /v1/files``
_MAX_FIELD_BYTES: Final = 1024  # ``purpose`` and other small form fields
_FILE_ORDERS: Final = {"desc": True, "asc": False}  # ``order`` -> newest first


class BatchRoutes:
    """The nine Files and Batches endpoints the OpenAI SDKs call."""

    def __init__(self, batches: BatchService, keys: KeyRing) -> None:
        self._batches = batches
        self._keys = keys

    def register(self, app: web.Application) -> None:
        router = app.router
        router.add_post("/v1/files", self.create_file)
        router.add_get("/v1/files", self.list_files)
        router.add_get("/v1/files/{file_id}", self.retrieve_file)
        router.add_delete("/v1/files/{file_id}", self.delete_file)
        router.add_get("/v1/files/{file_id}/content", self.file_content)
        router.add_post("/v1/batches", self.create_batch)
        router.add_get("/v1/batches", self.list_batches)
        router.add_get("/v1/batches/{batch_id}", self.retrieve_batch)
        router.add_post("/v1/batches/{batch_id}/cancel", self.cancel_batch)

    async def create_file(self, request: web.Request) -> web.Response:
        key = authenticate(request, self._keys)
        if not request.content_type.startswith("multipart/form-data"):
            raise InvalidRequest("Upload the file as multipart/form-data.", param="file")
        fields: dict[str, str] = {}
        filename: str | None = None
        async with self._batches.receive_file(key=key) as upload:
            try:
                reader = await request.multipart()
                async for part in reader:
                    if not isinstance(part, BodyPartReader):
                        raise InvalidRequest("Nested multipart bodies are not supported.")
                    if part.name == "file":
                        if filename is not None:
                            raise InvalidRequest("Send one 'file' field.", param="file")
                        filename = part.filename or ""
                        await _stream_part(part, upload)
                    elif part.name:
                        raw = await _read_field(part, _MAX_FIELD_BYTES, part.name)
                        fields[part.name] = raw.decode("utf-8", "replace")
            except InvalidRequest:
                raise
            except ValueError as exc:  # a malformed body (boundary, headers, length)
                raise InvalidRequest(f"The multipart body could not be read: {exc}") from None
            purpose = fields.get("purpose")
            if purpose is None:
                raise InvalidRequest("Missing required parameter: 'purpose'.", param="purpose")
            if filename is None:
                raise InvalidRequest("Missing required parameter: 'file'.", param="file")
            created = await self._batches.create_file(upload, filename, purpose, key=key)
        return web.json_response(created)

    async def list_files(self, request: web.Request) -> web.Response:
        key = authenticate(request, self._keys)
        query = request.query
        order = query.get("order", "desc")
        if order not in _FILE_ORDERS:
            raise InvalidRequest("'order' must be 'asc' or 'desc'.", param="order")
        page = await self._batches.list_files(
            query.get("purpose") or None,
            query.get("after") or None,
            _limit(query.get("limit"), FILES_LIST_MAX_LIMIT, FILES_LIST_MAX_LIMIT),
            newest=_FILE_ORDERS[order],
            key=key,
        )
        return web.json_response(page)

    async def retrieve_file(self, request: web.Request) -> web.Response:
        key = authenticate(request, self._keys)
        file = await self._batches.get_file(request.match_info["file_id"], key=key)
        return web.json_response(file)

    async def delete_file(self, request: web.Request) -> web.Response:
        key = authenticate(request, self._keys)
        deleted = await self._batches.delete_file(request.match_info["file_id"], key=key)
        return web.json_response(deleted)

    async def file_content(self, request: web.Request) -> web.StreamResponse:
        """Streamed in chunks; a 404 (or any error) comes before the first byte."""
        key = authenticate(request, self._keys)
        content = await self._batches.file_content(request.match_info["file_id"], key=key)
        response = web.StreamResponse(headers={"Content-Type": "application/octet-stream"})
        response.content_length = content.record.bytes
        try:
            await response.prepare(request)
            async for chunk in content.chunks():
                await response.write(chunk)
            await response.write_eof()
        except ConnectionResetError:
            pass  # the client left mid-download; aiohttp ignores the closed transport
        finally:
            await content.aclose()
        return response

    async def create_batch(self, request: web.Request) -> web.Response:
        key = authenticate(request, self._keys)
        body = await read_json_body(request)
        batch = await self._batches.create_batch(
            _required_str(body, "input_file_id"),
            _required_str(body, "endpoint"),
            _required_str(body, "completion_window"),
            body.get("metadata"),  # checked by the service (OpenAI's 16-pair rule)
            key=key,
        )
        return web.json_response(batch)

    async def list_batches(self, request: web.Request) -> web.Response:
        key = authenticate(request, self._keys)
        limit = _limit(request.query.get("limit"), LIST_DEFAULT_LIMIT, LIST_MAX_LIMIT)
        after = request.query.get("after") or None
        return web.json_response(await self._batches.list_batches(after, limit, key=key))

    async def retrieve_batch(self, request: web.Request) -> web.Response:
        key = authenticate(request, self._keys)
        batch = await self._batches.get_batch(request.match_info["batch_id"], key=key)
        return web.json_response(batch)

    async def cancel_batch(self, request: web.Request) -> web.Response:
        key = authenticate(request, self._keys)
        batch = await self._batches.cancel_batch(request.match_info["batch_id"], key=key)
        return web.json_response(batch)


async def _stream_part(part: BodyPartReader, upload: Upload) -> None:
    """The part's bytes into the upload as they arrive (refused past the size limit)."""
    while chunk := await part.read_chunk(CHUNK_BYTES):
        await upload.write(chunk)


async def _read_field(part: BodyPartReader, limit: int, name: str) -> bytes:
    """A small form field's bytes, refused (400) the moment they pass ``limit``."""
    chunks: list[bytes] = []
    size = 0
    while chunk := await part.read_chunk(_MAX_FIELD_BYTES):
        size += len(chunk)
        if size > limit:
            raise InvalidRequest(
                f"The '{name}' field is larger than the limit of {limit} bytes.", param=name
            )
        chunks.append(chunk)
    return b"".join(chunks)


def _required_str(body: dict[str, Any], name: str) -> str:
    value = body.get(name)
    if not isinstance(value, str) or not value:
        raise InvalidRequest(f"Missing required parameter: '{name}' (a string).", param=name)
    return value


def _limit(raw: str | None, default: int, maximum: int) -> int:
    if raw is None:
        return default
    try:
        value = int(raw)
    except ValueError:
        value = 0
    if not 1 <= value <= maximum:
        raise InvalidRequest(f"'limit' must be an integer from 1 to {maximum}.", param="limit")
    return value
