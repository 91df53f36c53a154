"""The contract package's exception hierarchy: one root, expected faults below it."""

from __future__ import annotations

from iop_proto.v1 import runtime_pb2 as pb


class IopError(Exception):
    """Root of every error raised by the contract package."""


class ProtocolError(IopError):
    """The peer broke the wire protocol; the connection must be closed.

    ``code`` is what the error frame sent before closing carries.
    """

    code: int = pb.ERROR_CODE_BAD_FRAME


class FrameTooLarge(ProtocolError):
    """The length prefix announces more than the configured maximum."""

    code = pb.ERROR_CODE_FRAME_TOO_LARGE

    def __init__(self, length: int, maximum: int) -> None:
        super().__init__(f"frame of {length} bytes exceeds the maximum of {maximum} bytes")
        self.length = length
        self.maximum = maximum


class ShortRead(ProtocolError, EOFError):
    """The stream ended inside a frame (after some of its bytes arrived)."""

    def __init__(self, expected: int, received: int) -> None:
        super().__init__(f"stream ended after {received} of {expected} bytes of a frame")
        self.expected = expected
        self.received = received


class UnparsableFrame(ProtocolError, ValueError):
    """The payload is not a serialized ``Envelope``, or carries no body."""


class UnexpectedMessage(ProtocolError):
    """A well-formed message arrived where the protocol does not allow it."""

    code = pb.ERROR_CODE_UNEXPECTED_MESSAGE


class HeartbeatTimeout(ProtocolError, TimeoutError):
    """Nothing arrived from the peer for the allowed number of heartbeat intervals."""

    code = pb.ERROR_CODE_HEARTBEAT_TIMEOUT


class ConnectionClosed(IopError, ConnectionError):
    """The connection is closed: cleanly by the peer, by us, or after a fault.

    ``error`` is the error frame the peer sent before closing, if any.
    """

    def __init__(self, message: str = "connection closed", error: pb.Error | None = None) -> None:
        super().__init__(message)
        self.error = error


class ConfigurationError(IopError):
    """The service's configuration cannot work, and retrying would not change that.

    The service stops and its process exits with code 2 (``EXIT_BAD_SETTINGS``) and one
    line saying what to fix, rather than retrying what only an operator can repair.
    """


class TlsConfigError(ConfigurationError, ValueError):
    """Certificate files are missing or do not form a usable TLS context."""


class SettingsError(ConfigurationError, ValueError):
    """A service's settings file or environment overrides are invalid."""
