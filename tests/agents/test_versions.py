"""``make agents`` installs exactly the versions the suite names (``agents.VERSIONS``)."""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def test_the_makefile_pins_the_versions_the_suite_names() -> None:
    spec = importlib.util.spec_from_file_location("iop_agents_versions", HERE / "agents.py")
    assert spec is not None
    assert spec.loader is not None
    agents = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = agents
    spec.loader.exec_module(agents)
    makefile = (HERE.parents[1] / "Makefile").read_text().replace("\\\n", " ")
    npm = re.search(r"^AGENTS_NPM\s*:=(.*)$", makefile, re.M)
    aider = re.search(r"^AIDER_VERSION\s*:=\s*(\S+)", makefile, re.M)
    assert npm is not None
    assert aider is not None
    pinned = dict(spec_.rsplit("@", 1) for spec_ in npm.group(1).split())
    pinned["aider-chat"] = aider.group(1)
    assert pinned == agents.VERSIONS
    assert {agent.package for agent in agents.AGENTS} == set(agents.VERSIONS)
