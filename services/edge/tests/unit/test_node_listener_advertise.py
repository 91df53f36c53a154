"""Where an edge tells the control-plane its nodes and workers reach it
(docs/ARCHITECTURE.md#several-edges)."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from iop_edge.bootstrap import node_listener_endpoint
from iop_edge.settings import EdgeSettings, NodeListenerSettings


def test_unset_it_is_the_bound_address_unless_the_host_is_a_wildcard() -> None:
    assert NodeListenerSettings(host="10.0.0.1", port=0).advertised(7123) == ("10.0.0.1", 7123)
    for wildcard in ("0.0.0.0", "::"):
        assert NodeListenerSettings(host=wildcard).advertised(7000) is None


def test_set_it_is_taken_as_written() -> None:
    listener = NodeListenerSettings(host="0.0.0.0", advertise="edge-a.example:7001")
    assert listener.advertised(7000) == ("edge-a.example", 7001)
    assert NodeListenerSettings(advertise="[fd00::1]:7000").advertised(1) == ("fd00::1", 7000)


@pytest.mark.parametrize("bad", ["edge-a", ":7000", "edge-a:", "edge-a:port", "edge-a:70000"])
def test_an_advertise_that_is_not_host_port_fails_the_start_naming_it(bad: str) -> None:
    with pytest.raises(ValidationError, match="advertise"):
        NodeListenerSettings(advertise=bad)


TLS = {"ca_file": "ca.pem", "cert_file": "e.pem", "key_file": "e.key"}


def test_the_endpoint_carries_the_edge_id_and_the_certificates_name() -> None:
    settings = EdgeSettings.model_validate(
        {
            "service_id": "edge-b",
            "tls": TLS,
            "node_listener": {
                "host": "0.0.0.0",
                "advertise": "10.0.0.2:7000",
                "advertise_server_name": "edge-b",
            },
        }
    )
    endpoint = node_listener_endpoint(settings, 7000)
    assert endpoint is not None
    assert (endpoint.edge_id, endpoint.host, endpoint.port, endpoint.server_name) == (
        "edge-b",
        "10.0.0.2",
        7000,
        "edge-b",
    )
    unlisted = EdgeSettings.model_validate({"tls": TLS, "node_listener": {"host": "0.0.0.0"}})
    assert node_listener_endpoint(unlisted, 7000) is None
