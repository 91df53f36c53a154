"""What an API key lets through: the loopback rule while no keys exist, and the catalog a
key sees (its allow-list over the real dispatcher's pool)."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry

from iop_edge.adapters.fleet_proto import fleet_from_proto
from iop_edge.domain.fleet import ApiKeyEntry, Fleet, ModelEntry, ProviderEntry
from iop_edge.entrypoints.api_auth import access_mode, check_open_access, is_loopback
from iop_edge.errors import LoopbackOnly
from iop_edge.metrics import EdgeMetrics
from iop_edge.service.catalog import PoolCatalog
from iop_edge.testing import WiredDispatcher as Dispatch
from iop_proto.v1 import runtime_pb2 as pb


class Keys:
    def __init__(self, open_: bool) -> None:
        self._open = open_

    configured = True  # a fleet config has arrived

    @property
    def open(self) -> bool:
        return self._open

    def lookup(self, presented_key: str) -> ApiKeyEntry | None:
        return None


@pytest.mark.parametrize(
    "remote", ["127.0.0.1", "127.1.2.3", "::1", "::ffff:127.0.0.1", "::ffff:127.9.0.1"]
)
def test_loopback_addresses(remote: str) -> None:
    assert is_loopback(remote)


@pytest.mark.parametrize(
    "remote",
    [None, "", "10.0.0.2", "192.0.2.2", "0.0.0.0", "::", "::ffff:10.0.0.1", "fe80::1%eth0",
     "fd00::2", "localhost", "not an address"],
)  # fmt: skip
def test_everything_else_is_not_loopback(remote: str | None) -> None:
    assert not is_loopback(remote)


def test_without_keys_only_loopback_is_served_unless_allow_open() -> None:
    no_keys = Keys(open_=True)
    check_open_access("127.0.0.1", no_keys, allow_open=False)
    check_open_access("::1", no_keys, allow_open=False)
    with pytest.raises(LoopbackOnly) as refused:
        check_open_access("10.213.1.2", no_keys, allow_open=False)
    assert refused.value.status == 401
    assert refused.value.code == "invalid_api_key"
    assert "no API keys" in refused.value.message
    assert "http.allow_open: true" in refused.value.message
    check_open_access("10.213.1.2", no_keys, allow_open=True)


def test_with_keys_the_address_does_not_matter() -> None:
    # Every request needs a key then; the key check is authenticate's.
    check_open_access("10.213.1.2", Keys(open_=False), allow_open=False)


def test_the_start_line_names_the_mode() -> None:
    assert "loopback clients only" in access_mode(Keys(True), False, "0.0.0.0")
    assert "open to anyone" in access_mode(Keys(True), True, "0.0.0.0")
    assert "needs a Bearer key" in access_mode(Keys(False), False, "0.0.0.0")


# ---------------------------------------------------------------- the catalog per key


def provider(provider_id: str, node_id: str, *served: str) -> ProviderEntry:
    return ProviderEntry(provider_id, node_id, "mock", "local_inference", served, 2, 4, 1000, 1000)


def entry(key_id: str, *models: str, operator: bool = False) -> ApiKeyEntry:
    return ApiKeyEntry(key_id, key_id, f"hash-{key_id}", frozenset(models), 0, operator)


@pytest.fixture
def catalog() -> PoolCatalog:
    """``p-shared`` serves 'small' and 'twin'; 'solo' has a provider of its own."""
    dispatcher = Dispatch(EdgeMetrics.create(CollectorRegistry()))
    dispatcher.pool.apply_fleet(
        Fleet(
            version=1,
            models={
                "small": ModelEntry("small", "Small", {"p-a": "small-a", "p-shared": "small-s"}),
                "solo": ModelEntry("solo", "Solo", {"p-solo": "solo-served"}),
                "twin": ModelEntry("twin", "Twin", {"p-shared": "twin-s"}),
            },
            providers={
                "p-a": provider("p-a", "n1", "small-a"),
                "p-solo": provider("p-solo", "n1", "solo-served"),
                "p-shared": provider("p-shared", "n2", "small-s", "twin-s", "not-in-fleet"),
            },
        )
    )
    return PoolCatalog(dispatcher.fleet, dispatcher.pool, dispatcher)


def test_a_restricted_key_sees_only_its_models_and_their_providers(catalog: PoolCatalog) -> None:
    key = entry("k", "small")
    assert [m["id"] for m in catalog.model_views(key)] == ["small"]
    rows = {p["provider_id"]: p for p in catalog.provider_views(key)}
    assert set(rows) == {"p-a", "p-shared"}
    assert (rows["p-shared"]["serves"], rows["p-shared"]["models"]) == (["small"], ["small-s"])
    assert (rows["p-a"]["serves"], rows["p-a"]["models"]) == (["small"], ["small-a"])


def test_a_key_allowed_a_model_nobody_serves_sees_an_empty_catalog(catalog: PoolCatalog) -> None:
    key = entry("k", "gone")
    assert catalog.model_views(key) == []
    assert catalog.provider_views(key) == []


@pytest.mark.parametrize(
    "key",
    [None, entry("all"), entry("ops", "solo", operator=True)],
    ids=["open API", "no allow-list", "operator"],
)
def test_the_whole_catalog_for_operators_and_unrestricted_keys(
    catalog: PoolCatalog, key: ApiKeyEntry | None
) -> None:
    assert [m["id"] for m in catalog.model_views(key)] == ["small", "solo", "twin"]
    rows = {p["provider_id"]: p for p in catalog.provider_views(key)}
    assert set(rows) == {"p-a", "p-solo", "p-shared"}
    assert rows["p-shared"]["serves"] == ["small", "twin"]
    assert rows["p-shared"]["models"] == ["small-s", "twin-s", "not-in-fleet"]


def test_the_operator_flag_comes_from_the_fleet_config() -> None:
    config = pb.FleetConfig(
        version=3,
        api_keys=[
            pb.ApiKeyPolicy(key_id="k1", name="ops", key_hash="h1", operator=True),
            pb.ApiKeyPolicy(key_id="k2", name="app", key_hash="h2", models=["m"]),
        ],
    )
    keys = fleet_from_proto(config).api_keys
    assert (keys["h1"].operator, keys["h2"].operator) == (True, False)
    assert keys["h2"].models == frozenset({"m"})
