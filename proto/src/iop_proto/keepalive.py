"""TCP keepalive and a user timeout on every IOP socket: the kernel's word on a dead link.

Heartbeats (``Connection``) judge a peer that stopped answering; these options
judge the link under it, on both ends, whoever dialed. A link whose far end
vanished silently (a host unplugged, a network cut) answers nothing: with
nothing in flight keepalive probes find it, with data in flight the user
timeout does (unacknowledged bytes for that long end the connection). Either
way the socket fails and the read loop ends instead of waiting for TCP's
default of many minutes. The values match the default heartbeat verdict
(3 missed 2 s heartbeats), so neither waits far behind the other.
"""

from __future__ import annotations

import socket

from loguru import logger

KEEPALIVE_IDLE_S = 3  # silence before the first probe
KEEPALIVE_INTERVAL_S = 1  # between probes
KEEPALIVE_PROBES = 3  # unanswered probes before the kernel gives up
USER_TIMEOUT_MS = 6_000  # data unacknowledged this long ends the connection (Linux)


def enable_keepalive(sock: object) -> None:
    """Set keepalive (and, where the platform has them, its timings and the user
    timeout) on ``sock``: a socket, or what ``get_extra_info("socket")`` returns.

    Options a platform lacks are skipped (macOS has no ``TCP_USER_TIMEOUT`` and
    names the idle time ``TCP_KEEPALIVE``); a socket that is not TCP (a Unix
    socket in a test) is left alone.
    """
    setsockopt = getattr(sock, "setsockopt", None)
    if setsockopt is None or getattr(sock, "family", None) not in (
        socket.AF_INET,
        socket.AF_INET6,
    ):
        return
    options = [
        (socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1),
        (socket.IPPROTO_TCP, _option("TCP_KEEPIDLE", "TCP_KEEPALIVE"), KEEPALIVE_IDLE_S),
        (socket.IPPROTO_TCP, _option("TCP_KEEPINTVL"), KEEPALIVE_INTERVAL_S),
        (socket.IPPROTO_TCP, _option("TCP_KEEPCNT"), KEEPALIVE_PROBES),
        (socket.IPPROTO_TCP, _option("TCP_USER_TIMEOUT"), USER_TIMEOUT_MS),
    ]
    for level, name, value in options:
        if name is None:
            continue
        try:
            setsockopt(level, name, value)
        except OSError as exc:  # a sandbox may refuse one; the heartbeats still judge
            logger.debug("socket option {} not set: {}", name, exc)


def _option(*names: str) -> int | None:
    """The first of ``names`` this platform's ``socket`` module defines."""
    for name in names:
        value = getattr(socket, name, None)
        if isinstance(value, int):
            return value
    return None
