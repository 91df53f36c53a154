"""``make test-multihost``: docs/deploy-bare-metal.md run on four network-namespace hosts.

Not part of ``make test`` (pyproject.toml's testpaths): it needs root and takes a minute
or two, so in ``pytest tests/multihost`` without
``TEST_MULTIHOST=1`` (or ``TEST_MULTIHOST_REQUIRED=1``, which ``make test-multihost``
sets) every test that needs the hosts skips at once, saying how to run it (the checks of
the guide's text run everywhere). Where namespaces cannot be made (not root, no
iproute2) it skips with the reason, and ``TEST_MULTIHOST_REQUIRED=1`` turns that
skip into a failure: CI must not pass without having run it.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

# The harness modules beside this file (tests are imported with --import-mode=importlib,
# which puts no test directory on sys.path).
sys.path.insert(0, str(Path(__file__).parent))

import netns

REQUIRED = os.environ.get("TEST_MULTIHOST_REQUIRED") == "1"
WANTED = REQUIRED or os.environ.get("TEST_MULTIHOST") == "1"


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    if WANTED:
        return
    skip = pytest.mark.skip(reason="run by `make test-multihost` (or TEST_MULTIHOST=1, as root)")
    for item in items:
        if "network" in getattr(item, "fixturenames", ()):
            item.add_marker(skip)


@pytest.fixture(scope="module")
def network() -> Iterator[netns.Network]:
    """Four hosts on one bridge, removed after the module whatever happened."""
    reason = netns.unavailable_reason()
    if reason is not None:
        if REQUIRED:
            pytest.fail(f"TEST_MULTIHOST_REQUIRED=1 but {reason}")
        pytest.skip(reason)
    with pytest.MonkeyPatch.context() as patch:
        # Services get only the settings the guide gives them, and reach no proxy.
        for name in [name for name in os.environ if name.startswith("IOP_")]:
            patch.delenv(name)
        for name in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "https_proxy"):
            patch.delenv(name, raising=False)
        with netns.make_hosts(4) as made:
            yield made
