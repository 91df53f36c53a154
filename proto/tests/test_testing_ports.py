"""The port helpers of ``iop_proto.testing``: a refused port, and the retry for programs
that must be told their port up front."""

from __future__ import annotations

import asyncio
import socket

import pytest

from iop_proto.testing import PortTaken, port_offsets, port_taken, ports_to_try, refused_port


async def test_a_refused_port_refuses_connections_and_stays_held() -> None:
    with refused_port() as port:
        with pytest.raises(ConnectionRefusedError):
            await asyncio.open_connection("127.0.0.1", port)
        assert port_taken(port)  # nobody else can listen there meanwhile


def test_port_taken_tells_a_held_port_from_a_free_one() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        held = sock.getsockname()[1]
        assert port_taken(held)
    assert not port_taken(held)


def test_ports_to_try_gives_up_after_its_attempts() -> None:
    ports = ports_to_try(attempts=2)
    assert [next(ports), next(ports)]  # one port per attempt (every one lost, say)
    with pytest.raises(PortTaken, match="2 ports in a row"):
        next(ports)


def test_port_offsets_move_every_port_into_a_free_block_in_range() -> None:
    ports = [7000, 8080, 9100]
    offset = next(port_offsets(ports, low=20000, high=32000))
    assert all(20000 <= port + offset < 32000 for port in ports)
    assert not any(port_taken(port + offset) for port in ports)
